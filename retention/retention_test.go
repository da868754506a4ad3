package retention_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/retention"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const day = 24 * time.Hour

// receipt is one receipt of a fixture, written as it would be after its
// moves (the triggers off, so its times can lie in the past), with a
// history event per move and a readback check.
type receipt struct {
	key     string
	state   string
	settled time.Duration // how long ago its last move was
	detail  string        // its last move's detail (evidence, error)
	retryOf string        // key of the receipt it retries
	alarm   bool          // a duplicate alarm
	late2   bool          // a lifetime alarm (a late outcome after the window)
	hook    string        // a webhook delivery: "pending" or "delivered"
	replay  bool          // a gateway response still replayable
	late    bool          // a late outcome
	audit   string        // its verdict's audit (00015): "pending" (queued) or a verdict_audits verdict
	window  bool          // a window alarm names it
	kept    bool          // what retention must do with it
}

// insert writes rs into db and returns their ids by key.
func insert(t testing.TB, db *pgxpool.Pool, rs []receipt) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SET session_replication_role = replica`); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, `RESET session_replication_role`)
	ids := map[string]int64{}
	for i, r := range rs {
		detail := r.detail
		if detail == "" {
			detail = "{}"
		}
		var retryOf *int64
		attempt := 1
		if r.retryOf != "" {
			id := ids[r.retryOf]
			retryOf, attempt = &id, 2
		}
		var id int64
		err := conn.QueryRow(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
			target, fingerprint, state, state_actor, state_detail, created_at, submitted_at, updated_at, retry_of,
			attempt, version)
			VALUES ($1, 'things.create', 'api', 'POST', '/things', 'sha256:' || repeat(to_hex($2 % 16), 64), $3,
			        'reconciler:test', $4, clock_timestamp() - $5 * interval '1 microsecond' - interval '1 hour',
			        clock_timestamp() - $5 * interval '1 microsecond' - interval '1 hour',
			        clock_timestamp() - $5 * interval '1 microsecond', $6, $7, 3)
			RETURNING id`, r.key, i, r.state, detail, r.settled.Microseconds(), retryOf, attempt).Scan(&id)
		if err != nil {
			t.Fatalf("insert %s: %v", r.key, err)
		}
		ids[r.key] = id
		for _, q := range []string{
			`INSERT INTO reconciler.receipt_keys (idempotency_key, receipt_id) SELECT idempotency_key, id FROM reconciler.receipts WHERE id = $1`,
			`INSERT INTO reconciler.receipt_events (receipt_id, seq, from_state, to_state, at, actor)
			 SELECT id, s, NULL, CASE s WHEN 3 THEN state ELSE 'planned' END, updated_at, state_actor
			 FROM reconciler.receipts, generate_series(1, 3) s WHERE id = $1`,
			`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			 SELECT id, 1, updated_at, 'test', 'test', 'api', 'present', 1 FROM reconciler.receipts WHERE id = $1`,
		} {
			if _, err := conn.Exec(ctx, q, id); err != nil {
				t.Fatalf("insert %s: %v", r.key, err)
			}
		}
		if r.alarm {
			mustExec(t, conn, `INSERT INTO reconciler.duplicate_alarms (receipt_id, detected_at, instance, adapter, dependency, external_ids)
				VALUES ($1, clock_timestamp(), 'test', 'test', 'api', '{a,b}')`, id)
		}
		if r.late2 {
			mustExec(t, conn, `INSERT INTO reconciler.lifetime_alarms (receipt_id, late_outcome_id, dependency, operation,
				outcome, late_at, window_end) VALUES ($1, 1, 'api', 'things.create', 'succeeded', clock_timestamp(), clock_timestamp())`, id)
		}
		if r.hook != "" {
			mustExec(t, conn, `INSERT INTO reconciler.webhook_receipts (receipt_id, route) VALUES ($1, 'r')`, id)
			mustExec(t, conn, `INSERT INTO reconciler.webhook_deliveries (receipt_id, state, route, delivered_at)
				VALUES ($1, 'succeeded', 'r', CASE WHEN $2 = 'delivered' THEN clock_timestamp() END)`, id, r.hook)
		}
		if r.replay {
			mustExec(t, conn, `INSERT INTO reconciler.gateway_responses (receipt_id, agent, status, body_bytes, expires_at)
				VALUES ($1, 'agent:gw', 200, 0, clock_timestamp() + interval '1 hour')`, id)
		}
		if r.late {
			mustExec(t, conn, `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome) VALUES ($1, 'agent:x', 'rejected')`, id)
		}
		switch r.audit {
		case "":
		case "pending":
			mustExec(t, conn, `INSERT INTO reconciler.audit_queue (receipt_id, dependency, settled_state, settled_at)
				SELECT id, dependency, state, updated_at FROM reconciler.receipts WHERE id = $1`, id)
		default:
			mustExec(t, conn, `INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter,
				settled_state, settled_at, at, instance, verdict, matches, evidence)
				SELECT id, dependency, operation, 'test', state, updated_at, updated_at + interval '1 hour', 'test', $2,
				       CASE $2 WHEN 'contradicted' THEN 1 ELSE 0 END, '{"read": "audit"}'
				FROM reconciler.receipts WHERE id = $1`, id, r.audit)
		}
		if r.window {
			mustExec(t, conn, `INSERT INTO reconciler.window_alarms (at, instance, dependency, adapter, operation,
				receipt_id, kind, declared, observed, effective_before, effective_after)
				VALUES (clock_timestamp(), 'test', 'api', 'test', 'things.create', $1, 'present_after_absence',
				        interval '1 minute', interval '2 minutes', interval '1 minute', interval '2 minutes')`, id)
		}
	}
	return ids
}

