package protect

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// t0 is aligned on the windows' 5s buckets, so window expiries are exact.
var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// fakeClock is a Clock the test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: t0} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// logRecorder is a slog.Handler that keeps each record's message and
// dependency attribute.
type logRecorder struct {
	mu      sync.Mutex
	entries []logEntry
}

type logEntry struct {
	level      slog.Level
	msg        string
	dependency string
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *logRecorder) WithGroup(string) slog.Handler            { return r }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	e := logEntry{level: rec.Level, msg: rec.Message}
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == "dependency" {
			e.dependency = a.Value.String()
		}
		return true
	})
	r.mu.Lock()
	r.entries = append(r.entries, e)
	r.mu.Unlock()
	return nil
}

// messages returns the messages logged for dep, in order.
func (r *logRecorder) messages(dep string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.entries {
		if e.dependency == dep {
			out = append(out, e.msg)
		}
	}
	return out
}

// testConfig is DefaultConfig without the limits a test does not exercise
// (rate, concurrency), so each test meets only the mechanism it is about.
func testConfig() Config {
	cfg := DefaultConfig()
	cfg.Instance = "test-1"
	cfg.Default.Rate.Limit = rate.Inf
	cfg.Default.Concurrency.MaxInFlight = 1000
	// Most tests drive the breaker with a streak of failures; the rate
	// trigger and the default policy as a whole have their own tests
	// (regimes_test.go).
	cfg.Default.Breaker.FailureThreshold = 5
	cfg.Default.Breaker.MinCalls = 1 << 30
	return cfg
}

type harness struct {
	t     *testing.T
	g     *Guard
	clock *fakeClock
	store *MemStore
	logs  *logRecorder
}

func newHarness(t *testing.T, edit func(*Config)) *harness {
	t.Helper()
	cfg := testConfig()
	if edit != nil {
		edit(&cfg)
	}
	h := &harness{t: t, clock: newFakeClock(), store: NewMemStore(), logs: &logRecorder{}}
	g, err := New(h.store, cfg, h.clock, slog.New(h.logs))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	h.g = g
	return h
}

// permit acquires a permit for dep and fails the test if deferred.
func (h *harness) permit(dep string, kind Kind) *Permit {
	h.t.Helper()
	p, err := h.g.Acquire(context.Background(), dep, kind)
	if err != nil {
		h.t.Fatalf("Acquire(%s, %v) at %v: %v", dep, kind, h.clock.Now().Sub(t0), err)
	}
	return p
}

// deferral acquires for dep and fails the test unless deferred for reason.
func (h *harness) deferral(dep string, kind Kind, reason Reason) *Deferral {
	h.t.Helper()
	p, err := h.g.Acquire(context.Background(), dep, kind)
	if err == nil {
		p.Done(Abandoned, 0)
		h.t.Fatalf("Acquire(%s, %v) at %v: got a permit, want a %s deferral", dep, kind, h.clock.Now().Sub(t0), reason)
	}
	var d *Deferral
	if !errors.As(err, &d) {
		h.t.Fatalf("Acquire(%s): error %v is not a *Deferral", dep, err)
	}
	if !errors.Is(err, ErrDeferred) {
		h.t.Fatalf("Acquire(%s): %v does not match ErrDeferred", dep, err)
	}
	if d.Reason != reason {
		h.t.Fatalf("Acquire(%s) at %v: deferred for %s (%s), want %s", dep, h.clock.Now().Sub(t0), d.Reason, d.Detail, reason)
	}
	if d.Dependency != dep {
		h.t.Fatalf("deferral names dependency %q, want %q", d.Dependency, dep)
	}
	if !d.Until.After(h.clock.Now()) {
		h.t.Fatalf("deferral Until %v is not after now %v", d.Until, h.clock.Now())
	}
	return d
}

// call makes one sequential call to dep with the given outcome.
func (h *harness) call(dep string, o Outcome) {
	h.t.Helper()
	h.permit(dep, First).Done(o, 0)
}

// open drives dep's breaker open with threshold transient failures.
func (h *harness) open(dep string) {
	h.t.Helper()
	for i := 0; i < h.g.cfg.policy(dep).Breaker.FailureThreshold; i++ {
		h.call(dep, Transient)
	}
	if s := h.g.Status(dep).Breaker; s != Open {
		h.t.Fatalf("%s breaker is %v after threshold failures, want open", dep, s)
	}
}

func (h *harness) wantState(dep string, want BreakerState) {
	h.t.Helper()
	if got := h.g.States()[dep]; got != want {
		h.t.Fatalf("%s breaker at %v: %v, want %v", dep, h.clock.Now().Sub(t0), got, want)
	}
}

func wantUntil(t *testing.T, d *Deferral, want time.Time) {
	t.Helper()
	if !d.Until.Equal(want) {
		t.Fatalf("deferral %s until %v (t0+%v), want t0+%v", d.Reason, d.Until, d.Until.Sub(t0), want.Sub(t0))
	}
}

// countingStore counts Loads and can be made to fail.
type countingStore struct {
	Store
	mu    sync.Mutex
	loads int
	fail  error
}

func (s *countingStore) Load(ctx context.Context, dep string) (SharedOpen, error) {
	s.mu.Lock()
	s.loads++
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		return SharedOpen{}, fail
	}
	return s.Store.Load(ctx, dep)
}

func (s *countingStore) Open(ctx context.Context, dep string, until time.Time, by, reason string) (SharedOpen, error) {
	s.mu.Lock()
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		return SharedOpen{}, fail
	}
	return s.Store.Open(ctx, dep, until, by, reason)
}

func (s *countingStore) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loads
}

var t0Ctx = context.Background()
