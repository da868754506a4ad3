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
	"container/heap"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/dbclock"
	"github.com/receiptledger/reconciler/internal/pglisten"
	"github.com/receiptledger/reconciler/internal/protect"
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

func (s *session) claimLoop(once bool, wake <-chan struct{}) error {
	p := s.p
	cfg := p.cfg
	poll := time.NewTicker(cfg.PollInterval)
	defer poll.Stop()
	var lastSweep, lastMetrics time.Time
	// Nothing is compared with a stored time before the clock has read the
	// database's.
	for {
		err := p.syncClock(s.stop)
		if err == nil {
			break
		}
		if s.stop.Err() != nil {
			return nil
		}
		s.dbError("clock", err)
		if once {
			return err
		}
		s.pause(wake, poll.C, cfg.PollInterval)
	}
	// A restart under the same instance name takes back at once the rows
	// its previous process held, instead of waiting out their leases.
	if n, err := p.store.ReclaimOwn(s.stop, cfg.Now(), cfg.SweepTimeout); err != nil {
		if s.stop.Err() == nil {
			s.dbError("reclaim own leases", err)
		}
	} else if n > 0 {
		p.log.Info("took back the rows a previous process of this instance held", "rows", n)
	}
	sweep := func() error {
		orphans, err := p.store.SweepOrphans(s.stop, cfg.Now(), cfg.OrphanTimeout, cfg.BatchSize, cfg.SweepTimeout)
		for _, o := range orphans {
			p.log.Info("orphaned submitted receipt moved to outcome_unknown",
				"receipt_id", o.ID, "dependency", o.Dependency)
		}
		if p.m != nil {
			p.m.Orphans.Add(float64(len(orphans)))
		}
		s.mu.Lock()
		s.summary.Orphans += len(orphans)
		s.mu.Unlock()
		return err
	}
	if err := sweep(); err != nil && s.stop.Err() == nil {
		s.dbError("orphan sweep", err)
		if once {
			return err
		}
	}
	lastSweep = time.Now()
	// Drain works what is due at its start: rows it reschedules are due
	// later and wait for the next run, so a cron run always ends. Only the
	// "due by" cut-off is fixed: every claim's lease runs from the claim.
	cutoff := cfg.Now()
	dbFailures := 0
	for s.stop.Err() == nil {
		if !once && time.Since(lastSweep) >= cfg.PollInterval {
			if err := p.syncClock(s.stop); err != nil && s.stop.Err() == nil {
				s.dbError("clock", err)
			}
			if err := sweep(); err != nil && s.stop.Err() == nil {
				s.dbError("orphan sweep", err)
			}
			lastSweep = time.Now()
		}
		if !once && p.m != nil && time.Since(lastMetrics) >= cfg.MetricsInterval {
			p.refreshGauges(s.stop)
			lastMetrics = time.Now()
		}
		// Claim what the workers can start on soon (the idle ones, plus
		// the prefetch), within the room left for rows in flight. Claim
		// again only once half a prefetch is missing, so a slow adapter
		// does not cost a claim statement per finished check.
		room := int64(cfg.MaxInFlight) - s.inflight.Load()
		prefetch := s.prefetch()
		need := int64(cfg.Workers) + prefetch - s.unchecked.Load()
		if s.inflight.Load() > 0 && (room < int64(min(cfg.BatchSize, cfg.MaxInFlight/2)) || need < (prefetch+1)/2) {
			s.waitSpace()
			continue
		}
		limit := int(max(1, min(room, need, int64(cfg.BatchSize))))
		if pause, refused := p.refusedPause(); refused {
			// The database refuses every outcome as such (a privilege,
			// the schema): claiming more would only read the APIs for
			// outcomes that cannot be written. A drain ends; a run probes
			// with one row at a time, after a growing pause, until an
			// outcome goes through.
			if once {
				return p.WritesRefused()
			}
			if s.inflight.Load() > 0 {
				s.waitSpace()
				continue
			}
			s.sleep(pause)
			if s.stop.Err() != nil {
				break
			}
			limit = 1
		}
		now := cfg.Now()
		dueBy := now
		if once {
			dueBy = cutoff
		}
		// Every recorded due time up to now is covered by this claim.
		s.takeDue(now)
		// The claim outlives the stop signal: cancelled mid-statement it
		// could commit leases this process would never hear of, leaving
		// rows held until their lease expires.
		claimCtx, cancel := context.WithTimeout(context.WithoutCancel(s.stop), 30*time.Second)
		rows, refused, err := s.claim(claimCtx, dueBy, now, limit)
		cancel()
		if err != nil {
			if s.stop.Err() != nil {
				break
			}
			s.dbError("claim", err)
			if classifyDB(err) == dbStatementRefused {
				p.refusals.note("claim", err)
			}
			dbFailures++
			if once && dbFailures >= 3 {
				return err
			}
			s.pause(wake, poll.C, min(time.Duration(dbFailures)*time.Second, cfg.PollInterval))
			continue
		}
		dbFailures = 0
		p.refusals.clear("claim")
		if len(rows) > 0 {
			s.hold(rows)
			s.inflight.Add(int64(len(rows)))
			s.unchecked.Add(int64(len(rows)))
			if p.m != nil {
				p.m.Claimed.Add(float64(len(rows)))
			}
			s.mu.Lock()
			s.summary.Claimed += len(rows)
			s.mu.Unlock()
		}
		s.dispatch(rows, len(rows)+refused == limit)
		if len(rows)+refused == limit {
			// Maybe more due: the receipts whose claim was refused are
			// left out of the next claim, so it takes the rows behind.
			continue
		}
		if once {
			if s.inflight.Load() == 0 {
				// The last outcomes may have been refused while this
				// claim ran, after the check at the top of the loop.
				return p.WritesRefused()
			}
			s.waitSpace()
			continue
		}
		s.idle(wake, poll.C)
	}
	return nil
}

