package integration

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
)

// breakerGate admits the first `admit` checks, then defers every check as
// an open breaker would, for ever (until the test ends).
type breakerGate struct {
	now     func() time.Time
	admit   atomic.Int64
	entered atomic.Int64
	defers  atomic.Int64
}

func (g *breakerGate) Enter(context.Context, string, bool) (reconcile.Pass, error) {
	g.entered.Add(1)
	if g.admit.Add(-1) >= 0 {
		return nopPass{}, nil
	}
	g.defers.Add(1)
	return nil, &reconcile.Deferral{Reason: "breaker open", Until: g.now().Add(2 * time.Second)}
}

type nopPass struct{}

func (nopPass) Exit(reconcile.CheckResult, time.Duration) {}

// Issue 9, item 3: waiting is not checking. A dependency whose breaker stays
// open for many poll cycles defers its receipts again and again: those
// deferrals do not use up max_checks, so no receipt goes to manual_review by
// max_checks; only the deadline ends them, and the evidence says so, with
// the reads and the waits.
func TestDeferralsDoNotUseUpMaxChecks(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	api.SetFail(true) // the reads that are let through fail: 503
	pol := shortPolicy()
	pol.MaxChecks, pol.Deadline = 3, 2*time.Minute
	gate := &breakerGate{now: clk.Now}
	gate.admit.Store(2) // two reads get through (and fail), then the breaker opens
	ids := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")
	id := ids[0]
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, pol), Gate: gate, Now: clk.Now,
		Workers: 2, BatchSize: 8, MaxInFlight: 8, PollInterval: time.Second})

	ctx := context.Background()
	cycles := 0
	for {
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		cycles++
		got := receipt(t, db, id)
		if got.State != "reconciling" && got.State != "outcome_unknown" {
			break
		}
		if got.Checks > 2 {
			t.Fatalf("cycle %d: check_count %d: a deferral counted as a check", cycles, got.Checks)
		}
		if cycles > 100 {
			t.Fatal("the deadline never ended the receipt")
		}
		clk.Advance(5 * time.Second) // one poll cycle of an operator's daemon
	}
	got := receipt(t, db, id)
	if got.State != "manual_review" {
		t.Fatalf("state %s, want manual_review at the deadline", got.State)
	}
	if got.Checks != 2 {
		t.Fatalf("check_count %d, want the 2 reads made", got.Checks)
	}
	if gate.defers.Load() <= int64(pol.MaxChecks) {
		t.Fatalf("only %d deferrals: the test did not wait past max_checks", gate.defers.Load())
	}
	ev := settlements(t, db, id)
	if len(ev) != 1 {
		t.Fatalf("%d settlements, want 1", len(ev))
	}
	if ev[0]["reason"] != reconcile.ReasonBoundReached {
		t.Fatalf("reason %v, want bound_reached", ev[0]["reason"])
	}
	evidence := ev[0]["evidence"].(map[string]any)
	if evidence["bound"] != "deadline" {
		t.Fatalf("bound %v, want deadline (evidence %v)", evidence["bound"], evidence)
	}
	if int(evidence["checks"].(float64)) != 2 || int(evidence["waits"].(float64)) != int(gate.defers.Load()) {
		t.Fatalf("evidence checks %v waits %v, want 2 reads and %d waits", evidence["checks"], evidence["waits"], gate.defers.Load())
	}
	if n := checkCount(t, db, id); n != 2 {
		t.Fatalf("%d check records, want the 2 reads", n)
	}
}

// A receipt whose reads all answer (inconclusively, here failing
// transiently) is still ended by max_checks, and the evidence says so.
func TestMaxChecksStillBoundsReads(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	api.SetFail(true)
	pol := shortPolicy()
	pol.MaxChecks, pol.Deadline = 3, time.Hour
	id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, pol), Now: clk.Now,
		Workers: 2, BatchSize: 8, MaxInFlight: 8, PollInterval: time.Second})
	for i := 0; i < 10; i++ {
		if st := receipt(t, db, id).State; st != "outcome_unknown" && st != "reconciling" {
			break
		}
		if _, err := pool.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		clk.Advance(5 * time.Second)
	}
	ev := settlements(t, db, id)
	if len(ev) != 1 || ev[0]["reason"] != reconcile.ReasonBoundReached {
		t.Fatalf("settlements %v, want one bound_reached", ev)
	}
	evidence := ev[0]["evidence"].(map[string]any)
	if evidence["bound"] != "max_checks" || int(evidence["checks"].(float64)) != 3 || int(evidence["waits"].(float64)) != 0 {
		t.Fatalf("evidence %v, want bound max_checks after 3 reads and 0 waits", evidence)
	}
}
