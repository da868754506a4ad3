package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/urfave/cli/v2"
	"golang.org/x/time/rate"

	"github.com/receiptledger/reconciler/internal/dbclock"
	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// flagDefaults is the protection policy of a dependency when neither the
// flags nor the adapters file say otherwise.
var flagDefaults = protect.DefaultPolicy()

// runFlags are the flags of run.
func runFlags() []cli.Flag {
	return append([]cli.Flag{
		databaseURLFlag(),
		&cli.StringFlag{Name: "adapters", EnvVars: []string{"RECONCILER_ADAPTERS"},
			Usage: "adapters file (YAML); required unless --no-adapters"},
		&cli.BoolFlag{Name: "no-adapters", EnvVars: []string{"RECONCILER_NO_ADAPTERS"},
			Usage: "run without adapters: every receipt that needs a readback goes to manual_review (without --adapters, or with a file that declares none)"},
		&cli.BoolFlag{Name: "once", EnvVars: []string{"RECONCILER_ONCE"},
			Usage: "drain what is due now, print a summary and exit (for cron)"},
		&cli.StringFlag{Name: "instance", EnvVars: []string{"RECONCILER_INSTANCE"},
			Usage: "this instance's name; its actor is reconciler:<instance> (default <hostname>-<pid>)"},
		&cli.IntFlag{Name: "workers", Value: 32, EnvVars: []string{"RECONCILER_WORKERS"},
			Usage: "concurrent readback checks"},
		&cli.IntFlag{Name: "batch-size", Value: 512, EnvVars: []string{"RECONCILER_BATCH_SIZE"},
			Usage: "rows per claim and per settle statement"},
		&cli.DurationFlag{Name: "lease", Value: reconcile.DefaultLease, EnvVars: []string{"RECONCILER_LEASE"},
			Usage: "how long a claim holds a row; a crashed instance's rows are reclaimed after it"},
		&cli.DurationFlag{Name: "check-timeout", Value: 30 * time.Second, EnvVars: []string{"RECONCILER_CHECK_TIMEOUT"},
			Usage: "timeout of one readback call"},
		&cli.DurationFlag{Name: "poll-interval", Value: 5 * time.Second, EnvVars: []string{"RECONCILER_POLL_INTERVAL"},
			Usage: "fallback wake-up when no NOTIFY arrives; orphan sweep cadence"},
		&cli.DurationFlag{Name: "orphan-timeout", Value: 5 * time.Minute, EnvVars: []string{"RECONCILER_ORPHAN_TIMEOUT"},
			Usage: "a submitted receipt with no transition for longer is moved to outcome_unknown (negative: never)"},
		&cli.DurationFlag{Name: "stale-planned-after", Value: time.Hour, EnvVars: []string{"RECONCILER_STALE_PLANNED_AFTER"},
			Usage: "planned receipts older than this are counted as stale (never touched)"},
		&cli.DurationFlag{Name: "grace-period", Value: 20 * time.Second, EnvVars: []string{"RECONCILER_GRACE_PERIOD"},
			Usage: "on SIGTERM/SIGINT, how long in-flight checks may finish before their rows are released"},
		&cli.IntFlag{Name: "breaker-failures", Value: flagDefaults.Breaker.FailureThreshold, EnvVars: []string{"RECONCILER_BREAKER_FAILURES"},
			Usage: "consecutive transient readback failures that also open a dependency's circuit breaker (0: off; the breaker opens on its failure rate); a default the adapters file overrides per dependency"},
		&cli.DurationFlag{Name: "breaker-cooldown", Value: flagDefaults.Breaker.Cooldown, EnvVars: []string{"RECONCILER_BREAKER_COOLDOWN"},
			Usage: "how long an open breaker waits before its single half-open probe; a default the adapters file overrides per dependency"},
		&cli.IntFlag{Name: "dependency-concurrency", Value: flagDefaults.Concurrency.MaxInFlight, EnvVars: []string{"RECONCILER_DEPENDENCY_CONCURRENCY"},
			Usage: "readback calls in flight per dependency; a default the adapters file overrides per dependency"},
		&cli.Float64Flag{Name: "dependency-rate", Value: float64(flagDefaults.Rate.Limit), EnvVars: []string{"RECONCILER_DEPENDENCY_RATE"},
			Usage: "readback calls per second per dependency, Retry-After honoured on top; a default the adapters file overrides per dependency"},
		&cli.IntFlag{Name: "dependency-burst", Value: flagDefaults.Rate.Burst, EnvVars: []string{"RECONCILER_DEPENDENCY_BURST"},
			Usage: "burst above the per-dependency rate; a default the adapters file overrides per dependency"},
		&cli.StringFlag{Name: "metrics-addr", EnvVars: []string{"RECONCILER_METRICS_ADDR"},
			Usage: "serve /metrics, /healthz and /readyz on this address (e.g. :9090); empty: off"},
		&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"RECONCILER_LOG_LEVEL"},
			Usage: "debug, info, warn or error"},
		requireSyncFlag(),
	}, auditFlags()...)
}

