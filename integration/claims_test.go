package integration

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
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
	// Each check recorded once: by the recorder when it was made, not again
	// by the settlement.
	var checks int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.readback_checks
		WHERE receipt_id = ANY($1)`, ids).Scan(&checks); err != nil || checks != n {
		t.Fatalf("%d check records (%v), want one per receipt (%d)", checks, err, n)
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

// Issue 9, item 4: "reads made by a process that was killed before it
// settled leave no readback_checks row". A check is recorded as soon as its
// adapter answers, apart from the settlement: here the settlement cannot be
// written (the receipt's row is locked), the check's record is there all
// the same, and it stays after the pool is stopped without settling (its
// writes cut off at the end of the grace period).
func TestCheckRecordedBeforeSettlement(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	// The reconciler has connections of its own, so the test can cut them.
	rdb := pgtest.Pool(t, url)
	id := seed(t, db, 1, "things.create", "held-api", "outcome_unknown")[0]
	a := heldAdapter{started: make(chan struct{}), release: make(chan struct{}), once: &sync.Once{}}
	reg := registry(t, nil, shortPolicy(), readback.Binding{Name: "held", Kind: readback.Create,
		Dependency: "held-api", Adapter: a, Policy: shortPolicy()})
	p := newPool(t, rdb, reconcile.Config{Instance: "killed", Registry: reg, GracePeriod: 100 * time.Millisecond,
		PollInterval: 100 * time.Millisecond})
	stop := runPool(t, p)
	<-a.started

	lock, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	var lockPID int
	if err := lock.QueryRow(ctx, `SELECT pg_backend_pid() FROM reconciler.receipts WHERE id = $1 FOR UPDATE`, id).
		Scan(&lockPID); err != nil {
		t.Fatal(err)
	}
	close(a.release)
	waitUntil(t, "the check to be recorded", func() bool { return checkCount(t, db, id) == 1 })
	if r := receipt(t, db, id); r.State != "reconciling" {
		t.Fatalf("receipt = %+v, want it unsettled while its row is locked", r)
	}

	// Stop the pool; its settlement, waiting on the lock, is cut off until
	// the grace period is over and it gives up.
	stopped := make(chan reconcile.Summary)
	go func() { stopped <- stop() }()
	var sum reconcile.Summary
	waitUntil(t, "the pool to stop without settling", func() bool {
		select {
		case sum = <-stopped:
			return true
		default:
		}
		cutWaiters(t, db, lockPID)
		return false
	})
	if n := len(sum.Settled); sum.Settled["succeeded"] != 0 {
		t.Fatalf("summary %+v (%d states): the pool reports a settlement that was never written", sum, n)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := checkCount(t, db, id); n != 1 {
		t.Fatalf("%d check records after the pool stopped, want the one made", n)
	}
	if r := receipt(t, db, id); r.State != "reconciling" || len(settlements(t, db, id)) != 0 {
		t.Fatalf("receipt = %+v, want unsettled", r)
	}
}

// cutWaiters terminates the backends of the test's database waiting on a
// lock, other than pid.
func cutWaiters(t *testing.T, db *pgxpool.Pool, pid int) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
		WHERE a.datname = current_database() AND a.wait_event_type = 'Lock' AND a.pid <> $1`, pid); err != nil {
		t.Fatal(err)
	}
}

// Issue 9 follow-up: a row whose outcome the database refused even in its
// minimal form is released with a check error (issue 8), not settled; the
// run's summary and the metrics counted it as settled. They now count it as
// refused and waiting.
func TestRefusedOutcomeIsNotCountedAsSettled(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	id := seed(t, db, 1, "things.create", "refusing-api", "outcome_unknown")[0]
	// The database refuses every settlement of this dependency's receipts,
	// as it would refuse a row's data: the full outcome, then the minimal.
	if _, err := db.Exec(ctx, `
		CREATE FUNCTION refuse_for_test() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused for the test' USING ERRCODE = 'check_violation'; END $$;
		CREATE TRIGGER refuse_settlement BEFORE UPDATE ON reconciler.receipts FOR EACH ROW
		WHEN (NEW.state = 'succeeded' AND NEW.dependency = 'refusing-api') EXECUTE FUNCTION refuse_for_test()`); err != nil {
		t.Fatal(err)
	}
	present := readback.Binding{Name: "answer", Kind: readback.Create, Dependency: "refusing-api",
		Policy: shortPolicy(), Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	reg := prometheus.NewRegistry()
	p := newPool(t, db, reconcile.Config{Registry: registry(t, nil, shortPolicy(), present), Now: newClock().Now,
		Metrics: reconcile.NewMetrics(reg)})
	sum, err := p.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r := receipt(t, db, id); r.State != "reconciling" || r.LeaseOwner != "" {
		t.Fatalf("receipt = %+v, want released, not settled", r)
	}
	if total(sum.Settled) != 0 || sum.Refused != 1 || sum.Waiting != 1 {
		t.Fatalf("summary %+v, want nothing settled, one refused and waiting", sum)
	}
	if n := family(t, reg, "reconciler_settlements_total"); n != 0 {
		t.Fatalf("reconciler_settlements_total = %v, want 0", n)
	}
	if n := counter(t, reg, "reconciler_outcomes_refused_total"); n != 1 {
		t.Fatalf("reconciler_outcomes_refused_total = %v, want 1", n)
	}
}

func total(m map[statemachine.State]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// family sums every series of the counter family name in reg.
func family(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}
