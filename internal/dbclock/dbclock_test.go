package dbclock

import (
	"context"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Issue 7, path 5: the clock follows the database's, whatever the host's
// wall clock says; the host's clock only shows up as the reported skew.
func TestNowIsALowerBoundOfTheDatabaseClock(t *testing.T) {
	db := pgtest.NewPool(t)
	ctx := context.Background()
	for _, skew := range []time.Duration{0, 5 * time.Minute, -5 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			c := New(db, WithWallClock(func() time.Time { return time.Now().Add(skew) }))
			if c.Synced() {
				t.Fatal("synced before Sync")
			}
			smp, err := c.Sync(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if d := smp.Skew - skew; d > time.Second || d < -time.Second {
				t.Fatalf("skew measured %v, want about %v", smp.Skew, skew)
			}
			if got, ok := c.Skew(); !ok || got != smp.Skew {
				t.Fatalf("Skew() = %v, %v", got, ok)
			}
			for range 5 {
				var before, after time.Time
				if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
					t.Fatal(err)
				}
				now := c.Now()
				if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&after); err != nil {
					t.Fatal(err)
				}
				// A lower bound: never after the database's time; and behind it
				// by no more than the anchor's round trip (plus scheduling).
				if now.After(after) {
					t.Fatalf("Now() %v is after the database's %v", now, after)
				}
				if now.Before(before.Add(-smp.RoundTrip - 100*time.Millisecond)) {
					t.Fatalf("Now() %v lags the database's %v by more than the round trip %v", now, before, smp.RoundTrip)
				}
			}
		})
	}
}
