package integration

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
)

// A receipt becoming outcome_unknown wakes Run through NOTIFY
// reconciler_due, also after the server terminated the listening session:
// the receipt is checked within seconds although the poll interval is a
// minute. The session is cut before any receipt exists, so no other
// wake-up (a due row, the first pass) can stand in for the notification.
func TestRunWokenByNotifyAfterTheListenerReconnects(t *testing.T) {
	db := pgtest.NewPool(t)
	api := newFakeAPI(t, time.Now, 0)
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: time.Now,
		Workers: 2, BatchSize: 8, MaxInFlight: 8, PollInterval: time.Minute, OrphanTimeout: -1})
	runPool(t, pool)

	first := dueListener(t, db, 0)
	if _, err := db.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, first); err != nil {
		t.Fatal(err)
	}
	dueListener(t, db, first)
	id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	waitFor(t, 5*time.Second, "the new outcome_unknown receipt checked (poll interval 1 minute)",
		func() (bool, string) { return checkCount(t, db, id) > 0, "" })
}

// dueListener waits (bounded) until a session other than not LISTENs on
// reconciler_due, and returns its pid.
func dueListener(t *testing.T, db *pgxpool.Pool, not int32) int32 {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		rows, _ := db.Query(context.Background(), `SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND query = 'LISTEN reconciler_due' AND pid <> $1`, not)
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		if len(pids) == 1 {
			return pids[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions LISTEN on reconciler_due (other than %d), want 1", len(pids), not)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
}
