package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestRunNeedsAdaptersOrNoAdapters: a daemon with no adapters sends every
// receipt to manual_review; it starts so only with --no-adapters, and says
// so in its log.
func TestRunNeedsAdaptersOrNoAdapters(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	empty := write("empty.yaml", "")
	none := write("none.yaml", "version: 1\nadapters: []\n")
	good := write("good.yaml", "version: 1\nadapters:\n  - {name: s, type: static, kind: create, dependency: d, static: {verdict: present}}\n")
	url := pgtest.NewDatabase(t)
	t.Setenv("RECONCILER_ADAPTERS", "")
	os.Unsetenv("RECONCILER_ADAPTERS")
	t.Setenv("RECONCILER_NO_ADAPTERS", "")
	os.Unsetenv("RECONCILER_NO_ADAPTERS")
	tests := []struct {
		name string
		args []string
		code int
		want string // in stderr
	}{
		{"no file", []string{}, 2, "--no-adapters"},
		{"empty file", []string{"--adapters", empty}, 1, "empty.yaml: adapters: no adapters declared"},
		{"file with none", []string{"--adapters", none}, 1, "none.yaml:2: adapters: no adapters declared"},
		{"contradiction", []string{"--adapters", good, "--no-adapters"}, 2, "declares adapters"},
		{"explicit", []string{"--no-adapters"}, 0, "every receipt that needs a readback goes to manual_review"},
		{"explicit, empty file", []string{"--no-adapters", "--adapters", empty}, 0, "goes to manual_review"},
		{"good file", []string{"--adapters", good}, 0, ""},
	}
	for _, tt := range tests {
		args := append([]string{"run", "--once", "--database-url", url}, tt.args...)
		code, _, errOut := runCLI(t, "", args...)
		if code != tt.code || !strings.Contains(errOut, tt.want) {
			t.Errorf("%s: %v: exit %d, stderr %q; want exit %d and %q", tt.name, tt.args, code, errOut, tt.code, tt.want)
		}
		if code != 0 && strings.Count(errOut, "\n") != 1 {
			t.Errorf("%s: want one line, got %q", tt.name, errOut)
		}
	}
}