func mustExec(t testing.TB, conn interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func future(d time.Duration) string { return time.Now().Add(d).UTC().Format(time.RFC3339Nano) }

// guarantees is a fixture of every reason to keep a receipt, each next to
// one that may go, all settled 100 days ago unless said otherwise.
func guarantees() []receipt {
	old := 100 * day
	return []receipt{
		{key: "plain", state: "succeeded", settled: old},
		{key: "plain-rejected", state: "rejected", settled: old, late: true},
		{key: "recent", state: "succeeded", settled: 10 * day, kept: true},
		{key: "in-flight", state: "outcome_unknown", settled: old, kept: true},
		{key: "reconciling", state: "reconciling", settled: old, kept: true},
		{key: "submitted", state: "submitted", settled: old, kept: true},
		{key: "planned", state: "planned", settled: old, kept: true},
		{key: "held", state: "manual_review", settled: old, kept: true},
		{key: "native-key", state: "safe_to_retry", settled: old, kept: true,
			detail: `{"evidence": {"reuse_idempotency_key_before": "` + future(day) + `"}}`},
		{key: "native-key-retried", state: "safe_to_retry", settled: old,
			detail: `{"evidence": {"reuse_idempotency_key_before": "` + future(-day) + `"}}`},
		{key: "native-key-retried#2", state: "succeeded", settled: old, retryOf: "native-key-retried"},
		{key: "absence-window", state: "succeeded", settled: old, kept: true,
			detail: `{"evidence": {"absence_safe_at": "` + future(time.Hour) + `"}}`},
		{key: "open-chain", state: "safe_to_retry", settled: old, kept: true},
		{key: "open-retryable", state: "rejected", settled: old, kept: true, detail: `{"error": {"retryable": true}}`},
		{key: "chain-in-flight", state: "safe_to_retry", settled: old, kept: true},
		{key: "chain-in-flight#2", state: "outcome_unknown", settled: old, retryOf: "chain-in-flight", kept: true},
		{key: "chain-recent", state: "safe_to_retry", settled: old, kept: true},
		{key: "chain-recent#2", state: "succeeded", settled: day, retryOf: "chain-recent", kept: true},
		{key: "alarm", state: "succeeded", settled: old, alarm: true, kept: true},
		{key: "lifetime-alarm", state: "safe_to_retry", settled: old, late2: true, kept: true},
		{key: "lifetime-alarm#2", state: "succeeded", settled: old, retryOf: "lifetime-alarm", kept: true},
		{key: "hook-pending", state: "succeeded", settled: old, hook: "pending", kept: true},
		{key: "hook-delivered", state: "succeeded", settled: old, hook: "delivered"},
		{key: "replayable", state: "succeeded", settled: old, replay: true, kept: true},
		{key: "audit-pending", state: "safe_to_retry", settled: old, audit: "pending", kept: true},
		{key: "audit-pending#2", state: "succeeded", settled: old, retryOf: "audit-pending", kept: true},
		{key: "audit-contradicted", state: "safe_to_retry", settled: old, audit: "contradicted", kept: true},
		{key: "audit-contradicted#2", state: "succeeded", settled: old, retryOf: "audit-contradicted", kept: true},
		{key: "audit-confirmed", state: "safe_to_retry", settled: old, audit: "confirmed"},
		{key: "audit-confirmed#2", state: "succeeded", settled: old, retryOf: "audit-confirmed"},
		{key: "audit-inconclusive", state: "succeeded", settled: old, audit: "inconclusive"},
		{key: "window-alarm", state: "succeeded", settled: old, window: true, kept: true},
	}
}

// snapshot is every row of the tables retention removes from, as to_jsonb
// writes it, by table.
func snapshot(t *testing.T, db *pgxpool.Pool) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, tbl := range []string{"receipts", "late_outcomes", "webhook_receipts", "webhook_deliveries",
		"gateway_responses", "receipt_events", "readback_checks", "duplicate_alarms", "receipt_keys",
		"verdict_audits", "audit_queue", "window_alarms"} {
		rows, err := db.Query(context.Background(), `SELECT to_jsonb(x)::text FROM reconciler.`+tbl+` x`)
		if err != nil {
			t.Fatal(err)
		}
		vs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		out[tbl] = canonical(t, vs)
	}
	return out
}

