package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// drainUntil advances clk by step and drains pool until done says so, or
// fails after rounds.
func drainUntil(t *testing.T, pool *reconcile.Pool, clk *clock, step time.Duration, rounds int, done func() bool) {
	t.Helper()
	for i := 0; !done(); i++ {
		if i > rounds {
			t.Fatalf("not done after %d rounds", rounds)
		}
		clk.Advance(step)
		if _, err := pool.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// Acceptance (b): the API held the request past its declared lifetime, so
// its effect landed after the receipt settled safe_to_retry. The audit
// read finds it: a contradicted audit with the evidence of both reads, a
// false_absence window alarm that widens the window, and the receipt,
// still safe_to_retry, listed for reviewers and shown with its audit.
func TestAuditFindsAnEffectThatLandedAfterSafeToRetry(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	p := shortPolicy()
	reg := prometheus.NewRegistry()
	m := reconcile.NewMetrics(reg)
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now, Metrics: m})
	drainUntil(t, pool, clk, 500*time.Millisecond, 200, func() bool {
		return receipt(t, db, id).State != "reconciling" && receipt(t, db, id).State != "outcome_unknown"
	})
	if st := receipt(t, db, id).State; st != "safe_to_retry" {
		t.Fatalf("settled %s, want safe_to_retry", st)
	}
	// The original lands now, past its declared lifetime.
	api.Create(idempotencyKey(t, db, id), "late-thing")
	if n := countAudits(t, db, ""); n != 0 {
		t.Fatalf("%d audits before the audit delay", n)
	}
	// Default delay: 4 × (5 s send delay + 10 s window) = 60 s.
	drainUntil(t, pool, clk, 5*time.Second, 20, func() bool { return countAudits(t, db, "") > 0 })
	if n := countAudits(t, db, "contradicted"); n != 1 {
		t.Fatalf("%d contradicted audits, want 1", n)
	}
	if st := receipt(t, db, id).State; st != "safe_to_retry" {
		t.Fatalf("the receipt left its terminal state: %s", st)
	}
	var fa dto.Metric
	if err := m.Verdicts.FalseAbsences.WithLabelValues("fake-api").Write(&fa); err != nil || fa.GetCounter().GetValue() != 1 {
		t.Fatalf("false absences metric %v, want 1 (%v)", fa.GetCounter().GetValue(), err)
	}
	var kind string
	var declared, effective float64
	if err := db.QueryRow(ctx, `SELECT kind, extract(epoch FROM declared), extract(epoch FROM effective_after)
		FROM reconciler.window_alarms WHERE receipt_id = $1`, id).Scan(&kind, &declared, &effective); err != nil {
		t.Fatal(err)
	}
	if kind != "false_absence" || declared != 10 || effective <= declared {
		t.Fatalf("window alarm %s declared %vs effective %vs", kind, declared, effective)
	}
	// Reviewers see it: review list, and the timeline with both reads.
	cs, err := review.Contradicted(ctx, db, review.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) != 1 || cs[0].ID != id || cs[0].State != "safe_to_retry" {
		t.Fatalf("contradicted verdicts listed: %+v", cs)
	}
	tl, err := review.Show(ctx, db, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(tl.Audits) != 1 || tl.Audits[0].Verdict != "contradicted" {
		t.Fatalf("audits shown: %+v", tl.Audits)
	}
	var settledOn, auditRead map[string]any
	for _, e := range tl.Events {
		if e.To == "safe_to_retry" {
			_ = json.Unmarshal(e.Evidence, &settledOn)
		}
	}
	_ = json.Unmarshal(tl.Audits[0].Evidence, &auditRead)
	if settledOn["verdict"] != "absent" || auditRead["verdict"] != "present" || auditRead["matched"] == nil {
		t.Fatalf("evidence of the two reads: settled on %v, audit %v", settledOn, auditRead)
	}
	t.Logf("settled safe_to_retry on %v at %v; audit found %v at %s; window %vs -> %vs",
		settledOn["verdict"], settledOn["read_at"], auditRead["matched"], tl.Audits[0].At.Format(time.RFC3339), declared, effective)
}

// stampSubmitted makes receipt id submitted (and outcome_unknown) at at,
// the injected clock's time: the database stamps its own clock, which the
// injected one outruns, and a stream of receipts must be submitted on the
// clock the fake API and the reconciler share. The triggers, which keep
// these columns as stamped, are off for this one statement.
func stampSubmitted(t testing.TB, db *pgxpool.Pool, id int64, at time.Time) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL session_replication_role = replica`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `UPDATE reconciler.receipts SET created_at = $2, submitted_at = $2, unknown_since = $2
		WHERE id = $1`, id, at); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// countAudits counts the audits with verdict ("" for all).
func countAudits(t testing.TB, db *pgxpool.Pool, verdict string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.verdict_audits
		WHERE $1 = '' OR verdict = $1`, verdict).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Acceptance (a): a fake API whose real lag (21 s) is three times the
