package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
)

// probeGate defers the first check for `cooldown` (an open breaker), then
// admits every check (its half-open probe), and reports each Enter's time.
type probeGate struct {
	cooldown time.Duration
	mu       sync.Mutex
	until    time.Time
	entered  chan time.Time
}

func (g *probeGate) Enter(context.Context, string, bool) (reconcile.Pass, error) {
	now := time.Now()
	g.entered <- now
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.until.IsZero() {
		g.until = now.Add(g.cooldown)
		return nil, &reconcile.Deferral{Reason: "breaker open", Until: g.until}
	}
	return nopPass{}, nil
}

// Issue 9: a half-open probe came after the poll interval rather than the
// cooldown. Run wakes for the earliest time a released row becomes due: a
// row deferred for 200 ms is checked again well within 5 s although the
// poll interval is a minute (and no NOTIFY announces a release).
func TestRunWakesWhenReleasedRowIsDue(t *testing.T) {
	db := pgtest.NewPool(t)
	api := newFakeAPI(t, time.Now, 0)
	gate := &probeGate{cooldown: 200 * time.Millisecond, entered: make(chan time.Time, 16)}
	seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Gate: gate, Now: time.Now,
		Workers: 2, BatchSize: 8, MaxInFlight: 8, PollInterval: time.Minute, OrphanTimeout: -1})

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := pool.Run(ctx); done <- err }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	deadline := time.NewTimer(5 * time.Second)
	defer deadline.Stop()
	var first, second time.Time
	for _, at := range []*time.Time{&first, &second} {
		select {
		case *at = <-gate.entered:
		case <-deadline.C:
			t.Fatalf("the deferred row was not checked again within 5 s (poll interval 1 minute): first check at %v", first)
		}
	}
	gate.mu.Lock()
	until := gate.until
	gate.mu.Unlock()
	if second.Before(until) {
		t.Fatalf("checked again at %v, before the deferral's end %v", second, until)
	}
	t.Logf("deferred for %v; checked again %v after the first check", gate.cooldown, second.Sub(first))
}
