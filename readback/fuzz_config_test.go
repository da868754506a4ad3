package readback_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// yamlBlock matches a fenced YAML block of a Markdown file.
var yamlBlock = regexp.MustCompile("(?s)```ya?ml\n(.*?)```")

// Issue 9, item 6: the adapters file parser under arbitrary bytes, with the
// built-in types and the declarative http type. It never panics; an error is
// a *readback.ConfigError matching ErrInvalidConfig with a non-empty message
// and a cause; a file that loads yields bindings that each have a name, a
// dependency and a valid kind (and an adapter unless blind), with unique
// names, and dependency limits only for dependencies an adapter reads.
func FuzzLoadAdaptersFile(f *testing.F) {
	seeds := []string{
		good,
		"",
		"version: 1\n",
		"version: 2\nadapters: []\n",
		"version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\n",
		"version: 1\nadapters:\n  - {name: a, type: soap, kind: create, dependency: d}\n",
		"version: 1\nadapters:\n  - name: a\n    type: blind\n    dependncy: d\n",
		"version: 1\nadapters:\n  - {name: a, type: blind, dependency: d, consistency_window: soon}\n",
		"version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d, deadline: 1s, static: {verdict: present}}\n",
		"version: 1\nadapters:\n  - {name: a, type: static, kind: create, dependency: d, static: {verdict: yes}}\n",
		"version: 1\nadapters:\n  - {name: a, type: static, kind: update, dependency: d, static: {verdict: absent}}\n" +
			"dependencies:\n  d: {max_in_flight: 2, breaker: {failures: 3, cooldown: 5s}, retry_budget: {ratio: 0.1, min: 1}}\n",
		"version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\ndependencies:\n  e: {max_in_flight: 1}\n",
		"version: 1\nadapters:\n  - {name: a, type: blind, dependency: d}\n  - {name: a, type: blind, dependency: d}\n",
		"version: 1\nadapters:\n  - &x {name: a, type: blind, dependency: d}\n  - *x\n",
		"version: 1\nadapters: {a: 1}\n",
		"- 1\n- 2\n",
		"version: 1\nadapters:\n  - [1, 2]\n",
		"version: 1\nadapters:\n  - {name: a, type: http, kind: create, dependency: d, http: {}}\n",
	}
	docs, _ := filepath.Glob("../docs/*.md")
	for _, doc := range append([]string{"../README.md"}, docs...) {
		data, err := os.ReadFile(doc)
		if err != nil {
			f.Fatalf("seed %s: %v", doc, err)
		}
		for _, m := range yamlBlock.FindAllSubmatch(data, -1) {
			seeds = append(seeds, string(m[1]))
		}
	}
	if matches, _ := filepath.Glob("testdata/*.yaml"); len(matches) > 0 {
		for _, p := range matches {
			if data, err := os.ReadFile(p); err == nil {
				seeds = append(seeds, string(data))
			}
		}
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	types := httpadapter.Types()
	f.Fuzz(func(t *testing.T, data []byte) {
		reg, err := readback.Load("adapters.yaml", bytes.NewReader(data), types)
		if err != nil {
			if reg != nil {
				t.Errorf("Load returned a registry with its error %v", err)
			}
			var ce *readback.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("error %T is not a *readback.ConfigError: %v", err, err)
			}
			if !errors.Is(err, readback.ErrInvalidConfig) {
				t.Errorf("error does not match ErrInvalidConfig: %v", err)
			}
			if ce.Err == nil {
				t.Errorf("ConfigError without a cause: %#v", ce)
			}
			if msg := err.Error(); strings.TrimSpace(msg) == "" || strings.Contains(msg, "%!") {
				t.Errorf("error message empty or badly formatted: %q", msg)
			}
			return
		}
		if reg == nil {
			t.Fatal("Load returned neither a registry nor an error")
		}
		bs := reg.Bindings()
		if len(bs) == 0 {
			t.Fatal("a file that loads has no binding (ErrNoAdapters not enforced)")
		}
		names := map[string]bool{}
		deps := map[string]bool{}
		for _, b := range bs {
			if b.Name == "" || b.Dependency == "" || !b.Kind.Valid() {
				t.Errorf("binding without name, dependency or valid kind: %+v", b)
			}
			if b.Kind != readback.Blind && b.Adapter == nil {
				t.Errorf("binding %q of kind %q has no adapter", b.Name, b.Kind)
			}
			if names[b.Name] {
				t.Errorf("two bindings named %q", b.Name)
			}
			names[b.Name] = true
			deps[b.Dependency] = true
		}
		for dep := range reg.Dependencies() {
			if !deps[dep] {
				t.Errorf("limits for dependency %q that no binding reads", dep)
			}
		}
	})
}