// whole declared window (5 s send delay + 2 s lifetime and consistency).
// Receipts arrive one every two seconds, four in five with an effect. The
// first absences settle too early; the audits find their effects, raise
// false_absence and widen the window, and from then on no receipt settles
// safe_to_retry before its effect is visible (the fake API's truth).
func TestAuditsDetectALagLongerThanDeclared(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	const lag = 21 * time.Second
	api := newFakeAPI(t, clk.Now, lag)
	p := readback.Policy{ConsistencyWindow: time.Second, MaxRequestLifetime: time.Second,
		MaxChecks: 100, Deadline: time.Hour, BackoffBase: 500 * time.Millisecond, BackoffCap: 5 * time.Second}
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now})
	type sent struct {
		id     int64
		at     time.Time
		effect bool
	}
	var all []sent
	const n = 100
	const step = 250 * time.Millisecond
	for i := 0; ; i++ {
		if i%8 == 0 && len(all) < n {
			id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
			stampSubmitted(t, db, id, clk.Now())
			s := sent{id: id, at: clk.Now(), effect: len(all)%5 != 4}
			if s.effect {
				api.Create(idempotencyKey(t, db, id), fmt.Sprintf("thing-%d", id))
			}
			all = append(all, s)
		}
		clk.Advance(step)
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		if len(all) == n && countWhere(t, db, "state IN ('outcome_unknown', 'reconciling')") == 0 {
			break
		}
		if i > 20000 {
			t.Fatal("receipts still unsettled")
		}
	}
	var alarmAt time.Time
	if err := db.QueryRow(ctx, `SELECT min(at) FROM reconciler.window_alarms WHERE kind = 'false_absence'`).
		Scan(&alarmAt); err != nil || alarmAt.IsZero() {
		t.Fatalf("no false_absence alarm (%v)", err)
	}
	// When each receipt settled, on the injected clock: the read its
	// verdict rests on.
	settledAt := func(id int64) (string, time.Time) {
		var st string
		var at time.Time
		if err := db.QueryRow(ctx, `SELECT r.state, (e.detail -> 'evidence' ->> 'read_at')::timestamptz
			FROM reconciler.receipts r JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.seq = r.version
			WHERE r.id = $1`, id).Scan(&st, &at); err != nil {
			t.Fatal(err)
		}
		return st, at
	}
	effectsBefore, prematureBefore, prematureAfter, absentAfter, settledAfter := 0, 0, 0, 0, 0
	for _, s := range all {
		if s.effect && s.at.Before(alarmAt) {
			effectsBefore++
		}
		st, at := settledAt(s.id)
		premature := st == "safe_to_retry" && s.effect
		// A drain settles before it audits: a verdict read at the alarm's
		// instant (the injected clock stands still during a drain) came
		// before it. (The same instant can read a microsecond apart: pgx
		// truncates the alarm's time to microseconds, the cast of the
		// evidence's read_at, written with nanoseconds, rounds.)
		if !at.After(alarmAt.Add(time.Microsecond)) {
			if premature {
				prematureBefore++
			}
			continue
		}
		settledAfter++
		if premature {
			prematureAfter++
			t.Errorf("receipt %d (submitted %s) settled safe_to_retry at %s, after the alarm at %s, before its effect was visible at %s",
				s.id, s.at.Format(time.RFC3339Nano), at.Format(time.RFC3339Nano), alarmAt.Format(time.RFC3339Nano),
				s.at.Add(lag).Format(time.RFC3339Nano))
		}
		if st == "safe_to_retry" && !s.effect {
			absentAfter++
		}
		if st == "succeeded" && !s.effect {
			t.Fatalf("receipt %d settled succeeded without an effect", s.id)
		}
	}
	t.Logf("real lag %s, declared window 7s (5s send + 2s): effects until detection %d, premature safe_to_retry before %d, after %d (of %d settled after; %d true absences settled after)",
		lag, effectsBefore, prematureBefore, prematureAfter, settledAfter, absentAfter)
	if prematureAfter != 0 {
		t.Fatalf("%d receipts settled safe_to_retry before their effects were visible after the alarm", prematureAfter)
	}
	if prematureBefore == 0 || settledAfter < 50 || absentAfter == 0 {
		t.Fatalf("the test did not exercise the lag: %d premature before, %d settled after, %d absences after",
			prematureBefore, settledAfter, absentAfter)
	}
	// Bounded detection: one audit delay (4 × 7 s) after the first
	// premature verdict, at one receipt every 2 s, plus the window.
	if effectsBefore > 30 {
		t.Fatalf("%d effects before detection, want at most 30", effectsBefore)
	}
	// A restarted daemon (a new pool) applies the widened window at once.
	w := newPool(t, db, reconcile.Config{Registry: registry(t, api, p), Now: clk.Now})
	if _, err := w.Audit(ctx); err != nil {
		t.Fatal(err)
	}
	b, _ := registry(t, api, p).Lookup("things.create", "fake-api")
	if win := w.Windows().For(b); win.Effective <= lag {
		t.Fatalf("a new pool's effective window %s does not cover the lag %s", win.Effective, lag)
	}
}