func runCommand() *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "settle outcome_unknown receipts: a daemon until SIGTERM, or --once for cron",
		Description: "Claims due receipts in batches, reads each back through its adapter, and " +
			"settles it (succeeded, safe_to_retry, manual_review) with the evidence, or releases it " +
			"until its next check. Exit status is non-zero only when the reconciler could not run.",
		Flags:  runFlags(),
		Action: runAction,
	}
}

func runAction(c *cli.Context) error {
	ctx := c.Context
	if err := checkRunFlags(c); err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
		return cli.Exit(fmt.Sprintf("run: --log-level: %v", err), 2)
	}
	instance := c.String("instance")
	if instance == "" {
		host, _ := os.Hostname()
		if host == "" {
			host = "reconciler"
		}
		instance = host + "-" + strconv.Itoa(os.Getpid())
	}
	// The pool tags its own lines with the instance; everything else here
	// gets it from logger.
	// Log lines are JSON, made safe to show too: they carry outside text.
	base := slog.New(slog.NewJSONHandler(jsonLines{c.App.ErrWriter}, &slog.HandlerOptions{Level: level}))
	logger := base.With("instance", instance)

	// The adapters file is checked before anything connects, so a bad file
	// fails at once; its adapters are built once the database's clock is
	// known, below.
	// A daemon with no adapters sends every receipt to manual_review: it
	// runs so only when asked with --no-adapters, never because the file
	// was forgotten, empty or truncated.
	adaptersPath, noAdapters := c.String("adapters"), c.Bool("no-adapters")
	var deps map[string]readback.DependencyLimits
	if adaptersPath != "" {
		reg, err := httpadapter.LoadFile(adaptersPath, nil)
		if err == nil {
			deps = reg.Dependencies()
		}
		switch {
		case noAdapters && errors.Is(err, readback.ErrNoAdapters):
			adaptersPath = "" // the file agrees: no adapters
		case err != nil:
			return cli.Exit(fmt.Sprintf("run: %v", err), 1)
		case noAdapters:
			return cli.Exit(fmt.Sprintf("run: --no-adapters, but %s declares adapters: drop one or the other", adaptersPath), 2)
		}
	} else if !noAdapters {
		return cli.Exit("run: no --adapters file: pass one, or --no-adapters to run without adapters (every receipt then goes to manual_review)", 2)
	}
	// The protection of each dependency, from the flags and the file's
	// dependencies block, is checked before anything connects too.
	pcfg, err := protectConfig(instance, flagPolicy(c), adaptersPath, deps)
	if err != nil {
		var ce *readback.ConfigError
		if errors.As(err, &ce) {
			return cli.Exit(fmt.Sprintf("run: %v", err), 1) // the adapters file
		}
		return cli.Exit(fmt.Sprintf("run: %v", err), 2) // the flags
	}

	db, err := openLedgerPool(ctx, "run", c.String("database-url"))
	if err != nil {
		return err
	}
	defer db.Close()
	if err := checkLedger(ctx, "run", db, settle); err != nil {
		return err // read-only: a runtime command never creates or migrates the schema
	}

	// One clock (SPEC §5a): every comparison with a stored time, in the
	// pool and in the breaker, uses the database's clock, read here and
	// re-read by the pool every poll interval.
	clock := dbclock.New(db)
	if smp, err := clock.Sync(ctx); err != nil {
		return cli.Exit(fmt.Sprintf("run: database: %v", err), 1)
	} else if smp.Skew > time.Second || smp.Skew < -time.Second {
		logger.Warn("this host's clock differs from the database's by more than a second; "+
			"the reconciler uses the database's clock", "skew_s", smp.Skew.Seconds())
	}

	// The http adapters end their search window at "now": the database's
	// now, not this host's, or a host whose clock runs behind would leave
	// the newest items out of the window and read them as absent.
	reg := readback.NewRegistry()
	if adaptersPath != "" {
		if reg, err = httpadapter.LoadFile(adaptersPath, nil, httpadapter.WithClock(clock.Now)); err != nil {
			return cli.Exit(fmt.Sprintf("run: %v", err), 1)
		}
	} else {
		logger.Warn("running with no adapters (--no-adapters): every receipt that needs a readback goes to manual_review as adapter-less")
	}

	promReg := prometheus.NewRegistry()
	promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := reconcile.NewMetrics(promReg)
	// What a commit means and whether this process can write the ledger,
	// logged now and re-read in the background for /readyz and metrics.
	health := newLedgerHealth(db, promReg, logger, c.Bool("require-synchronous-standby"))
	health.check(ctx)
	go health.run(ctx)
	cfg := reconcile.Config{
		Instance:          instance,
		Clock:             clock,
		Registry:          reg,
		Logger:            base,
		Metrics:           metrics,
		Workers:           c.Int("workers"),
		BatchSize:         c.Int("batch-size"),
		Lease:             c.Duration("lease"),
		CheckTimeout:      c.Duration("check-timeout"),
		PollInterval:      c.Duration("poll-interval"),
		OrphanTimeout:     c.Duration("orphan-timeout"),
		StalePlannedAfter: c.Duration("stale-planned-after"),
		GracePeriod:       c.Duration("grace-period"),
		Audits:            auditConfig(c),
	}
	guard, err := protect.New(protect.NewPGStore(db), pcfg, clock, logger)
	if err != nil {
		return cli.Exit(fmt.Sprintf("run: %v", err), 2)
	}
	cfg.Gate = reconcile.ProtectGate(guard)
	pool, err := reconcile.New(db, cfg)
	if err != nil {
		return cli.Exit(fmt.Sprintf("run: %v", err), 2)
	}

	if addr := c.String("metrics-addr"); addr != "" {
		srv, err := serveHTTP(addr, health, promReg, logger, pool.AdapterHealth, pool.WritesRefused)
		if err != nil {
			return cli.Exit(fmt.Sprintf("run: --metrics-addr: %v", err), 1)
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
	}

	// The history partitions are kept ahead by every instance (one leads
	// each round), at once and then each minute.
	defer startPartitionKeeper(ctx, db, promReg, logger, c.Bool("once"))()
	if c.Bool("once") {
		sum, err := pool.Drain(ctx)
		printSummary(c.App.Writer, sum)
		if err != nil {
			return cli.Exit(fmt.Sprintf("run --once: %v", err), 1)
		}
		return nil
	}
	logger.Info("reconciler started", "adapters", len(reg.Bindings()), "workers", cfg.Workers, "batch_size", cfg.BatchSize)
	sum, err := pool.Run(ctx)
	if err != nil {
		return cli.Exit(fmt.Sprintf("run: %v", err), 1)
	}
	logger.Info("reconciler stopped", "claimed", sum.Claimed, "settled", total(sum.Settled), "waiting", sum.Waiting)
	return nil
}

