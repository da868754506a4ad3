package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"
	"golang.org/x/time/rate"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

// sqlBacklogTimes reads, for each receipt of a run, its state and the
// times of its submission and of its settlement event (epoch seconds).
const sqlBacklogTimes = `SELECT r.idempotency_key, r.state, extract(epoch FROM r.submitted_at)::float8,
		extract(epoch FROM e.at)::float8
	FROM reconciler.receipts r
	JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.to_state = r.state
	WHERE r.id = ANY($1)`

func benchBacklogCommand() *cli.Command {
	return &cli.Command{
		Name: "backlog",
		Usage: "drain a backlog of outcome_unknown receipts behind a rate-limited API, reading per receipt " +
			"and in batches, and print drain time, API reads and time to settlement for each",
		Description: "Runs the real reconcile.Pool, with the declarative http adapter and the dependency's " +
			"protection (rate limit --api-rate), against an in-process fake API that knows the truth, " +
			"enforces the same rate limit (429 beyond it) and lists an effect --lag after it happened, in a " +
			"scratch database. A warm-up wave first lets the pool learn the lag and pass its positive control. " +
			"Then agents submit --unknowns receipts as fast as they can, half of which took effect, and once " +
			"all are submitted record every answer lost: the backlog appears at once, and the pool drains it. Strategy per_receipt reads each receipt with a search narrowed to its key (the adapter " +
			"without search.batch); strategy batched declares search.batch, so one list over a time window " +
			"answers many receipts. Per receipt, a large backlog would take hours at a low rate: that " +
			"strategy reads at most --per-receipt-max receipts (unknowns= says how many). Prints one line " +
			"per strategy: drain_s (from the first answer recorded lost to the last settlement), reads (requests to the API, " +
			"throttled ones included), reads_per_receipt, p50_s and p95_s from submission to settlement, " +
			"false (a receipt that took effect settled safe_to_retry, or one that did not settled succeeded) " +
			"and manual (receipts left to manual_review).",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.IntFlag{Name: "unknowns", Value: 10000, Usage: "receipts whose outcome is unknown, half of them present"},
			&cli.Float64Flag{Name: "api-rate", Value: 10, Usage: "the API's read limit, in requests per second"},
			&cli.DurationFlag{Name: "lag", Value: 2 * time.Second, Usage: "how long after it happened an effect is listed"},
			&cli.IntFlag{Name: "per-receipt-max", Value: 200, Usage: "most receipts the per_receipt strategy reads"},
			&cli.StringFlag{Name: "strategies", Value: "per_receipt,batched", Usage: "strategies to run, comma-separated"},
		},
		Action: benchBacklog,
	}
}

// backlogStrategies are the strategies of bench backlog, in output order.
var backlogStrategies = []string{"per_receipt", "batched"}

// backlogResult is one strategy's figures.
type backlogResult struct {
	unknowns                int
	drain, p50, p95         time.Duration
	reads                   int64
	wrong, manual, rejected int
}

func benchBacklog(c *cli.Context) error {
	n, apiRate, lag, perMax := c.Int("unknowns"), c.Float64("api-rate"), c.Duration("lag"), c.Int("per-receipt-max")
	if n < 2 || apiRate <= 0 || lag <= 0 || perMax < 2 {
		return cli.Exit("bench backlog: --unknowns and --per-receipt-max must be at least 2, --api-rate and --lag positive", 2)
	}
	strategies, err := parseList("strategies", c.String("strategies"), func(s string) (string, error) {
		if !slices.Contains(backlogStrategies, s) {
			return "", fmt.Errorf("not one of %s", strings.Join(backlogStrategies, ", "))
		}
		return s, nil
	})
	if err != nil {
		return cli.Exit("bench backlog: "+err.Error(), 2)
	}
	ctx := c.Context
	log := c.App.ErrWriter
	db, agent, closeDB, err := openBenchAgent(ctx, log, c.String("database-url"), 48)
	if err != nil {
		return cli.Exit("bench backlog: "+err.Error(), 1)
	}
	defer closeDB()
	for _, s := range strategies {
		count := n
		if s == "per_receipt" {
			count = min(n, perMax)
		}
		fmt.Fprintf(log, "bench backlog: %s, %d unknowns at %g reads/s, lag %s ...\n", s, count, apiRate, lag)
		r := backlogRun{db: db, agent: agent, strategy: s, lag: lag, rate: apiRate, log: log}
		res, err := r.run(ctx, count)
		if err != nil {
			return cli.Exit(fmt.Sprintf("bench backlog: %s: %v", s, err), 1)
		}
		fmt.Fprintf(c.App.Writer, "strategy=%s unknowns=%d api_rate=%g lag_s=%.3f absence_window_s=%.3f drain_s=%.3f reads=%d "+
			"reads_per_receipt=%.4f p50_s=%.3f p95_s=%.3f p50_x=%.2f p95_x=%.2f false=%d manual=%d throttled=%d\n",
			s, res.unknowns, apiRate, lag.Seconds(), (r.sendDelay() + r.lifetime() + lag).Seconds(), res.drain.Seconds(), res.reads,
			float64(res.reads)/float64(res.unknowns), res.p50.Seconds(), res.p95.Seconds(),
			res.p50.Seconds()/lag.Seconds(), res.p95.Seconds()/lag.Seconds(), res.wrong, res.manual, res.rejected)
	}
	return nil
}

