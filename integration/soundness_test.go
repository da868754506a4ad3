package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// gaugeValue reads a gauge.
func gaugeValue(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// absentAdapter answers an authoritative absence for every receipt except
// the declared control, which it finds.
func absentAdapter(calls *atomic.Int64) readback.Adapter {
	return readback.AdapterFunc(func(_ context.Context, r readback.Receipt) (readback.Result, error) {
		if r.IdempotencyKey == controlMarker {
			return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"c"}, Authoritative: true}, nil
		}
		if calls != nil {
			calls.Add(1)
		}
		return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET /things?marker=" + r.IdempotencyKey}, nil
	})
}

// seedWithSendDelay inserts n outcome_unknown receipts with the given
// max_send_delay.
func seedWithSendDelay(t *testing.T, db *pgxpool.Pool, n int, delay time.Duration) []int64 {
	t.Helper()
	ctx := context.Background()
	tag := fmt.Sprintf("send-%d", time.Now().UnixNano())
	rows, err := db.Query(ctx, `
		INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target,
		                                 fingerprint, intent, state_actor, max_send_delay)
		SELECT $1 || ':' || g, 'things.create', 'skew-api', 'POST', '/things',
		       'sha256:' || encode(sha256(($1 || ':' || g)::bytea), 'hex'), '{}', 'agent:test',
		       $3::bigint * interval '1 microsecond'
		FROM generate_series(1, $2) g RETURNING id`, tag, n, delay.Microseconds())
	if err != nil {
		t.Fatal(err)
	}
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, to := range []string{"submitted", "outcome_unknown"} {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $1, state_actor = 'agent:test' WHERE id = ANY($2)`, to, out); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// Issue 7, path 5 (acceptance 3): a reconciler whose host clock is 5
// minutes ahead of or behind the database's, with a 30 s consistency
// window, settles nothing before the database's time reaches the window,
// and does not sweep live submitted receipts as orphans. It warns about the
// skew (metric and log). With a window short enough to wait for, it settles
// once the database's clock has passed it. The pool runs on its default,
// database-anchored clock; only the host's wall clock is skewed.
func TestSkewedHostClockSettlesOnTheDatabaseClock(t *testing.T) {
	for _, skew := range []time.Duration{5 * time.Minute, -5 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			ctx := context.Background()
			db := pgtest.NewPool(t)
			wall := func() time.Time { return time.Now().Add(skew) }
			var calls atomic.Int64
			long := readback.Policy{ConsistencyWindow: 30 * time.Second, MaxRequestLifetime: time.Second,
				MaxChecks: 50, Deadline: time.Hour, BackoffBase: time.Millisecond, BackoffCap: 2 * time.Millisecond}
			reg := readback.NewRegistry()
			if err := reg.Register(readback.Binding{Name: "skew-search", Kind: readback.Create, Dependency: "skew-api",
				Adapter: absentAdapter(&calls), Policy: long, Control: fakeControl()}); err != nil {
				t.Fatal(err)
			}
			unknown := seedWithSendDelay(t, db, 3, time.Second)
			live := seed(t, db, 2, "things.create", "skew-api", "submitted")
			reg2 := prometheus.NewRegistry()
			metrics := reconcile.NewMetrics(reg2)
			logs := &adLogs{}
			pool := newPool(t, db, reconcile.Config{Registry: reg, WallClock: wall, Metrics: metrics,
				Logger: slog.New(slog.NewJSONHandler(logs, nil)), OrphanTimeout: time.Minute})
			sum, err := pool.Drain(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if calls.Load() == 0 {
				t.Fatal("no check was made: the test proves nothing")
			}
			if sum.Settled[statemachine.SafeToRetry] != 0 || countWhere(t, db, "state = 'safe_to_retry'") != 0 {
				t.Fatalf("settled safe_to_retry before the database's clock reached the window: %+v", sum)
			}
			if n := countWhere(t, db, "state = 'submitted'"); n != len(live) || sum.Orphans != 0 {
				t.Fatalf("live submitted receipts swept as orphans: %d left submitted, %d orphans", n, sum.Orphans)
			}
			if got := gaugeValue(t, metrics.ClockSkew); got < skew.Seconds()-1 || got > skew.Seconds()+1 {
				t.Fatalf("reconciler_clock_skew_seconds = %v, want about %v", got, skew.Seconds())
			}
			if !strings.Contains(logs.String(), "clock differs from the database") {
				t.Fatalf("no skew warning in the logs: %s", logs.String())
			}

			// A window short enough to wait for: wait until the database's
			// clock is past it (send deadline + lifetime + window), then drain.
			short := readback.Policy{ConsistencyWindow: 200 * time.Millisecond, MaxRequestLifetime: 100 * time.Millisecond,
				MaxChecks: 50, Deadline: time.Hour, BackoffBase: time.Millisecond, BackoffCap: 2 * time.Millisecond}
			regShort := readback.NewRegistry()
			if err := regShort.Register(readback.Binding{Name: "skew-search", Kind: readback.Create, Dependency: "skew-api",
				Adapter: absentAdapter(nil), Policy: short, Control: fakeControl()}); err != nil {
				t.Fatal(err)
			}
			quick := seedWithSendDelay(t, db, 2, 100*time.Millisecond)
			poolShort := newPool(t, db, reconcile.Config{Registry: regShort, WallClock: wall, OrphanTimeout: -1})
			if _, err := poolShort.Drain(ctx); err != nil {
				t.Fatal(err)
			}
			// Issue 7, path 5: nothing before the database's time reaches the
			// window (the drain ran well inside it: 400 ms after submission).
			if n := countWhere(t, db, fmt.Sprintf("id = ANY('{%d,%d}') AND state = 'safe_to_retry' AND submitted_at + interval '400 ms' > clock_timestamp()", quick[0], quick[1])); n != 0 {
				t.Fatalf("%d settled before the window", n)
			}
			waitFor(t, 10*time.Second, "the database's clock to pass the window", func() (bool, string) {
				n := countWhere(t, db, fmt.Sprintf("id = ANY('{%d,%d}') AND submitted_at + interval '400 ms' < clock_timestamp()", quick[0], quick[1]))
				return n == 2, fmt.Sprintf("%d of 2", n)
			})
			waitFor(t, 10*time.Second, "the receipts to come due", func() (bool, string) {
				if _, err := poolShort.Drain(ctx); err != nil {
					t.Fatal(err)
				}
				n := countWhere(t, db, fmt.Sprintf("id = ANY('{%d,%d}') AND state = 'safe_to_retry'", quick[0], quick[1]))
				return n == 2, fmt.Sprintf("%d of 2 safe_to_retry", n)
			})
			for _, id := range quick {
				ev := settlements(t, db, id)
				evidence := ev[len(ev)-1]["evidence"].(map[string]any)
				var readAt, safeAt time.Time
				_ = readAt.UnmarshalText([]byte(evidence["read_at"].(string)))
				_ = safeAt.UnmarshalText([]byte(evidence["absence_safe_at"].(string)))
				if readAt.Before(safeAt) {
					t.Fatalf("receipt %d: read at %v, before the window's end %v", id, readAt, safeAt)
				}
			}
			if n := countWhere(t, db, fmt.Sprintf("id = ANY('{%d,%d,%d}') AND state = 'safe_to_retry'", unknown[0], unknown[1], unknown[2])); n != 0 {
				t.Fatalf("%d receipts with the 30 s window settled", n)
			}
		})
	}
}

// blockingAdapter answers an authoritative absence, but blocks its first
// call until released; the declared control is found at once.
type blockingAdapter struct {
	started chan struct{}
	release chan struct{}
	once    sync.Once
}

func (a *blockingAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	if r.IdempotencyKey == controlMarker {
		return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"c"}, Authoritative: true}, nil
	}
	first := false
	a.once.Do(func() { first = true })
	if first {
		close(a.started)
		select {
		case <-a.release:
		case <-ctx.Done():
			return readback.Result{}, ctx.Err()
		}
	}
	return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, nil
}

// Issue 7, path 2: a read that begins at window−1 s and answers at
// window+1 s does not settle safe_to_retry: absence is judged at the moment
// the read began. The next read, begun after the window, does.
func TestAbsenceIsJudgedWhenTheReadBegan(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	id := seed(t, db, 1, "things.create", "slow-api", "outcome_unknown")[0]
	var sendDeadline time.Time
	if err := db.QueryRow(ctx, `SELECT submitted_at + max_send_delay FROM reconciler.receipts WHERE id = $1`, id).Scan(&sendDeadline); err != nil {
		t.Fatal(err)
	}
	p := shortPolicy() // lifetime 6 s + window 4 s
	window := sendDeadline.Add(p.MaxRequestLifetime + p.ConsistencyWindow)
	clk := newClock()
	clk.Advance(window.Add(-time.Second).Sub(clk.Now()))
	a := &blockingAdapter{started: make(chan struct{}), release: make(chan struct{})}
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "slow", Kind: readback.Create, Dependency: "slow-api",
		Adapter: a, Policy: p, Control: fakeControl()}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	done := make(chan error, 1)
	go func() {
		_, err := pool.Drain(ctx)
		done <- err
	}()
	<-a.started
	clk.Advance(2 * time.Second) // the answer arrives at window+1 s
	close(a.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, id); got.State != "reconciling" {
		t.Fatalf("a read begun before the window settled the receipt: %+v", got)
	}
	var at time.Time
	if err := db.QueryRow(ctx, `SELECT at FROM reconciler.readback_checks WHERE receipt_id = $1`, id).Scan(&at); err != nil {
		t.Fatal(err)
	}
	if want := window.Add(-time.Second); at.Sub(want) > time.Microsecond || want.Sub(at) > time.Microsecond {
		t.Fatalf("check recorded at %v, want the read's start %v", at, want)
	}
	// The next read begins after the window: now the absence proves it.
	clk.Advance(time.Minute)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, id); got.State != "safe_to_retry" {
		t.Fatalf("a read begun after the window: %+v, want safe_to_retry", got)
	}
}

// Issue 7, path 10: in a long drain (slow checks, small batches), rows
// claimed late still get a full lease from their claim, so every claimed
// row is checked: claimed == checked.
func TestLongDrainLeasesRunFromTheClaim(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 8, "things.create", "slow-api", "outcome_unknown")
	clk := newClock()
	clk.Advance(time.Second)
	var checked atomic.Int64
	slow := readback.AdapterFunc(func(context.Context, readback.Receipt) (readback.Result, error) {
		checked.Add(1)
		clk.Advance(3 * time.Second) // each check takes 3 s of the lease
		return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"x"}, Authoritative: true}, nil
	})
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "slow", Kind: readback.Create, Dependency: "slow-api",
		Adapter: slow, Policy: shortPolicy()}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1,
		Workers: 1, BatchSize: 2, MaxInFlight: 2, Lease: 10 * time.Second, CheckTimeout: 5 * time.Second})
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Claimed != len(ids) || int(checked.Load()) != sum.Claimed || sum.Settled[statemachine.Succeeded] != len(ids) {
		t.Fatalf("claimed %d, checked %d, settled %v; want all %d checked and settled", sum.Claimed, checked.Load(), sum.Settled, len(ids))
	}
}

// Issue 7, suspicion "a requeued receipt keeps its check count and deadline
// and goes straight back to manual_review": a receipt that hit the check
// bound, requeued by a human, gets a fresh budget.
func TestRequeuedReceiptGetsAFreshBudget(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	id := seed(t, db, 1, "things.create", "unsure-api", "outcome_unknown")[0]
	clk := newClock()
	clk.Advance(time.Second)
	p := shortPolicy()
	p.MaxChecks = 2
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "unsure", Kind: readback.Create, Dependency: "unsure-api", Policy: p,
		Adapter: readback.AdapterFunc(func(context.Context, readback.Receipt) (readback.Result, error) {
			return readback.Result{Verdict: readback.VerdictInconclusive}, nil
		})}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	for range 2 {
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Minute)
	}
	if got := receipt(t, db, id); got.State != "manual_review" || got.Checks != 2 {
		t.Fatalf("after the bound: %+v, want manual_review after 2 checks", got)
	}
	if _, err := db.Exec(ctx, `SELECT reconciler.transition($1, 'outcome_unknown', 'human:alice',
		'{"reason": "requeue: the API had an outage"}')`, id); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, id); got.State != "reconciling" || got.Checks != 1 {
		t.Fatalf("requeued receipt: %+v, want reconciling after its first new check", got)
	}
}

// Issue 7, "a misconfigured adapter must not produce proof" (acceptance 4):
// an adapter whose path, filter or marker is wrong answers "absent" for
// everything, its declared control or a receipt known to exist included.
// It settles nothing safe_to_retry, is reported unhealthy (metric, log,
// AdapterHealth), and its receipts wait; the correct adapter settles as
// before, with a declared control or one drawn from the ledger.
func TestPositiveControl(t *testing.T) {
	type misconfig func(a searchAdapter) readback.Adapter
	wrongMarker := func(a searchAdapter) readback.Adapter {
		return readback.AdapterFunc(func(ctx context.Context, r readback.Receipt) (readback.Result, error) {
			r.IdempotencyKey = "order-" + r.IdempotencyKey // a marker the agent never wrote
			return a.Check(ctx, r)
		})
	}
	empty := emptyListServer(t)
	wrongServer := func(searchAdapter) readback.Adapter {
		return searchAdapter{base: empty.URL, client: empty.Client()} // an empty list for everything
	}
	tests := []struct {
		name     string
		adapter  misconfig
		declared bool
		healthy  bool
	}{
		{"correct, declared control", nil, true, true},
		{"correct, control from the ledger", nil, false, true},
		{"wrong marker, declared control", wrongMarker, true, false},
		{"wrong server, declared control", wrongServer, true, false},
		{"wrong marker, control from the ledger", wrongMarker, false, false},
		{"no control at all", nil, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			db := pgtest.NewPool(t)
			clk := newClock()
			api := newFakeAPI(t, clk.Now, 0)
			ids := seed(t, db, 3, "things.create", "fake-api", "outcome_unknown")
			if !tt.declared && tt.name != "no control at all" {
				// A receipt the agent saw succeed (its 2xx), whose effect exists.
				ctl := seed(t, db, 1, "things.create", "fake-api", "submitted")[0]
				if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'agent:test',
					external_id = 'thing-ctl', state_detail = '{"evidence": {"source": "http_response", "http_status": 201}}'
					WHERE id = $1`, ctl); err != nil {
					t.Fatal(err)
				}
				api.Create(idempotencyKey(t, db, ctl), "thing-ctl")
			}
			var a readback.Adapter = searchAdapter{base: api.srv.URL, client: api.srv.Client()}
			if tt.adapter != nil {
				a = tt.adapter(searchAdapter{base: api.srv.URL, client: api.srv.Client()})
			}
			b := readback.Binding{Name: "fake-search", Kind: readback.Create, Dependency: "fake-api", Adapter: a, Policy: shortPolicy()}
			if tt.declared {
				b.Control = fakeControl()
			}
			reg := readback.NewRegistry()
			if err := reg.Register(b); err != nil {
				t.Fatal(err)
			}
			metrics := reconcile.NewMetrics(prometheus.NewRegistry())
			logs := &adLogs{}
			pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, Metrics: metrics, OrphanTimeout: -1,
				Logger: slog.New(slog.NewJSONHandler(logs, nil))})
			clk.Advance(time.Minute) // well after the window
			for range 3 {
				if _, err := pool.Drain(ctx); err != nil {
					t.Fatal(err)
				}
				clk.Advance(time.Minute)
			}
			settled := countWhere(t, db, fmt.Sprintf("id IN (%d, %d, %d) AND state = 'safe_to_retry'", ids[0], ids[1], ids[2]))
			health := pool.AdapterHealth()
			ok := gaugeValue(t, metrics.ControlOK.WithLabelValues("fake-search", "things.create", "present"))
			if tt.healthy {
				if settled != 3 || len(health) != 1 || !health[0].OK || ok != 1 {
					t.Fatalf("correct adapter: %d safe_to_retry, health %+v, metric %v; want 3, OK, 1", settled, health, ok)
				}
				ev := settlements(t, db, ids[0])
				if c, _ := ev[0]["evidence"].(map[string]any)["positive_control"].(string); c == "" {
					t.Fatalf("the settlement does not name its control: %v", ev[0])
				}
				return
			}
			if settled != 0 {
				t.Fatalf("a misconfigured adapter settled %d receipts safe_to_retry", settled)
			}
			if n := countWhere(t, db, fmt.Sprintf("id IN (%d, %d, %d) AND state = 'reconciling'", ids[0], ids[1], ids[2])); n != 3 {
				t.Fatalf("%d of 3 receipts wait for their next check", n)
			}
			if len(health) != 1 || health[0].OK || health[0].Reason == "" || ok != 0 {
				t.Fatalf("misconfigured adapter reported %+v, metric %v; want unhealthy with a reason", health, ok)
			}
			if !strings.Contains(logs.String(), "positive control failed") {
				t.Fatalf("no log line says why: %s", logs.String())
			}
			var held int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks
				WHERE receipt_id = $1 AND evidence ->> 'absence_not_authoritative' LIKE 'positive control not passed%'`, ids[0]).Scan(&held); err != nil || held == 0 {
				t.Fatalf("no check record says the absence was held back (%v)", err)
			}
		})
	}
}

// emptyListServer answers every search with an empty list: the wrong
// server, like the rest preset pointed elsewhere.
func emptyListServer(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"ids": []string{}})
	}))
	t.Cleanup(srv.Close)
	return srv
}

// Issue 7, suspicion "the orphan sweep moving a receipt while its agent is
// between submitted and the response": the agent's late 2xx, recorded with
// reconciler.record_late_outcome, settles the receipt succeeded with its
// external id without reading the API back; a late outcome of another kind
// goes into the evidence.
func TestLateOutcomes(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	ids := seed(t, db, 2, "things.create", "fake-api", "outcome_unknown")
	late, other := ids[0], ids[1]
	if _, err := db.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:test', 'succeeded', 201, 'thing-late',
		'{"source": "http_response"}')`, late); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:test', 'outcome_unknown', NULL, NULL,
		'{"error": "connection reset"}')`, other); err != nil {
		t.Fatal(err)
	}
	api.Create(idempotencyKey(t, db, other), "thing-other")
	clk.Advance(time.Second)
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: clk.Now, OrphanTimeout: -1})
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, late); got.State != "succeeded" || got.ExternalID != "thing-late" {
		t.Fatalf("late succeeded: %+v, want succeeded with thing-late", got)
	}
	ev := settlements(t, db, late)
	if len(ev) != 1 || ev[0]["reason"] != reconcile.ReasonAgentResponse ||
		ev[0]["evidence"].(map[string]any)["source"] != "agent_response" {
		t.Fatalf("late succeeded settlement: %v", ev)
	}
	if n := checkCount(t, db, late); n != 0 {
		t.Fatalf("%d readback checks for a receipt the agent's answer settled", n)
	}
	if got := receipt(t, db, other); got.State != "succeeded" || got.ExternalID != "thing-other" {
		t.Fatalf("other: %+v", got)
	}
	ev = settlements(t, db, other)
	lo, _ := ev[0]["evidence"].(map[string]any)["late_outcomes"].([]any)
	if len(lo) != 1 || lo[0].(map[string]any)["outcome"] != "outcome_unknown" {
		t.Fatalf("the late outcome is not in the evidence: %v", ev[0])
	}
}

// claimSeeded seeds n outcome_unknown receipts of fake-api and claims them
// all through a store of instance, a second ahead of now: it returns their
// ids, the store, the claimed rows and the claim's time.
func claimSeeded(t *testing.T, db *pgxpool.Pool, n int, instance string) ([]int64, *reconcile.Store, []reconcile.Claimed, time.Time) {
	t.Helper()
	ids := seed(t, db, n, "things.create", "fake-api", "outcome_unknown")
	store, err := reconcile.NewStore(db, instance)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().Add(time.Second)
	claimed, err := store.Claim(context.Background(), now, 10, time.Minute)
	if err != nil || len(claimed) != n {
		t.Fatalf("claimed %d, %v", len(claimed), err)
	}
	return ids, store, claimed, now
}

// Issue 7, suspicion "a retried Complete after an ambiguous commit inserts
// check rows twice and reuses check_no": confirmed (Complete run twice
// recorded the check twice and reported the row lost). CompleteAgain, which
// the pool uses for every retry, records each check once and reports the
// rows the first attempt applied as applied.
func TestRetriedCompleteIsIdempotent(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids, store, claimed, now := claimSeeded(t, db, 2, "retry-test")
	check := func(id int64) *reconcile.CheckRecord {
		return &reconcile.CheckRecord{CheckNo: 1, At: now, Adapter: "a", Dependency: "fake-api", Verdict: "present", Latency: time.Millisecond}
	}
	outs := []reconcile.Outcome{
		{ID: claimed[0].ID, Lease: claimed[0].Lease, To: statemachine.Succeeded, ExternalID: "x", Check: check(claimed[0].ID),
			Detail: reconcile.Detail{Reason: reconcile.ReasonPresent}},
		{ID: claimed[1].ID, Lease: claimed[1].Lease, To: statemachine.Reconciling, NextCheck: now.Add(time.Minute), Check: check(claimed[1].ID)},
	}
	applied, err := store.Complete(ctx, outs)
	if err != nil || len(applied) != 2 {
		t.Fatalf("first attempt: %v, %v", applied, err)
	}
	// The commit went through but its answer was lost: the pool retries.
	again, err := store.CompleteAgain(ctx, outs)
	if err != nil {
		t.Fatal(err)
	}
	if len(again) != 2 {
		t.Fatalf("retry reports %v applied, want both rows (the first attempt committed)", again)
	}
	for _, id := range ids {
		if n := checkCount(t, db, id); n != 1 {
			t.Fatalf("receipt %d: %d check rows, want 1", id, n)
		}
	}
	if ev := settlements(t, db, claimed[0].ID); len(ev) != 1 {
		t.Fatalf("settlement events: %v", ev)
	}
}

// The pool records each check as its adapter answers (RecordChecks) and
// repeats a record whose commit is unknown with RecordChecksAgain; the
// settlement then counts the check without writing it again. A repeat that
// wrote the check twice, or a Complete that did, would leave two records of
// one read in the audit trail.
func TestRetriedRecordChecksIsIdempotent(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids, store, claimed, now := claimSeeded(t, db, 2, "record-test")
	checks := make([]reconcile.ReceiptCheck, len(claimed))
	outs := make([]reconcile.Outcome, len(claimed))
	for i, c := range claimed {
		rec := &reconcile.CheckRecord{CheckNo: 1, At: now, Adapter: "a", Dependency: "fake-api", Verdict: "absent", Latency: time.Millisecond}
		checks[i] = reconcile.ReceiptCheck{ReceiptID: c.ID, Check: rec}
		outs[i] = reconcile.Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.Reconciling, NextCheck: now.Add(time.Minute), Check: rec}
	}
	if err := store.RecordChecks(ctx, checks); err != nil {
		t.Fatal(err)
	}
	// The commit went through but its answer was lost: the pool repeats it.
	if err := store.RecordChecksAgain(ctx, checks); err != nil {
		t.Fatal(err)
	}
	for _, c := range checks {
		if !c.Check.Recorded {
			t.Fatalf("receipt %d: check not marked recorded", c.ReceiptID)
		}
	}
	if applied, err := store.Complete(ctx, outs); err != nil || len(applied) != 2 {
		t.Fatalf("complete: %v, %v", applied, err)
	}
	for _, id := range ids {
		if n := checkCount(t, db, id); n != 1 {
			t.Fatalf("receipt %d: %d check rows, want 1", id, n)
		}
		var counted int
		if err := db.QueryRow(ctx, `SELECT check_count FROM reconciler.receipts WHERE id = $1`, id).Scan(&counted); err != nil {
			t.Fatal(err)
		}
		if counted != 1 {
			t.Fatalf("receipt %d: check_count %d, want the recorded check counted once", id, counted)
		}
	}
}

// A recorder write whose commit outcome is still unknown when the grace
// period ends leaves its checks unconfirmed (Recorded false), though they
// may have committed: the settlement writes them with its outcome, and must
// not write one that is there already (a review leftover: the plain
// Complete inserted such a check a second time).
func TestUnconfirmedCheckIsNotRecordedTwice(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids, store, claimed, now := claimSeeded(t, db, 1, "unconfirmed-test")
	rec := &reconcile.CheckRecord{CheckNo: 1, At: now, Adapter: "a", Dependency: "fake-api", Verdict: "present", Latency: time.Millisecond}
	if err := store.RecordChecks(ctx, []reconcile.ReceiptCheck{{ReceiptID: claimed[0].ID, Check: rec}}); err != nil {
		t.Fatal(err)
	}
	// The write committed, but its answer never came: the pool gave up on
	// it at the end of the grace period, so the check is unconfirmed.
	rec.Recorded = false
	out := reconcile.Outcome{ID: claimed[0].ID, Lease: claimed[0].Lease, To: statemachine.Succeeded, ExternalID: "x",
		Check: rec, Detail: reconcile.Detail{Reason: reconcile.ReasonPresent}}
	if applied, err := store.Complete(ctx, []reconcile.Outcome{out}); err != nil || len(applied) != 1 {
		t.Fatalf("complete: %v, %v", applied, err)
	}
	if n := checkCount(t, db, ids[0]); n != 1 {
		t.Fatalf("%d check rows for one read, want 1", n)
	}
}

// Issue 7, suspicion "the sweep has no statement timeout, so a hung
// connection stops all claiming": confirmed (a lock held on the receipts
// table kept the sweep, and the claim loop behind it, waiting for as long as
// it was held). The sweep is now bounded: it fails within its timeout.
func TestOrphanSweepIsBounded(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	seed(t, db, 1, "things.create", "fake-api", "submitted")
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE reconciler.receipts IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Now: newClock().Now, OrphanTimeout: time.Millisecond, SweepTimeout: 300 * time.Millisecond})
	done := make(chan error, 1)
	go func() {
		_, err := pool.Drain(ctx)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "orphan sweep") {
			t.Fatalf("drain under a held lock: %v, want the sweep's timeout", err)
		}
		var pgErr interface{ SQLState() string }
		if errors.As(err, &pgErr) && pgErr.SQLState() != "55P03" && pgErr.SQLState() != "57014" {
			t.Fatalf("unexpected error %v", err)
		}
	case <-time.After(20 * time.Second):
		_ = tx.Rollback(ctx)
		t.Fatal("the sweep waited on the lock: claiming would stop as long as it is held")
	}
}

// A ledger control vouches for receipts submitted at or after it; a receipt
// submitted before the control that passed draws an older control (here
// the fallback, the oldest after it) and has it run at once, in the same
// pass. It used to wait for Config.ControlRetry while its checks ran on,
// and a tight check budget sent a receipt whose effect was absent to
// manual_review (seen in the demo).
func TestOlderReceiptRunsItsControlAtOnce(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	older := seed(t, db, 1, "things.create", "fake-api", "submitted")[0]
	ctl := seed(t, db, 1, "things.create", "fake-api", "submitted")[0]
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'agent:test',
		external_id = 'thing-ctl', state_detail = '{"evidence": {"source": "http_response", "http_status": 201}}'
		WHERE id = $1`, ctl); err != nil {
		t.Fatal(err)
	}
	api.Create(idempotencyKey(t, db, ctl), "thing-ctl")
	newer := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	// The older receipt becomes unknown last, so it is claimed (and
	// checked, with one worker) after the newer one has run the control.
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'outcome_unknown', state_actor = 'agent:test'
		WHERE id = $1`, older); err != nil {
		t.Fatal(err)
	}
	p := shortPolicy()
	p.MaxChecks = 2
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "fake-search", Kind: readback.Create, Dependency: "fake-api",
		Adapter: searchAdapter{base: api.srv.URL, client: api.srv.Client()}, Policy: p}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, Workers: 1, OrphanTimeout: -1})
	clk.Advance(time.Minute) // well after the window; less than nothing between the two checks
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range []int64{newer, older} {
		if got := receipt(t, db, id); got.State != "safe_to_retry" {
			t.Errorf("receipt %d: %s after one pass, want safe_to_retry (its control runs at once)", id, got.State)
		}
	}
}