// checkRunFlags refuses, as usage errors naming the flag, the values of
// run's flags that the pool would refuse later with a message naming none
// or, for 0, silently replace with its default.
func checkRunFlags(c *cli.Context) error {
	for _, name := range []string{"workers", "batch-size", "dependency-concurrency", "dependency-burst"} {
		if c.Int(name) < 1 {
			return cli.Exit(fmt.Sprintf("run: --%s must be at least 1, got %d", name, c.Int(name)), 2)
		}
	}
	if c.Int("breaker-failures") < 0 {
		return cli.Exit(fmt.Sprintf("run: --breaker-failures must not be negative (0: off), got %d", c.Int("breaker-failures")), 2)
	}
	if r := c.Float64("dependency-rate"); !(r > 0) {
		return cli.Exit(fmt.Sprintf("run: --dependency-rate must be positive (calls per second), got %v", r), 2)
	}
	for _, name := range []string{"lease", "check-timeout", "poll-interval", "stale-planned-after", "grace-period", "breaker-cooldown"} {
		if c.Duration(name) <= 0 {
			return cli.Exit(fmt.Sprintf("run: --%s must be positive, got %s", name, c.Duration(name)), 2)
		}
	}
	if c.Duration("orphan-timeout") == 0 {
		return cli.Exit("run: --orphan-timeout must not be 0 (a negative value disables the orphan sweep)", 2)
	}
	return nil
}