// dueGrain is how finely due times are told apart: the wake-ups for rows
// released to become due within one grain are one claim, and a row released
// due at once (or in the past) is claimed within a grain, so a gate that
// keeps deferring to the past cannot make the claim loop spin.
const dueGrain = 100 * time.Millisecond

// maxDueTimes bounds the due times remembered; beyond it a new time is not
// recorded and the poll interval covers it.
const maxDueTimes = 4096

// dueTimes is a min-heap of distinct due times.
type dueTimes []time.Time

func (h dueTimes) Len() int           { return len(h) }
func (h dueTimes) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h dueTimes) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *dueTimes) Push(x any)        { *h = append(*h, x.(time.Time)) }
func (h *dueTimes) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}

// noteDue records that released rows become due at the times given
// (database clock), for Run's wake-ups. A time already passed counts as
// now: it is claimed within a grain.
func (s *session) noteDue(times []time.Time) {
	if !s.run || len(times) == 0 {
		return
	}
	grain := min(dueGrain, s.p.cfg.PollInterval)
	now := s.p.cfg.Now()
	s.dueMu.Lock()
	earlier := false
	for _, t := range times {
		t = later(t, now)
		r := t.Truncate(grain)
		if r.Before(t) {
			r = r.Add(grain)
		}
		if _, ok := s.dueSet[r.UnixNano()]; ok || len(s.due) >= maxDueTimes {
			continue
		}
		if s.dueSet == nil {
			s.dueSet = map[int64]struct{}{}
		}
		s.dueSet[r.UnixNano()] = struct{}{}
		heap.Push(&s.due, r)
		earlier = earlier || s.due[0].Equal(r)
	}
	s.dueMu.Unlock()
	if earlier {
		select {
		case s.rearm <- struct{}{}:
		default:
		}
	}
}

// takeDue forgets the due times up to now: the claim about to run at now
// covers their rows.
func (s *session) takeDue(now time.Time) {
	s.dueMu.Lock()
	defer s.dueMu.Unlock()
	for len(s.due) > 0 && !s.due[0].After(now) {
		delete(s.dueSet, heap.Pop(&s.due).(time.Time).UnixNano())
	}
}

// nextDue returns how long until the earliest recorded due time (at most
// zero when it has passed), and whether there is one.
func (s *session) nextDue() (time.Duration, bool) {
	s.dueMu.Lock()
	defer s.dueMu.Unlock()
	if len(s.due) == 0 {
		return 0, false
	}
	return s.due[0].Sub(s.p.cfg.Now()), true
}

// idle waits, between claims of Run, for min(poll interval, earliest due
// time − now): a NOTIFY, the poll tick, the earliest time a released row
// becomes due, or the stop. A due time recorded meanwhile that is earlier
// than the one waited for re-arms the timer.
func (s *session) idle(wake <-chan struct{}, poll <-chan time.Time) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		var due <-chan time.Time
		if d, ok := s.nextDue(); ok {
			if d <= 0 {
				return
			}
			t.Reset(d)
			due = t.C
		} else {
			t.Stop()
		}
		select {
		case <-s.stop.Done():
			return
		case <-wake:
			return
		case <-poll:
			return
		case <-due:
			return
		case <-s.rearm:
		}
	}
}

