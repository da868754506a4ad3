// Package reconcile is the reconciler's worker pool: it claims due
// receipts in batches (outcome_unknown, and reconciling rows whose wait or
// lease is over), reads each back through its adapter, and settles or
// releases them in batches: succeeded, safe_to_retry or manual_review with
// the evidence, or back to the database with the time of the next check.
//
// Nothing sleeps while holding a row: a row waiting for its next check
// carries next_check_at and no lease, so waits survive restarts and slow
// rows cannot starve the pool. Several instances share one database safely:
// claims use FOR UPDATE SKIP LOCKED, and every write after a claim is
// guarded by the claim's lease token and the reconciling state.
package reconcile

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/dbclock"
	"github.com/receiptledger/reconciler/internal/pglisten"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// Config configures a Pool. Zero fields take the documented defaults.
type Config struct {
	// Instance names this reconciler: its actor is "reconciler:<Instance>".
	Instance string
	// Registry finds each receipt's adapter; nil means none (every receipt
	// goes to manual_review as adapter-less).
	Registry *readback.Registry
	// Gate protects the dependencies; nil admits every check.
	Gate Gate
	// Now is the clock every comparison with a stored time uses (due,
	// lease, orphan cut-off, window, deadline). It must be the database's
	// clock (SPEC §5a, "one clock"): the default is Clock's Now. Tests
	// inject their own to drive time.
	Now func() time.Time
	// Clock is the database-anchored clock used when Now is nil (default:
	// one over the pool's database, with WallClock as the host's clock).
	// The pool re-synchronises it every PollInterval and reports the skew
	// (reconciler_clock_skew_seconds, and a warning beyond a second).
	Clock *dbclock.Clock
	// WallClock is the host's wall clock for the default Clock (default
	// time.Now); it only measures the skew, nothing is compared with it.
	WallClock func() time.Time
	// Int63n draws the jitter (default math/rand/v2).
	Int63n func(n int64) int64
	// Schedule picks each unsettled receipt's next check (default a
	// LearnedLag drawing from Int63n).
	Schedule Schedule
	// Logger receives JSON-ready structured logs (default: discard).
	Logger *slog.Logger
	// Metrics, if set, is updated as the pool works.
	Metrics *Metrics

	// Workers is the number of concurrent checks (default 32).
	Workers int
	// BatchSize bounds one claim and one completion statement (default 512).
	BatchSize int
	// PrefetchFor sizes the claims to what this instance can check soon,
	// so that several instances share a backlog instead of the first to
	// start holding it all: the rows claimed and not yet checked are kept
	// to the workers plus a prefetch of the checks the workers finish in
	// PrefetchFor, from the measured time a row keeps a worker (at least
	// one row, at most BatchSize; one row until a first check is measured).
	// Checks that take microseconds (a local adapter) are still claimed a
	// batch at a time; checks of 100 ms with 32 workers, 32 rows beyond the
	// busy workers (default 100ms).
	PrefetchFor time.Duration
	// MaxInFlight bounds the rows claimed and not yet completed
	// (default 3·max(Workers, BatchSize)); a row waiting in the pool holds
	// its lease, so this should stay a few batches at most.
	MaxInFlight int
	// Flushers is the number of completion batches written concurrently
	// (default 2).
	Flushers int
	// Lease is how long a claim holds a row without renewal (default 30s).
	// While a row is in flight (waiting for a worker, being checked, its
	// outcome waiting to be written) its lease is renewed every Heartbeat,
	// so a check may run longer than the lease; a crashed instance's rows
	// are claimable again at most one lease after its last renewal.
	Lease time.Duration
	// Heartbeat is how often the leases of the rows in flight are renewed,
	// in one statement per batch of rows (default Lease/3; at most
	// Lease/2, so one missed renewal does not lose a lease). A check
	// starts only while its row's lease has at least one heartbeat left.
	Heartbeat time.Duration
	// CheckTimeout bounds one adapter call (default 30s). It may exceed
	// the lease: the heartbeat keeps the row's lease while the check runs.
	CheckTimeout time.Duration
	// PollInterval is the fallback wake-up when no NOTIFY arrives, and the
	// cadence of the orphan sweep (default 5s).
	PollInterval time.Duration
	// FlushInterval is the longest an outcome waits to be written with
	// others (default 20ms).
	FlushInterval time.Duration
	// OrphanTimeout: a submitted receipt with no transition for longer is
	// moved to outcome_unknown (default 5m; negative disables the sweep).
	OrphanTimeout time.Duration
	// StalePlannedAfter: planned receipts older than this are counted in
	// metrics and stats, never touched (default 1h).
	StalePlannedAfter time.Duration
	// GracePeriod is how long in-flight checks may run after the context
	// is cancelled before they are cancelled and their rows released
	// (default 20s).
	GracePeriod time.Duration
	// MetricsInterval is how often backlog gauges are refreshed (default 15s).
	MetricsInterval time.Duration
	// SweepTimeout bounds one orphan-sweep statement, on the client and on
	// the server (statement and lock timeouts), so a stuck sweep cannot stop
	// the claims (default 10s).
	SweepTimeout time.Duration
	// ControlInterval is how long a binding's positive control result is
	// reused before the control runs again, when an absence needs it
	// (default 5m); after a failed run it runs again after ControlRetry
	// (default 5s). ControlValidFor is how long a pass lets absences settle
	// (default 15m). ControlScan bounds the newest receipts searched for a
	// ledger-derived control (default ControlScan).
	ControlInterval time.Duration
	ControlRetry    time.Duration
	ControlValidFor time.Duration
	ControlScan     int
	// Audits configures the audits of settled absences and the window
	// alarms (docs/verdict-audits.md).
	Audits AuditConfig
}