// backlogRun is one strategy's run: its own dependency, API and pool.
type backlogRun struct {
	db       *pgxpool.Pool
	agent    *ledger.Client
	strategy string
	lag      time.Duration
	rate     float64
	log      io.Writer
}

// The run's timing declarations, in sixteenths of the lag: the agents
// write a request within one of submitting it (max_send_delay), the API
// answers within one more (max_request_lifetime), and the declared
// consistency window is the lag, so an absence concludes 1.125 lags after
// submission. An effect happens within a twentieth of the lag.
func (r backlogRun) sendDelay() time.Duration { return max(r.lag/16, time.Millisecond) }
func (r backlogRun) lifetime() time.Duration  { return max(r.lag/16, time.Millisecond) }
func (r backlogRun) effect() time.Duration    { return max(r.lag/20, time.Millisecond) }

// backlogWarmup is the size of the wave that lets the pool learn the lag
// before the measured one.
const backlogWarmup = 20

// adapters returns the run's adapters file: a search narrowed to the
// receipt's key, with search.batch for the batched strategy.
func (r backlogRun) adapters(dep, base string, control time.Time) string {
	batch := ""
	if r.strategy == "batched" {
		batch = "        batch: {max_receipts: 20000}\n"
	}
	return fmt.Sprintf(`version: 1
adapters:
  - name: backlog
    type: http
    kind: create
    dependency: %[1]s
    consistency_window: %[2]s
    max_request_lifetime: %[3]s
    max_checks: 1000
    deadline: 1h
    backoff: {base: %[4]s, cap: %[5]s}
    control:
      idempotency_key: "bootstrap:backlog"
      target: /items
      submitted_at: %[6]s
      operation: items.create
    http:
      base_url: %[7]s
      window_skew: 1s
      timeout: 30s
      search:
        path: /items
        query: {created_after: "{window.start}", key: "{receipt.logical_key}", limit: "100"}
        items: /items
        id: /id
        created_at: /created_at
        pagination: {style: cursor, cursor: /next_cursor, has_more: /has_more, param: cursor, max_pages: 500}
%[8]s      match:
        marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`, dep, r.lag, r.lifetime(), r.lag/2, 4*r.lag, control.UTC().Format(time.RFC3339), base, batch)
}

