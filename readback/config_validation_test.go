package readback_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// TestLoadValidation: every refusal names the file, the line of the
// offending key (not its parent's), the adapter and the field; a file that
// declares no adapter is refused.
func TestLoadValidation(t *testing.T) {
	tests := []struct {
		name, file string
		want       []string
		noAdapters bool
	}{
		{"empty file", "", []string{"a.yaml: adapters: no adapters declared", "--no-adapters"}, true},
		{"only comments", "# nothing yet\n", []string{"a.yaml: adapters: no adapters declared"}, true},
		{"empty list", "version: 1\nadapters: []\n", []string{"a.yaml:2: adapters: no adapters declared"}, true},
		{"no adapters key", "version: 1\ndefaults: {max_checks: 3}\n", []string{"a.yaml:1: adapters: no adapters declared"}, true},
		{"unknown key in the type's block", `version: 1
adapters:
  - name: blog
    type: http
    kind: create
    dependency: blog-api
    http:
      base_url: https://blog.example
      search:
        path: /api/articles
        bogus: 1
        items: /data
        id: /id
`, []string{`a.yaml:11: adapter "blog": http.search.bogus: unknown field`}, false},
		{"bad duration in the type's block", `version: 1
adapters:
  - name: blog
    type: http
    kind: create
    dependency: blog-api
    http:
      base_url: https://blog.example
      timeout: 2 days
      search: {path: /api/articles, items: /data, id: /id}
`, []string{`a.yaml:9: adapter "blog": http.timeout:`, `"2 days"`}, false},
		{"bad duration in defaults", `version: 1
defaults:
  backoff: {base: 2d}
adapters:
  - {name: s, type: static, kind: create, dependency: d, static: {verdict: present}}
`, []string{`a.yaml:3: defaults.backoff.base:`, `"2d"`}, false},
		{"bad duration on an adapter", `version: 1
adapters:
  - name: s
    type: static
    kind: create
    dependency: d

    consistency_window: 5 minutes
    static: {verdict: present}
`, []string{`a.yaml:8: adapter "s": consistency_window:`, `"5 minutes"`}, false},
		{"bad duration in static", `version: 1
adapters:
  - name: s
    type: static
    kind: create
    dependency: d
    static:
      verdict: present
      delay: 3x
`, []string{`a.yaml:9: adapter "s": static.delay:`}, false},
		{"bad duration in a dependency", `version: 1
dependencies:
  d:
    breaker:
      cooldown: 2d
adapters:
  - {name: s, type: static, kind: create, dependency: d, static: {verdict: present}}
`, []string{`a.yaml:5: dependency "d": breaker.cooldown:`, `"2d"`}, false},
		{"unknown key on an adapter", `version: 1
adapters:
  - name: s
    type: static
    kind: create
    dependency: d
    static: {verdict: present}
    retries: 3
`, []string{`a.yaml:8: adapter "s": retries: unknown field`}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readback.Load("a.yaml", strings.NewReader(tt.file), httpadapter.Types())
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			for _, w := range tt.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q lacks %q", msg, w)
				}
			}
			if strings.Contains(msg, "\n") {
				t.Errorf("error is not one line: %q", msg)
			}
			if !errors.Is(err, readback.ErrInvalidConfig) {
				t.Errorf("error does not match ErrInvalidConfig: %v", err)
			}
			if errors.Is(err, readback.ErrNoAdapters) != tt.noAdapters {
				t.Errorf("errors.Is(err, ErrNoAdapters) = %v, want %v", !tt.noAdapters, tt.noAdapters)
			}
		})
	}
}