// prefetch is how many rows beyond the workers the next claim may take:
// the checks the workers finish in PrefetchFor at the measured cost of a
// row, at least one and at most BatchSize.
func (s *session) prefetch() int64 {
	cfg := s.p.cfg
	cost := s.rowCost.Load()
	if cost <= 0 {
		return 1
	}
	n := (int64(cfg.Workers)*int64(cfg.PrefetchFor) + cost - 1) / cost
	return min(max(n, 1), int64(cfg.BatchSize))
}

// measure folds the time one row kept a worker into rowCost (a moving
// average weighting the newest row 1/8).
func (s *session) measure(d time.Duration) {
	ns := max(int64(d), 1)
	for {
		old := s.rowCost.Load()
		next := ns
		if old > 0 {
			next = max(old+(ns-old)/8, 1)
		}
		if s.rowCost.CompareAndSwap(old, next) {
			return
		}
	}
}

// signalSpace tells a waiting claim loop that a worker or room in flight
// was freed.
func (s *session) signalSpace() {
	select {
	case s.space <- struct{}{}:
	default:
	}
}

// waitSpace waits until a worker finishes a row or the completer frees
// room, or the session stops.
func (s *session) waitSpace() {
	select {
	case <-s.space:
	case <-s.stop.Done():
	}
}

// claim leases up to limit rows due by dueBy, leaving out the receipts
// whose claim the database refused, and returns how many it refused this
// time besides. If it refuses this claim for one row's sake (a row-level
// SQLSTATE: a trigger's RAISE, a constraint), retrying it would fail alike
// forever, and since the claim takes rows in due order, the refused
// receipt would stop every row behind it: the candidates are claimed apart
// instead, the batch split in halves down to the receipts refused on their
// own, which are reported (claimRefused) and left out of claims for a
// while. A transient failure, a refusal of the statement itself, or a
// refusal once MaxUnclaimable receipts are left out (the database refuses
// claims wholesale: one statement per row would walk every due row) is
// returned as before.
func (s *session) claim(ctx context.Context, dueBy, now time.Time, limit int) ([]Claimed, int, error) {
	p := s.p
	args := claimArgs{dueBy: dueBy, now: now, limit: limit, lease: p.cfg.Lease, skip: p.unclaimable.skip(now)}
	rows, err := p.store.claim(ctx, args)
	if err == nil || classifyDB(err) != dbRowRefused || p.unclaimable.full() {
		p.unclaimable.forget(rows)
		return rows, 0, err
	}
	ids, derr := p.store.due(ctx, dueBy, limit, args.skip)
	if derr != nil {
		return nil, 0, derr
	}
	var a apart
	rows = s.claimApart(ctx, args, ids, &a)
	p.unclaimable.forget(rows)
	if len(rows) == 0 && a.full != nil {
		return nil, a.refused, a.full
	}
	return rows, a.refused, nil
}

// apart is what claimApart met besides the rows it claimed: the receipts
// it left out, and the refusal it could not leave out (unclaimable full).
type apart struct {
	refused int
	full    error
}

// claimApart claims the rows ids alone, splitting on a row-level refusal
// down to the receipts refused on their own (claimRefused, counted in
// a). A transient failure ends it with the rows claimed so far (the next
// claim meets it again), and so does a full unclaimable set (in a).
func (s *session) claimApart(ctx context.Context, args claimArgs, ids []int64, a *apart) []Claimed {
	if len(ids) == 0 {
		return nil
	}
	args.only, args.limit = ids, len(ids)
	rows, err := s.p.store.claim(ctx, args)
	switch {
	case err == nil:
		return rows
	case classifyDB(err) != dbRowRefused:
		s.dbError("claim", err)
		return nil
	case len(ids) == 1:
		if s.p.unclaimable.full() {
			a.full = err
			return nil
		}
		s.claimRefused(ids[0], err, args.now)
		a.refused++
		return nil
	}
	half := len(ids) / 2
	rows = s.claimApart(ctx, args, ids[:half], a)
	if ctx.Err() != nil || a.full != nil {
		return rows
	}
	return append(rows, s.claimApart(ctx, args, ids[half:], a)...)
}

// claimRefused reports a receipt whose claim the database refused for its
// own sake: an ERROR naming it, the SQLSTATE and what to do, the count by
// statement and SQLSTATE class, and the receipt left out of claims until
// its time (unclaimable). Nothing was written: it stays as it was.
func (s *session) claimRefused(id int64, err error, now time.Time) {
	p := s.p
	until := p.unclaimable.add(id, now)
	if p.m != nil {
		p.m.WritesRefused.WithLabelValues("claim", sqlStateClass(err)).Inc()
	}
	s.mu.Lock()
	s.summary.Refused++
	s.mu.Unlock()
	p.log.Error("claim refused by the database; the receipt is left out of claims for a while",
		"receipt_id", id, "statement", "claim", "sqlstate", sqlState(err), "error", refusal(err),
		"hint", refusalHint(err), "retry_at", until)
}