func (c Config) withDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Gate == nil {
		c.Gate = openGate{}
	}
	if c.Registry == nil {
		c.Registry = readback.NewRegistry()
	}
	if c.Schedule == nil {
		c.Schedule = &LearnedLag{Int63n: c.Int63n}
	}
	if c.Workers == 0 {
		c.Workers = 32
	}
	if c.BatchSize == 0 {
		c.BatchSize = 512
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 3 * max(c.Workers, c.BatchSize)
	}
	if c.Flushers == 0 {
		c.Flushers = 2
	}
	def(&c.PrefetchFor, 100*time.Millisecond)
	def(&c.Lease, DefaultLease)
	def(&c.Heartbeat, c.Lease/3)
	def(&c.CheckTimeout, 30*time.Second)
	def(&c.PollInterval, 5*time.Second)
	def(&c.FlushInterval, 20*time.Millisecond)
	def(&c.OrphanTimeout, 5*time.Minute)
	def(&c.StalePlannedAfter, time.Hour)
	def(&c.GracePeriod, 20*time.Second)
	def(&c.MetricsInterval, 15*time.Second)
	def(&c.SweepTimeout, DefaultSweepLimit)
	def(&c.ControlInterval, 5*time.Minute)
	def(&c.ControlRetry, 5*time.Second)
	def(&c.ControlValidFor, 15*time.Minute)
	if c.ControlScan == 0 {
		c.ControlScan = ControlScan
	}
	c.Audits = c.Audits.withDefaults()
	return c
}

func (c Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("reconcile: %w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.Workers < 1:
		return bad("workers must be at least 1, got %d", c.Workers)
	case c.Flushers < 1:
		return bad("flushers must be at least 1, got %d", c.Flushers)
	case c.BatchSize < 1:
		return bad("batch size must be at least 1, got %d", c.BatchSize)
	case c.MaxInFlight < c.BatchSize:
		return bad("max in flight (%d) must be at least the batch size (%d)", c.MaxInFlight, c.BatchSize)
	case c.PrefetchFor <= 0 || c.CheckTimeout <= 0 || c.Lease <= 0 || c.Heartbeat <= 0 || c.PollInterval <= 0 || c.FlushInterval <= 0 || c.GracePeriod < 0 ||
		c.SweepTimeout <= 0 || c.ControlInterval <= 0 || c.ControlRetry <= 0 || c.ControlValidFor <= 0 || c.ControlScan < 1:
		return bad("durations must be positive")
	case 2*c.Heartbeat > c.Lease:
		// The heartbeat renews the leases of the rows in flight (a check
		// may outlast the lease); a lease must survive one missed renewal.
		return bad("heartbeat (%s) must be at most half the lease (%s)", c.Heartbeat, c.Lease)
	}
	if err := c.Audits.validate(); err != nil {
		return bad("%v", err)
	}
	return nil
}

