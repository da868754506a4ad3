package protect

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// twoGuards returns two Guards ("instances") over their own stores (which
// share one backing database or MemStore) and one clock.
func twoGuards(t *testing.T, storeA, storeB Store, clock Clock) (a, b *Guard) {
	t.Helper()
	mk := func(name string, store Store) *Guard {
		cfg := testConfig()
		cfg.Instance = name
		g, err := New(store, cfg, clock, slog.New(&logRecorder{}))
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	return mk("instance-a", storeA), mk("instance-b", storeB)
}

// testSharedOpen is the scenario of SPEC §5 "state shared between instances":
// A's breaker opens; B, which never saw a failure, defers until A's
// open_until once its cached copy is refreshed, then probes once.
//
// tol is how far B's view of open_until may differ from A's: zero for a
// MemStore; for Postgres the row crosses the database's clock (stored as a
// duration from clock_timestamp(), read back as the time left), and the
// fake clock's steps are not the database's (B reads SharedRefresh later on
// the fake clock, a few milliseconds later on the database's).
//
// elapse, if set, is told when the test advances the fake clock past the
// cool-down, so a database-backed store can let the same time pass on the
// database's clock.
func testSharedOpen(t *testing.T, storeA, storeB Store, clock *fakeClock, tol time.Duration, elapse func(time.Duration)) {
	a, b := twoGuards(t, storeA, storeB, clock)
	ctx := context.Background()
	acquire := func(g *Guard) (*Permit, *Deferral) {
		t.Helper()
		p, err := g.Acquire(ctx, "api", First)
		var d *Deferral
		if err != nil && !errors.As(err, &d) {
			t.Fatalf("%s: Acquire: %v", g.Instance(), err)
		}
		return p, d
	}

	// B reads the (empty) shared row now and caches it.
	if p, d := acquire(b); d != nil {
		t.Fatalf("B deferred before anything happened: %v", d)
	} else {
		p.Done(Success, 0)
	}

	for range a.cfg.Default.Breaker.FailureThreshold {
		p, d := acquire(a)
		if d != nil {
			t.Fatal(d)
		}
		p.Done(Transient, 0)
	}
	openUntil := clock.Now().Add(a.cfg.Default.Breaker.Cooldown)
	if s := a.Status("api"); s.Breaker != Open || !s.OpenUntil.Equal(openUntil) {
		t.Fatalf("A: %+v", s)
	}

	// Within SharedRefresh B still uses its cached copy.
	clock.Advance(a.cfg.SharedRefresh - time.Millisecond)
	if p, d := acquire(b); d != nil {
		t.Fatalf("B refreshed before SharedRefresh: %v", d)
	} else {
		p.Done(Success, 0)
	}

	clock.Advance(time.Millisecond)
	_, d := acquire(b)
	if d == nil || d.Reason != ReasonBreakerOpen || d.Until.After(openUntil.Add(tol)) || d.Until.Before(openUntil.Add(-tol)) {
		t.Fatalf("B after refresh: %v, want breaker_open until %v", d, openUntil)
	}
	if !strings.Contains(d.Detail, "instance-a") || !strings.Contains(d.Detail, "consecutive transient failures") {
		t.Fatalf("B's deferral does not say who opened it and why: %q", d.Detail)
	}
	if s := b.States()["api"]; s != Open {
		t.Fatalf("B state %v", s)
	}

	// After open_until each instance probes once; B's probe closes B.
	clock.Advance(a.cfg.Default.Breaker.Cooldown)
	if elapse != nil {
		elapse(a.cfg.Default.Breaker.Cooldown)
	}
	pb, d := acquire(b)
	if d != nil || !pb.Probe() {
		t.Fatalf("B after open_until: permit %v, deferral %v; want the probe", pb, d)
	}
	if _, d := acquire(b); d == nil || d.Reason != ReasonBreakerOpen {
		t.Fatalf("B gave a second call during its probe: %v", d)
	}
	pb.Done(Success, 0)
	if s := b.States()["api"]; s != Closed {
		t.Fatalf("B state %v after a successful probe", s)
	}
	pa, d := acquire(a)
	if d != nil || !pa.Probe() {
		t.Fatalf("A after open_until: permit %v, deferral %v; want its own probe", pa, d)
	}
	pa.Done(Success, 0)
}

func TestSharedOpenMemStore(t *testing.T) {
	store := NewMemStore()
	testSharedOpen(t, store, store, newFakeClock(), 0, nil)
}

func TestSharedOpenPostgres(t *testing.T) {
	// Two instances, each with its own pool, on one database.
	url := pgtest.NewDatabase(t)
	poolA, poolB := pgtest.Pool(t, url), pgtest.Pool(t, url)
	elapse := func(d time.Duration) {
		// The database's clock does not follow the fake one: move the row
		// back instead, as if d had passed.
		if _, err := poolA.Exec(context.Background(), `UPDATE reconciler.dependency_breakers
			SET open_until = open_until - $1::bigint * interval '1 microsecond'`, d.Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	testSharedOpen(t, NewPGStore(poolA), NewPGStore(poolB), newFakeClock(), 5*time.Second, elapse)

	var by, reason string
	var left time.Duration
	err := poolB.QueryRow(context.Background(),
		`SELECT open_until - clock_timestamp(), opened_by, reason FROM reconciler.dependency_breakers WHERE dependency = 'api'`).
		Scan(&left, &by, &reason)
	if err != nil {
		t.Fatal(err)
	}
	// A opened for the 30s cool-down, on the database's clock (A's fake
	// clock, in 2026, is not the database's), which elapse moved back by 30s.
	if by != "instance-a" || reason != "5 consecutive transient failures" || left > 0 || left < -10*time.Second {
		t.Fatalf("row: %v left, %q %q", left, by, reason)
	}
}

func TestSharedRowIsReadAtMostOncePerRefresh(t *testing.T) {
	store := &countingStore{Store: NewMemStore()}
	clock := newFakeClock()
	g, err := New(store, testConfig(), clock, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := g.Acquire(context.Background(), "api", First)
			if err != nil {
				t.Error(err)
				return
			}
			p.Done(Success, 0)
		}()
	}
	wg.Wait()
	if n := store.count(); n != 1 {
		t.Fatalf("%d loads for 100 calls at one instant, want 1", n)
	}
	clock.Advance(999 * time.Millisecond)
	g.permitOrFail(t, "api")
	if n := store.count(); n != 1 {
		t.Fatalf("%d loads before SharedRefresh passed", n)
	}
	clock.Advance(time.Millisecond)
	g.permitOrFail(t, "api")
	g.permitOrFail(t, "other") // per dependency
	if n := store.count(); n != 3 {
		t.Fatalf("%d loads, want 3", n)
	}
}

func (g *Guard) permitOrFail(t *testing.T, dep string) {
	t.Helper()
	p, err := g.Acquire(context.Background(), dep, First)
	if err != nil {
		t.Fatal(err)
	}
	p.Done(Success, 0)
}

func TestStoreFailureFallsBackToTheLocalBreaker(t *testing.T) {
	store := &countingStore{Store: NewMemStore(), fail: errors.New("connection refused")}
	logs := &logRecorder{}
	clock := newFakeClock()
	g, err := New(store, testConfig(), clock, slog.New(logs))
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		p, err := g.Acquire(context.Background(), "api", First)
		if err != nil {
			t.Fatalf("a store failure must not stop calls: %v", err)
		}
		p.Done(Transient, 0)
	}
	_, err = g.Acquire(context.Background(), "api", First)
	var d *Deferral
	if !errors.As(err, &d) || d.Reason != ReasonBreakerOpen {
		t.Fatalf("local breaker did not open without the store: %v", err)
	}
	msgs := logs.messages("api")
	if !containsAll(msgs,
		"protect: cannot read shared breaker state; using the cached copy",
		"protect: cannot share circuit breaker opening; other instances will not see it") {
		t.Fatalf("logs %q", msgs)
	}
}

func TestPGStoreKeepsTheLaterOpening(t *testing.T) {
	pool := pgtest.NewPool(t)
	s := NewPGStore(pool)
	ctx := context.Background()

	got, err := s.Load(ctx, "api")
	if err != nil || !got.Until.IsZero() {
		t.Fatalf("Load of a dependency never opened: %+v, %v", got, err)
	}

	steps := []struct {
		until      time.Time
		by, reason string
		want       SharedOpen
	}{
		{t0.Add(time.Minute), "x", "first", SharedOpen{t0.Add(time.Minute), "x", "first"}},
		{t0.Add(30 * time.Second), "y", "earlier", SharedOpen{t0.Add(time.Minute), "x", "first"}},
		{t0.Add(2 * time.Minute), "z", "later", SharedOpen{t0.Add(2 * time.Minute), "z", "later"}},
	}
	for i, st := range steps {
		row, err := s.Open(ctx, "api", st.until, st.by, st.reason)
		if err != nil {
			t.Fatal(err)
		}
		loaded, err := s.Load(ctx, "api")
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range []SharedOpen{row, loaded} {
			if !o.Until.Equal(st.want.Until) || o.By != st.want.By || o.Reason != st.want.Reason {
				t.Fatalf("step %d: %+v, want %+v", i, o, st.want)
			}
		}
	}

	// Concurrent openings: the latest wins whatever the order.
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Open(ctx, "race", t0.Add(time.Duration(i)*time.Second), "i", "r"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if o, err := s.Load(ctx, "race"); err != nil || !o.Until.Equal(t0.Add(19*time.Second)) {
		t.Fatalf("after concurrent openings: %+v, %v", o, err)
	}

	// The schema refuses an empty dependency name.
	if _, err := s.Open(ctx, "", t0, "x", "y"); err == nil {
		t.Fatal("empty dependency accepted")
	}
}

// Issue 7, suspicion "one instance with a skewed clock holds every
// instance's shared breaker open": instance A's clock runs 5 minutes ahead of
// B's (and of the database's). A's breaker opens for its 30 s cool-down; B
// must see the dependency open for those 30 s, not for 5 min 30 s. Before,
// open_until was written from A's clock and compared with B's.
func TestSkewedInstanceOpensTheSharedBreakerForItsCooldownOnly(t *testing.T) {
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	for _, skew := range []time.Duration{5 * time.Minute, -5 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			clockB := newFakeClock()
			clockA := &fakeClock{t: clockB.Now().Add(skew)}
			mk := func(name string, clock Clock) *Guard {
				cfg := testConfig()
				cfg.Instance = name
				g, err := New(NewPGStore(pgtest.Pool(t, url)), cfg, clock, slog.New(&logRecorder{}))
				if err != nil {
					t.Fatal(err)
				}
				return g
			}
			dep := "api" + skew.String()
			a, b := mk("skewed-a", clockA), mk("b", clockB)
			for range a.cfg.Default.Breaker.FailureThreshold {
				p, err := a.Acquire(ctx, dep, First)
				if err != nil {
					t.Fatal(err)
				}
				p.Done(Transient, 0)
			}
			if s := a.Status(dep); s.Breaker != Open {
				t.Fatalf("A: %+v", s)
			}
			cool := a.cfg.Default.Breaker.Cooldown
			_, err := b.Acquire(ctx, dep, First)
			var d *Deferral
			if !errors.As(err, &d) || d.Reason != ReasonBreakerOpen {
				t.Fatalf("B: %v, want a breaker_open deferral", err)
			}
			if left := d.Until.Sub(clockB.Now()); left > cool || left < cool-5*time.Second {
				t.Fatalf("B deferred for %v, want A's cool-down %v (A's clock is %v off)", left, cool, skew)
			}
			// A, on its own clock, sees the same cool-down.
			if s := a.Status(dep); s.OpenUntil.Sub(clockA.Now()) != cool {
				t.Fatalf("A open until %v from its now, want %v", s.OpenUntil.Sub(clockA.Now()), cool)
			}
		})
	}
}