// unclaimable are receipts whose claim the database refused for their own
// sake. Each is left out of claims for WriteRefusedRetry, doubling with
// each refusal in a row up to MaxUnclaimablePause, and forgotten once a
// claim takes it. Safe for concurrent use.
type unclaimable struct {
	mu sync.Mutex
	by map[int64]unclaimableRow
}

type unclaimableRow struct {
	until   time.Time
	strikes int
}

// MaxUnclaimable bounds the receipts left out of claims at once. A
// database that refuses more receipts' claims than that refuses claims
// wholesale, whatever its SQLSTATE says: each further refusal is the
// claim's, which backs off as any failed claim does, rather than one
// statement, one ERROR and one id more per due row.
const MaxUnclaimable = 1024

// full reports whether MaxUnclaimable receipts are left out already.
func (u *unclaimable) full() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.by) >= MaxUnclaimable
}

// MaxUnclaimablePause bounds how long a receipt whose claim the database
// refused is left out of claims before it is tried again.
const MaxUnclaimablePause = time.Hour

// add records a refusal of id's claim at now and returns when it is tried
// again.
func (u *unclaimable) add(id int64, now time.Time) time.Time {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.by == nil {
		u.by = map[int64]unclaimableRow{}
	}
	r := u.by[id]
	wait := WriteRefusedRetry
	for i := 0; i < r.strikes && wait < MaxUnclaimablePause; i++ {
		wait *= 2
	}
	r.strikes++
	r.until = now.Add(min(wait, MaxUnclaimablePause))
	u.by[id] = r
	return r.until
}

// skip returns the receipts to leave out of a claim at now (nil: none).
func (u *unclaimable) skip(now time.Time) []int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	var ids []int64
	for id, r := range u.by {
		switch {
		case now.Before(r.until):
			ids = append(ids, id)
		case now.Sub(r.until) > MaxUnclaimablePause:
			// Settled by someone else, or quiet long enough: its next
			// refusal starts the doubling over.
			delete(u.by, id)
		}
	}
	return ids
}

// forget drops the receipts a claim took: their refusal is over.
func (u *unclaimable) forget(rows []Claimed) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, c := range rows {
		delete(u.by, c.ID)
	}
}

// sleep waits d or the stop: nothing else shortens it.
func (s *session) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.stop.Done():
	}
}

// pause waits d, a wake-up, or the stop.
func (s *session) pause(wake <-chan struct{}, poll <-chan time.Time, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-wake:
	case <-poll:
	case <-s.stop.Done():
	}
}

func (s *session) dbError(what string, err error) {
	s.p.log.Error("database statement failed", "statement", what, "error", err)
	if s.p.m != nil {
		s.p.m.DBErrors.Inc()
	}
	s.mu.Lock()
	s.summary.DBErrors++
	s.mu.Unlock()
}