// DefaultLease is the lease of a claim when Config.Lease is unset: short,
// since the heartbeat renews it while the row is in flight, so the rows of
// a crashed instance are claimable again within seconds.
const DefaultLease = 30 * time.Second

// Pool claims, checks and settles receipts. Create it with New; Run and
// Drain may be called once each, not concurrently.
type Pool struct {
	cfg   Config
	db    *pgxpool.Pool
	store *Store
	dec   decider
	log   *slog.Logger
	m     *Metrics
	// clock is the database-anchored clock behind cfg.Now, nil when the
	// caller injected Now.
	clock *dbclock.Clock
	ctl   controls
	// windows are the effective windows of the adapters' declarations.
	windows *Windows
	// refusals are the statements the database refuses as such (a
	// privilege, the schema): claims back off while complete is one.
	refusals refusals
	// unclaimable are the receipts whose claim the database refused for
	// their own sake, left out of claims for a while (claimRefused).
	unclaimable unclaimable

	skewMu     sync.Mutex
	skewWarned time.Time
}

// New returns a pool over db. It validates cfg (ErrInvalidConfig).
func New(db *pgxpool.Pool, cfg Config) (*Pool, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := NewStore(db, cfg.Instance)
	if err != nil {
		return nil, err
	}
	var clock *dbclock.Clock
	if cfg.Now == nil {
		clock = cfg.Clock
		if clock == nil {
			clock = dbclock.New(db, dbclock.WithWallClock(cfg.WallClock))
		}
		cfg.Now = clock.Now
	}
	windows := &Windows{}
	p := &Pool{
		cfg: cfg, db: db, store: store, windows: windows,
		dec:   decider{int63n: cfg.Int63n, sched: cfg.Schedule, windows: windows},
		log:   cfg.Logger.With("instance", cfg.Instance),
		m:     cfg.Metrics,
		clock: clock,
	}
	if cfg.Metrics != nil {
		p.refusals.gauge = cfg.Metrics.WritesBlocked
		cfg.Metrics.Known(cfg.Registry)
	}
	return p, nil
}

// Now returns the pool's current time: the database's clock (a lower
// bound), or the injected clock.
func (p *Pool) Now() time.Time { return p.cfg.Now() }

// syncClock re-anchors the database clock and reports the skew. With an
// injected clock there is nothing to do.
func (p *Pool) syncClock(ctx context.Context) error {
	if p.clock == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	smp, err := p.clock.Sync(ctx)
	if err != nil {
		if p.clock.Synced() {
			p.log.Warn("cannot re-read the database's clock; keeping the last anchor", "error", err)
			return nil
		}
		return err
	}
	if p.m != nil {
		p.m.ClockSkew.Set(smp.Skew.Seconds())
	}
	if smp.Skew > time.Second || smp.Skew < -time.Second {
		p.skewMu.Lock()
		warn := p.skewWarned.IsZero() || time.Since(p.skewWarned) >= 10*time.Minute
		if warn {
			p.skewWarned = time.Now()
		}
		p.skewMu.Unlock()
		if warn {
			p.log.Warn("this host's clock differs from the database's by more than a second; "+
				"the reconciler uses the database's clock for every comparison with a stored time",
				"skew_s", smp.Skew.Seconds(), "round_trip_ms", float64(smp.RoundTrip.Microseconds())/1000)
		}
	} else {
		p.skewMu.Lock()
		p.skewWarned = time.Time{}
		p.skewMu.Unlock()
	}
	return nil
}

// Store returns the pool's store (claims, completions, backlog).
func (p *Pool) Store() *Store { return p.store }

