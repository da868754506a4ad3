package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// Acceptance 1: present → succeeded with the external id; absent after the
// window → safe_to_retry; absent before the window is never settled, even
// when the adapter says the answer is authoritative.
func TestSettleByVerdict(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	ids := seed(t, db, 2, "things.create", "fake-api", "outcome_unknown")
	present, absent := ids[0], ids[1]
	api.Create(idempotencyKey(t, db, present), "thing-42")
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: clk.Now})

	// Inside the window: the present one settles, the absent one waits.
	clk.Advance(time.Second)
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, present); got.State != "succeeded" || got.ExternalID != "thing-42" {
		t.Fatalf("present receipt = %+v, want succeeded with thing-42", got)
	}
	ev := settlements(t, db, present)
	if len(ev) != 1 || ev[0]["reason"] != reconcile.ReasonPresent {
		t.Fatalf("settlement events = %v", ev)
	}
	evidence := ev[0]["evidence"].(map[string]any)
	if evidence["query"] == "" || evidence["checks"].(float64) != 1 || evidence["adapter"] != "fake-search" {
		t.Fatalf("evidence = %v", evidence)
	}
	if got := receipt(t, db, absent); got.State != "reconciling" || got.LeaseOwner != "" {
		t.Fatalf("absent before the window = %+v, want reconciling without a lease", got)
	}
	if sum.Settled[statemachine.Succeeded] != 1 || sum.Waiting != 1 {
		t.Fatalf("summary = %+v", sum)
	}

	// Still inside the window, several more checks: never settled.
	for range 5 {
		clk.Advance(time.Second)
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		if got := receipt(t, db, absent); got.State != "reconciling" {
			t.Fatalf("absent receipt settled inside the window: %+v", got)
		}
	}
	if len(settlements(t, db, absent)) != 0 {
		t.Fatal("a settlement event was written inside the window")
	}
	before := checkCount(t, db, absent)
	if before < 2 {
		t.Fatalf("checks recorded = %d, want one per check", before)
	}

	// After the window (lifetime 6s + lag 4s): safe_to_retry, with the guarantee.
	clk.Advance(10 * time.Second)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, absent); got.State != "safe_to_retry" {
		t.Fatalf("absent after the window = %+v, want safe_to_retry", got)
	}
	ev = settlements(t, db, absent)
	if len(ev) != 1 {
		t.Fatalf("settlement events = %v", ev)
	}
	evidence = ev[0]["evidence"].(map[string]any)
	if evidence["guarantee"] != string(readback.RequestLifetimeElapsed) || int(evidence["checks"].(float64)) != before+1 {
		t.Fatalf("evidence = %v", evidence)
	}
	if n := checkCount(t, db, absent); n != before+1 {
		t.Fatalf("checks recorded = %d, want %d", n, before+1)
	}
}