// process decides one claimed row: settle without a check (no adapter,
// blind), release (stopping, lease too short, deferred by the gate), or
// check and decide.
func (s *session) process(c Claimed) Outcome {
	p := s.p
	cfg := p.cfg
	now := cfg.Now()
	b, ok := cfg.Registry.Lookup(c.Operation, c.Dependency)
	if lo, late := lateSucceeded(c); late {
		// The agent saw the API's 2xx after the orphan sweep moved the
		// receipt: the proof is in, no adapter call needed.
		if !ok {
			b = nil
		}
		return p.dec.voided(now, c, b, p.dec.late(now, c, b, lo))
	}
	if !ok {
		return p.dec.manual(now, c, nil, ReasonNoAdapter)
	}
	if b.Kind == readback.Blind {
		return p.dec.manual(now, c, b, ReasonBlind)
	}
	if s.stop.Err() != nil || now.Add(cfg.Heartbeat).After(s.leaseExpiry(c)) {
		// Stopping, or the lease is about to run out (its renewals failed):
		// hand the row back for whoever claims next instead of racing the
		// lease.
		return p.dec.release(c, now)
	}
	gate := cfg.Gate
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		// Nothing is called: the dependency's protection has nothing to
		// protect, and its rate limit would only slow the answer down.
		gate = openGate{}
	}
	pass, err := gate.Enter(s.work, c.Dependency, c.Retry)
	if err != nil {
		var d *Deferral
		if errors.As(err, &d) {
			s.mu.Lock()
			s.summary.Deferred++
			s.mu.Unlock()
			if p.m != nil {
				p.m.Deferrals.WithLabelValues(c.Dependency).Inc()
			}
			p.log.Debug("check deferred", "receipt_id", c.ID, "dependency", c.Dependency,
				"reason", d.Reason, "until", d.Until)
			// A deferral is a wait, not a check: it does not use up
			// max_checks; only the deadline ends a receipt whose
			// dependency can never be read.
			return p.dec.waitOrDeadline(now, c, b, later(d.Until, now))
		}
		return p.dec.release(c, now)
	}
	ctx, cancel := context.WithTimeout(s.work, cfg.CheckTimeout)
	if r, ok := pass.(protect.Retrier); ok {
		// Retries an adapter makes inside the check (a flaky page) are
		// charged to the dependency's retry budget like repeated checks.
		ctx = protect.WithRetrier(ctx, r)
	}
	// Absence is judged at the moment the read began (SPEC §5a): the
	// database's time just before the adapter's first request, never the
	// time its answer arrives.
	readAt := cfg.Now()
	start := time.Now()
	res, cerr := safeCheck(ctx, b.Adapter, c.Receipt)
	latency := time.Since(start)
	cancel()
	if s.work.Err() != nil {
		// The grace period ran out mid-check: the answer is not the
		// dependency's fault and not evidence; release the row.
		pass.Exit(Cancelled, 0)
		return p.dec.release(c, cfg.Now())
	}
	result, retryAfter := Answered, time.Duration(0)
	if cerr != nil {
		class, ra := readback.Classify(cerr)
		result, retryAfter = FailedTransient, ra
		if class == readback.Permanent {
			result = FailedPermanent
		}
	}
	pass.Exit(result, retryAfter)
	answeredAt := cfg.Now()
	out := p.dec.decide(readAt, answeredAt, c, b, res, cerr, latency, controlAssumed)
	if kind := ControlNeeded(out); kind != "" {
		// The answer would settle on an answer a misconfigured adapter
		// gives for everything: only if the adapter's positive control of
		// that kind, for this receipt's operation, has passed recently.
		out = p.dec.decide(readAt, answeredAt, c, b, res, cerr, latency, s.control(b, c.Receipt, kind))
	}
	s.found(c, b, readAt, out)
	if p.m != nil {
		outcome := string(res.Verdict)
		if cerr != nil {
			outcome = string(result)
			p.m.Failures.WithLabelValues(c.Dependency, string(result)).Inc()
		}
		p.m.Checks.WithLabelValues(b.Name, outcome).Inc()
		p.m.CheckLatency.WithLabelValues(b.Name).Observe(latency.Seconds())
	}
	if cerr != nil {
		s.mu.Lock()
		s.summary.CheckErrors++
		s.mu.Unlock()
		p.log.Warn("readback check failed", "receipt_id", c.ID, "dependency", c.Dependency,
			"adapter", b.Name, "class", string(result), "error", cerr)
	}
	return out
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// safeCheck calls the adapter, turning a panic into a permanent error: a
// bug in one adapter must not take the daemon down, and repeating the same
// input would panic again.
func safeCheck(ctx context.Context, a readback.Adapter, r readback.Receipt) (res readback.Result, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = readback.PermanentError(fmt.Errorf("adapter panicked: %v", v))
		}
	}()
	return a.Check(ctx, r)
}

// complete collects outcomes and writes them in batches: when a batch is
// full, when every claimed row has its outcome, or after FlushInterval.
func (s *session) complete() {
	cfg := s.p.cfg
	// Several batches are written at once, so the database works on a
	// claim and on completions in parallel instead of taking turns.
	batches := make(chan []Outcome)
	var writers sync.WaitGroup
	for range cfg.Flushers {
		writers.Go(func() {
			for b := range batches {
				s.flush(b)
				s.flushing.Add(-int64(len(b)))
			}
		})
	}
	pending := make([]Outcome, 0, cfg.BatchSize)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	armed := false
	flush := func() {
		if armed {
			timer.Stop()
			armed = false
		}
		if len(pending) > 0 {
			s.flushing.Add(int64(len(pending)))
			batches <- pending
			pending = make([]Outcome, 0, cfg.BatchSize)
		}
	}
	for {
		select {
		case o, ok := <-s.outcomes:
			if !ok {
				flush()
				close(batches)
				writers.Wait()
				return
			}
			pending = append(pending, o)
			// Flush a full batch, or when every row not already being
			// written has its outcome: nothing more is coming soon.
			if len(pending) >= cfg.BatchSize || int64(len(pending)) >= s.inflight.Load()-s.flushing.Load() {
				flush()
			} else if !armed {
				timer.Reset(cfg.FlushInterval)
				armed = true
			}
		case <-timer.C:
			armed = false
			flush()
		}
	}
}

