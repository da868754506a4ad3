package rolestest

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

// TestVerdictAuditsUnderRoles: under the roles of docs/roles.sql the
// worker settles an absence (the trigger queues its audit), audits it,
// records the contradiction and the window alarm; the reviewer sees the
// contradicted verdict and the audit; readonly reports them; nobody
// rewrites an audit or an alarm, and the agent reads neither.
func TestVerdictAuditsUnderRoles(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	r := unknown(t, agent, "v:late", "late-api")
	var landed atomic.Bool
	adapter := readback.AdapterFunc(func(_ context.Context, rc readback.Receipt) (readback.Result, error) {
		if rc.IdempotencyKey == "control" || landed.Load() {
			return readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: []string{"t-1"}}, nil
		}
		return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, nil
	})
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "late", Kind: readback.Create, Dependency: "late-api",
		Adapter: adapter, Policy: readback.DefaultPolicy(),
		Control: &readback.Control{Receipt: readback.Receipt{IdempotencyKey: "control", Operation: "things.create"}, Source: "declared"}}); err != nil {
		t.Fatal(err)
	}
	at := func(d time.Duration) func() time.Time { return func() time.Time { return time.Now().Add(d) } }
	settle, err := reconcile.New(e.worker, reconcile.Config{Instance: workerID, Registry: reg, Now: at(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := settle.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := agent.Get(ctx, r.ID); err != nil || got.State != statemachine.SafeToRetry {
		t.Fatalf("as the worker: %v, %v; want safe_to_retry", got, err)
	}
	landed.Store(true)
	// Default audit delay: 4 × (5 s + 90 s) after the settling read.
	later, err := reconcile.New(e.worker, reconcile.Config{Instance: workerID, Registry: reg, Now: at(2 * time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := later.Audit(ctx); err != nil || n != 1 {
		t.Fatalf("audit as the worker: %d, %v; want 1", n, err)
	}
	cs, err := review.Contradicted(ctx, e.reviewer, review.Filter{})
	if err != nil || len(cs) != 1 || cs[0].ID != r.ID {
		t.Fatalf("contradicted verdicts as the reviewer: %+v, %v", cs, err)
	}
	tl, err := review.Show(ctx, e.reviewer, r.ID)
	if err != nil || len(tl.Audits) != 1 || tl.Audits[0].Verdict != reconcile.AuditContradicted {
		t.Fatalf("timeline as the reviewer: %+v, %v", tl, err)
	}
	ro := loginPool(t, e.owner, e.url, "reconciler_readonly")
	store, err := reconcile.NewStore(ro, "stats")
	if err != nil {
		t.Fatal(err)
	}
	ds, err := store.VerdictStats(ctx, 24*time.Hour)
	if err != nil || len(ds) != 1 || ds[0].Contradicted != 1 || ds[0].Alarms != 1 || len(ds[0].Windows) != 1 {
		t.Fatalf("stats as readonly: %+v, %v", ds, err)
	}
	rewrites := []stmt{
		{"update verdict_audits", `UPDATE reconciler.verdict_audits SET verdict = 'confirmed'`, nil},
		{"delete verdict_audits", `DELETE FROM reconciler.verdict_audits`, nil},
		{"update window_alarms", `UPDATE reconciler.window_alarms SET effective_after = declared`, nil},
		{"delete window_alarms", `DELETE FROM reconciler.window_alarms`, nil},
	}
	refuse(t, e.worker, denied, rewrites)
	refuse(t, e.reviewer, denied, rewrites)
	refuse(t, e.owner, rewrite, rewrites)
	refuse(t, e.agent, denied, []stmt{
		{"read verdict_audits", `SELECT * FROM reconciler.verdict_audits`, nil},
		{"read window_alarms", `SELECT * FROM reconciler.window_alarms`, nil},
		{"read audit_queue", `SELECT * FROM reconciler.audit_queue`, nil},
	})
}
