package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// The bench's reads of the outcome: which of a wave's receipts are
// settled, and for each the time from submission to its settlement event.
const (
	sqlWaveSettled = `SELECT count(*) FROM reconciler.receipts
		WHERE id = ANY($1) AND state IN ('succeeded', 'safe_to_retry', 'manual_review')`
	sqlWaveTimes = `SELECT extract(epoch FROM e.at - r.submitted_at)::float8, r.state
		FROM reconciler.receipts r
		JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.to_state = r.state
		WHERE r.id = ANY($1)`
)

// consistencySchedules are the schedules compared, in output order.
// "default" is the daemon's own (reconcile.Config's when Schedule is nil).
var consistencySchedules = []string{"default", "full-jitter", "exponential", "fixed", "fixed-quarter-lag"}

func benchConsistencyCommand() *cli.Command {
	return &cli.Command{
		Name: "consistency",
		Usage: "time from submission to settlement, and reads per receipt, for each check schedule " +
			"and visibility lag",
		Description: "For each schedule and lag, runs the real reconcile.Pool against an in-process fake " +
			"API whose effects become visible to reads a fixed lag after the call, in a scratch " +
			"database. Each wave submits --receipts receipts at once, records each effect, marks each " +
			"outcome_unknown (the answer was lost) and waits until the pool settled them all. Prints one " +
			"line per (schedule, lag): median and p95 from submission to settlement (seconds and " +
			"multiples of the lag) and readback calls per receipt, of the last wave; cold_* are the " +
			"first wave's, before a learning schedule has seen anything. Schedules: default (the " +
			"daemon's: the learned visibility lag), full-jitter (the previous default, rand(0, " +
			"min(cap, base·2^n))), exponential (min(cap, base·2^n), no jitter), fixed (every backoff " +
			"base) and fixed-quarter-lag (every lag/4: fixed polling as fast as the learned schedule).",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.StringFlag{Name: "lags", Value: "500ms,2s,8s", Usage: "visibility lags, comma-separated"},
			&cli.IntFlag{Name: "receipts", Value: 100, Usage: "receipts reconciled at once, per wave"},
			&cli.IntFlag{Name: "waves", Value: 2, Usage: "waves per schedule and lag (the last is reported)"},
			&cli.StringFlag{Name: "schedules", Value: strings.Join(consistencySchedules, ","),
				Usage: "schedules to compare, comma-separated"},
			&cli.Float64Flag{Name: "scale", Value: 1, Usage: "multiplies the policy's durations (backoff " +
				"base 1s and cap 5m, consistency window 30s, request lifetime 60s) and the poll interval, " +
				"so that short --lags run as the real ones would"},
		},
		Action: benchConsistency,
	}
}

// waveResult is one wave's figures.
type waveResult struct {
	median, p95 time.Duration
	reads       float64
	// unsettled counts receipts that did not settle succeeded.
	unsettled int
}

func benchConsistency(c *cli.Context) error {
	lags, err := parseList("lags", c.String("lags"), positiveDuration)
	if err != nil {
		return cli.Exit("bench consistency: "+err.Error(), 2)
	}
	scheds, err := parseList("schedules", c.String("schedules"), func(s string) (string, error) {
		if !slices.Contains(consistencySchedules, s) {
			return "", fmt.Errorf("not one of %s", strings.Join(consistencySchedules, ", "))
		}
		return s, nil
	})
	if err != nil {
		return cli.Exit("bench consistency: "+err.Error(), 2)
	}
	receipts, waves, scale := c.Int("receipts"), c.Int("waves"), c.Float64("scale")
	if receipts < 1 || waves < 1 || scale <= 0 {
		return cli.Exit("bench consistency: --receipts and --waves must be at least 1, --scale positive", 2)
	}
	ctx := c.Context
	log := c.App.ErrWriter
	db, agent, closeDB, err := openBenchAgent(ctx, log, c.String("database-url"), 48)
	if err != nil {
		return cli.Exit("bench consistency: "+err.Error(), 1)
	}
	defer closeDB()
	r := consistencyRunner{db: db, agent: agent, scale: scale, receipts: receipts, log: log}
	for _, lag := range lags {
		for _, name := range scheds {
			fmt.Fprintf(log, "bench consistency: %s, lag %s, %d waves of %d ...\n", name, lag, waves, receipts)
			res, err := r.run(ctx, name, lag, waves)
			if err != nil {
				return cli.Exit(fmt.Sprintf("bench consistency: %s, lag %s: %v", name, lag, err), 1)
			}
			cold, last := res[0], res[len(res)-1]
			x := func(d time.Duration) float64 { return d.Seconds() / lag.Seconds() }
			fmt.Fprintf(c.App.Writer, "bench=consistency schedule=%s lag_s=%.3f receipts=%d median_s=%.3f p95_s=%.3f "+
				"median_x=%.2f p95_x=%.2f reads_per_receipt=%.2f cold_median_x=%.2f cold_p95_x=%.2f "+
				"cold_reads_per_receipt=%.2f unsettled=%d\n",
				name, lag.Seconds(), receipts, last.median.Seconds(), last.p95.Seconds(),
				x(last.median), x(last.p95), last.reads, x(cold.median), x(cold.p95), cold.reads,
				last.unsettled+cold.unsettled)
		}
	}
	return nil
}