// Summary counts what a Run or Drain did.
type Summary struct {
	Claimed int
	// Settled counts settlements by resulting state.
	Settled map[statemachine.State]int
	// Reasons counts settlements by reason.
	Reasons map[string]int
	// Waiting counts rows released to wait for a later check (including
	// deferrals, rows released at shutdown, and Refused).
	Waiting int
	// Refused counts outcomes the database refused permanently even in
	// their minimal form: not settled; their rows were released with their
	// next check pushed (counted in Waiting too) or, if even that was
	// refused, left to their lease's expiry. It also counts receipts whose
	// claim the database refused for their own sake, left out of claims
	// for a while. Each is logged at ERROR.
	Refused int
	// Deferred counts checks the Gate refused (rescheduled).
	Deferred int
	// CheckErrors counts checks that failed (transient or permanent).
	CheckErrors int
	// LeaseLost counts outcomes discarded because the lease had moved on.
	LeaseLost int
	// Orphans counts submitted receipts moved to outcome_unknown.
	Orphans int
	// DBErrors counts failed statements (retried or given up).
	DBErrors int
	// Duplicates counts duplicate alarms raised.
	Duplicates int
	// LifetimeExceeded counts settlements of receipts whose agent recorded
	// an answer after the absence window (an alarm each: see
	// ReasonLifetimeExceeded).
	LifetimeExceeded int
}

func newSummary() Summary {
	return Summary{Settled: map[statemachine.State]int{}, Reasons: map[string]int{}}
}

// Run works until ctx is cancelled: it wakes on NOTIFY or every poll
// interval, sweeps orphans, claims what is due and settles it. On
// cancellation it stops claiming, lets in-flight checks finish within the
// grace period, releases the rest, and returns nil.
func (p *Pool) Run(ctx context.Context) (Summary, error) {
	return p.serve(ctx, false)
}

// Drain sweeps orphans, works what is due now (rows rescheduled meanwhile
// wait for a later run) and returns a summary. An error means the pool
// could not run (database unreachable), never that a receipt needed review.
func (p *Pool) Drain(ctx context.Context) (Summary, error) {
	return p.serve(ctx, true)
}

// session is the state of one Run or Drain.
type session struct {
	p        *Pool
	stop     context.Context // cancelled: stop claiming and starting checks
	work     context.Context // cancelled at the end of the grace period
	jobs     chan Claimed
	outcomes chan Outcome
	// checks carries each check, as soon as its adapter answered, to the
	// recorder, which writes it apart from the settlement.
	checks   chan pendingCheck
	space    chan struct{}
	inflight atomic.Int64 // claimed and not yet completed
	flushing atomic.Int64 // handed to a writer, not yet completed
	// unchecked counts the rows claimed whose processing (check, or
	// settlement without one) has not ended: waiting for a worker or
	// being checked. rowCost is the moving average of the time a row keeps
	// a worker, in nanoseconds (0 until the first is measured). Together
	// they size the claims (Config.PrefetchFor).
	unchecked atomic.Int64
	rowCost   atomic.Int64

	// leases are the rows in flight (claimed, outcome not yet written),
	// whose leases the heartbeat renews: id → token and current expiry.
	leaseMu sync.Mutex
	leases  map[int64]heldLease

	mu      sync.Mutex
	summary Summary

	// due holds the times (database clock, rounded up to dueGrain) at
	// which rows this session released become due again, so that Run
	// wakes for the earliest of them instead of waiting out the poll
	// interval: an open breaker's half-open probe then happens at the end
	// of its cooldown. Only Run (not Drain) records them. rearm tells an
	// idle claim loop that an earlier time was recorded.
	dueMu  sync.Mutex
	due    dueTimes
	dueSet map[int64]struct{} // the times in due, as Unix nanoseconds
	rearm  chan struct{}
	run    bool

	// batch gathers the rows read in batches (batch.go).
	batch batches
}

