package readback_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"reflect"
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

// TestLoadEmptyFile: a file that declares no adapter is refused (a daemon
// without adapters is asked for with run --no-adapters, not by an empty
// file); config_validation_test.go has the other shapes of it.
func TestLoadEmptyFile(t *testing.T) {
	_, err := readback.Load("empty.yaml", strings.NewReader(""), nil)
	if !errors.Is(err, readback.ErrNoAdapters) || !errors.Is(err, readback.ErrInvalidConfig) {
		t.Fatalf("empty file: %v, want ErrNoAdapters", err)
	}
}

const withDependencies = `version: 1
adapters:
  - {name: gh, type: static, kind: create, dependency: github, static: {verdict: present}}
  - {name: pay, type: static, kind: create, dependency: stripe, static: {verdict: present}}
  - {name: mail, type: blind, dependency: mailer}
dependencies:
  github:
    concurrency: 2
    rate: 1
    burst: 5
    breaker: {failures: 3, cooldown: 1m, max_cooldown: 10m, window: 20s, min_calls: 10, rate: 0.6}
    retry_budget: {ratio: 0, min: 0}
    degraded: {enter: 0.4, exit: 0.1, concurrency: 1, decrease: 0.7, increase: 2}
  stripe:
    rate: 20.5
  mailer: {}
`

