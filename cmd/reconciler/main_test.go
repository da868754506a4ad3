package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
)

// runCLI runs the command line in-process and returns its exit status and output.
func runCLI(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), append([]string{"reconciler"}, args...), strings.NewReader(stdin), &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestMigrate(t *testing.T) {
	url := pgtest.NewEmptyDatabase(t)
	steps := []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"migrate", "--database-url", url, "status"}, 0, "no schema: nothing applied"},
		{[]string{"migrate", "--database-url", url, "status"}, 0, "pending"},
		{[]string{"migrate", "--database-url", url, "up"}, 0, "applied 00001_receipts.sql"},
		{[]string{"migrate", "--database-url", url, "status"}, 0, "applied"},
		{[]string{"migrate", "--database-url", url, "up"}, 0, fmt.Sprintf("nothing to apply, the schema is at version %d", migrations.Latest())},
	}
	for _, s := range steps {
		code, out, errOut := runCLI(t, "", s.args...)
		if code != s.code || !strings.Contains(out, s.contains) {
			t.Fatalf("%v: exit %d, stdout %q, stderr %q; want exit %d and %q", s.args, code, out, errOut, s.code, s.contains)
		}
	}
	// Roll everything back, then forward again: the down migrations work.
	for {
		code, out, errOut := runCLI(t, "", "migrate", "--database-url", url, "down")
		if code != 0 {
			if !strings.Contains(errOut, "nothing to roll back") {
				t.Fatalf("down: exit %d: %s %s", code, out, errOut)
			}
			break
		}
	}
	if code, out, errOut := runCLI(t, "", "migrate", "--database-url", url, "status"); code != 0 || strings.Contains(out, "applied ") {
		t.Fatalf("status after rolling back: exit %d %q %q", code, out, errOut)
	}
	if code, _, errOut := runCLI(t, "", "migrate", "--database-url", url, "up"); code != 0 {
		t.Fatalf("up again: %s", errOut)
	}
}

func TestUsageErrors(t *testing.T) {
	t.Setenv("RECONCILER_DATABASE_URL", "")
	os.Unsetenv("RECONCILER_DATABASE_URL") // restored by t.Setenv's cleanup
	tests := []struct {
		args []string
		code int
	}{
		{[]string{"migrate", "up"}, 2},
		{[]string{"nonsense"}, 2},
		{[]string{"migrate", "--no-such-flag", "up"}, 2},
		{[]string{"migrate", "--database-url", "postgres://127.0.0.1:1/x?connect_timeout=2", "up"}, 1},
	}
	for _, tt := range tests {
		code, _, errOut := runCLI(t, "", tt.args...)
		if code != tt.code || strings.Count(strings.TrimSpace(errOut), "\n") > 0 {
			t.Errorf("%v: exit %d (stderr %q), want %d with a one-line error", tt.args, code, errOut, tt.code)
		}
	}
}
