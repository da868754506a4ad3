package integration

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// waitUntil polls cond (a database condition) until it holds or 30 s pass.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	waitFor(t, 30*time.Second, what, func() (bool, string) { return cond(), "" })
}

func leaseExpiry(t *testing.T, db *pgxpool.Pool, id int64) time.Time {
	t.Helper()
	var at *time.Time
	if err := db.QueryRow(context.Background(), `SELECT lease_expires_at FROM reconciler.receipts WHERE id = $1`, id).Scan(&at); err != nil {
		t.Fatal(err)
	}
	if at == nil {
		return time.Time{}
	}
	return *at
}

// heldAdapter answers present once released; started is closed when
// its first check begins.
type heldAdapter struct {
	started chan struct{}
	release chan struct{}
	once    *sync.Once
}

func (a heldAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	a.once.Do(func() { close(a.started) })
	select {
	case <-a.release:
	case <-ctx.Done():
		return readback.Result{}, readback.TransientError(ctx.Err(), 0)
	}
	return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"slow-1"}, Authoritative: true,
		Query: "slow"}, nil
}

// runPool runs p until the test ends (or stop is called) and returns the
// summary once stopped.
func runPool(t *testing.T, p *reconcile.Pool) (stop func() reconcile.Summary) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan reconcile.Summary, 1)
	go func() {
		s, err := p.Run(ctx)
		if err != nil {
			t.Errorf("run: %v", err)
		}
		done <- s
	}()
	var once sync.Once
	var sum reconcile.Summary
	stop = func() reconcile.Summary {
		once.Do(func() { cancel(); sum = <-done })
		return sum
	}
	t.Cleanup(func() { stop() })
	return stop
}

// Issue 9, item 4: a check that outlasts the lease keeps its row, because
// the heartbeat renews the lease while it runs: another instance cannot
// claim the row meanwhile, and the slow check's outcome settles it.
func TestHeartbeatKeepsSlowChecksLease(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	a := heldAdapter{started: make(chan struct{}), release: make(chan struct{}), once: &sync.Once{}}
	reg := registry(t, nil, shortPolicy(), readback.Binding{Name: "slow", Kind: readback.Create,
		Dependency: "slow-api", Adapter: a, Policy: shortPolicy()})
	id := seed(t, db, 1, "things.create", "slow-api", "outcome_unknown")[0]
	clk.Advance(time.Second)
	lease := 30 * time.Second
	pool := newPool(t, db, reconcile.Config{Instance: "slow", Registry: reg, Now: clk.Now, Lease: lease,
		Heartbeat: 10 * time.Millisecond, CheckTimeout: 10 * time.Minute, PollInterval: 100 * time.Millisecond})
	stop := runPool(t, pool)
	<-a.started
	first := leaseExpiry(t, db, id)
	// Time passes beyond the first lease while the check runs, in steps
	// the heartbeat follows.
	for range 4 {
		clk.Advance(20 * time.Second)
		want := clk.Now().Add(lease).Truncate(time.Microsecond)
		waitUntil(t, "the heartbeat to renew the lease", func() bool { return !leaseExpiry(t, db, id).Before(want) })
	}
	if !clk.Now().After(first) {
		t.Fatal("the test did not pass the first lease's expiry")
	}
	other, err := reconcile.NewStore(db, "other")
	if err != nil {
		t.Fatal(err)
	}
	got, err := other.Claim(context.Background(), clk.Now(), 10, lease)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Fatalf("another instance claimed %d rows held by a running check", len(got))
	}
	close(a.release)
	waitUntil(t, "the slow check to settle", func() bool { return receipt(t, db, id).State == "succeeded" })
	if s := stop(); s.LeaseLost != 0 || s.Settled[statemachine.Succeeded] != 1 {
		t.Fatalf("summary %+v, want one settlement and no lease lost", s)
	}
}

// A crashed instance's rows are claimable again after the short default
// lease (30 s), not the 2 minutes of before.
func TestCrashedInstancesRowsReturnAfterTheShortLease(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	ids := seed(t, db, 3, "things.create", "fake-api", "outcome_unknown")
	for _, id := range ids {
		api.Create(idempotencyKey(t, db, id), "ext")
	}
	clk.Advance(time.Second)
	if reconcile.DefaultLease > 30*time.Second {
		t.Fatalf("default lease %s, want at most 30s", reconcile.DefaultLease)
	}
	crashed, err := reconcile.NewStore(db, "crashed")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := crashed.Claim(context.Background(), clk.Now(), 10, reconcile.DefaultLease); err != nil || len(got) != 3 {
		t.Fatalf("claim: %d rows, %v", len(got), err)
	}
	// The crashed process never writes; the survivor uses the defaults.
	survivor := newPool(t, db, reconcile.Config{Instance: "survivor", Registry: registry(t, api, shortPolicy()), Now: clk.Now})
	if s, err := survivor.Drain(context.Background()); err != nil || s.Claimed != 0 {
		t.Fatalf("before the lease ran out: claimed %d, %v", s.Claimed, err)
	}
	clk.Advance(reconcile.DefaultLease)
	if s, err := survivor.Drain(context.Background()); err != nil || s.Settled[statemachine.Succeeded] != 3 {
		t.Fatalf("after the lease: %+v, %v", s, err)
	}
}