// persist runs write until it succeeds: retried twice with a short
// jittered backoff, then kept and retried, with a backoff capped at
// min(5s, PollInterval), until the database answers or the grace period of
// a stop ends. Every attempt after the first is told so (again): it may
// follow an attempt that committed without our hearing of it. Each attempt
// outlives the stop signal, bounded by its own timeout. A permanent refusal
// (permanentDB: a privilege, the schema, a row's data) is returned at once:
// retrying the same statement cannot change it, and keeping it would hold
// its rows, and the claims behind them, forever. The writes handle their
// rows' refusals themselves; this is the net under them.
func (s *session) persist(what string, rows int, write func(ctx context.Context, again bool) error) error {
	p := s.p
	retry := backoff.NewExponentialBackOff()
	retry.InitialInterval = 200 * time.Millisecond
	attempt := 0
	try := func() error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(s.stop), 30*time.Second)
		defer cancel()
		attempt++
		err := write(ctx, attempt > 1)
		if err != nil && permanentDB(err) {
			return backoff.Permanent(err)
		}
		return err
	}
	err := backoff.RetryNotify(try, backoff.WithMaxRetries(retry, 2),
		func(err error, _ time.Duration) { s.dbError(what, err) })
	if err == nil {
		return nil
	}
	s.dbError(what, err)
	if permanentDB(err) {
		return err
	}
	p.log.Warn("kept until the database answers", "statement", what, "rows", rows, "error", err)
	keep := backoff.NewExponentialBackOff()
	keep.InitialInterval = 500 * time.Millisecond
	keep.MaxInterval = min(5*time.Second, p.cfg.PollInterval)
	keep.MaxElapsedTime = 0
	err = backoff.RetryNotify(try, backoff.WithContext(keep, s.work),
		func(err error, _ time.Duration) { s.dbError(what, err) })
	if err == nil {
		p.log.Info("kept rows written", "statement", what, "rows", rows)
	} else if permanentDB(err) {
		s.dbError(what, err)
	}
	return err
}

// pendingCheck is a check on its way to the recorder; done is closed once
// the recorder is done with it.
type pendingCheck struct {
	check ReceiptCheck
	done  chan struct{}
}

// record writes the checks as their adapters answer, apart from the
// settlements, so a read is in the audit trail even if this process dies
// before it settles. It writes whatever has arrived while the previous
// write ran, up to BatchSize in one statement: a lone check is written at
// once, and under load the batches grow by themselves. A check whose write
// is refused or abandoned (end of the grace period) stays unrecorded and is
// written with its outcome.
func (s *session) record() {
	cfg := s.p.cfg
	batch := make([]pendingCheck, 0, cfg.BatchSize)
	for first := range s.checks {
		batch = append(batch[:0], first)
	more:
		for len(batch) < cfg.BatchSize {
			select {
			case c, ok := <-s.checks:
				if !ok {
					break more
				}
				batch = append(batch, c)
			default:
				break more
			}
		}
		checks := make([]ReceiptCheck, len(batch))
		for i, c := range batch {
			checks[i] = c.check
		}
		var refused error
		err := s.persist("record checks", len(checks), func(ctx context.Context, again bool) error {
			var err error
			refused, err = s.p.store.recordChecks(ctx, checks, again)
			return err
		})
		if err != nil && !permanentDB(err) {
			s.p.log.Warn("checks not recorded at the end of the grace period; each is written with its outcome if that can be",
				"rows", len(checks))
		} else if err != nil {
			refused = err
		}
		if refused != nil {
			s.checksRefused(checks, refused)
		}
		for _, c := range batch {
			close(c.done)
		}
	}
}

