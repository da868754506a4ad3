// Package protect protects external APIs from the reconciler's readback
// calls (SPEC §5), per dependency: a circuit breaker whose "open until" is
// shared between instances through the database, a concurrency limit, a
// rate limit that honours Retry-After, a retry budget and a degraded mode.
//
// A worker asks before each call and reports after it:
//
//	p, err := guard.Acquire(ctx, dep, protect.First) // protect.Retry after a transient failure
//	var d *protect.Deferral
//	if errors.As(err, &d) {
//		// Not now: release the row with next_check_at = d.Slot. Never
//		// settle a row because its dependency is protected.
//		return release(row, d.Slot)
//	} else if err != nil {
//		return err // ctx done, or a programming error
//	}
//	defer p.Done(protect.Abandoned, 0) // safety net; no-op after the real report
//	res, err := adapter.Check(ctx, row)
//	p.Done(classify(err), retryAfter) // Success, Transient or Permanent
//
// Acquire never blocks waiting for capacity or time: every "not now" is a
// *Deferral carrying a Reason, the time Until which the call should wait and
// the Slot its caller should come back at, so the wait lives in the
// database, not in a goroutine holding a row.
//
// Each dependency has its own state, created on first use; dependencies never
// share state and the package has no global state. Time comes from an
// injected Clock, so tests drive every transition without sleeping.
//
// Across instances, only the breaker's "open until" is shared: an instance
// whose breaker opens upserts it (keeping the later time), and every instance
// reads it at most once per Config.SharedRefresh per dependency and adopts it
// as its own open state. After it passes, each instance lets one probe
// through; concurrency, rate, budget and degraded mode are per process.
package protect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// Clock tells the time. Tests inject a fake one.
type Clock interface {
	Now() time.Time
}

// SystemClock is the wall clock.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// Outcome is what happened to a permitted call, as classified by the caller
// (SPEC §5: timeouts, 429 and 5xx are transient; auth, bad configuration and
// other deterministic refusals are permanent).
type Outcome int

const (
	// Success: the dependency answered (present, absent or inconclusive
	// all count: the dependency is healthy).
	Success Outcome = iota + 1
	// Transient: a failure that says the dependency is unwell (timeout,
	// connection error, 429, 5xx). Counts for the breaker and degraded mode.
	Transient
	// Permanent: a deterministic failure (401, 403, an endpoint that does
	// not exist, bad configuration). Neutral: it neither counts as a failure
	// nor as proof of health.
	Permanent
	// Abandoned: the call was not made or its result is not known, e.g. the
	// worker is shutting down. Neutral, like Permanent; it only frees the
	// slot (and the half-open probe, if this was it).
	Abandoned
)

