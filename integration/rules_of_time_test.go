package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// Issue 19, item 1 (SPEC §5a, "late answers void the window"): an answer of
// any kind to the original request recorded after the receipt's absence
// window (send deadline + max_request_lifetime + consistency_window) shows
// the request outlived its declared lifetime. The reconciler never settles
// such a receipt safe_to_retry from a later absence: it goes to
// manual_review, reason lifetime_exceeded; a positive proof (the agent's
// 2xx) still settles it succeeded. Either way the dependency raises the
// alarm: an ERROR log, reconciler_lifetime_exceeded_total, and a row of
// reconciler.lifetime_alarms (what `reconciler stats` counts). An answer
// recorded inside the window changes nothing: the absence settles.
func TestLateAnswerAfterWindowVoidsIt(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	p := shortPolicy() // the window closes 5 s (send) + 6 s + 4 s after submission
	cases := []struct {
		name    string
		outcome string
		status  any    // the late outcome's HTTP status (nil: none, a reset)
		after   string // the late outcome's time, after submitted_at
		want    string // the settlement: state/reason
		alarm   bool
	}{
		{"504 from a proxy after the window", "outcome_unknown", 504, "1 hour", "manual_review/lifetime_exceeded", true},
		{"reset after the window", "outcome_unknown", nil, "16 seconds", "manual_review/lifetime_exceeded", true},
		{"500 after the window", "outcome_unknown", 500, "2 minutes", "manual_review/lifetime_exceeded", true},
		{"4xx after the window", "rejected", 409, "1 hour", "manual_review/lifetime_exceeded", true},
		{"2xx after the window", "succeeded", 201, "1 hour", "succeeded/agent_response", true},
		{"504 inside the window", "outcome_unknown", 504, "10 seconds", "safe_to_retry/absent_after_window", false},
	}
	ids := seed(t, db, len(cases), "things.create", "fake-api", "outcome_unknown")
	for i, c := range cases {
		// Written as the table's owner, with the time it names: the
		// agent's reconciler.record_late_outcome stamps its own clock.
		if _, err := db.Exec(ctx, `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome, http_status, at)
			SELECT id, 'agent:test', $2, $3, submitted_at + $4::interval FROM reconciler.receipts WHERE id = $1`,
			ids[i], c.outcome, c.status, c.after); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(2 * time.Hour) // every read begins long after every window
	var logs bytes.Buffer
	m := reconcile.NewMetrics(prometheus.NewRegistry())
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now, OrphanTimeout: -1,
		Metrics: m, Logger: slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelError}))})
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	alarms := 0
	for i, c := range cases {
		ev := settlements(t, db, ids[i])
		if len(ev) != 1 {
			t.Fatalf("%s: settlements %v, want one", c.name, ev)
		}
		if got := receipt(t, db, ids[i]).State + "/" + ev[0]["reason"].(string); got != c.want {
			t.Errorf("%s: settled %s, want %s", c.name, got, c.want)
		}
		lx, _ := ev[0]["evidence"].(map[string]any)["lifetime_exceeded"].(map[string]any)
		if (lx != nil) != c.alarm {
			t.Errorf("%s: evidence lifetime_exceeded = %v, want it set: %v", c.name, lx, c.alarm)
		}
		var rows int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.lifetime_alarms WHERE receipt_id = $1`,
			ids[i]).Scan(&rows); err != nil {
			t.Fatal(err)
		}
		if (rows == 1) != c.alarm || rows > 1 {
			t.Errorf("%s: %d rows in reconciler.lifetime_alarms, want an alarm: %v", c.name, rows, c.alarm)
		}
		if c.alarm {
			alarms++
			if !strings.Contains(logs.String(), `"receipt_id":`+jsonNumber(ids[i])) {
				t.Errorf("%s: no ERROR log names receipt %d:\n%s", c.name, ids[i], logs.String())
			}
		}
	}
	var metric dto.Metric
	if err := m.LifetimeExceeded.WithLabelValues("fake-api", "things.create").Write(&metric); err != nil {
		t.Fatal(err)
	}
	if got := metric.GetCounter().GetValue(); got != float64(alarms) {
		t.Errorf("reconciler_lifetime_exceeded_total{fake-api, things.create} = %v, want %d", got, alarms)
	}
	if sum.LifetimeExceeded != alarms {
		t.Errorf("summary lifetime_exceeded = %d, want %d", sum.LifetimeExceeded, alarms)
	}
	store, err := reconcile.NewStore(db, "stats")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := store.LifetimeAlarms(ctx); err != nil || len(got) != 1 || got[0].Dependency != "fake-api" ||
		got[0].Count != int64(alarms) {
		t.Errorf("Store.LifetimeAlarms (stats) = %+v, %v; want %d for fake-api", got, err, alarms)
	}
}

// The database holds the rule for any client that settles: a move
// reconciling -> safe_to_retry whose receipt has a late outcome after the
// window its evidence declares is refused (RL002, DETAIL
// lifetime_exceeded), and with no declaration the strictest window (the
// send deadline alone) applies; the same move to manual_review keeps the
// alarm. A late outcome recorded after a settlement that declared its
// window (reconciler.record_late_outcome) keeps the alarm at once.
func TestSettlementRefusedAfterLateAnswer(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 3, "things.create", "late-api", "outcome_unknown")
	// The fourth receipt's send deadline is a microsecond after its
	// submission, so a late answer recorded statements later is after the
	// window its settlement declares (0 s and 0 s).
	var quick int64
	if err := db.QueryRow(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
		target, fingerprint, intent, state_actor, max_send_delay)
		VALUES ('late-api:quick', 'things.create', 'late-api', 'POST', '/things',
		        'sha256:' || encode(sha256('late-api:quick'::bytea), 'hex'), '{}', 'agent:test', interval '1 microsecond')
		RETURNING id`).Scan(&quick); err != nil {
		t.Fatal(err)
	}
	for _, to := range []string{"submitted", "outcome_unknown"} {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $2, state_actor = 'agent:test' WHERE id = $1`,
			quick, to); err != nil {
			t.Fatal(err)
		}
	}
	ids = append(ids, quick)
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'reconciling', state_actor = 'reconciler:test'
		WHERE id = ANY($1)`, ids); err != nil {
		t.Fatal(err)
	}
	late := func(id int64, after string) {
		t.Helper()
		if _, err := db.Exec(ctx, `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome, http_status, at)
			SELECT id, 'agent:test', 'outcome_unknown', 504, submitted_at + $2::interval
			FROM reconciler.receipts WHERE id = $1`, id, after); err != nil {
			t.Fatal(err)
		}
	}
	settle := func(id int64, to, evidence string) error {
		_, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $2, state_actor = 'reconciler:test',
			state_detail = jsonb_build_object('evidence', $3::jsonb) WHERE id = $1`, id, to, evidence)
		return err
	}
	declared := `{"max_request_lifetime_s": 60, "consistency_window_s": 30}`
	late(ids[0], "2 minutes") // after 5 s + 60 s + 30 s
	late(ids[1], "1 minute")  // inside it
	late(ids[2], "6 seconds") // after the send deadline: past a window nobody declared
	for _, c := range []struct {
		id       int64
		evidence string
		refused  bool
	}{{ids[0], declared, true}, {ids[1], declared, false}, {ids[2], `{}`, true}} {
		err := settle(c.id, "safe_to_retry", c.evidence)
		pe := pgErr(err)
		if c.refused != (err != nil) || c.refused && (pe == nil || pe.Code != "RL002" || pe.Detail != "lifetime_exceeded") {
			t.Errorf("receipt %d -> safe_to_retry with evidence %s: %v, want refused: %v (RL002 lifetime_exceeded)",
				c.id, c.evidence, err, c.refused)
		}
	}
	if err := settle(ids[0], "manual_review", declared); err != nil {
		t.Fatal(err)
	}
	// Settled safe_to_retry on a declared window; the late answer comes after.
	if err := settle(ids[3], "safe_to_retry", `{"max_request_lifetime_s": 0, "consistency_window_s": 0}`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:test', 'outcome_unknown', 502)`, ids[3]); err != nil {
		t.Fatal(err)
	}
	rows, err := db.Query(ctx, `SELECT receipt_id FROM reconciler.lifetime_alarms ORDER BY receipt_id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if want := []int64{ids[0], ids[3]}; len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("lifetime_alarms for receipts %v, want %v (the manual_review settlement, the late answer after safe_to_retry)", got, want)
	}
	// The late answer voided the absence ids[3] was settled on: it is
	// back with the reconciler (migration 00023), where the duplicate
	// guard holds its intent again.
	var state, reason string
	if err := db.QueryRow(ctx, `SELECT state, state_detail ->> 'reason' FROM reconciler.receipts WHERE id = $1`,
		ids[3]).Scan(&state, &reason); err != nil || state != "outcome_unknown" || reason != "late_answer" {
		t.Errorf("after a late answer past its window, safe_to_retry receipt %d is %s (%s, %v), want outcome_unknown (late_answer)",
			ids[3], state, reason, err)
	}
}

// Migration 00023: a late answer that voids a safe_to_retry (any answer
// after the window the settlement declared) reopens the receipt only while
// no retry of it went out; a late answer inside the declared window that is
// not a success (a straggler the API's native key deduplicates) changes
// nothing. Either way the outcome is recorded.
func TestLateAnswerReopensOnlyWhatItVoids(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	// Send deadlines a microsecond after submission: a window of 0 s has
	// closed by the time a late answer is recorded.
	rows, err := db.Query(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
		target, fingerprint, intent, state_actor, max_send_delay)
		SELECT 'late-api:' || g, 'things.create', 'late-api', 'POST', '/things',
		       'sha256:' || encode(sha256(('late-api:' || g)::bytea), 'hex'), '{}', 'agent:test', interval '1 microsecond'
		FROM generate_series(1, 3) g RETURNING id`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	for _, to := range []string{"submitted", "outcome_unknown"} {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $2, state_actor = 'agent:test' WHERE id = ANY($1)`,
			ids, to); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range []struct {
		window    int
		guarantee string
	}{{0, "request_lifetime_elapsed"}, {3600, "native_idempotency_key"}, {0, "request_lifetime_elapsed"}} {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'reconciling', state_actor = 'reconciler:test'
			WHERE id = $1`, ids[i]); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'safe_to_retry', state_actor = 'reconciler:test',
			state_detail = jsonb_build_object('evidence', jsonb_build_object('max_request_lifetime_s', $2::int,
				'consistency_window_s', 0, 'guarantee', $3::text))
			WHERE id = $1`, ids[i], c.window, c.guarantee); err != nil {
			t.Fatal(err)
		}
	}
	// ids[2]'s retry went out already.
	if _, err := db.Exec(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target,
		fingerprint, intent, state_actor, retry_of, attempt, state)
		SELECT idempotency_key || '#2', operation, dependency, method, target, fingerprint, intent, 'agent:test',
		       id, 2, 'submitted' FROM reconciler.receipts WHERE id = $1`, ids[2]); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id   int64
		want string
		why  string
	}{
		{ids[0], "outcome_unknown", "a 504 after the declared window"},
		{ids[1], "safe_to_retry", "a 504 inside the declared window"},
		{ids[2], "safe_to_retry", "a 504 after the window, but the retry is out"},
	} {
		if _, err := db.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:test', 'outcome_unknown', 504)`, c.id); err != nil {
			t.Fatalf("%s: %v", c.why, err)
		}
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.late_outcomes WHERE receipt_id = $1`, c.id).Scan(&n); err != nil || n != 1 {
			t.Errorf("%s: %d late outcomes recorded (%v), want 1", c.why, n, err)
		}
		if got := receipt(t, db, c.id).State; got != c.want {
			t.Errorf("%s: receipt %d is %s, want %s", c.why, c.id, got, c.want)
		}
	}
}

// Migration 00023, end to end: the reconciler proves an absence on the
// API's native key and settles safe_to_retry; then the original's 201
// arrives after all and the agent records it. The effect exists: a
// re-planned duplicate of the intent under a new key is refused
// (ErrDuplicateIntent carrying the receipt), where before it was sent, and
// the reconciler settles the receipt succeeded with the late answer's id.
func TestLateSuccessAfterSafeToRetryBlocksTheDuplicate(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:late")
	if err != nil {
		t.Fatal(err)
	}
	in := ledger.Intent{IdempotencyKey: "late:1", Operation: "things.create", Dependency: "fake-api",
		Method: "POST", Target: "/things", Payload: []byte(`{"n": 1}`), MaxSendDelay: time.Millisecond}
	r, err := agent.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	clk := testkit.NewClock(r.SubmittedAt.Add(500 * time.Millisecond))
	api := newFakeAPI(t, clk.Now, 0)
	p := readback.Policy{ConsistencyWindow: 0, MaxRequestLifetime: time.Hour, IdempotencyKeys: true,
		IdempotencyRetention: 24 * time.Hour, MaxChecks: 50, Deadline: 3 * time.Hour,
		BackoffBase: 100 * time.Millisecond, BackoffCap: time.Second}
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now, OrphanTimeout: -1})
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, r.ID).State; got != "safe_to_retry" {
		t.Fatalf("first settlement: %s, want safe_to_retry (an absence on the native key)", got)
	}
	if err := agent.RecordLateOutcome(ctx, r.ID, ledger.OutcomeSucceeded, http.StatusCreated, "thing-late", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	again := in
	again.IdempotencyKey = "late:2"
	_, err = agent.Plan(ctx, again)
	var dup *ledger.DuplicateError
	if !errors.As(err, &dup) || dup.Existing.ID != r.ID {
		t.Fatalf("re-plan of the intent after its late 201: %v, want ErrDuplicateIntent carrying receipt %d", err, r.ID)
	}
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if got := receipt(t, db, r.ID); got.State != "succeeded" || got.ExternalID != "thing-late" {
		t.Fatalf("after the late 201 the receipt settled %s (external id %q), want succeeded (thing-late)", got.State, got.ExternalID)
	}
}

// pgErr returns err's *pgconn.PgError, nil if it has none.
func pgErr(err error) *pgconn.PgError {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe
	}
	return nil
}

func jsonNumber(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// Issue 19, item 2, end to end: the reconciler settles an absence on the
// API's native key (guarantee native_idempotency_key), whose retention runs
// out before the step runs again. Caller.Do then sends nothing: the
// database refuses the retry (ErrKeyRetentionPassed), and Do sends the
// receipt back to the reconciler for a fresh proof. The reconciler reads it
// again, now past the full window, and settles it safe_to_retry on
// request_lifetime_elapsed; the step run again sends the retry, whose
// history says which guarantee it used.
func TestFreshProofAfterNativeKeyRetention(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:native")
	if err != nil {
		t.Fatal(err)
	}
	var sent atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id": "thing-retry"}`))
	}))
	t.Cleanup(srv.Close)
	in := ledger.Intent{IdempotencyKey: "native:1", Operation: "things.create", Dependency: "fake-api",
		Method: "POST", Target: "/things", Payload: []byte(`{"n": 1}`), MaxSendDelay: time.Millisecond}
	r, err := agent.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	// The read begins after the key's consistency window (0 s after the
	// send deadline) and within its retention (1 s), long before the full
	// window (1 h).
	clk := testkit.NewClock(r.SubmittedAt.Add(500 * time.Millisecond))
	api := newFakeAPI(t, clk.Now, 0)
	p := readback.Policy{ConsistencyWindow: 0, MaxRequestLifetime: time.Hour, IdempotencyKeys: true,
		IdempotencyRetention: time.Second, MaxChecks: 50, Deadline: 3 * time.Hour,
		BackoffBase: 100 * time.Millisecond, BackoffCap: time.Second}
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now, OrphanTimeout: -1})
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	ev := settlements(t, db, r.ID)
	if got := ev[len(ev)-1]["evidence"].(map[string]any)["guarantee"]; got != "native_idempotency_key" {
		t.Fatalf("first settlement: %v, want guarantee native_idempotency_key", ev)
	}
	do := func() (*ledger.Result, error) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/things", strings.NewReader(`{"n": 1}`))
		if err != nil {
			t.Fatal(err)
		}
		return (&ledger.Caller{Ledger: agent, HTTP: srv.Client()}).Do(ctx, in, req)
	}
	// The step runs again, its retry with the default send deadline (5 s):
	// its request could be written after the key's retention (1 s).
	in.MaxSendDelay = 0
	if _, err := do(); !errors.Is(err, ledger.ErrKeyRetentionPassed) || !errors.Is(err, ledger.ErrRetryRefused) || sent.Load() != 0 {
		t.Fatalf("Do after the retention: %v (%d requests), want ErrKeyRetentionPassed and nothing sent", err, sent.Load())
	}
	if got := receipt(t, db, r.ID); got.State != "outcome_unknown" {
		t.Fatalf("after the refused retry the receipt is %s, want outcome_unknown (a fresh proof requested)", got.State)
	}
	clk.Advance(2 * time.Hour)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	ev = settlements(t, db, r.ID)
	if got := ev[len(ev)-1]["evidence"].(map[string]any)["guarantee"]; receipt(t, db, r.ID).State != "safe_to_retry" ||
		got != "request_lifetime_elapsed" {
		t.Fatalf("fresh proof: %v, want safe_to_retry on request_lifetime_elapsed", ev[len(ev)-1])
	}
	res, err := do()
	if err != nil || sent.Load() != 1 || res.Receipt.RetryOf != r.ID {
		t.Fatalf("Do after the fresh proof: %v (%d requests), want the retry sent", err, sent.Load())
	}
	var basis string
	if err := db.QueryRow(ctx, `SELECT detail #>> '{retry_basis,guarantee}' FROM reconciler.receipt_events
		WHERE receipt_id = $1 AND to_state = 'submitted'`, res.Receipt.ID).Scan(&basis); err != nil || basis != "request_lifetime_elapsed" {
		t.Fatalf("the retry's submission records guarantee %q (%v), want request_lifetime_elapsed", basis, err)
	}
}
