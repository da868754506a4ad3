package integration

import (
	"context"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/reconcile"
)

// Acceptance 3: a readback dependency answering 503 for a while: the
// breaker opens, rows are rescheduled (none settled), exactly one probe runs
// in half-open, and the rows settle after recovery.
func TestBreakerReschedulesAndProbesOnce(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	ids := seed(t, db, 20, "things.create", "fake-api", "outcome_unknown")
	for i, id := range ids {
		api.Create(idempotencyKey(t, db, id), "thing-"+string(rune('a'+i)))
	}
	api.SetFail(true)
	// Without Retry-After: the breaker, not the header, is under test (a
	// Retry-After on the frozen test clock would defer every other row).
	api.retryAfter = ""

	pcfg := protect.DefaultConfig()
	pcfg.Instance = "breaker-test"
	pcfg.Default.Breaker.FailureThreshold = 3
	pcfg.Default.Breaker.Cooldown = 10 * time.Second
	pcfg.Default.Breaker.CooldownGrowth = 1
	pcfg.Default.Concurrency.MaxInFlight = 1 // calls in order, so the breaker sees them one by one
	pcfg.Default.Rate.Limit = 1000
	pcfg.Default.Rate.Burst = 1000
	pcfg.Default.RetryBudget.MinRetries = 1000
	pcfg.Default.Degraded.MinCalls = 1 << 30
	guard, err := protect.New(protect.NewPGStore(db), pcfg, clk, nil)
	if err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: clk.Now,
		Gate: reconcile.ProtectGate(guard), Workers: 1})
	// The shared open-until row lives on the database's clock (issue 7,
	// path 5), which this test's clock does not move: when the test moves
	// its clock, the row is moved back by as much, as if the time had passed.
	advance := func(d time.Duration) {
		t.Helper()
		clk.Advance(d)
		if _, err := db.Exec(ctx, `UPDATE reconciler.dependency_breakers
			SET open_until = open_until - $1::bigint * interval '1 microsecond'`, d.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	drain := func() reconcile.Summary {
		t.Helper()
		sum, err := pool.Drain(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return sum
	}
	settled := func() int { return countWhere(t, db, "state IN ('succeeded', 'safe_to_retry', 'manual_review')") }

	// Outage: three 503s open the breaker; every other row is deferred.
	clk.Advance(time.Second)
	sum := drain()
	if got := api.calls.Load(); got != 3 {
		t.Fatalf("calls during the outage = %d, want the 3 that opened the breaker", got)
	}
	if guard.Status("fake-api").Breaker != protect.Open || sum.Deferred != 17 {
		t.Fatalf("breaker %v, deferred %d; want open and 17 deferred", guard.Status("fake-api").Breaker, sum.Deferred)
	}
	var open int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.dependency_breakers
		WHERE dependency = 'fake-api' AND open_until > $1`, clk.Now()).Scan(&open); err != nil || open != 1 {
		t.Fatalf("shared open-until row: %d, %v", open, err)
	}

	// While open: rows come due and are rescheduled without a call.
	advance(5 * time.Second)
	drain()
	if got := api.calls.Load(); got != 3 || settled() != 0 {
		t.Fatalf("while open: calls %d, settled %d; want 3 and 0", got, settled())
	}

	// Cool-down over, still failing: exactly one probe, which reopens.
	advance(6 * time.Second)
	drain()
	if got := api.calls.Load(); got != 4 {
		t.Fatalf("half-open calls = %d, want exactly one probe", got-3)
	}
	if guard.Status("fake-api").Breaker != protect.Open || settled() != 0 {
		t.Fatalf("after a failed probe: breaker %v, settled %d", guard.Status("fake-api").Breaker, settled())
	}
	if k := countWhere(t, db, "state = 'reconciling' AND lease_owner IS NULL"); k != len(ids) {
		t.Fatalf("%d rows rescheduled, want %d", k, len(ids))
	}

	// Recovery: the next probe succeeds, the breaker closes, all settle.
	api.SetFail(false)
	for i := 0; settled() < len(ids); i++ {
		if i > 50 {
			t.Fatalf("only %d of %d settled after recovery", settled(), len(ids))
		}
		advance(11 * time.Second)
		drain()
	}
	if guard.Status("fake-api").Breaker != protect.Closed {
		t.Fatalf("breaker = %v after recovery", guard.Status("fake-api").Breaker)
	}
	if k := countWhere(t, db, "state = 'succeeded'"); k != len(ids) {
		t.Fatalf("%d succeeded, want %d (no outage answer may settle a row otherwise)", k, len(ids))
	}
}