// String returns the name of the Outcome.
func (o Outcome) String() string {
	switch o {
	case Success:
		return "success"
	case Transient:
		return "transient"
	case Permanent:
		return "permanent"
	case Abandoned:
		return "abandoned"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Kind says whether a call is a retry, for the retry budget.
type Kind int

const (
	// First is a call that is not a retry: a row's first readback, or a
	// scheduled re-check after an inconclusive answer.
	First Kind = iota
	// Retry is a call made because the previous call for the same row
	// failed transiently. Retries are limited by the retry budget.
	Retry
)

// String returns the name of the Kind.
func (k Kind) String() string {
	switch k {
	case First:
		return "first"
	case Retry:
		return "retry"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// BreakerState is the state of a dependency's circuit breaker.
type BreakerState int

const (
	// Closed: calls flow; consecutive transient failures are counted.
	Closed BreakerState = iota
	// HalfOpen: the cool-down is over; exactly one probe call is allowed.
	HalfOpen
	// Open: every call is deferred until the cool-down ends.
	Open
)

// String returns the name of the BreakerState.
func (s BreakerState) String() string {
	switch s {
	case Closed:
		return "closed"
	case HalfOpen:
		return "half_open"
	case Open:
		return "open"
	}
	return fmt.Sprintf("BreakerState(%d)", int(s))
}

// Reason says why a call was deferred.
type Reason string

// The reasons of a Deferral.
const (
	// ReasonBreakerOpen: the breaker is open (locally or, through the shared
	// row, by another instance), or half-open with its probe in flight.
	ReasonBreakerOpen Reason = "breaker_open"
	// ReasonRateLimited: the rate limit, or a Retry-After from the dependency.
	ReasonRateLimited Reason = "rate_limited"
	// ReasonBudgetExhausted: a retry beyond the retry budget.
	ReasonBudgetExhausted Reason = "budget_exhausted"
	// ReasonDegraded: the dependency is degraded and its reduced concurrency
	// is in use.
	ReasonDegraded Reason = "degraded"
	// ReasonConcurrency: the concurrency limit is in use.
	ReasonConcurrency Reason = "concurrency"
)

// ErrDeferred is matched (errors.Is) by every *Deferral.
var ErrDeferred = errors.New("call deferred")

// Deferral is the error Acquire returns when a call must not be made now.
// The caller should reschedule the work at Until (for a readback, release
// the row with next_check_at = Until); it is never a verdict on the work.
type Deferral struct {
	Dependency string
	Reason     Reason
	// Until is the earliest time a new attempt can succeed, as far as this
	// process knows; for reasons with no known end (concurrency, a probe in
	// flight, degraded) it is a short configured delay.
	Until time.Time
	// Slot is when the caller should come back: Until, except for a rate
	// limit (the limiter's or a Retry-After), where the deferrals are
	// booked about one token apart after the slots booked before them (the
	// k-th of a run gets Until + (k−1)/(0.8 × rate): a fifth of the rate
	// stays free for calls that were not deferred, such as a positive
	// control). A backlog deferred at one moment
	// then comes back spread over the times the limit admits it, instead
	// of all at Until, to be admitted a burst's worth and deferred again.
	// A slot reserves nothing: it is advice, and the limit is enforced
	// when the call comes back. A caller that reschedules its work (a
	// readback row) should use Slot.
	Slot time.Time
	// Detail is a human-readable explanation, e.g. the degraded stop reason.
	Detail string
}

// Error describes the Deferral in one line.
func (d *Deferral) Error() string {
	return fmt.Sprintf("protect: %s deferred until %s: %s: %s",
		d.Dependency, d.Until.Format(time.RFC3339Nano), d.Reason, d.Detail)
}

// Unwrap returns ErrDeferred.
func (d *Deferral) Unwrap() error { return ErrDeferred }

// Status is a snapshot of one dependency's protection state, for metrics,
// /readyz and logs.
type Status struct {
	Dependency string
	Breaker    BreakerState
	// OpenUntil is when an Open breaker goes half-open.
	OpenUntil time.Time
	// OpenReason says why the breaker opened (and by which instance, when
	// adopted from the shared row).
	OpenReason string
	// ConsecutiveFailures is the breaker's current count of transient
	// failures in a row (while Closed).
	ConsecutiveFailures int
	// Degraded reports degraded mode; DegradedReason is its explicit stop
	// reason while degraded, empty otherwise.
	Degraded       bool
	DegradedReason string
	// Calls and ErrorRate are over the degraded-mode window: calls with a
	// health signal (successes and transient failures) and the share of
	// transient failures among them.
	Calls     int
	ErrorRate float64
	// InFlight is the number of permits not yet Done; MaxInFlight the limit
	// in force (lower while degraded).
	InFlight    int
	MaxInFlight int
	// RetryAfterUntil is the end of the latest Retry-After, if in the future.
	RetryAfterUntil time.Time
}

// Guard holds the protection state of every dependency of one process.
// It is safe for concurrent use.
type Guard struct {
	cfg      Config
	store    Store
	clock    Clock
	log      *slog.Logger
	instance string

	mu   sync.Mutex
	deps map[string]*dependency
}

// New returns a Guard. store shares breaker openings between instances
// (NewPGStore in production, NewMemStore for a lone process or tests); a nil
// clock means SystemClock and a nil logger discards logs. It returns the
// configuration's validation errors, if any.
func New(store Store, cfg Config, clock Clock, logger *slog.Logger) (*Guard, error) {
	if store == nil {
		return nil, errors.New("protect: nil Store (use NewPGStore, or NewMemStore for a single process)")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if clock == nil {
		clock = SystemClock{}
	}
	if b, ok := store.(interface{ withClock(Clock) Store }); ok {
		// The shared row goes through the database's clock, converted
		// with this Guard's (see PGStore).
		store = b.withClock(clock)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	instance := cfg.Instance
	if instance == "" {
		host, _ := os.Hostname()
		instance = fmt.Sprintf("%s:%d", host, os.Getpid())
	}
	// The caller's map stays the caller's.
	deps := make(map[string]Policy, len(cfg.Dependencies))
	for k, v := range cfg.Dependencies {
		deps[k] = v
	}
	cfg.Dependencies = deps
	return &Guard{
		cfg:      cfg,
		store:    store,
		clock:    clock,
		log:      logger,
		instance: instance,
		deps:     map[string]*dependency{},
	}, nil
}

// Instance returns the name this Guard writes as opened_by.
func (g *Guard) Instance() string { return g.instance }

// dependency is the state of one dependency; mu guards every field below it.
type dependency struct {
	name   string
	policy Policy

	mu sync.Mutex

	// Breaker. gen changes on every breaker transition; a permit's outcome
	// only moves the breaker if the generation it was granted in is current,
	// so calls granted before an opening cannot close or re-open it later.
	state        BreakerState
	gen          uint64
	failures     int // consecutive transient failures, while Closed
	failedProbes int // consecutive failed probes, for the cool-down growth
	openUntil    time.Time
	openReason   string
	probing      bool // HalfOpen: the probe is in flight

	// Shared row, as last read or written, and when it was last read.
	shared          SharedOpen
	sharedCheckedAt time.Time
	sharedChecked   bool

	inFlight        int
	limiter         *rate.Limiter
	retryAfterUntil time.Time
	// booked is the latest slot given to a rate-limited deferral (Slot).
	booked         time.Time
	budget         *window // cFirst, cRetry
	health         *window // cSuccess, cTransient
	brk            *window // cSuccess, cTransient of the current Closed generation
	degraded       bool
	degradedReason string

	// limit is the adaptive concurrency limit (AIMD), in
	// [Degraded.MaxInFlight, Concurrency.MaxInFlight]; lastDecrease is when
	// it was last multiplied down.
	limit        float64
	lastDecrease time.Time

	// freed is closed (and dropped) when a permit is done, waking the
	// callers of AcquireWait waiting for a slot; nil while nobody waits.
	freed chan struct{}
}

// maxInFlight is the concurrency limit in force: the adaptive limit,
// rounded down, never below the degraded floor.
func (d *dependency) maxInFlight() int {
	return max(d.policy.Degraded.MaxInFlight, min(d.policy.Concurrency.MaxInFlight, int(math.Floor(d.limit))))
}

func (g *Guard) dependency(name string) *dependency {
	g.mu.Lock()
	defer g.mu.Unlock()
	d, ok := g.deps[name]
	if !ok {
		p := g.cfg.policy(name)
		d = &dependency{
			name:    name,
			policy:  p,
			limiter: rate.NewLimiter(p.Rate.Limit, p.Rate.Burst),
			budget:  newWindow(p.RetryBudget.Window),
			health:  newWindow(p.Degraded.Window),
			brk:     newWindow(p.Breaker.Window),
			limit:   float64(p.Concurrency.MaxInFlight),
		}
		g.deps[name] = d
	}
	return d
}

// Permit is the right to make one call. Call Done exactly once with the
// outcome; later calls are ignored, so `defer p.Done(Abandoned, 0)` is a
// safe net behind the real report. A nil *Permit's Done does nothing.
type Permit struct {
	g     *Guard
	d     *dependency
	gen   uint64
	probe bool
	done  atomic.Bool

	retries atomic.Int64 // in-call retries granted by Retry
}

// Dependency returns the dependency the permit is for.
func (p *Permit) Dependency() string { return p.d.name }

// Probe reports whether this call is the half-open breaker's single probe.
func (p *Permit) Probe() bool { return p.probe }

// Acquire asks to make one call of the given kind to dependency dep now. It
// returns a Permit, or a *Deferral saying why not and until when. It never
// waits for capacity; it returns ctx.Err() if ctx is done, and an error for
// an empty dependency name or an unknown kind.
//
// Checks, in order: the breaker (including another instance's shared
// opening), Retry-After, degraded concurrency, concurrency, the retry budget
// (retries only), the rate limit. A deferred call consumes nothing; a
// rate-limited one books the slot its caller should come back at
// (Deferral.Slot).
func (g *Guard) Acquire(ctx context.Context, dep string, kind Kind) (*Permit, error) {
	if dep == "" {
		return nil, errors.New("protect: empty dependency name")
	}
	if kind != First && kind != Retry {
		return nil, fmt.Errorf("protect: unknown call kind %d", int(kind))
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d := g.dependency(dep)
	if err := g.refreshShared(ctx, d); err != nil {
		return nil, err
	}
	var ev events
	d.mu.Lock()
	p, def := g.acquireLocked(d, g.clock.Now(), kind, &ev)
	d.mu.Unlock()
	g.emit(d, ev)
	if def != nil {
		return nil, def
	}
	return p, nil
}

// AcquireWait is Acquire, except that a call refused only because the
// dependency's concurrency limit (or its limit lowered in degraded mode) is
// in use waits for a call of dep to end, up to the deferral's Until (the
// configured busy or degraded delay), and tries again, instead of being
// deferred at once. A slot of a healthy dependency frees within one call's
// latency, so a caller that holds its work (a leased row) and more workers
// than the dependency's limit uses each slot as it frees, rather than
// putting the work back for a whole delay and an extra round trip. Every
// other refusal returns at once, like Acquire's.
func (g *Guard) AcquireWait(ctx context.Context, dep string, kind Kind) (*Permit, error) {
	var (
		until time.Time
		freed <-chan struct{}
	)
	for {
		p, err := g.Acquire(ctx, dep, kind)
		var d *Deferral
		if !errors.As(err, &d) || (d.Reason != ReasonConcurrency && d.Reason != ReasonDegraded) {
			return p, err
		}
		if until.IsZero() {
			until = d.Until
		}
		wait := until.Sub(g.clock.Now())
		if wait <= 0 {
			return nil, d
		}
		if freed == nil {
			// Watch for the next permit done, then try again before
			// waiting: one done in between closes the channel, so it is
			// not missed. A call admitted at once (the common case) takes
			// no channel and no second lock.
			freed = g.freed(dep)
			continue
		}
		t := time.NewTimer(wait)
		select {
		case <-freed:
			t.Stop()
			freed = nil
		case <-t.C:
			return nil, d
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
	}
}

// freed returns the channel closed when the next permit of dep is done.
func (g *Guard) freed(dep string) <-chan struct{} {
	d := g.dependency(dep)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.freed == nil {
		d.freed = make(chan struct{})
	}
	return d.freed
}

// refreshShared re-reads d's shared row if the cached copy is older than
// SharedRefresh. One caller reads; concurrent callers use the cached copy.
// A store error is logged and the cached copy kept (the local breaker still
// protects the dependency); only the caller's own cancellation is returned.
func (g *Guard) refreshShared(ctx context.Context, d *dependency) error {
	now := g.clock.Now()
	d.mu.Lock()
	due := !d.sharedChecked || !now.Before(d.sharedCheckedAt.Add(g.cfg.SharedRefresh))
	if due {
		d.sharedChecked = true
		d.sharedCheckedAt = now
	}
	d.mu.Unlock()
	if !due {
		return nil
	}
	lctx, cancel := context.WithTimeout(ctx, g.cfg.StoreTimeout)
	row, err := g.store.Load(lctx, d.name)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		g.log.Warn("protect: cannot read shared breaker state; using the cached copy",
			"dependency", d.name, "error", err)
		return nil
	}
	d.mu.Lock()
	d.keepShared(row)
	d.mu.Unlock()
	return nil
}

// keepShared caches row if it is later than the cached one: the stored
// open_until only ever grows, so an older read is stale.
func (d *dependency) keepShared(row SharedOpen) {
	if row.Until.After(d.shared.Until) {
		d.shared = row
	}
}

func (g *Guard) acquireLocked(d *dependency, now time.Time, kind Kind, ev *events) (*Permit, *Deferral) {
	g.advance(d, now, ev)
	pol := d.policy
	deferral := func(r Reason, until time.Time, format string, args ...any) *Deferral {
		return &Deferral{Dependency: d.name, Reason: r, Until: until, Slot: until, Detail: fmt.Sprintf(format, args...)}
	}
	booked := func(def *Deferral) *Deferral {
		def.Slot = d.book(def.Until)
		return def
	}
	switch d.state {
	case Open:
		return nil, deferral(ReasonBreakerOpen, d.openUntil, "circuit breaker open: %s", d.openReason)
	case HalfOpen:
		if d.probing {
			return nil, deferral(ReasonBreakerOpen, now.Add(pol.Concurrency.BusyDelay),
				"circuit breaker half-open: waiting for the probe in flight")
		}
	}
	if now.Before(d.retryAfterUntil) {
		return nil, booked(deferral(ReasonRateLimited, d.retryAfterUntil, "dependency asked to retry after %s",
			d.retryAfterUntil.Format(time.RFC3339Nano)))
	}
	if lim := d.maxInFlight(); lim < pol.Concurrency.MaxInFlight && d.inFlight >= lim {
		if d.degraded {
			return nil, deferral(ReasonDegraded, now.Add(pol.Degraded.Delay), "%s", d.degradedReason)
		}
		return nil, deferral(ReasonDegraded, now.Add(pol.Degraded.Delay),
			"concurrency limit lowered to %d of %d after transient failures, climbing back with successes",
			lim, pol.Concurrency.MaxInFlight)
	}
	if d.inFlight >= pol.Concurrency.MaxInFlight {
		return nil, deferral(ReasonConcurrency, now.Add(pol.Concurrency.BusyDelay),
			"%d calls in flight, limit %d", d.inFlight, pol.Concurrency.MaxInFlight)
	}
	if kind == Retry {
		if def := d.budgetDeferral(now); def != nil {
			return nil, def
		}
	}
	r := d.limiter.ReserveN(now, 1)
	if !r.OK() { // burst < 1 with a finite limit: refused by Validate
		return nil, deferral(ReasonRateLimited, now.Add(time.Second), "rate limiter refuses every call")
	}
	if delay := r.DelayFrom(now); delay > 0 {
		r.CancelAt(now)
		return nil, booked(deferral(ReasonRateLimited, now.Add(delay), "rate limit %v calls/s, burst %d",
			float64(pol.Rate.Limit), pol.Rate.Burst))
	}

	d.inFlight++
	if kind == Retry {
		d.budget.add(now, cRetry)
	} else {
		d.budget.add(now, cFirst)
	}
	p := &Permit{g: g, d: d, gen: d.gen}
	if d.state == HalfOpen {
		d.probing = true
		p.probe = true
		ev.add(slog.LevelInfo, "protect: circuit breaker probe sent")
	}
	return p, nil
}

// events collects log records under a dependency's lock, to be written
// after it is released.
type events []event

type event struct {
	level slog.Level
	msg   string
	attrs []slog.Attr
}

func (e *events) add(level slog.Level, msg string, attrs ...slog.Attr) {
	*e = append(*e, event{level: level, msg: msg, attrs: attrs})
}

func (g *Guard) emit(d *dependency, ev events) {
	for _, e := range ev {
		attrs := append([]slog.Attr{slog.String("dependency", d.name)}, e.attrs...)
		g.log.LogAttrs(context.Background(), e.level, e.msg, attrs...)
	}
}