func TestLoadDependencies(t *testing.T) {
	reg, err := readback.Load("adapters.yaml", strings.NewReader(withDependencies), nil)
	if err != nil {
		t.Fatal(err)
	}
	deps := reg.Dependencies()
	if len(deps) != 3 {
		t.Fatalf("Dependencies() = %v, want github, stripe and mailer", deps)
	}
	gh := deps["github"]
	if gh.Line != 7 || *gh.Concurrency != 2 || *gh.Rate != 1 || *gh.Burst != 5 ||
		*gh.BreakerFailures != 3 || *gh.BreakerCooldown != time.Minute || *gh.BreakerMaxCooldown != 10*time.Minute ||
		*gh.RetryRatio != 0 || *gh.RetryMin != 0 ||
		*gh.DegradedEnter != 0.4 || *gh.DegradedExit != 0.1 || *gh.DegradedConcurrency != 1 ||
		*gh.BreakerWindow != 20*time.Second || *gh.BreakerMinCalls != 10 || *gh.BreakerRate != 0.6 ||
		*gh.DegradedDecrease != 0.7 || *gh.DegradedIncrease != 2 {
		t.Errorf("github = %+v", gh)
	}
	st := deps["stripe"]
	if *st.Rate != 20.5 || st.Concurrency != nil || st.Burst != nil || st.BreakerFailures != nil ||
		st.RetryRatio != nil || st.DegradedEnter != nil {
		t.Errorf("stripe = %+v, want only rate set", st)
	}
	// The registry hands out copies.
	*gh.Concurrency = 99
	if *reg.Dependencies()["github"].Concurrency != 2 {
		t.Error("changing a returned limit changed the registry")
	}

	inf, err := readback.Load("adapters.yaml", strings.NewReader(
		"version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\ndependencies:\n  d: {rate: .inf}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := *inf.Dependencies()["d"].Rate; !math.IsInf(r, 1) {
		t.Errorf("rate .inf = %v", r)
	}

	for _, src := range []string{good, "version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\ndependencies:\n"} {
		reg, err := readback.Load("adapters.yaml", strings.NewReader(src), nil)
		if err != nil {
			t.Fatal(err)
		}
		if d := reg.Dependencies(); len(d) != 0 {
			t.Errorf("no dependencies block: Dependencies() = %v", d)
		}
	}
	if d := readback.NewRegistry().Dependencies(); d == nil || len(d) != 0 {
		t.Errorf("NewRegistry().Dependencies() = %v, want an empty map", d)
	}
}

func TestLoadDependenciesErrors(t *testing.T) {
	const head = "version: 1\nadapters:\n  - {name: a, type: blind, dependency: github}\ndependencies:\n" // 4 lines
	tests := []struct {
		name, yaml string
		want       []string // substrings of the error
	}{
		{"zero rate", "  github:\n    rate: 0\n", []string{"adapters.yaml:6: ", `dependency "github": rate: must be positive`}},
		{"negative rate", "  github: {rate: -1}\n", []string{"adapters.yaml:5: ", `dependency "github": rate: must be positive`}},
		{"nan rate", "  github: {rate: .nan}\n", []string{`dependency "github": rate: must be positive`}},
		{"rate as string", "  github: {rate: fast}\n", []string{`dependency "github": rate: want a number, got "fast"`}},
		{"quoted integer", "  github: {concurrency: \"2\"}\n", []string{`dependency "github": concurrency: want an integer`}},
		{"fractional burst", "  github: {burst: 1.5}\n", []string{`dependency "github": burst: want an integer`}},
		{"zero concurrency", "  github: {concurrency: 0}\n", []string{`dependency "github": concurrency: must be positive, got 0`}},
		{"zero burst", "  github: {burst: 0}\n", []string{`dependency "github": burst: must be positive`}},
		{"typo", "  github:\n    rate: 1\n    brust: 5\n", []string{"adapters.yaml:7: ", `dependency "github": brust: unknown field`}},
		{"nested typo", "  github:\n    breaker:\n      failures: 2\n      cooldwn: 1m\n",
			[]string{"adapters.yaml:8: ", `dependency "github": breaker.cooldwn: unknown field`}},
		{"breaker not a mapping", "  github: {breaker: 5}\n", []string{`dependency "github": breaker: must be a mapping`}},
		{"zero failures", "  github: {breaker: {failures: 0}}\n", []string{`dependency "github": breaker.failures: must be positive`}},
		{"bad cooldown", "  github: {breaker: {cooldown: soon}}\n", []string{`dependency "github": breaker.cooldown: want a duration`}},
		{"negative cooldown", "  github: {breaker: {cooldown: -1s}}\n", []string{`dependency "github": breaker.cooldown: must be positive`}},
		{"max below cooldown", "  github:\n    breaker: {cooldown: 1m, max_cooldown: 30s}\n",
			[]string{"adapters.yaml:6: ", `breaker.max_cooldown: must be at least breaker.cooldown (1m0s)`}},
		{"negative ratio", "  github: {retry_budget: {ratio: -0.1}}\n", []string{`dependency "github": retry_budget.ratio: must be a finite number >= 0`}},
		{"infinite ratio", "  github: {retry_budget: {ratio: .inf}}\n", []string{`retry_budget.ratio: must be a finite number`}},
		{"negative min", "  github: {retry_budget: {min: -1}}\n", []string{`dependency "github": retry_budget.min: must be at least 0`}},
		{"enter above 1", "  github: {degraded: {enter: 1.5}}\n", []string{`dependency "github": degraded.enter: must be a rate in (0, 1]`}},
		{"zero enter", "  github: {degraded: {enter: 0}}\n", []string{`degraded.enter: must be a rate in (0, 1]`}},
		{"breaker rate above 1", "  github: {breaker: {rate: 1.5}}\n", []string{`dependency "github": breaker.rate: must be a rate in (0, 1]`}},
		{"zero breaker min calls", "  github: {breaker: {min_calls: 0}}\n", []string{`dependency "github": breaker.min_calls: must be positive`}},
		{"decrease of 1", "  github: {degraded: {decrease: 1}}\n", []string{`dependency "github": degraded.decrease: must be a factor in (0, 1)`}},
		{"zero increase", "  github: {degraded: {increase: 0}}\n", []string{`dependency "github": degraded.increase: must be a finite number > 0`}},
		{"exit above enter", "  github: {degraded: {enter: 0.3, exit: 0.4}}\n", []string{`dependency "github": degraded.exit: must not exceed degraded.enter (0.3)`}},
		{"degraded above concurrency", "  github: {concurrency: 2, degraded: {concurrency: 3}}\n",
			[]string{`dependency "github": degraded.concurrency: must not exceed concurrency (2)`}},
		{"null value", "  github: {rate: ~}\n", []string{`dependency "github": rate: must be a single value`}},
		{"entry not a mapping", "  github: 5\n", []string{"adapters.yaml:5: ", `dependency "github": must be a mapping`}},
		{"block not a mapping", "  - github\n", []string{"adapters.yaml:5: ", "dependencies: must be a mapping"}},
		{"empty name", "  \"\": {rate: 1}\n", []string{"dependencies: a dependency name is empty"}},
		{"declared twice", "  github: {rate: 1}\n  github: {rate: 2}\n", []string{"adapters.yaml:6: ", `dependency "github": declared twice (first at line 5)`}},
		{"no adapter reads it", "  github: {rate: 1}\n  githbu: {rate: 2}\n",
			[]string{"adapters.yaml:6: ", `dependency "githbu": no adapter reads this dependency (adapters read: github)`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readback.Load("adapters.yaml", strings.NewReader(head+tt.yaml), nil)
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

	// With no adapter at all, that is the error.
	_, err := readback.Load("adapters.yaml", strings.NewReader("version: 1\ndependencies:\n  github: {rate: 1}\n"), nil)
	if !errors.Is(err, readback.ErrNoAdapters) {
		t.Errorf("dependency without adapters: %v", err)
	}
}

// controlFile is an adapters file with one static create adapter reading
// the operations ops (a YAML list; "" for every operation of the
// dependency) whose control block is control (YAML indented under
// `control:`).
func controlFile(ops, control string) string {
	var b strings.Builder
	if ops == "" {
		ops = "[]"
	}
	b.WriteString("version: 1\nadapters:\n  - name: shop-items\n    type: static\n    kind: create\n    dependency: shop\n    operations: " + ops + "\n    static: {verdict: present}\n    control:\n")
	for _, line := range strings.Split(strings.Trim(control, "\n"), "\n") {
		b.WriteString("      " + line + "\n")
	}
	return b.String()
}

// Issue 7, "a misconfigured adapter must not produce proof": the adapters
// file declares a positive control, a resource known to exist described as
// the receipt of the call that made it; the loader puts it on the binding.
func TestLoadControl(t *testing.T) {
	tests := []struct {
		name, ops, control string
		want               readback.Receipt
		payload            string
	}{
		{name: "YAML intent, defaults", ops: "[items.create]",
			control: `idempotency_key: "bootstrap:shop#1:items.create"
target: /items
intent: {title: control lamp, price: 12}
external_id: item-1
submitted_at: 2026-01-02T03:04:05Z`,
			want: readback.Receipt{IdempotencyKey: "bootstrap:shop#1:items.create", Operation: "items.create",
				Dependency: "shop", Method: "POST", Target: "/items", ExternalID: "item-1", Attempt: 1},
			payload: `{"price":12,"title":"control lamp"}`},
		{name: "JSON intent, operation and method", ops: "[items.create, items.import]",
			control: `idempotency_key: k
target: /imports
intent: '{"title": "x"}'
submitted_at: 2026-01-02T03:04:05.5+02:00
operation: items.import
method: PUT`,
			want: readback.Receipt{IdempotencyKey: "k", Operation: "items.import", Dependency: "shop",
				Method: "PUT", Target: "/imports", Attempt: 1},
			payload: `{"title":"x"}`},
		{name: "no intent", ops: "[items.create]",
			control: "idempotency_key: k\ntarget: /items\nsubmitted_at: 2026-01-02T03:04:05Z",
			want: readback.Receipt{IdempotencyKey: "k", Operation: "items.create", Dependency: "shop",
				Method: "POST", Target: "/items", Attempt: 1},
			payload: `null`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, err := readback.Load("adapters.yaml", strings.NewReader(controlFile(tt.ops, tt.control)), nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := reg.Lookup("items.create", "shop")
			c := b.Control
			if c == nil || c.Source != "declared" {
				t.Fatalf("control %+v, want a declared control", c)
			}
			got := c.Receipt
			if got.SubmittedAt.IsZero() || !got.CreatedAt.Equal(got.SubmittedAt) || !got.SendDeadline.Equal(got.SubmittedAt) {
				t.Errorf("times %v %v %v, want all the declared submitted_at", got.SubmittedAt, got.CreatedAt, got.SendDeadline)
			}
			var intent struct {
				Method, Target string
				Payload        json.RawMessage
			}
			if err := json.Unmarshal(got.Intent, &intent); err != nil {
				t.Fatal(err)
			}
			if intent.Method != tt.want.Method || intent.Target != tt.want.Target || string(intent.Payload) != tt.payload {
				t.Errorf("intent %s, want method %s, target %s, payload %s", got.Intent, tt.want.Method, tt.want.Target, tt.payload)
			}
			if !strings.HasPrefix(got.Fingerprint, "sha256:") {
				t.Errorf("fingerprint %q", got.Fingerprint)
			}
			got.Intent, got.Fingerprint = nil, ""
			got.SubmittedAt, got.CreatedAt, got.SendDeadline = time.Time{}, time.Time{}, time.Time{}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("receipt %+v, want %+v", got, tt.want)
			}
		})
	}
	reg, err := readback.Load("adapters.yaml", strings.NewReader(good), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range reg.Bindings() {
		if b.Control != nil {
			t.Errorf("%s: a control nobody declared", b.Name)
		}
	}
}

// Issue 7, "a misconfigured adapter must not produce proof": a malformed
// control fails at load with the file, the adapter, the field and the line.
func TestLoadControlErrors(t *testing.T) {
	base := "idempotency_key: k\ntarget: /items\nsubmitted_at: 2026-01-02T03:04:05Z\n"
	tests := []struct {
		name, control, field string
	}{
		{"unknown key", base + "idempotency: k2", "control.idempotency"},
		{"bad time", "idempotency_key: k\ntarget: /items\nsubmitted_at: yesterday", "control.submitted_at"},
		{"time without zone", "idempotency_key: k\ntarget: /items\nsubmitted_at: 2026-01-02 03:04:05", "control.submitted_at"},
		{"missing key", "target: /items\nsubmitted_at: 2026-01-02T03:04:05Z", "control.idempotency_key"},
		{"key too long", "idempotency_key: " + strings.Repeat("k", 256) + "\ntarget: /items\nsubmitted_at: 2026-01-02T03:04:05Z", "control.idempotency_key"},
		{"missing target", "idempotency_key: k\nsubmitted_at: 2026-01-02T03:04:05Z", "control.target"},
		{"missing time", "idempotency_key: k\ntarget: /items", "control.submitted_at"},
		{"intent a list", base + "intent: [1, 2]", "control.intent"},
		{"intent JSON not an object", base + "intent: '[1]'", "control.intent"},
		{"intent a number", base + "intent: 3", "control.intent"},
		{"bad method", base + "method: 'GET X'", "control.method"},
		{"foreign operation", base + "operation: items.delete", "control.operation"},
		{"key a mapping", "idempotency_key: {a: b}\ntarget: /items\nsubmitted_at: 2026-01-02T03:04:05Z", "control.idempotency_key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readback.Load("adapters.yaml", strings.NewReader(controlFile("[items.create]", tt.control)), nil)
			var ce *readback.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("got %v, want a *readback.ConfigError", err)
			}
			if ce.File != "adapters.yaml" || ce.Adapter != "shop-items" || ce.Field != tt.field || ce.Line < 10 {
				t.Fatalf("got %q (field %q, line %d), want the file, the adapter, field %q and its line", err, ce.Field, ce.Line, tt.field)
			}
		})
	}
	t.Run("blind", func(t *testing.T) {
		_, err := readback.Load("adapters.yaml", strings.NewReader(
			"version: 1\nadapters:\n  - name: b\n    type: blind\n    dependency: d\n    control: {idempotency_key: k, target: /x, submitted_at: 2026-01-02T03:04:05Z}\n"), nil)
		var ce *readback.ConfigError
		if !errors.As(err, &ce) || ce.Field != "control" || !strings.Contains(err.Error(), "blind") {
			t.Fatalf("got %v, want a control error for a blind adapter", err)
		}
	})
}

// Issue 7, adversarial review: a declared control vouches only for the
// operation whose call made its resource, so after loading its
// Receipt.Operation is never empty: the explicit operation, else the
// adapter's only one. An adapter reading several operations, or every
// operation of its dependency, must name it; otherwise loading fails naming
// control.operation (a control of one operation must not vouch for
// another, whose path, filter or marker may be wrong).
func TestControlNamesItsOperation(t *testing.T) {
	base := "idempotency_key: k\ntarget: /items\nsubmitted_at: 2026-01-02T03:04:05Z\n"
	tests := []struct {
		name, ops, control string
		want               string // the control's operation; "" when loading must fail
		why                string // in the error
	}{
		{"one operation, implicit", "[items.create]", base, "items.create", ""},
		{"one operation, explicit", "[items.create]", base + "operation: items.create", "items.create", ""},
		{"several operations, explicit", "[items.create, items.import]", base + "operation: items.import", "items.import", ""},
		{"several operations, implicit", "[items.create, items.import]", base, "", "several operations (items.create, items.import)"},
		{"dependency-wide, explicit", "", base + "operation: items.create", "items.create", ""},
		{"dependency-wide, implicit", "", base, "", `every operation of dependency "shop"`},
		{"explicit, not the adapter's", "[items.create]", base + "operation: items.import", "", "not one of the adapter's operations"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, err := readback.Load("adapters.yaml", strings.NewReader(controlFile(tt.ops, tt.control)), nil)
			if tt.want == "" {
				var ce *readback.ConfigError
				if !errors.As(err, &ce) || ce.Field != "control.operation" || ce.Adapter != "shop-items" || ce.Line < 10 ||
					!strings.Contains(err.Error(), tt.why) {
					t.Fatalf("got %v, want a ConfigError naming control.operation, its line and %q", err, tt.why)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			b := reg.Bindings()[0]
			if b.Control == nil || b.Control.Receipt.Operation != tt.want {
				t.Fatalf("control %+v, want operation %q", b.Control, tt.want)
			}
		})
	}
}