// run settles a warm-up wave, then n receipts, and measures the second.
func (r backlogRun) run(ctx context.Context, n int) (backlogResult, error) {
	dep := "backlog-" + r.strategy
	api := newBacklogAPI(r.lag, r.rate)
	defer api.srv.Close()
	api.add(backlogItem{id: "control", marker: "bootstrap:backlog", created: time.Now().Add(-time.Minute)})
	reg, err := readback.Load("bench-backlog.yaml", strings.NewReader(r.adapters(dep, api.srv.URL, time.Now().Add(-time.Minute))),
		httpadapter.Types())
	if err != nil {
		return backlogResult{}, err
	}
	pol := protect.DefaultPolicy()
	// One second of burst, as the API allows it: the reads of a check and
	// the positive control it needs right after them both pass.
	pol.Rate.Limit, pol.Rate.Burst = rate.Limit(r.rate), max(1, int(r.rate))
	pol.Concurrency.MaxInFlight = 64
	pcfg := protect.DefaultConfig()
	pcfg.Instance, pcfg.Default = "bench", pol
	guard, err := protect.New(protect.NewMemStore(), pcfg, protect.SystemClock{}, slog.New(slog.DiscardHandler))
	if err != nil {
		return backlogResult{}, err
	}
	pool, err := reconcile.New(r.db, reconcile.Config{
		Instance: "bench-" + r.strategy, Registry: reg, Gate: reconcile.ProtectGate(guard),
		Logger: slog.New(slog.DiscardHandler), BatchSize: 4000, CheckTimeout: 2 * time.Minute,
		PollInterval: 500 * time.Millisecond, GracePeriod: time.Second,
	})
	if err != nil {
		return backlogResult{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, err := pool.Run(runCtx); done <- err }()
	defer func() { stop(); <-done }()

	// The warm-up lets the pool learn the lag and pass its positive
	// control, as a running daemon has.
	ids, _, err := r.submit(ctx, api, dep, "warmup", backlogWarmup)
	if err == nil {
		err = r.waitSettled(ctx, ids, "warmup")
	}
	if err != nil {
		return backlogResult{}, err
	}
	before := api.reads.Load()
	ids, began, err := r.submit(ctx, api, dep, "wave", n)
	if err == nil {
		err = r.waitSettled(ctx, ids, "wave")
	}
	if err != nil {
		return backlogResult{}, err
	}
	res, err := r.measure(ctx, api, ids, began)
	res.reads = api.reads.Load() - before
	res.rejected = int(api.throttled.Load())
	return res, err
}

// submit has agents submit n receipts at once (32 at a time), half of
// which take effect, and then, once all are submitted, record each answer
// lost (outcome_unknown) as fast as they can: the backlog appears at once.
// It returns the receipts' ids and when the first answer was recorded lost.
func (r backlogRun) submit(ctx context.Context, api *backlogAPI, dep, name string, n int) ([]int64, time.Time, error) {
	rcs := make([]*ledger.Receipt, n)
	err := parallel(n, func(i int) error {
		key := fmt.Sprintf("%s-%s-%d", dep, name, i)
		payload, _ := json.Marshal(map[string]any{"title": key})
		rc, err := r.agent.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: key, Operation: "items.create",
			Dependency: dep, Method: "POST", Target: "/items", Payload: payload, MaxSendDelay: r.sendDelay()})
		if err != nil {
			return err
		}
		if i%2 == 0 {
			// The effect happens within the declared bounds of the
			// submission the database recorded, whatever this goroutine's
			// own delays.
			api.add(backlogItem{id: "item-" + key, marker: key,
				created: rc.SubmittedAt.Add(time.Duration(rand.Int64N(int64(r.effect()))))})
		}
		rcs[i] = rc
		return nil
	})
	if err != nil {
		return nil, time.Time{}, err
	}
	ids := make([]int64, n)
	began := time.Now()
	err = parallel(n, func(i int) error {
		rc, err := r.agent.MarkUnknown(ctx, rcs[i], ledger.Detail{Reason: "bench: the answer was lost"})
		if err == nil {
			ids[i] = rc.ID
		}
		return err
	})
	return ids, began, err
}