// flagPolicy is the default protection policy set by the flags.
func flagPolicy(c *cli.Context) protect.Policy {
	p := flagDefaults
	p.Breaker.FailureThreshold = c.Int("breaker-failures")
	p.Breaker.Cooldown = c.Duration("breaker-cooldown")
	p.Concurrency.MaxInFlight = c.Int("dependency-concurrency")
	p.Rate.Limit = rate.Limit(c.Float64("dependency-rate"))
	p.Rate.Burst = c.Int("dependency-burst")
	return p
}

// protectConfig returns the protection of the readbacks: def (the flags)
// is the policy of every dependency, and each entry of the adapters file's
// dependencies block (read from file) replaces the fields it sets for its
// dependency. An error about an entry is a *readback.ConfigError naming the
// file, line, dependency and field; any other error is about the flags.
func protectConfig(instance string, def protect.Policy, file string, deps map[string]readback.DependencyLimits) (protect.Config, error) {
	cfg := protect.DefaultConfig()
	cfg.Instance = instance
	// A long --breaker-cooldown raises the cap of the grown cool-down
	// rather than being refused for exceeding it.
	def.Breaker.MaxCooldown = max(def.Breaker.MaxCooldown, def.Breaker.Cooldown)
	cfg.Default = def
	if err := def.Validate(); err != nil {
		return protect.Config{}, fmt.Errorf("protection flags: %w", err)
	}
	names := make([]string, 0, len(deps))
	for name := range deps {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		l := deps[name]
		p, field, err := applyLimits(def, l)
		if err == nil {
			if verr := p.Validate(); verr != nil { // a backstop: applyLimits names the fields
				err = fmt.Errorf("with the flag defaults: %w", verr)
			}
		}
		if err != nil {
			return protect.Config{}, &readback.ConfigError{File: file, Line: l.Line, Dependency: name, Field: field, Err: err}
		}
		if cfg.Dependencies == nil {
			cfg.Dependencies = map[string]protect.Policy{}
		}
		cfg.Dependencies[name] = p
	}
	return cfg, nil
}

