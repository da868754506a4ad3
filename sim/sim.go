// Package sim is the fault-injection experiment of the article in
// shared/seeds/000 ("Agentes Tolerantes a Fallas"), run through the real
// ledger, the real reconciler and real Postgres: agents answer questions
// with two read tools and record the answer with two writes (a draft, then
// a publish) against an in-process fake API that fails calls per a fault
// profile, and each strategy, the article's patterns and ours, is scored on
// strict success (the right answer and exactly one published record, no
// duplicates, no orphans).
//
// Faults come from per-task random streams (see schedule): the same seed
// injects the same faults whatever the concurrency, in every strategy.
package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/ledger"
)

// The strategies, in the order of the report: the article's rows, then
// ours.
const (
	Baseline           = "baseline"
	Retries            = "retries"
	RetriesIdempotency = "retries+idempotency"
	Timeouts           = "timeouts"
	Breaker            = "breaker"
	Degradation        = "degradation"
	Compensation       = "compensation"
	AllPatterns        = "all-patterns"
	Ledger             = "ledger"
	LedgerReconciler   = "ledger+reconciler"
)

// Strategies lists every strategy, in the order of the report.
var Strategies = []string{Baseline, Retries, RetriesIdempotency, Timeouts, Breaker, Degradation,
	Compensation, AllPatterns, Ledger, LedgerReconciler}

// descriptions say in a line what each strategy does.
var descriptions = map[string]string{
	Baseline:           "each call once, no deadline, a cut answer parsed as it comes",
	Retries:            "up to N attempts per call with full-jitter backoff, answers validated",
	RetriesIdempotency: "retries, with the harness's key in an Idempotency-Key header the API deduplicates",
	Timeouts:           "baseline with a 100 ms deadline per call and 3 s per task",
	Breaker:            "baseline with a breaker per dependency (3 failures in a row open it for 250 ms)",
	Degradation:        "failed reads fall back to a cached snapshot; a failed write ends read-only, answer given",
	Compensation:       "baseline; a failed task deletes its drafts (human-written compensator, 3 tries)",
	AllPatterns:        "all of the above together",
	Ledger:             "reads as retries with deadlines; writes through ledger.Caller, no reconciler: unknowns stay unknown",
	LedgerReconciler:   "as ledger, with reconcile.Pool settling unknowns; agents resend only after safe_to_retry (or not sent), through Caller.Do, until the task's deadline",
}

// ErrInvalidOptions means Options hold a value Run cannot use.
var ErrInvalidOptions = errors.New("invalid simulation options")

// Options configure a Run. Zero fields take the defaults shown.
type Options struct {
	// Tasks is the number of tasks per strategy (default 48).
	Tasks int
	// Profile is the fault profile (default medium).
	Profile Profile
	// Seed seeds every fault stream and the backoff jitter.
	Seed uint64
	// Strategies to run (default all, in the order of Strategies).
	Strategies []string
	// Concurrency is the number of tasks running at once (default 16).
	Concurrency int
	// Attempts bounds the attempts of one call for every strategy that
	// retries (default 6). Through the ledger it bounds the reads; a
	// write is sent again after each proof that the last send took no
	// effect, until the task's deadline.
	Attempts int
	// HangFor is how long a hanging call holds before its 504 (default
	// 300 ms); deadlines cut it at 100 ms.
	HangFor time.Duration
	// Database gives each ledger strategy a migrated database of its own
	// and the function that drops it; see ServerDatabases. Required when
	// a ledger strategy runs.
	Database func(ctx context.Context, strategy string) (db *pgxpool.Pool, drop func(), err error)
	// Progress, when set, is told each time a task of a strategy ends.
	Progress func(strategy string, done, total int)
}

func (o Options) withDefaults() Options {
	if o.Tasks == 0 {
		o.Tasks = 48
	}
	if o.Profile.Name == "" {
		o.Profile, _ = ProfileNamed("medium")
	}
	if len(o.Strategies) == 0 {
		o.Strategies = Strategies
	}
	if o.Concurrency == 0 {
		o.Concurrency = 16
	}
	if o.Attempts == 0 {
		o.Attempts = 6
	}
	if o.HangFor == 0 {
		o.HangFor = 300 * time.Millisecond
	}
	return o
}

