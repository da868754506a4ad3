package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
)

// startCLI runs the command line in-process in the background, its stderr
// in errOut, until stop cancels its context; stop returns its exit status,
// failing the test if it does not end within 30 s.
func startCLI(t *testing.T, errOut io.Writer, args ...string) (stop func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, append([]string{"reconciler"}, args...), strings.NewReader(""), io.Discard, errOut)
	}()
	return func() int {
		t.Helper()
		cancel()
		select {
		case code := <-done:
			return code
		case <-time.After(30 * time.Second):
			t.Fatalf("reconciler %s did not stop", args[0])
			return 0
		}
	}
}

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

// Issue 19, item 5: `migrate down` below 00004 while a receipt is unsettled
// is refused with a one-line error that says how many receipts, what the
// step would drop and how to go on; nothing is rolled back. With
// --accept-data-loss it goes through.
func TestMigrateDownKeepsSoundnessData(t *testing.T) {
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	if _, err := db.Exec(context.Background(), `SELECT reconciler.plan('down:1', 'things.create', 'api', 'POST',
		'/things', 'sha256:' || repeat('a', 64), '{}', 'agent:test')`); err != nil {
		t.Fatal(err)
	}
	var code int
	var out, errOut string
	for code == 0 {
		code, out, errOut = runCLI(t, "", "migrate", "--database-url", url, "down")
		if code == 0 && strings.Contains(out, "00004_soundness.sql") {
			t.Fatalf("down rolled back 00004 with a receipt unsettled: %q", out)
		}
	}
	wantOneLine(t, "down below 00004", code, out, errOut, 1, "1 receipts are unsettled", "late_outcomes",
		"max_send_delay", "nothing was rolled back", "--accept-data-loss")
	code, out, errOut = runCLI(t, "", "migrate", "--database-url", url, "down", "--accept-data-loss")
	if code != 0 || !strings.Contains(out, "rolled back 00004_soundness.sql") {
		t.Fatalf("down --accept-data-loss: exit %d %q %q", code, out, errOut)
	}
}

// Issue 19, item 1: `stats` says how many late answers were recorded after
// their receipt's absence window, and of which dependencies (a line, and
// the same in --json).
func TestStatsLifetimeExceeded(t *testing.T) {
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	code, out, errOut := runCLI(t, "", "stats", "--database-url", url)
	if code != 0 || !strings.Contains(out, "lifetime_exceeded=0\n") || strings.Contains(out, "lifetime_exceeded_dependencies") {
		t.Fatalf("stats with no alarm: exit %d %q %q", code, out, errOut)
	}
	if _, err := db.Exec(context.Background(), `INSERT INTO reconciler.lifetime_alarms
		(receipt_id, late_outcome_id, dependency, operation, outcome, http_status, late_at, window_end)
		VALUES (1, 1, 'payments', 'charges.create', 'outcome_unknown', 504, now(), now() - interval '1 minute'),
		       (2, 2, 'payments', 'charges.create', 'succeeded', 201, now(), now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = runCLI(t, "", "stats", "--database-url", url)
	if code != 0 || !strings.Contains(out, "lifetime_exceeded=2\n") || !strings.Contains(out, "lifetime_exceeded_dependencies=payments\n") {
		t.Fatalf("stats: exit %d %q %q; want lifetime_exceeded=2 of payments", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "stats", "--json", "--database-url", url)
	var got struct {
		Exceeded int64 `json:"lifetime_exceeded"`
		ByDep    []struct {
			Dependency string `json:"dependency"`
			Count      int64  `json:"count"`
		} `json:"lifetime_exceeded_by_dependency"`
	}
	if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil || got.Exceeded != 2 || len(got.ByDep) != 1 ||
		got.ByDep[0].Dependency != "payments" || got.ByDep[0].Count != 2 {
		t.Fatalf("stats --json: exit %d %q %q (%v): %+v", code, out, errOut, err, got)
	}
}