// canonical re-encodes JSON objects so equal rows compare equal as text.
func canonical(t *testing.T, vs []string) []string {
	t.Helper()
	out := make([]string, 0, len(vs))
	for _, v := range vs {
		var m map[string]any
		if err := json.Unmarshal([]byte(v), &m); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(m)
		out = append(out, string(b))
	}
	sort.Strings(out)
	return out
}

func receiptIDs(t *testing.T, db *pgxpool.Pool, table, col string) []int64 {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT DISTINCT `+col+` FROM reconciler.`+table+` ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// Issue 25: retention removes every settled receipt no guarantee needs,
// with its history, and keeps every one a guarantee needs (unsettled,
// manual_review, inside the policy, native-key retention, the absence
// window, an open or unsettled retry chain, a duplicate alarm, a pending
// webhook, a replayable gateway response, a lifetime alarm, an audit
// pending or contradicting its verdict, a window alarm); the archive
// holds exactly the rows removed, byte for byte as to_jsonb wrote them;
// the keys stay.
func TestRetentionKeepsWhatAGuaranteeNeeds(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	fixture := guarantees()
	ids := insert(t, db, fixture)
	before := snapshot(t, db)

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour, Batch: 3}, 0)
	if err != nil {
		t.Fatal(err)
	}

	var want []int64
	for _, r := range fixture {
		if r.kept {
			want = append(want, ids[r.key])
		}
	}
	slices.Sort(want)
	for _, c := range []struct{ table, col string }{
		{"receipts", "id"}, {"receipt_events", "receipt_id"}, {"readback_checks", "receipt_id"},
	} {
		if got := receiptIDs(t, db, c.table, c.col); !slices.Equal(got, want) {
			t.Errorf("%s: receipts left %v, want %v", c.table, got, want)
		}
	}
	// No row of 00015 is left naming a receipt that left.
	for _, c := range []struct{ table, col string }{
		{"verdict_audits", "receipt_id"}, {"audit_queue", "receipt_id"}, {"window_alarms", "receipt_id"},
	} {
		for _, id := range receiptIDs(t, db, c.table, c.col) {
			if !slices.Contains(want, id) {
				t.Errorf("%s: a row left for removed receipt %d", c.table, id)
			}
		}
	}
	for _, r := range fixture {
		if r.kept {
			continue
		}
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.removed_receipts WHERE receipt_id = $1`, ids[r.key]).Scan(&n); err != nil || n != 1 {
			t.Errorf("%s: %d removed_receipts rows, %v", r.key, n, err)
		}
	}
	if got := len(receiptIDs(t, db, "receipt_keys", "receipt_id")); got != len(fixture) {
		t.Errorf("receipt_keys: %d keys left, want all %d", got, len(fixture))
	}

	// The archives hold exactly the rows that left, as they were.
	after := snapshot(t, db)
	archived := map[string][]string{}
	for _, f := range rep.Files {
		lines, err := retention.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range lines {
			archived[l.Table] = append(archived[l.Table], string(l.Row))
		}
	}
	for tbl, rows := range before {
		var gone []string
		for _, r := range rows {
			if !slices.Contains(after[tbl], r) {
				gone = append(gone, r)
			}
		}
		if got := canonical(t, archived[tbl]); !slices.Equal(got, gone) {
			t.Errorf("%s: archived %d rows, removed %d:\narchived %v\nremoved  %v", tbl, len(got), len(gone), got, gone)
		}
	}
	if rep.Rows["receipts"] == 0 || rep.ReceiptBatches < 2 || rep.HistoryBatches != rep.ReceiptBatches {
		t.Errorf("report %+v: want several receipts batches (batch 3), each with its history", rep)
	}

	// A removed receipt's key stays taken: planned again, it is refused,
	// never a new receipt to send.
	agent, err := ledger.New(db, "agent:a")
	if err != nil {
		t.Fatal(err)
	}
	in := ledger.Intent{IdempotencyKey: "plain", Operation: "things.create", Dependency: "api", Method: "POST", Target: "/things"}
	if _, err := agent.Plan(ctx, in); !errors.Is(err, ledger.ErrKeyRemoved) {
		t.Errorf("plan of a removed receipt's key: %v, want ErrKeyRemoved", err)
	}
	if _, err := agent.PlanAndSubmit(ctx, in); !errors.Is(err, ledger.ErrKeyRemoved) {
		t.Errorf("plan and submit of a removed receipt's key: %v, want ErrKeyRemoved", err)
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE idempotency_key = 'plain'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("plain: %d receipts, %v", n, err)
	}

	// A second pass has nothing left to remove.
	rep, err = retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil || rep.ReceiptBatches != 0 || rep.HistoryBatches != 0 {
		t.Errorf("second pass: %+v, %v", rep, err)
	}
}

// The request horizon of the adapters keeps a receipt whose call could
// still answer, however old its settlement.
func TestRetentionKeepsInsideTheRequestHorizon(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := insert(t, db, []receipt{{key: "a", state: "succeeded", settled: 100 * day}})
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: 200 * day}, 0); err != nil {
		t.Fatal(err)
	}
	if got := receiptIDs(t, db, "receipts", "id"); !slices.Equal(got, []int64{ids["a"]}) {
		t.Errorf("receipts left %v, want the one inside the horizon", got)
	}
}

// History stays until the history policy: the receipt leaves at 90 days,
// its events and checks at a year, in a later pass.
func TestHistoryOutlivesItsReceipt(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := insert(t, db, []receipt{
		{key: "old", state: "succeeded", settled: 400 * day},
		{key: "mid", state: "succeeded", settled: 100 * day},
	})
	a := retention.New(db, retention.Dir(t.TempDir()), nil)
	p := retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour, Batch: 1}
	if _, err := a.Run(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	if got := receiptIDs(t, db, "receipts", "id"); len(got) != 0 {
		t.Errorf("receipts left %v, want none", got)
	}
	if got := receiptIDs(t, db, "receipt_events", "receipt_id"); !slices.Equal(got, []int64{ids["mid"]}) {
		t.Errorf("history left for %v, want only the receipt settled 100 days ago", got)
	}
	p.History = 90 * day
	if _, err := a.Run(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	if got := receiptIDs(t, db, "receipt_events", "receipt_id"); len(got) != 0 {
		t.Errorf("history left for %v, want none", got)
	}
}

// failingSink writes part of the archive, then fails.
type failingSink struct{}

func (failingSink) Write(_ context.Context, _ string, write func(io.Writer) error) (string, string, error) {
	if err := write(io.Discard); err != nil {
		return "", "", err
	}
	return "", "", errors.New("disk full")
}

// An export that fails removes nothing: neither a failing writer nor a
// directory that cannot be written.
func TestFailedExportRemovesNothing(t *testing.T) {
	ctx := context.Background()
	notADir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notADir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		sink retention.Sink
	}{
		{"failing writer", failingSink{}},
		{"unwritable directory", retention.Dir(filepath.Join(notADir, "archive"))},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := pgtest.NewPool(t)
			insert(t, db, []receipt{{key: "a", state: "succeeded", settled: 100 * day}})
			before := snapshot(t, db)
			_, err := retention.New(db, c.sink, nil).Run(ctx,
				retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
			if err == nil {
				t.Fatal("the pass succeeded")
			}
			t.Log(err)
			if after := snapshot(t, db); !mapsEqual(before, after) {
				t.Errorf("rows changed after a failed export")
			}
			var n int
			if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches`).Scan(&n); err != nil || n != 0 {
				t.Errorf("%d batches recorded, %v", n, err)
			}
		})
	}
}