// consistencyRunner runs the waves of one bench consistency.
type consistencyRunner struct {
	db       *pgxpool.Pool
	agent    *ledger.Client
	scale    float64
	receipts int
	log      io.Writer
}

func (r consistencyRunner) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * r.scale)
}

// schedule returns the named schedule for lag; nil is the pool's default.
func (r consistencyRunner) schedule(name string, lag time.Duration) reconcile.Schedule {
	switch name {
	case "full-jitter":
		return reconcile.PolicyJitter{}
	case "exponential":
		return reconcile.Exponential{}
	case "fixed":
		return reconcile.Fixed{Interval: r.scaled(time.Second)}
	case "fixed-quarter-lag":
		return reconcile.Fixed{Interval: lag / 4}
	}
	return nil
}

// run measures waves of receipts of a dependency of their own, read back by
// a fake API with lag, and settled by one pool with the named schedule.
func (r consistencyRunner) run(ctx context.Context, name string, lag time.Duration, waves int) ([]waveResult, error) {
	dep := fmt.Sprintf("bench-%s-%dms", name, lag.Milliseconds())
	policy := readback.DefaultPolicy()
	policy.ConsistencyWindow = r.scaled(policy.ConsistencyWindow)
	policy.MaxRequestLifetime = r.scaled(policy.MaxRequestLifetime)
	policy.BackoffBase = r.scaled(policy.BackoffBase)
	policy.BackoffCap = r.scaled(policy.BackoffCap)
	// Only the schedule may end a wave: no bound cuts a slow one short.
	policy.MaxChecks, policy.Deadline = 100000, 24*time.Hour
	api := newLagAPI(lag)
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "bench-lag", Kind: readback.Create, Dependency: dep,
		Adapter: api, Policy: policy}); err != nil {
		return nil, err
	}
	pool, err := reconcile.New(r.db, reconcile.Config{
		Instance: "bench", Registry: reg, Schedule: r.schedule(name, lag), Logger: slog.New(slog.DiscardHandler),
		PollInterval: max(r.scaled(time.Second), 50*time.Millisecond), GracePeriod: time.Second,
	})
	if err != nil {
		return nil, err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, err := pool.Run(runCtx); done <- err }()
	defer func() { stop(); <-done }()

	var out []waveResult
	for w := range waves {
		ids, err := r.submit(ctx, api, dep, w)
		if err != nil {
			return nil, err
		}
		if err := r.waitSettled(ctx, ids, lag); err != nil {
			return nil, err
		}
		res, err := r.measure(ctx, ids)
		if err != nil {
			return nil, err
		}
		res.reads = float64(api.readsOf(fmt.Sprintf("%s-w%d-", dep, w))) / float64(len(ids))
		out = append(out, res)
	}
	return out, nil
}