func (o Options) validate() error {
	if o.Tasks < 1 || o.Concurrency < 1 || o.Attempts < 1 || o.HangFor < 0 {
		return fmt.Errorf("%w: tasks, concurrency and attempts must be at least 1", ErrInvalidOptions)
	}
	for _, s := range o.Strategies {
		if !slices.Contains(Strategies, s) {
			return fmt.Errorf("%w: unknown strategy %q (one of %v)", ErrInvalidOptions, s, Strategies)
		}
		if (s == Ledger || s == LedgerReconciler) && o.Database == nil {
			return fmt.Errorf("%w: strategy %s needs a Postgres server", ErrInvalidOptions, s)
		}
	}
	return nil
}

// Run runs every strategy of o, one after the other, each against a fresh
// fake API drawing the same faults, and reports what each achieved.
func Run(ctx context.Context, o Options) (*Report, error) {
	o = o.withDefaults()
	if err := o.validate(); err != nil {
		return nil, err
	}
	rep := &Report{Profile: o.Profile.Name, Why: o.Profile.Why, Transient: o.Profile.Transient, Hang: o.Profile.Hang,
		Malformed: o.Profile.Malformed, LagMS: ms(o.Profile.Lag), HangMS: ms(o.HangFor), AmbiguousWindow: AmbiguousWindow,
		Tasks: o.Tasks, Seed: o.Seed, Concurrency: o.Concurrency, Attempts: o.Attempts}
	for _, s := range o.Strategies {
		res, err := runStrategy(ctx, o, s)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s, err)
		}
		rep.Results = append(rep.Results, res)
	}
	return rep, nil
}

// runStrategy runs the tasks of one strategy and audits the API after.
func runStrategy(ctx context.Context, o Options, strategy string) (Result, error) {
	a := newAPI(o.Seed, o.Profile, o.HangFor)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Result{}, err
	}
	srv := &http.Server{Handler: a, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln) //nolint:errcheck // ends with Close below
	defer srv.Close()
	defer a.close()
	base := "http://" + ln.Addr().String()

	ledgered := strategy == Ledger || strategy == LedgerReconciler
	p, ok := articlePatterns[strategy]
	if ledgered {
		p = patterns{retries: true, timeouts: true, validate: true}
	} else if !ok {
		return Result{}, fmt.Errorf("%w: unknown strategy %q", ErrInvalidOptions, strategy)
	}
	ag := newAgent(base, o.Seed, o.Attempts, p)
	run := ag.run
	var stopReconciler func() error
	var audit func(context.Context) (unsettled, held map[int]int, err error)
	if ledgered {
		db, drop, err := o.Database(ctx, strategy)
		if err != nil {
			return Result{}, err
		}
		defer drop()
		client, err := ledger.New(db, "agent:sim")
		if err != nil {
			return Result{}, err
		}
		ag.caller = &ledger.Caller{Ledger: client, HTTP: &http.Client{Timeout: callTimeout,
			Transport: &http.Transport{MaxIdleConnsPerHost: 64}}, ExternalID: externalID}
		run = ag.runLedger
		audit = func(ctx context.Context) (map[int]int, map[int]int, error) { return ledgerState(ctx, db) }
		if strategy == LedgerReconciler {
			ag.settle = true
			if stopReconciler, err = startReconciler(ctx, db, base, o.Profile, o.HangFor); err != nil {
				return Result{}, err
			}
			defer func() {
				if stopReconciler != nil {
					_ = stopReconciler()
				}
			}()
		}
	}

	results := make([]taskResult, o.Tasks)
	var done atomic.Int64
	sem := make(chan struct{}, o.Concurrency)
	var wg sync.WaitGroup
	for i := range o.Tasks {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			start := time.Now()
			results[i] = run(ctx, i)
			results[i].latency = time.Since(start)
			if o.Progress != nil {
				o.Progress(strategy, int(done.Add(1)), o.Tasks)
			}
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	if stopReconciler != nil {
		err := stopReconciler()
		stopReconciler = nil
		if err != nil {
			return Result{}, fmt.Errorf("reconciler: %w", err)
		}
	}
	var unsettled, held map[int]int
	if audit != nil {
		if unsettled, held, err = audit(ctx); err != nil {
			return Result{}, fmt.Errorf("read the ledger: %w", err)
		}
	}
	drafts, posts := a.liveRecords()
	res := score(o.Seed, strategy, results, drafts, posts, unsettled, held)
	res.APICalls, res.ReadbackCalls = a.agentCalls.Load(), a.readbackCalls.Load()
	res.faults = a.sched.faults()
	return res, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