func mapsEqual(a, b map[string][]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

// The removal function re-checks everything itself: a receipt a guarantee
// keeps, a chain cut in two, or counts that differ from the export refuse
// the whole batch (RL020), whatever the caller passes.
func TestRemovalRefusesWhatItMustKeep(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := insert(t, db, []receipt{
		{key: "ok", state: "succeeded", settled: 100 * day},
		{key: "held", state: "manual_review", settled: 100 * day},
		{key: "chain", state: "safe_to_retry", settled: 100 * day},
		{key: "chain#2", state: "succeeded", settled: 100 * day, retryOf: "chain"},
		{key: "audited", state: "succeeded", settled: 100 * day, audit: "confirmed"},
	})
	before := snapshot(t, db)
	one := `{"receipts": 1, "late_outcomes": 0, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}`
	for _, c := range []struct {
		name     string
		ids      []int64
		expected string
	}{
		{"manual_review", []int64{ids["ok"], ids["held"]}, `{"receipts": 2, "late_outcomes": 0, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}`},
		{"chain cut at its retry", []int64{ids["chain"]}, one},
		{"chain cut at its start", []int64{ids["chain#2"]}, one},
		{"counts differ", []int64{ids["ok"]}, `{"receipts": 1, "late_outcomes": 1, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}`},
		{"missing receipt", []int64{ids["ok"], 999999}, one},
		{"verdict audit not exported", []int64{ids["audited"]}, one},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := db.Exec(ctx, `SELECT reconciler.retention_remove_receipts($1, 'x', repeat('0', 64),
				clock_timestamp() - interval '90 days', interval '1 hour', $2)`, c.ids, c.expected)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "RL020" {
				t.Fatalf("err %v, want RL020", err)
			}
			t.Log(pe.Message)
		})
	}
	if after := snapshot(t, db); !mapsEqual(before, after) {
		t.Errorf("rows changed after refused removals")
	}
}