// applyLimits returns def with the fields l sets replaced. Values left
// unset follow the ones set where they must (the cool-down cap rises to the
// cool-down, the degraded concurrency falls to the concurrency, the
// degraded exit rate is half the enter rate), and a value set that
// contradicts a default is refused, naming its field.
func applyLimits(def protect.Policy, l readback.DependencyLimits) (protect.Policy, string, error) {
	p := def
	if l.Concurrency != nil {
		p.Concurrency.MaxInFlight = *l.Concurrency
	}
	if l.Rate != nil {
		p.Rate.Limit = rate.Limit(*l.Rate)
		if math.IsInf(*l.Rate, 1) {
			p.Rate.Limit = rate.Inf // no limit; rate.Inf is MaxFloat64, not +Inf
		}
	}
	if l.Burst != nil {
		p.Rate.Burst = *l.Burst
	}
	if l.BreakerFailures != nil {
		p.Breaker.FailureThreshold = *l.BreakerFailures
	}
	if l.BreakerCooldown != nil {
		p.Breaker.Cooldown = *l.BreakerCooldown
	}
	if l.BreakerWindow != nil {
		p.Breaker.Window = *l.BreakerWindow
	}
	if l.BreakerMinCalls != nil {
		p.Breaker.MinCalls = *l.BreakerMinCalls
	}
	if l.BreakerRate != nil {
		p.Breaker.FailureRate = *l.BreakerRate
	}
	if l.BreakerMaxCooldown != nil {
		p.Breaker.MaxCooldown = *l.BreakerMaxCooldown
		if p.Breaker.MaxCooldown < p.Breaker.Cooldown {
			return p, "breaker.max_cooldown", fmt.Errorf("must be at least the cooldown (%s, from --breaker-cooldown)", p.Breaker.Cooldown)
		}
	} else {
		p.Breaker.MaxCooldown = max(p.Breaker.MaxCooldown, p.Breaker.Cooldown)
	}
	if l.RetryRatio != nil {
		p.RetryBudget.Ratio = *l.RetryRatio
	}
	if l.RetryMin != nil {
		p.RetryBudget.MinRetries = *l.RetryMin
	}
	if l.DegradedEnter != nil {
		p.Degraded.EnterRate = *l.DegradedEnter
		if l.DegradedExit == nil {
			p.Degraded.ExitRate = *l.DegradedEnter / 2
		}
	}
	if l.DegradedExit != nil {
		p.Degraded.ExitRate = *l.DegradedExit
		if p.Degraded.ExitRate > p.Degraded.EnterRate {
			return p, "degraded.exit", fmt.Errorf("must not exceed degraded.enter (%v by default)", p.Degraded.EnterRate)
		}
	}
	if l.DegradedDecrease != nil {
		p.Degraded.Decrease = *l.DegradedDecrease
	}
	if l.DegradedIncrease != nil {
		p.Degraded.Increase = *l.DegradedIncrease
	}
	if l.DegradedConcurrency != nil {
		p.Degraded.MaxInFlight = *l.DegradedConcurrency
		if p.Degraded.MaxInFlight > p.Concurrency.MaxInFlight {
			return p, "degraded.concurrency", fmt.Errorf("must not exceed concurrency (%d, from --dependency-concurrency)", p.Concurrency.MaxInFlight)
		}
	} else {
		p.Degraded.MaxInFlight = min(p.Degraded.MaxInFlight, p.Concurrency.MaxInFlight)
	}
	return p, "", nil
}

// printDependencyLimits writes the protection each dependency read by an
// adapter of reg gets from `reconciler run` with its default flags, for
// `adapters check`. It fails like run would on limits that contradict
// those defaults.
func printDependencyLimits(w io.Writer, file string, reg *readback.Registry) error {
	deps := reg.Dependencies()
	cfg, err := protectConfig("", flagDefaults, file, deps)
	if err != nil {
		return fmt.Errorf("%w (with run's default protection flags)", err)
	}
	names := map[string]bool{}
	for _, b := range reg.Bindings() {
		if b.Kind != readback.Blind {
			names[b.Dependency] = true // a blind adapter makes no calls
		}
	}
	for name := range deps {
		names[name] = true
	}
	if len(names) == 0 {
		return nil
	}
	sorted := make([]string, 0, len(names))
	for name := range names {
		sorted = append(sorted, name)
	}
	sort.Strings(sorted)
	fmt.Fprintln(w, "\nprotection of each dependency (run's flags apply where the file sets nothing):")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DEPENDENCY\tCONCURRENCY\tRATE\tBURST\tBREAKER\tRETRY BUDGET\tDEGRADED\tFROM")
	for _, name := range sorted {
		p, from := cfg.Default, "flags"
		if dp, ok := cfg.Dependencies[name]; ok {
			p, from = dp, "file+flags"
		}
		r, burst := fmt.Sprintf("%g/s", float64(p.Rate.Limit)), strconv.Itoa(p.Rate.Burst)
		if p.Rate.Limit == rate.Inf {
			r, burst = "unlimited", "-"
		}
		breaker := fmt.Sprintf("%g%% of %d+ calls per %s", p.Breaker.FailureRate*100, p.Breaker.MinCalls, p.Breaker.Window)
		if p.Breaker.FailureThreshold > 0 {
			breaker += fmt.Sprintf(" or %d in a row", p.Breaker.FailureThreshold)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s, %s cooldown (max %s)\t%g%%, min %d per %s\tat %g%% (exit %g%%), %d in flight\t%s\n",
			name, p.Concurrency.MaxInFlight, r, burst,
			breaker, p.Breaker.Cooldown, p.Breaker.MaxCooldown,
			p.RetryBudget.Ratio*100, p.RetryBudget.MinRetries, p.RetryBudget.Window,
			p.Degraded.EnterRate*100, p.Degraded.ExitRate*100, p.Degraded.MaxInFlight, from)
	}
	return tw.Flush()
}