// Acceptance 1 (tables): the same rules for each verdict an adapter can give.
func TestSettleRules(t *testing.T) {
	tests := []struct {
		name   string
		kind   readback.Kind
		answer readback.Result
		after  time.Duration // since submission
		want   string
		reason string
	}{
		{"present", readback.Create, readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"x"}}, time.Second, "succeeded", reconcile.ReasonPresent},
		{"duplicate", readback.Create, readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"x", "y"}}, time.Second, "succeeded", reconcile.ReasonPresentDuplicates},
		{"absent after window", readback.Create, readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, time.Minute, "safe_to_retry", reconcile.ReasonAbsentAfterWindow},
		{"absent before window, authoritative", readback.Create, readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, time.Second, "reconciling", ""},
		{"update diverged", readback.Update, readback.Result{Verdict: readback.VerdictDiverged}, time.Second, "manual_review", reconcile.ReasonDiverged},
		{"delete done", readback.Delete, readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, time.Second, "succeeded", reconcile.ReasonDeleted},
		{"delete not done", readback.Delete, readback.Result{Verdict: readback.VerdictPresent, Authoritative: true}, time.Minute, "safe_to_retry", reconcile.ReasonPresentAfterDelay},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewPool(t)
			clk := newClock()
			id := seed(t, db, 1, "things.change", "static-api", "outcome_unknown")[0]
			ctl := fakeControl()
			ctl.Receipt.Operation = "things.change"
			gone := ""
			if tt.kind == readback.Delete {
				// A delete the agent saw succeed (its 2xx): its resource
				// is gone, the control of "still present".
				g := seed(t, db, 1, "things.change", "static-api", "submitted")[0]
				markSucceededFromResponse(t, db, g, "gone-1")
				gone = idempotencyKey(t, db, g)
			}
			reg := registry(t, nil, shortPolicy(), readback.Binding{Name: "answer", Kind: tt.kind,
				Dependency: "static-api", Policy: shortPolicy(), Control: ctl,
				Adapter: readback.AdapterFunc(func(_ context.Context, r readback.Receipt) (readback.Result, error) {
					switch r.IdempotencyKey {
					case controlMarker: // the declared control exists
						return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"c"}, Authoritative: true}, nil
					case gone:
						return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, nil
					}
					return tt.answer, nil
				})})
			clk.Advance(tt.after)
			pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now})
			if _, err := pool.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := receipt(t, db, id); got.State != tt.want {
				t.Fatalf("state = %s, want %s", got.State, tt.want)
			}
			ev := settlements(t, db, id)
			if tt.reason == "" {
				if len(ev) != 0 {
					t.Fatalf("settled: %v", ev)
				}
				return
			}
			if len(ev) != 1 || ev[0]["reason"] != tt.reason {
				t.Fatalf("settlement events = %v, want one with reason %s", ev, tt.reason)
			}
			if tt.reason == reconcile.ReasonPresentDuplicates {
				var n int
				if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.duplicate_alarms
					WHERE receipt_id = $1 AND external_ids = '{x,y}'`, id).Scan(&n); err != nil || n != 1 {
					t.Fatalf("duplicate alarms = %d, %v; want 1", n, err)
				}
			}
		})
	}
}

// Acceptance 6: orphaned submitted rows are reconciled; blind and
// adapter-less rows go to manual_review with their reason.
func TestOrphansBlindAndAdapterless(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	orphans := seed(t, db, 3, "things.create", "fake-api", "submitted")
	api.Create(idempotencyKey(t, db, orphans[0]), "thing-1")
	blind := seed(t, db, 2, "mail.send", "mailer", "outcome_unknown")
	lost := seed(t, db, 2, "mystery.op", "nowhere", "outcome_unknown")
	planned := seed(t, db, 1, "things.create", "fake-api", "planned")[0]
	reg := registry(t, api, shortPolicy(), readback.Binding{Name: "mailer-blind", Kind: readback.Blind, Dependency: "mailer", Policy: readback.DefaultPolicy()})

	// The fresh one is submitted a while after the others. (The database
	// stamps updated_at and refuses to have it rewritten (issue 7, path 9),
	// so the test waits until its clock has moved past the orphan timeout
	// instead of backdating rows.)
	const orphanTimeout = 300 * time.Millisecond
	waitFor(t, 10*time.Second, "the database's clock to pass the orphans' timeout", func() (bool, string) {
		n := countWhere(t, db, fmt.Sprintf("state = 'submitted' AND updated_at < clock_timestamp() - interval '%d milliseconds'",
			2*orphanTimeout.Milliseconds()))
		return n == len(orphans), fmt.Sprintf("%d of %d", n, len(orphans))
	})
	fresh := seed(t, db, 1, "things.create", "fake-api", "submitted")[0]
	clk = newClock() // now: the orphans are older than the timeout, the fresh one is not
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: orphanTimeout})
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// 10 minutes later the window is over for the absent orphans (no sweep:
	// it would take the fresh one too, on this test's clock).
	clk.Advance(10 * time.Minute)
	if _, err := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1}).Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if sum.Orphans != 3 {
		t.Fatalf("orphans = %d, want 3 (summary %+v)", sum.Orphans, sum)
	}
	if got := receipt(t, db, orphans[0]); got.State != "succeeded" || got.ExternalID != "thing-1" {
		t.Fatalf("orphan with an effect = %+v, want succeeded", got)
	}
	for _, id := range orphans[1:] {
		// Absent, and 10 minutes after submission the window is over.
		if got := receipt(t, db, id); got.State != "safe_to_retry" {
			t.Fatalf("orphan without an effect = %+v, want safe_to_retry", got)
		}
	}
	var actor, reason string
	if err := db.QueryRow(ctx, `SELECT actor, detail->>'reason' FROM reconciler.receipt_events
		WHERE receipt_id = $1 AND to_state = 'outcome_unknown'`, orphans[1]).Scan(&actor, &reason); err != nil {
		t.Fatal(err)
	}
	if actor != string(pool.Store().Actor()) || reason != "orphaned" {
		t.Fatalf("orphan event actor %q reason %q", actor, reason)
	}
	if got := receipt(t, db, fresh); got.State != "submitted" {
		t.Fatalf("a recent submitted receipt was touched: %+v", got)
	}
	if got := receipt(t, db, planned); got.State != "planned" {
		t.Fatalf("a planned receipt was touched: %+v", got)
	}
	for _, c := range []struct {
		ids    []int64
		reason string
	}{{blind, reconcile.ReasonBlind}, {lost, reconcile.ReasonNoAdapter}} {
		for _, id := range c.ids {
			if got := receipt(t, db, id); got.State != "manual_review" {
				t.Fatalf("receipt %d = %+v, want manual_review", id, got)
			}
			ev := settlements(t, db, id)
			if len(ev) != 1 || ev[0]["reason"] != c.reason {
				t.Fatalf("receipt %d events = %v, want reason %s", id, ev, c.reason)
			}
		}
	}
	b, err := pool.Store().Backlog(ctx, clk.Now(), time.Minute, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if b.StalePlanned != 1 || b.ManualReview != 4 || b.Submitted != 1 {
		t.Fatalf("backlog = %+v", b)
	}
}