// flush writes one batch of outcomes, once the recorder is done with their
// checks. A failed write (a failover, a dropped connection, a database
// outage) is kept and retried (persist) until the database answers: the
// outcomes are not lost, and their rows stay in flight, leases renewed by
// the heartbeat (so at most MaxInFlight outcomes are ever kept, and claims
// stop meanwhile). Only at the end of the grace period of a stop is a batch
// that still cannot be written abandoned to its leases' expiry, which
// re-offers its rows: checks are repeatable, settlements are guarded.
//
// A permanent refusal is not kept: the store writes every row it can and
// gives up the refused ones (Store.complete), each logged at ERROR with its
// verdict, so no evidence disappears unsaid. A batch refused whole for a
// reason of the statement (a privilege, the schema) makes the claims back
// off (Pool.WritesRefused) until a write goes through again.
func (s *session) flush(batch []Outcome) {
	p := s.p
	for _, o := range batch {
		if o.recorded != nil {
			<-o.recorded
		}
	}
	var w written
	err := s.persist("complete", len(batch), func(ctx context.Context, again bool) error {
		// A retry may follow a first attempt that committed without our
		// hearing of it, so it is the idempotent CompleteAgain's. What an
		// attempt that then failed wrote is kept too: a split commits row
		// by row, and a row it released after a refusal is no longer
		// leased, so the retry would not see it (nor its refusal) again.
		got, err := p.store.complete(ctx, batch, again)
		w.add(got)
		return err
	})
	if err != nil && !permanentDB(err) {
		p.log.Warn("kept outcomes abandoned at the end of the grace period; their rows return when their leases expire",
			"rows", len(batch))
	}
	s.release(batch)
	ok := make(map[int64]bool, len(w.applied))
	for _, id := range w.applied {
		ok[id] = true
	}
	var dueAt []time.Time
	wrote := 0
	var stmtRefusal error
	s.mu.Lock()
	for _, o := range batch {
		r, refused := w.refused[o.ID]
		if err != nil && permanentDB(err) {
			r, refused = rowRefusal{cause: err, fate: fateHeld, last: err}, true
		}
		if refused {
			s.refused(o, r)
			if classifyDB(r.cause) == dbStatementRefused && r.fate != fateMinimal {
				stmtRefusal = r.cause
			}
		}
		switch {
		case refused && r.fate != fateMinimal:
			// Not settled: released to wait (or left to its lease).
			s.summary.Refused++
			if p.m != nil {
				p.m.Refused.Inc()
			}
			if r.fate != fateHeld {
				s.summary.Waiting++
				if p.m != nil {
					p.m.Rescheduled.Inc()
				}
			}
		case err != nil:
		case !ok[o.ID]:
			s.summary.LeaseLost++
			if p.m != nil {
				p.m.LeaseLost.Inc()
			}
			p.log.Warn("outcome discarded: lease lost", "receipt_id", o.ID, "dependency", o.Dependency)
		case o.Settles():
			wrote++
			s.summary.Settled[o.To]++
			s.summary.Reasons[o.Detail.Reason]++
			if len(o.Duplicates) > 1 {
				s.summary.Duplicates++
			}
			if p.m != nil {
				p.m.Settlements.WithLabelValues(string(o.To), o.Detail.Reason).Inc()
				if len(o.Duplicates) > 1 {
					p.m.Duplicates.Inc()
				}
			}
			if len(o.Duplicates) > 1 {
				p.log.Warn("duplicate detected", "receipt_id", o.ID, "dependency", o.Dependency,
					"adapter", o.Adapter, "matches", len(o.Duplicates))
			}
			s.lifetimeAlarm(o)
			p.log.Info("receipt settled", "receipt_id", o.ID, "dependency", o.Dependency,
				"state", string(o.To), "reason", o.Detail.Reason, "adapter", o.Adapter)
		default:
			wrote++
			s.summary.Waiting++
			if p.m != nil {
				p.m.Rescheduled.Inc()
			}
			if !o.NextCheck.IsZero() {
				dueAt = append(dueAt, o.NextCheck)
			}
		}
	}
	s.mu.Unlock()
	switch {
	case wrote > 0:
		p.refusals.clear("complete")
	case stmtRefusal != nil:
		p.refusals.note("complete", stmtRefusal)
	}
	// Run wakes when the first of these rows is due again.
	s.noteDue(dueAt)
	s.inflight.Add(-int64(len(batch)))
	s.signalSpace()
}

// refused reports an outcome the database refused permanently: an ERROR
// naming the receipt, the statement, the SQLSTATE, what to do, what became
// of the row, and the verdict itself (the evidence the database did not
// take is not dropped unsaid), and the count by statement and SQLSTATE
// class. An outcome written without the API's text is a WARN: its verdict
// stands.
func (s *session) refused(o Outcome, r rowRefusal) {
	p := s.p
	if p.m != nil {
		p.m.WritesRefused.WithLabelValues("complete", sqlStateClass(r.cause)).Inc()
	}
	args := []any{"receipt_id", o.ID, "dependency", o.Dependency, "statement", "complete",
		"sqlstate", sqlState(r.cause), "error", refusal(r.cause), "hint", refusalHint(r.cause),
		"fate", r.fate.String()}
	if r.last != nil && r.last != r.cause {
		args = append(args, "last_error", refusal(r.last))
	}
	args = append(args, verdictAttrs(o)...)
	if r.fate == fateMinimal {
		p.log.Warn("outcome refused by the database; written without the API's text", args...)
		return
	}
	p.log.Error("outcome refused by the database", args...)
}