func (p *Pool) serve(ctx context.Context, once bool) (Summary, error) {
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	s := &session{
		p: p, stop: ctx, work: work,
		jobs:     make(chan Claimed, p.cfg.MaxInFlight),
		outcomes: make(chan Outcome, p.cfg.MaxInFlight),
		checks:   make(chan pendingCheck, p.cfg.MaxInFlight),
		space:    make(chan struct{}, 1),
		summary:  newSummary(),
		leases:   map[int64]heldLease{},
		rearm:    make(chan struct{}, 1),
		run:      !once,
	}
	finished := make(chan struct{})
	defer close(finished)
	go func() {
		select {
		case <-ctx.Done():
		case <-finished:
			return
		}
		t := time.NewTimer(p.cfg.GracePeriod)
		defer t.Stop()
		select {
		case <-t.C:
			cancelWork()
		case <-finished:
		}
	}()

	var workers, completer sync.WaitGroup
	for range p.cfg.Workers {
		workers.Go(func() {
			for c := range s.jobs {
				start := time.Now()
				o := s.process(c)
				s.measure(time.Since(start))
				s.unchecked.Add(-1)
				// A worker is free: the claim loop may be waiting for one.
				s.signalSpace()
				if o.Check != nil {
					// Never blocks: the channel holds MaxInFlight checks,
					// one per row in flight at most.
					done := make(chan struct{})
					s.checks <- pendingCheck{check: ReceiptCheck{ReceiptID: o.ID, Check: o.Check}, done: done}
					o.recorded = done
				}
				s.outcomes <- o
			}
		})
	}
	completer.Go(s.complete)
	var recorder sync.WaitGroup
	recorder.Go(s.record)
	var heart sync.WaitGroup
	heartCtx, stopHeart := context.WithCancel(work)
	heart.Go(func() { s.heartbeat(heartCtx) })
	defer func() { stopHeart(); heart.Wait() }()

	wake := make(chan struct{}, 1)
	if !once {
		// NOTIFY reconciler_due wakes the claim loop; while the listener
		// reconnects (1 s doubling to 30 s), polling covers the gap.
		l := pglisten.New(p.db, []string{notifyChannel}, pglisten.Options{
			OnNotify: func(pglisten.Notification) {
				select {
				case wake <- struct{}{}:
				default: // one pending wake-up is enough
				}
			},
			Logger: p.log, FirstPause: time.Second, MaxPause: 30 * time.Second,
		})
		var listener sync.WaitGroup
		listenCtx, stopListen := context.WithCancel(ctx)
		listener.Go(func() { l.Run(listenCtx) })
		defer func() { stopListen(); listener.Wait() }()
	}
	if err := p.loadWindows(ctx); err != nil && ctx.Err() == nil {
		s.dbError("effective windows", err)
	}
	var auditor sync.WaitGroup
	if !once && !p.cfg.Audits.Off {
		auditor.Go(s.auditLoop)
	}
	err := s.claimLoop(once, wake)
	s.endBatches()

	close(s.jobs)
	workers.Wait()
	close(s.checks)
	close(s.outcomes)
	completer.Wait()
	recorder.Wait()
	auditor.Wait()
	if once && err == nil && ctx.Err() == nil {
		// A drain audits what is due once its settling is done.
		if _, aerr := p.auditDue(ctx, func() bool { return ctx.Err() == nil }); aerr != nil {
			s.dbError("audit", aerr)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.summary, err
}

// refreshGauges updates the backlog and breaker gauges.
func (p *Pool) refreshGauges(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b, err := p.store.Backlog(ctx, p.cfg.Now(), p.cfg.StalePlannedAfter, p.cfg.OrphanTimeout)
	if err != nil {
		if ctx.Err() == nil {
			p.log.Warn("backlog query failed", "error", err)
		}
		return
	}
	p.m.SetBacklog(b)
	if ds, ok := p.cfg.Gate.(DependencyStates); ok {
		for dep, state := range ds.BreakerStates() {
			for _, st := range []string{"closed", "half_open", "open"} {
				v := 0.0
				if st == state {
					v = 1
				}
				p.m.Breaker.WithLabelValues(dep, st).Set(v)
			}
		}
	}
}

// SetBacklog publishes a backlog snapshot.
func (m *Metrics) SetBacklog(b Backlog) {
	m.Backlog.WithLabelValues(string(statemachine.Planned)).Set(float64(b.Planned))
	m.Backlog.WithLabelValues(string(statemachine.Submitted)).Set(float64(b.Submitted))
	m.Backlog.WithLabelValues(string(statemachine.OutcomeUnknown)).Set(float64(b.OutcomeUnknown))
	m.Backlog.WithLabelValues(string(statemachine.Reconciling)).Set(float64(b.Reconciling))
	m.Backlog.WithLabelValues(string(statemachine.ManualReview)).Set(float64(b.ManualReview))
	m.StalePlanned.Set(float64(b.StalePlanned))
	m.OldestUnknown.Set(b.OldestUnknownAge.Seconds())
}