// submit has agents plan, submit and call the fake API for a wave of
// receipts at once, each losing its answer (outcome_unknown), and returns
// their ids.
func (r consistencyRunner) submit(ctx context.Context, api *lagAPI, dep string, wave int) ([]int64, error) {
	ids := make([]int64, r.receipts)
	errs := make([]error, r.receipts)
	var wg sync.WaitGroup
	for i := range r.receipts {
		wg.Go(func() {
			key := fmt.Sprintf("%s-w%d-%d", dep, wave, i)
			payload, _ := json.Marshal(map[string]any{"title": key})
			rc, err := r.agent.Plan(ctx, ledger.Intent{IdempotencyKey: key, Operation: "things.create",
				Dependency: dep, Method: "POST", Target: "/things", Payload: payload})
			if err == nil {
				rc, err = r.agent.Submit(ctx, rc)
			}
			if err == nil {
				api.record(key)
				rc, err = r.agent.MarkUnknown(ctx, rc, ledger.Detail{Reason: "bench: the answer was lost"})
			}
			if err != nil {
				errs[i] = err
				return
			}
			ids[i] = rc.ID
		})
	}
	wg.Wait()
	return ids, errors.Join(errs...)
}

// waitSettled polls until every receipt of ids is settled: a bench may
// wait on a condition this way; it asserts nothing about time.
func (r consistencyRunner) waitSettled(ctx context.Context, ids []int64, lag time.Duration) error {
	limit := time.Now().Add(10*time.Minute + 100*lag)
	for {
		var n int
		if err := r.db.QueryRow(ctx, sqlWaveSettled, ids).Scan(&n); err != nil {
			return err
		}
		if n == len(ids) {
			return nil
		}
		if time.Now().After(limit) {
			return fmt.Errorf("%d of %d receipts settled after %s", n, len(ids), 10*time.Minute+100*lag)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// measure returns the median and p95 time from submission to settlement
// of ids, from their history.
func (r consistencyRunner) measure(ctx context.Context, ids []int64) (waveResult, error) {
	rows, err := r.db.Query(ctx, sqlWaveTimes, ids)
	if err != nil {
		return waveResult{}, err
	}
	defer rows.Close()
	var res waveResult
	var times []time.Duration
	for rows.Next() {
		var sec float64
		var state string
		if err := rows.Scan(&sec, &state); err != nil {
			return waveResult{}, err
		}
		times = append(times, time.Duration(sec*float64(time.Second)))
		if state != "succeeded" {
			res.unsettled++
		}
	}
	if err := rows.Err(); err != nil {
		return waveResult{}, err
	}
	if len(times) != len(ids) {
		return waveResult{}, fmt.Errorf("%d settlement events for %d receipts", len(times), len(ids))
	}
	slices.Sort(times)
	res.median, res.p95 = times[len(times)/2], times[(len(times)*95+99)/100-1]
	return res, nil
}

// lagAPI is the fake API of bench consistency: a created thing becomes
// visible to reads lag after the call that created it. It counts reads by
// idempotency key (the readback load each schedule puts on the API).
type lagAPI struct {
	lag   time.Duration
	mu    sync.Mutex
	made  map[string]time.Time
	reads map[string]int
}

func newLagAPI(lag time.Duration) *lagAPI {
	return &lagAPI{lag: lag, made: map[string]time.Time{}, reads: map[string]int{}}
}

// record is the agent's call: the thing exists from now on.
func (a *lagAPI) record(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.made[key] = time.Now()
}

// Check implements readback.Adapter: present once the lag has passed,
// absent (not authoritatively: the bench's effects all happened) before.
func (a *lagAPI) Check(_ context.Context, r readback.Receipt) (readback.Result, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.reads[r.IdempotencyKey]++
	if at, ok := a.made[r.IdempotencyKey]; ok && time.Since(at) >= a.lag {
		return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"thing-" + r.IdempotencyKey},
			Query: "GET /things?marker=" + r.IdempotencyKey}, nil
	}
	return readback.Result{Verdict: readback.VerdictAbsent, Query: "GET /things?marker=" + r.IdempotencyKey}, nil
}

// readsOf counts the reads of the receipts whose key starts with prefix.
func (a *lagAPI) readsOf(prefix string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for k, v := range a.reads {
		if strings.HasPrefix(k, prefix) {
			n += v
		}
	}
	return n
}
