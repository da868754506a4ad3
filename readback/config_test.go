package readback_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

const good = `
version: 1
defaults:
  consistency_window: 5s
  max_request_lifetime: 10s
  backoff: {base: 100ms, cap: 2s}
adapters:
  - name: blog-blind
    type: blind
    dependency: blog-api
    operations: [articles.publish]
  - name: blog-static
    type: static
    kind: create
    dependency: blog-api
    max_checks: 4
    idempotency: {native: true, retention: 24h}
    static: {verdict: present, external_id: x-1}
`

func TestLoad(t *testing.T) {
	reg, err := readback.Load("adapters.yaml", strings.NewReader(good), nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		op, dep  string
		wantName string
	}{
		{"articles.publish", "blog-api", "blog-blind"},
		{"articles.create", "blog-api", "blog-static"},
		{"articles.create", "other-api", ""},
	}
	for _, tt := range tests {
		b, ok := reg.Lookup(tt.op, tt.dep)
		if tt.wantName == "" {
			if ok {
				t.Errorf("Lookup(%s, %s) = %s, want none", tt.op, tt.dep, b.Name)
			}
			continue
		}
		if !ok || b.Name != tt.wantName {
			t.Errorf("Lookup(%s, %s) = %v, %v; want %s", tt.op, tt.dep, b, ok, tt.wantName)
		}
	}
	b, _ := reg.Lookup("articles.create", "blog-api")
	p := b.Policy
	if p.ConsistencyWindow != 5*time.Second || p.MaxRequestLifetime != 10*time.Second || p.MaxChecks != 4 ||
		p.BackoffBase != 100*time.Millisecond || !p.IdempotencyKeys || p.IdempotencyRetention != 24*time.Hour {
		t.Fatalf("policy = %+v", p)
	}
	res, err := b.Adapter.Check(context.Background(), readback.Receipt{ID: 3})
	if err != nil || res.Verdict != readback.VerdictPresent || res.ExternalIDs[0] != "x-1" {
		t.Fatalf("static check = %+v, %v", res, err)
	}
	blind, _ := reg.Lookup("articles.publish", "blog-api")
	if blind.Kind != readback.Blind {
		t.Fatalf("blind adapter kind = %s", blind.Kind)
	}
}

func TestLoadErrors(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string // substrings of the error
	}{
		{"unknown type", "version: 1\nadapters:\n  - {name: a, type: soap, kind: create, dependency: d}\n",
			[]string{"adapters.yaml:3", `adapter "a"`, "type", `unknown type "soap"`}},
		{"missing type", "version: 1\nadapters:\n  - {name: a, kind: create, dependency: d}\n",
			[]string{`adapter "a"`, "type: is required"}},
		{"typo", "version: 1\nadapters:\n  - name: a\n    type: blind\n    dependncy: d\n",
			[]string{"adapters.yaml:5", `adapter "a"`, "dependncy: unknown field"}},
		{"bad duration", "version: 1\nadapters:\n  - {name: a, type: blind, dependency: d, consistency_window: soon}\n",
			[]string{`adapter "a"`, "duration"}},
		{"negative window", "version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d, consistency_window: -1s, static: {verdict: present}}\n",
			[]string{`adapter "a"`, "consistency_window: must not be negative"}},
		{"deadline inside window", "version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d, deadline: 1s, static: {verdict: present}}\n",
			[]string{`adapter "a"`, "deadline: must exceed"}},
		{"static without verdict", "version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d}\n",
			[]string{`adapter "a"`, "static.verdict: is required"}},
		{"static bad verdict", "version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d, static: {verdict: yes}}\n",
			[]string{`adapter "a"`, "static.verdict"}},
		{"blind with another kind", "version: 1\nadapters:\n  - {name: a, type: blind, kind: create, dependency: d}\n",
			[]string{`adapter "a"`, "kind: a blind adapter"}},
		{"no dependency", "version: 1\nadapters:\n  - {name: a, type: blind}\n",
			[]string{`adapter "a"`, "dependency: is required"}},
		{"two for one dependency", "version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\n  - {name: b, type: blind, dependency: d}\n",
			[]string{`adapter "b"`, "already read by"}},
		{"wrong version", "version: 2\nadapters: []\n", []string{"version: must be 1"}},
		{"backoff typo", "version: 1\ndefaults:\n  backoff: {bsae: 1s}\n", []string{"defaults.backoff.bsae: unknown field"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readback.Load("adapters.yaml", strings.NewReader(tt.yaml), nil)
			if err == nil {
				t.Fatal("want an error")
			}
			if !errors.Is(err, readback.ErrInvalidConfig) {
				t.Errorf("error %v does not match ErrInvalidConfig", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestLoadEmptyFile(t *testing.T) {
	reg, err := readback.Load("empty.yaml", strings.NewReader(""), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := reg.Lookup("x", "y"); ok {
		t.Fatal("an empty file declares no adapters")
	}
}
