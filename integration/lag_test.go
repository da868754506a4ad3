package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
)

// Acceptance 2: a fake API that shows a created resource only after lag L:
// with the dependency's window declared to cover L, every receipt settles
// succeeded, never safe_to_retry, for L = 0, 2s and 10s (injected clock).
func TestReplicationLagNeverYieldsSafeToRetry(t *testing.T) {
	for _, lag := range []time.Duration{0, 2 * time.Second, 10 * time.Second} {
		t.Run(fmt.Sprintf("lag=%s", lag), func(t *testing.T) {
			ctx := context.Background()
			db := pgtest.NewPool(t)
			clk := newClock()
			api := newFakeAPI(t, clk.Now, lag)
			ids := seed(t, db, 25, "things.create", "fake-api", "outcome_unknown")
			for i, id := range ids {
				api.Create(idempotencyKey(t, db, id), fmt.Sprintf("thing-%d", i))
			}
			p := shortPolicy()
			p.ConsistencyWindow = lag // declared: reads may lag by up to L
			p.MaxRequestLifetime = time.Second
			p.BackoffBase, p.BackoffCap = 200*time.Millisecond, 2*time.Second
			pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now})
			for i := 0; countWhere(t, db, "state = 'reconciling' OR state = 'outcome_unknown'") > 0; i++ {
				if i > 500 {
					t.Fatal("receipts still unsettled after 500 rounds")
				}
				clk.Advance(150 * time.Millisecond)
				if _, err := pool.Drain(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if k := countWhere(t, db, "state = 'succeeded'"); k != len(ids) {
				t.Fatalf("%d of %d succeeded (safe_to_retry: %d)", k, len(ids), countWhere(t, db, "state = 'safe_to_retry'"))
			}
			var absentChecks int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks WHERE verdict = 'absent'`).
				Scan(&absentChecks); err != nil {
				t.Fatal(err)
			}
			if lag > 0 && absentChecks == 0 {
				t.Fatal("no check saw the lag: the test did not exercise it")
			}
			t.Logf("lag %s: %d absent answers before the resources became visible", lag, absentChecks)
		})
	}
}