// checksRefused reports checks the recorder could not write even without
// their evidence (the first refusal: cause): they are written with their
// outcomes, or given up with them (refused).
func (s *session) checksRefused(checks []ReceiptCheck, cause error) {
	n := 0
	for _, c := range checks {
		if !c.Check.Recorded {
			n++
		}
	}
	if n == 0 {
		return
	}
	if s.p.m != nil {
		s.p.m.WritesRefused.WithLabelValues("record checks", sqlStateClass(cause)).Add(float64(n))
	}
	s.p.log.Warn("checks refused by the database; each is written with its outcome if that can be",
		"statement", "record checks", "rows", n, "sqlstate", sqlState(cause), "error", refusal(cause),
		"hint", refusalHint(cause))
}

// verdictAttrs are the log attributes of o's verdict: what it decided and
// on what evidence (bounded, as the database would have stored it).
func verdictAttrs(o Outcome) []any {
	c := o.sanitized()
	args := []any{"outcome", string(c.To), "reason", c.Detail.Reason, "adapter", c.Adapter}
	if c.ExternalID != "" {
		args = append(args, "external_id", c.ExternalID)
	}
	if e := c.Detail.Evidence; e != nil {
		args = append(args, "verdict", e.Verdict, "authoritative", e.Authoritative, "matched", e.Matched)
	}
	if k := c.Check; k != nil {
		args = append(args, "check_no", k.CheckNo, "check_at", k.At, "check_verdict", k.Verdict)
		if k.Error != "" {
			args = append(args, "check_error", k.Error)
		}
	}
	if !c.NextCheck.IsZero() {
		args = append(args, "next_check", c.NextCheck)
	}
	return args
}

// heldLease is a row in flight: its lease token and current expiry.
type heldLease struct {
	token   string
	expires time.Time
}

// hold records claimed rows as in flight, for the heartbeat.
func (s *session) hold(rows []Claimed) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	for _, c := range rows {
		s.leases[c.ID] = heldLease{token: c.Lease, expires: c.LeaseExpires}
	}
}

// release forgets written (or abandoned) rows.
func (s *session) release(batch []Outcome) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	for _, o := range batch {
		if h, ok := s.leases[o.ID]; ok && h.token == o.Lease {
			delete(s.leases, o.ID)
		}
	}
}

// leaseExpiry returns the current expiry of c's lease (zero once lost).
func (s *session) leaseExpiry(c Claimed) time.Time {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	if h, ok := s.leases[c.ID]; ok && h.token == c.Lease {
		return h.expires
	}
	return c.LeaseExpires
}

// heartbeat renews the leases of the rows in flight every Heartbeat, in one
// statement per batch of rows, until ctx ends. A row the renewal no longer
// finds leased by its token (it expired and was claimed elsewhere) is
// marked lost: no check starts on it, and its outcome will be refused by
// the lease guard.
func (s *session) heartbeat(ctx context.Context) {
	p := s.p
	cfg := p.cfg
	t := time.NewTicker(cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.leaseMu.Lock()
		ids := make([]int64, 0, len(s.leases))
		tokens := make([]string, 0, len(s.leases))
		for id, h := range s.leases {
			ids = append(ids, id)
			tokens = append(tokens, h.token)
		}
		s.leaseMu.Unlock()
		for i := 0; i < len(ids); i += cfg.BatchSize {
			j := min(i+cfg.BatchSize, len(ids))
			expires := cfg.Now().Add(cfg.Lease)
			rctx, cancel := context.WithTimeout(ctx, max(cfg.Lease/2, cfg.Heartbeat))
			renewed, err := p.store.Renew(rctx, ids[i:j], tokens[i:j], expires)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					s.dbError("renew leases", err)
				}
				break
			}
			ok := make(map[int64]bool, len(renewed))
			for _, id := range renewed {
				ok[id] = true
			}
			s.leaseMu.Lock()
			for k, id := range ids[i:j] {
				h, held := s.leases[id]
				if !held || h.token != tokens[i+k] {
					continue // written meanwhile
				}
				if ok[id] {
					h.expires = expires
				} else if !h.expires.After(cfg.Now()) {
					h.expires = time.Time{}
				}
				s.leases[id] = h
			}
			s.leaseMu.Unlock()
		}
	}
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
