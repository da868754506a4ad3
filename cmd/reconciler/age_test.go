package main

import (
	"strings"
	"testing"
	"time"
)

// Issue 10, item 8: `--older-than 2d` dumped the whole help. Days are
// accepted; anything else is refused in one line that says what is.
func TestParseAge(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want time.Duration
		err  string
	}{
		{"", 0, ""},
		{"30m", 30 * time.Minute, ""},
		{"48h", 48 * time.Hour, ""},
		{"2d", 48 * time.Hour, ""},
		{"0d", 0, ""},
		{"2x", 0, "want a duration such as 30m, 48h or 2d"},
		{"-1d", 0, "want a duration such as"},
		{"-1h", 0, "must not be negative"},
		{"1.5d", 0, "want a duration such as"},
	} {
		got, err := parseAge(tt.in)
		switch {
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("parseAge(%q) = %v, %v; want an error saying %q", tt.in, got, err, tt.err)
		case tt.err == "" && (err != nil || got != tt.want):
			t.Errorf("parseAge(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
	code, out, errOut := runCLI(t, "", "review", "list", "--older-than", "2x", "--database-url", "postgres://nobody@127.0.0.1:1/none")
	if code != 2 || strings.Count(strings.TrimSpace(out+errOut), "\n") != 0 || !strings.Contains(errOut, "30m, 48h or 2d") {
		t.Errorf("review list --older-than 2x: exit %d, stdout %q, stderr %q; want one line, exit 2", code, out, errOut)
	}
}