// The append-only rules still hold outside a removal, for the owner too:
// a DELETE with the removal's setting pointing at a batch that does not
// list the row is refused, UPDATE and TRUNCATE are refused, and the audit
// tables are append-only themselves.
func TestDeleteOnlyInsideARemoval(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := insert(t, db, []receipt{
		{key: "gone", state: "succeeded", settled: 100 * day},
		{key: "stays", state: "succeeded", settled: 100 * day, audit: "confirmed"},
	})
	if _, err := db.Exec(ctx, `SELECT reconciler.retention_remove_receipts($1, 'x', repeat('0', 64),
		clock_timestamp() - interval '90 days', interval '1 hour',
		'{"receipts": 1, "late_outcomes": 0, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}')`,
		[]int64{ids["gone"]}); err != nil {
		t.Fatal(err)
	}
	var batch int64
	if err := db.QueryRow(ctx, `SELECT id FROM reconciler.retention_batches`).Scan(&batch); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`DELETE FROM reconciler.receipts WHERE id = $1`,
		`DELETE FROM reconciler.receipt_events WHERE receipt_id = $1`,
		`DELETE FROM reconciler.readback_checks WHERE receipt_id = $1`,
		`DELETE FROM reconciler.verdict_audits WHERE receipt_id = $1`,
		`UPDATE reconciler.receipt_events SET actor = 'x' WHERE receipt_id = $1`,
	} {
		for _, setting := range []string{"", "SET LOCAL reconciler.retention_batch = '" + strconv.FormatInt(batch, 10) + "'"} {
			tx, err := db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if setting != "" {
				mustExec(t, tx, setting)
			}
			_, err = tx.Exec(ctx, q, ids["stays"])
			tx.Rollback(ctx)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "RL006" {
				t.Errorf("%s (%q): err %v, want RL006", q, setting, err)
			}
		}
	}
	for _, q := range []string{
		`DELETE FROM reconciler.retention_batches`,
		`UPDATE reconciler.retention_batches SET archive = 'y'`,
		`DELETE FROM reconciler.removed_receipts`,
		`TRUNCATE reconciler.removed_receipts`,
		`TRUNCATE reconciler.receipt_events`,
		`TRUNCATE reconciler.verdict_audits`,
	} {
		_, err := db.Exec(ctx, q)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "RL006" {
			t.Errorf("%s: err %v, want RL006", q, err)
		}
	}
}