// An instance restarted under the same name takes back its own leases at
// start, at once; other instances' leases are left alone.
func TestRestartedInstanceReclaimsItsRowsAtStart(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	ids := seed(t, db, 4, "things.create", "fake-api", "outcome_unknown")
	for _, id := range ids {
		api.Create(idempotencyKey(t, db, id), "ext")
	}
	clk.Advance(time.Second)
	ctx := context.Background()
	claim := func(instance string, n int) {
		st, err := reconcile.NewStore(db, instance)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := st.Claim(ctx, clk.Now(), n, time.Hour); err != nil || len(got) != n {
			t.Fatalf("claim as %s: %d rows, %v", instance, len(got), err)
		}
	}
	claim("node-1", 2)  // the process that dies
	claim("node-10", 1) // another instance whose name starts alike
	claim("node-2", 1)  // another instance
	restarted := newPool(t, db, reconcile.Config{Instance: "node-1", Registry: registry(t, api, shortPolicy()), Now: clk.Now})
	s, err := restarted.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Settled[statemachine.Succeeded] != 2 {
		t.Fatalf("restarted instance settled %+v, want its own 2 rows", s.Settled)
	}
	for _, id := range ids {
		r := receipt(t, db, id)
		switch {
		case r.State == "succeeded":
		case r.State == "reconciling" && (strings.HasPrefix(r.LeaseOwner, "node-10/") || strings.HasPrefix(r.LeaseOwner, "node-2/")):
		default:
			t.Fatalf("receipt %d: %+v", id, r)
		}
	}
}

// Outcomes whose write fails (the database refuses every completion, as
// during an outage) are kept, their rows still leased to the instance, and
// written once the database answers again: nothing waits for lease expiry.
func TestOutcomesKeptUntilTheDatabaseAnswers(t *testing.T) {
	db := pgtest.NewPool(t)
	ctx := context.Background()
	// A deterministic outage of completions only: every statement that
	// records checks fails with 57P03 (cannot_connect_now) while
	// fault_on holds a row; fault_hits counts the attempts (a sequence is
	// not rolled back with the failed statement).
	if _, err := db.Exec(ctx, `
		CREATE TABLE public.fault_on (x int);
		CREATE SEQUENCE public.fault_hits;
		CREATE FUNCTION public.fault() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		    IF EXISTS (SELECT FROM public.fault_on) THEN
		        PERFORM nextval('public.fault_hits');
		        RAISE EXCEPTION 'the database is not answering (test)' USING ERRCODE = '57P03';
		    END IF;
		    RETURN NULL;
		END $$;
		CREATE TRIGGER fault BEFORE INSERT ON reconciler.readback_checks
		    FOR EACH STATEMENT EXECUTE FUNCTION public.fault();
		INSERT INTO public.fault_on VALUES (1);`); err != nil {
		t.Fatal(err)
	}
	hits := func() int64 {
		var n int64
		if err := db.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.fault_hits`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	api.Create(idempotencyKey(t, db, id), "ext-1")
	clk.Advance(time.Second)
	pool := newPool(t, db, reconcile.Config{Instance: "keeper", Registry: registry(t, api, shortPolicy()), Now: clk.Now,
		PollInterval: 200 * time.Millisecond, Heartbeat: 50 * time.Millisecond})
	stop := runPool(t, pool)
	// Beyond the three quick attempts that used to end in dropping the batch.
	waitUntil(t, "several failed writes", func() bool { return hits() >= 6 })
	if r := receipt(t, db, id); r.State != "reconciling" || !strings.HasPrefix(r.LeaseOwner, "keeper/") {
		t.Fatalf("during the outage: %+v, want the row still leased to the instance", r)
	}
	if _, err := db.Exec(ctx, `DELETE FROM public.fault_on`); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the kept outcome to be written", func() bool { return receipt(t, db, id).State == "succeeded" })
	s := stop()
	if s.LeaseLost != 0 || s.Settled[statemachine.Succeeded] != 1 || s.DBErrors < 6 {
		t.Fatalf("summary %+v, want the kept outcome settled, no lease lost, the failures counted", s)
	}
	if n := checkCount(t, db, id); n != 1 {
		t.Fatalf("%d check records, want 1", n)
	}
}
