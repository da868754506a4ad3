package integration

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// slowAdapter answers present after delay (a dependency's latency) and
// counts the checks it started.
type slowAdapter struct {
	delay   time.Duration
	started *atomic.Int64
}

func (a slowAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	a.started.Add(1)
	t := time.NewTimer(a.delay)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return readback.Result{}, readback.TransientError(ctx.Err(), 0)
	}
	return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"thing-" + r.IdempotencyKey},
		Authoritative: true, Query: "slow"}, nil
}

// Issue 9, item 4: "three daemons on one database were no faster than one:
// each claimed 3 × 512 rows the moment it started and the others found
// little". Three instances now share one backlog: each holds no more rows
// than its workers plus the prefetch (the checks its workers finish in
// PrefetchFor at the adapter's speed), each settles a fair part, and every
// receipt is settled exactly once.
func TestInstancesShareABacklog(t *testing.T) {
	const (
		instances = 3
		workers   = 4
		n         = 300
		delay     = 50 * time.Millisecond
		prefetch  = 100 * time.Millisecond
	)
	db := pgtest.NewPool(t)
	ids := seed(t, db, n, "things.create", "slow-api", "outcome_unknown")
	// The prefetch is the checks the workers finish in PrefetchFor: with
	// every check taking at least delay, never more than this.
	maxPrefetch := int64((workers*prefetch + delay - 1) / delay)
	bound := workers + maxPrefetch

	type instance struct {
		name    string
		started atomic.Int64
		reg     *prometheus.Registry
		stop    func() reconcile.Summary
		held    atomic.Int64 // the most rows seen claimed and not yet started
	}
	all := make([]*instance, instances)
	for i := range all {
		in := &instance{name: fmt.Sprintf("share-%d", i), reg: prometheus.NewRegistry()}
		reg := registry(t, nil, shortPolicy(), readback.Binding{Name: "slow", Kind: readback.Create,
			Dependency: "slow-api", Adapter: slowAdapter{delay: delay, started: &in.started}, Policy: shortPolicy()})
		p := newPool(t, db, reconcile.Config{Instance: in.name, Registry: reg, Metrics: reconcile.NewMetrics(in.reg),
			Workers: workers, PrefetchFor: prefetch, PollInterval: 200 * time.Millisecond})
		all[i] = in
		in.stop = runPool(t, p)
	}

	// Sample each instance's claimed-but-not-started rows while they work:
	// the claimed count is read before the started one, so a sample never
	// overstates what was held.
	sampling, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			for _, in := range all {
				held := int64(counter(t, in.reg, "reconciler_claimed_total")) - in.started.Load()
				if held > in.held.Load() {
					in.held.Store(held)
				}
			}
			select {
			case <-sampling:
				return
			case <-tick.C:
			}
		}
	}()
	var settled int
	waitUntil(t, "every receipt to settle", func() bool {
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts
			WHERE id = ANY($1) AND state = 'succeeded'`, ids).Scan(&settled); err != nil {
			t.Fatal(err)
		}
		return settled == n
	})
	close(sampling)
	<-sampled
	var wg sync.WaitGroup
	sums := make([]reconcile.Summary, instances)
	for i, in := range all {
		wg.Go(func() { sums[i] = in.stop() })
	}
	wg.Wait()

	// Exactly one settlement per receipt.
	rows, err := db.Query(context.Background(), `SELECT e.actor, count(*), count(DISTINCT e.receipt_id)
		FROM reconciler.receipt_events e WHERE e.receipt_id = ANY($1) AND e.to_state = 'succeeded'
		GROUP BY e.actor`, ids)
	if err != nil {
		t.Fatal(err)
	}
	type share struct {
		Actor            string
		Events, Receipts int
	}
	shares, err := pgx.CollectRows(rows, pgx.RowToStructByPos[share])
	if err != nil {
		t.Fatal(err)
	}
	byActor := map[string]int{}
	total := 0
	for _, s := range shares {
		byActor[s.Actor] = s.Events
		total += s.Events
	}
	if total != n {
		t.Fatalf("%d settlement events for %d receipts (%v), want exactly one each", total, n, shares)
	}
	var distinct int
	if err := db.QueryRow(context.Background(), `SELECT count(DISTINCT receipt_id) FROM reconciler.receipt_events
		WHERE receipt_id = ANY($1) AND to_state = 'succeeded'`, ids).Scan(&distinct); err != nil || distinct != n {
		t.Fatalf("%d receipts settled (%v), want %d", distinct, err, n)
	}
	for i, in := range all {
		got := byActor["reconciler:"+in.name]
		t.Logf("instance %s: settled %d of %d, at most %d rows claimed and not yet started (bound %d), summary settled %d",
			in.name, got, n, in.held.Load(), bound, sums[i].Settled["succeeded"])
		if in.held.Load() > bound {
			t.Errorf("instance %s held %d claimed rows not yet started, more than its %d workers plus a prefetch of %d",
				in.name, in.held.Load(), workers, maxPrefetch)
		}
		// A fair share is n/instances; half of it is the least accepted
		// (instances start a few milliseconds apart on a busy machine).
		if got < n/instances/2 {
			t.Errorf("instance %s settled %d of %d receipts: not a share of the backlog", in.name, got, n)
		}
	}
}

// counter reads the value of the unlabelled counter name from reg.
func counter(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Error(err)
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}