// Once retention removed anything, migrating below 00020 is refused: it
// would drop the only record of which receipts left and where their
// archive is.
func TestMigrateDownRefusedAfterRemovals(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	insert(t, db, []receipt{{key: "a", state: "succeeded", settled: 100 * day}})
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	p, err := migrations.NewProvider(ctx, migrations.OpenDB(db))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.DownTo(ctx, 19)
	if err == nil || !strings.Contains(err.Error(), "retention_batches records removed receipts") {
		t.Fatalf("down past 00020 with removals: %v", err)
	}
	if v, err := p.GetDBVersion(ctx); err != nil || v != 20 {
		t.Errorf("version %d (%v), want 20 (the steps above it went down; 00020 refused)", v, err)
	}
}

// racingSink writes the archive, then lets something happen before the
// removal: here an agent's late outcome for the exported receipt.
type racingSink struct {
	retention.Dir
	race func()
}

func (s racingSink) Write(ctx context.Context, name string, write func(io.Writer) error) (string, string, error) {
	loc, sum, err := s.Dir.Write(ctx, name, write)
	s.race()
	return loc, sum, err
}

// A row added between the export and the removal (a late outcome) refuses
// the batch: nothing is deleted that the archive does not hold. The next
// pass exports and removes it with its receipt.
func TestRowAddedAfterExportRefusesTheBatch(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := insert(t, db, []receipt{{key: "a", state: "rejected", settled: 100 * day}})
	p := retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}
	sink := racingSink{Dir: retention.Dir(t.TempDir()), race: func() {
		mustExec(t, db, `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome) VALUES ($1, 'agent:x', 'rejected')`, ids["a"])
	}}
	_, err := retention.New(db, sink, nil).Run(ctx, p, 0)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "RL020" {
		t.Fatalf("pass with a row added after the export: %v, want RL020", err)
	}
	if got := receiptIDs(t, db, "late_outcomes", "receipt_id"); len(got) != 1 {
		t.Fatalf("late outcomes left %v", got)
	}
	rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0)
	if err != nil || rep.Rows["receipts"] != 1 || rep.Rows["late_outcomes"] != 1 {
		t.Errorf("next pass: %+v, %v; want the receipt and its late outcome", rep.Rows, err)
	}
}