func total(m map[statemachine.State]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// printSummary writes a --once summary, one name=value per line.
func printSummary(w io.Writer, s reconcile.Summary) {
	fmt.Fprintf(w, "claimed=%d\n", s.Claimed)
	for _, st := range []statemachine.State{statemachine.Succeeded, statemachine.SafeToRetry, statemachine.ManualReview} {
		fmt.Fprintf(w, "settled_%s=%d\n", st, s.Settled[st])
	}
	reasons := make([]string, 0, len(s.Reasons))
	for r := range s.Reasons {
		reasons = append(reasons, r)
	}
	sort.Strings(reasons)
	for _, r := range reasons {
		fmt.Fprintf(w, "reason_%s=%d\n", r, s.Reasons[r])
	}
	fmt.Fprintf(w, "still_waiting=%d\n", s.Waiting)
	fmt.Fprintf(w, "deferred=%d\n", s.Deferred)
	fmt.Fprintf(w, "orphans=%d\n", s.Orphans)
	fmt.Fprintf(w, "duplicates=%d\n", s.Duplicates)
	fmt.Fprintf(w, "lifetime_exceeded=%d\n", s.LifetimeExceeded)
	fmt.Fprintf(w, "check_errors=%d\n", s.CheckErrors)
	fmt.Fprintf(w, "lease_lost=%d\n", s.LeaseLost)
	fmt.Fprintf(w, "refused=%d\n", s.Refused)
	fmt.Fprintf(w, "database_errors=%d\n", s.DBErrors)
}

// readiness is the body of /readyz: "ready" with the adapters whose
// positive control has not passed (their absences settle nothing, so their
// receipts wait), and why. Unhealthy adapters do not make the process
// unready: it still settles what it can prove.
type readiness struct {
	Status string `json:"status"`
	// Durability is what a commit on the ledger's server means.
	Durability *durabilityJSON `json:"durability,omitempty"`
	// UnhealthyAdapters lists the adapters whose control is failing, has
	// not run yet, or has none to run.
	UnhealthyAdapters []reconcile.AdapterHealth `json:"unhealthy_adapters"`
}

// serveHTTP serves /metrics, /healthz (the process is alive) and /readyz
// (from lh's last check: the database answers, this process can write it
// now, its schema is current, and with --require-synchronous-standby a
// synchronous standby confirms commits; and it does not refuse the
// reconciler's writes as such, from refused: a role without a grant; the
// body says what a commit means and lists the adapters whose positive
// control has not passed, from health). health and refused may be nil.
func serveHTTP(addr string, lh *ledgerHealth, reg *prometheus.Registry, logger *slog.Logger,
	health func() []reconcile.AdapterHealth, refused func() error) (*http.Server, error) {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		why, durability := lh.notReady()
		if why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		if refused != nil {
			if err := refused(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		body := readiness{Status: "ready", Durability: durability, UnhealthyAdapters: []reconcile.AdapterHealth{}}
		if health != nil {
			for _, h := range health() {
				if !h.OK {
					body.UnhealthyAdapters = append(body.UnhealthyAdapters, h)
				}
			}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(body)
	})
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("metrics server stopped", "error", err)
		}
	}()
	logger.Info("serving metrics", "addr", l.Addr().String())
	return srv, nil
}
