package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// TestVerdictReport: once an audit contradicted a settled absence, every
// command an operator reads says so: stats (lines and JSON) the counts,
// the observed lag and the widened window; review list the receipt;
// receipts show its audit with both reads; adapters check the effective
// window and why.
func TestVerdictReport(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	late := unknownReceipt(t, db, "things.create", "late-api", 1)
	found := unknownReceipt(t, db, "things.create", "late-api", 2)
	var landed atomic.Bool
	adapter := readback.AdapterFunc(func(_ context.Context, r readback.Receipt) (readback.Result, error) {
		if r.IdempotencyKey == "control" || r.ID == found.ID || landed.Load() {
			return readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: []string{fmt.Sprint("t-", r.ID)}}, nil
		}
		return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET /things?marker=" + r.IdempotencyKey}, nil
	})
	p := readback.DefaultPolicy()
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "late", Kind: readback.Create, Dependency: "late-api", Adapter: adapter, Policy: p,
		Control: &readback.Control{Receipt: readback.Receipt{IdempotencyKey: "control", Operation: "things.create"}, Source: "declared"}}); err != nil {
		t.Fatal(err)
	}
	at := func(d time.Duration) func() time.Time { return func() time.Time { return time.Now().Add(d) } }
	for i, d := range []time.Duration{time.Hour, 2 * time.Hour} {
		pool, err := reconcile.New(db, reconcile.Config{Instance: "t", Registry: reg, Now: at(d)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			landed.Store(true)
		}
	}

	code, out, errOut := runCLI(t, "", "stats", "--database-url", url)
	for _, want := range []string{
		"dependency.late-api.verdicts.safe_to_retry.absent_after_window=1",
		"dependency.late-api.verdicts.succeeded.present=1",
		"dependency.late-api.audited=1", "dependency.late-api.contradicted=1",
		"dependency.late-api.window_alarms=1", "dependency.late-api.observed_lag.things.create.samples=1",
		"dependency.late-api.window.late.declared_s=90.000", "dependency.late-api.window.late.widened=false_absence",
	} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("stats: exit %d, no %q in:\n%s%s", code, want, out, errOut)
		}
	}
	code, out, errOut = runCLI(t, "", "stats", "--json", "--database-url", url)
	var js struct {
		Dependencies []reconcile.DependencyVerdicts `json:"dependencies"`
	}
	if err := json.Unmarshal([]byte(out), &js); code != 0 || err != nil || len(js.Dependencies) != 1 || js.Dependencies[0].Contradicted != 1 {
		t.Fatalf("stats --json: exit %d, %v: %s%s", code, err, out, errOut)
	}

	code, out, errOut = runCLI(t, "", "review", "list", "--database-url", url)
	if code != 0 || !strings.Contains(out, "false_absence") || !strings.Contains(out, fmt.Sprint(late.ID)+" ") {
		t.Fatalf("review list: exit %d:\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "review", "list", "--json", "--database-url", url)
	if code != 0 || !strings.Contains(out, `"reason": "false_absence"`) {
		t.Fatalf("review list --json: exit %d:\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "receipts", "show", fmt.Sprint(late.ID), "--database-url", url)
	for _, want := range []string{"audits", "contradicted", "false_absence", `"verdict":"present"`, `"settled_on"`} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("receipts show: exit %d, no %q in:\n%s%s", code, want, out, errOut)
		}
	}

	path := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(path, []byte(`version: 1
adapters:
  - {name: late, type: static, kind: create, dependency: late-api, consistency_window: 30s, max_request_lifetime: 60s, static: {verdict: absent, authoritative: true}}
  - {name: other, type: static, kind: create, dependency: other-api, static: {verdict: absent, authoritative: true}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = runCLI(t, "", "adapters", "check", "--config", path, "--database-url", url)
	for _, want := range []string{"late: ", "widened from the declared 1m30s: false_absence on receipt " + fmt.Sprint(late.ID),
		"other: 1m30s, as declared"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("adapters check: exit %d, no %q in:\n%s%s", code, want, out, errOut)
		}
	}
	// Explaining a receipt's readback, it waits for the widened window.
	fresh := unknownReceipt(t, db, "things.create", "late-api", 3)
	code, out, errOut = runCLI(t, "", "adapters", "check", "--config", path, "--database-url", url, "--receipt", fmt.Sprint(fresh.ID))
	for _, want := range []string{"widened from the declared 1m30s by a false_absence alarm", "decision: check again at"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("adapters check --receipt: exit %d, no %q in:\n%s%s", code, want, out, errOut)
		}
	}
}