// parallel runs f for 0..n-1, 32 at a time, and joins their errors.
func parallel(n int, f func(i int) error) error {
	errs := make([]error, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				errs[i] = f(i)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// waitSettled polls until every receipt of ids is settled: a bench may
// wait on a condition this way; it asserts nothing about time.
func (r backlogRun) waitSettled(ctx context.Context, ids []int64, name string) error {
	n := len(ids)
	limit := time.Now().Add(30*time.Minute + 100*r.lag)
	for {
		var settled int
		if err := r.db.QueryRow(ctx, sqlWaveSettled, ids).Scan(&settled); err != nil {
			return err
		}
		if settled == n {
			return nil
		}
		if time.Now().After(limit) {
			return fmt.Errorf("%s: %d of %d receipts settled", name, settled, n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// measure reads the wave's settlements and compares them with the truth;
// the drain is timed from began, when the backlog began to appear.
func (r backlogRun) measure(ctx context.Context, api *backlogAPI, ids []int64, began time.Time) (backlogResult, error) {
	res := backlogResult{unknowns: len(ids)}
	rows, err := r.db.Query(ctx, sqlBacklogTimes, ids)
	if err != nil {
		return res, err
	}
	defer rows.Close()
	var times []time.Duration
	last := 0.0
	for rows.Next() {
		var key, state string
		var sub, at float64
		if err := rows.Scan(&key, &state, &sub, &at); err != nil {
			return res, err
		}
		last = max(last, at)
		times = append(times, time.Duration((at-sub)*float64(time.Second)))
		present := api.has(key)
		switch {
		case state == "manual_review":
			res.manual++
		case present && state != "succeeded", !present && state != "safe_to_retry":
			res.wrong++
		}
	}
	if err := rows.Err(); err != nil {
		return res, err
	}
	if len(times) != len(ids) {
		return res, fmt.Errorf("%d settlement events for %d receipts", len(times), len(ids))
	}
	slices.Sort(times)
	res.p50, res.p95 = times[len(times)/2], times[(len(times)*95+99)/100-1]
	res.drain = time.Duration((last - float64(began.UnixNano())/1e9) * float64(time.Second))
	return res, nil
}

// backlogItem is one resource of backlogAPI.
type backlogItem struct {
	id, marker string
	created    time.Time
}

// backlogAPI is the fake API of bench backlog: GET /items?created_after=
// <RFC 3339>[&key=K]&limit=L[&cursor=C] lists the resources created since
// created_after (carrying marker K, if given) that are visible (lag after
// their creation), oldest first, L to a page, with has_more and a cursor
// naming the last item served (so an item becoming visible behind it is
// not served twice, nor one skipped ahead of it). Beyond the rate limit
// it answers 429 with Retry-After.
type backlogAPI struct {
	srv     *httptest.Server
	lag     time.Duration
	limiter *rate.Limiter

	mu    sync.Mutex
	items []backlogItem // by creation time
	keys  map[string]bool

	reads, throttled atomic.Int64
}

func newBacklogAPI(lag time.Duration, perSecond float64) *backlogAPI {
	a := &backlogAPI{lag: lag, limiter: rate.NewLimiter(rate.Limit(perSecond), max(1, int(perSecond))),
		keys: map[string]bool{}}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	return a
}

// add records an effect: it happened at it.created.
func (a *backlogAPI) add(it backlogItem) {
	a.mu.Lock()
	defer a.mu.Unlock()
	i, _ := slices.BinarySearchFunc(a.items, it, func(x, y backlogItem) int {
		if c := x.created.Compare(y.created); c != 0 {
			return c
		}
		return strings.Compare(x.id, y.id)
	})
	a.items = slices.Insert(a.items, i, it)
	a.keys[it.marker] = true
}

// has reports whether the receipt keyed key took effect.
func (a *backlogAPI) has(key string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.keys[key]
}

func (a *backlogAPI) serve(w http.ResponseWriter, r *http.Request) {
	a.reads.Add(1)
	if !a.limiter.Allow() {
		a.throttled.Add(1)
		w.Header().Set("Retry-After", "1")
		http.Error(w, `{"error":"rate limited"}`, http.StatusTooManyRequests)
		return
	}
	q := r.URL.Query()
	after, err := time.Parse(time.RFC3339, q.Get("created_after"))
	limit, lerr := strconv.Atoi(q.Get("limit"))
	if err != nil || lerr != nil || limit < 1 {
		http.Error(w, `{"error":"bad request"}`, http.StatusBadRequest)
		return
	}
	var cursor backlogItem
	if c := q.Get("cursor"); c != "" {
		ns, id, _ := strings.Cut(c, "/")
		n, _ := strconv.ParseInt(ns, 10, 64)
		cursor = backlogItem{id: id, created: time.Unix(0, n)}
	}
	visible := time.Now().Add(-a.lag)
	a.mu.Lock()
	var page []map[string]any
	more := false
	for _, it := range a.items {
		if it.created.Before(after) || it.created.After(visible) || (q.Has("key") && it.marker != q.Get("key")) {
			continue
		}
		if c := q.Get("cursor"); c != "" && (it.created.Before(cursor.created) ||
			(it.created.Equal(cursor.created) && it.id <= cursor.id)) {
			continue
		}
		if len(page) == limit {
			more = true
			break
		}
		cursor = it
		page = append(page, map[string]any{"id": it.id, "created_at": it.created.UTC().Format(time.RFC3339Nano),
			"metadata": map[string]any{"idempotency_key": it.marker}})
	}
	a.mu.Unlock()
	body := map[string]any{"items": append([]map[string]any{}, page...), "has_more": more}
	if more {
		body["next_cursor"] = fmt.Sprintf("%d/%s", cursor.created.UnixNano(), cursor.id)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(body)
}