// recordingAdapter wraps an adapter and records the receipts it reads, in
// order.
type recordingAdapter struct {
	readback.Adapter
	mu   sync.Mutex
	read []int64
}

func (a *recordingAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	a.mu.Lock()
	a.read = append(a.read, r.ID)
	a.mu.Unlock()
	return a.Adapter.Check(ctx, r)
}

func (a *recordingAdapter) reads() []int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]int64(nil), a.read...)
}

// Acceptance (c): on a healthy API (lag inside the declared window) audits
// add exactly one read per settled absence, confirm every one, raise no
// alarm, and never delay settling: a drain with both settling work and
// audits due makes every settling read before the first audit read.
func TestAuditsOnAHealthyAPI(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, time.Second)
	p := shortPolicy()
	rec := &recordingAdapter{Adapter: searchAdapter{base: api.srv.URL, client: api.srv.Client()}}
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "fake-search", Kind: readback.Create, Dependency: "fake-api",
		Adapter: rec, Policy: p, Control: fakeControl()}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now})
	first := seed(t, db, 40, "things.create", "fake-api", "outcome_unknown")
	for i, id := range first {
		if i%2 == 0 {
			api.Create(idempotencyKey(t, db, id), fmt.Sprintf("thing-%d", id))
		}
	}
	unsettled := func() bool { return countWhere(t, db, "state IN ('outcome_unknown', 'reconciling')") == 0 }
	drainUntil(t, pool, clk, 500*time.Millisecond, 400, unsettled)
	absences := countWhere(t, db, "state = 'safe_to_retry'")
	if absences != 20 {
		t.Fatalf("%d safe_to_retry, want 20", absences)
	}
	// Just before the audits are due, a second batch arrives, due at once.
	clk.Advance(59 * time.Second)
	seed(t, db, 40, "things.create", "fake-api", "outcome_unknown")
	before := len(rec.reads())
	clk.Advance(2 * time.Second)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	reads := rec.reads()[before:]
	isFirst := map[int64]bool{}
	for _, id := range first {
		isFirst[id] = true
	}
	firstAudit, lastSettle, audits := -1, -1, 0
	for i, id := range reads {
		if isFirst[id] {
			audits++
			if firstAudit < 0 {
				firstAudit = i
			}
		} else {
			lastSettle = i
		}
	}
	if audits == 0 || lastSettle < 0 {
		t.Fatalf("the drain made %d audit reads and %d reads in all: nothing to compare", audits, len(reads))
	}
	if firstAudit < lastSettle {
		t.Fatalf("an audit read (#%d) came before a settling read (#%d)", firstAudit, lastSettle)
	}
	// Every absence audited, then a long quiet: no more reads of the
	// first batch.
	settledAndAudited := func() bool {
		return unsettled() && countAudits(t, db, "") == countWhere(t, db, "state = 'safe_to_retry'")
	}
	drainUntil(t, pool, clk, 5*time.Second, 50, settledAndAudited)
	clk.Advance(10 * time.Minute)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	perReceipt := map[int64]int{}
	for _, id := range rec.reads()[before:] {
		if isFirst[id] {
			perReceipt[id]++
		}
	}
	for id, n := range perReceipt {
		if n != 1 {
			t.Fatalf("receipt %d was audited with %d reads", id, n)
		}
	}
	if len(perReceipt) != absences || countAudits(t, db, "confirmed") != countAudits(t, db, "") {
		t.Fatalf("%d of %d absences audited; %d audits, %d confirmed", len(perReceipt), absences,
			countAudits(t, db, ""), countAudits(t, db, "confirmed"))
	}
	var alarms int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.window_alarms`).Scan(&alarms); err != nil || alarms != 0 {
		t.Fatalf("%d window alarms on a healthy API (%v)", alarms, err)
	}
	t.Logf("%d absences settled, %d audit reads (%d confirmed), 0 alarms", absences, len(perReceipt), countAudits(t, db, "confirmed"))
}

// An effect found after an authoritative absence that began past the
// window (held back: the adapter's positive control had not passed yet) is
// proof the declared window is too short: a present_after_absence window
// alarm widens it, with no audit needed.
func TestAnEffectAfterAnAbsencePastTheWindowWidensIt(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	api.mu.Lock()
	control := api.resources[controlMarker]
	delete(api.resources, controlMarker)
	api.mu.Unlock()
	id := seed(t, db, 1, "things.create", "fake-api", "outcome_unknown")[0]
	m := reconcile.NewMetrics(prometheus.NewRegistry())
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: clk.Now, Metrics: m})
	pastWindow := func() bool {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks c JOIN reconciler.receipts r ON r.id = c.receipt_id
			WHERE c.receipt_id = $1 AND c.verdict = 'absent' AND c.authoritative
			  AND c.at >= r.submitted_at + r.max_send_delay + interval '10 seconds'`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	drainUntil(t, pool, clk, 500*time.Millisecond, 200, pastWindow)
	if st := receipt(t, db, id).State; st != "reconciling" {
		t.Fatalf("an absence settled without its control: %s", st)
	}
	api.mu.Lock()
	api.resources[controlMarker] = control
	api.mu.Unlock()
	api.Create(idempotencyKey(t, db, id), "late-thing")
	drainUntil(t, pool, clk, 500*time.Millisecond, 200, func() bool { return receipt(t, db, id).State == "succeeded" })
	var kind string
	var declared, effective float64
	if err := db.QueryRow(ctx, `SELECT kind, extract(epoch FROM declared), extract(epoch FROM effective_after)
		FROM reconciler.window_alarms WHERE receipt_id = $1`, id).Scan(&kind, &declared, &effective); err != nil {
		t.Fatalf("no window alarm: %v", err)
	}
	if kind != reconcile.AlarmPresentAfterAbsence || effective <= declared {
		t.Fatalf("window alarm %s: declared %vs, effective %vs", kind, declared, effective)
	}
	b, _ := registry(t, api, shortPolicy()).Lookup("things.create", "fake-api")
	if w := pool.Windows().For(b); math.Abs(w.Effective.Seconds()-effective) > 1e-6 {
		t.Fatalf("the pool applies %s, the alarm set %vs", w.Effective, effective)
	}
	var alarms dto.Metric
	if err := m.Verdicts.WindowAlarms.WithLabelValues("fake-api", kind).Write(&alarms); err != nil || alarms.GetCounter().GetValue() != 1 {
		t.Fatalf("window alarms metric %v (%v)", alarms.GetCounter().GetValue(), err)
	}
	t.Logf("present_after_absence: window %vs -> %vs", declared, effective)
}
