// Package rolestest checks docs/roles.sql against a real Postgres: each
// component's role can run that component's real statements, and no role
// (nor the owner) can write or rewrite history (SPEC §7).
package rolestest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// rolesFile is docs/roles.sql, read from the repository at test time.
const rolesFile = "../../docs/roles.sql"

const (
	denied   = "42501" // insufficient_privilege
	illegal  = "RL001" // illegal transition (receipts_before_update)
	rewrite  = "RL006" // append-only (refuse_rewrite) or immutable column
	agentID  = "agent:billing"
	workerID = "rolestest"
)

// env is one fresh database with docs/roles.sql applied and one login user
// in each role.
type env struct {
	url                            string
	owner, agent, worker, reviewer *pgxpool.Pool
}

func setup(t *testing.T) *env {
	t.Helper()
	ctx := context.Background()
	dbURL := pgtest.NewDatabase(t)
	owner := pgtest.Pool(t, dbURL)
	sql, err := os.ReadFile(rolesFile)
	if err != nil {
		t.Fatal(err)
	}
	// Twice: the file must be idempotent.
	for range 2 {
		if _, err := owner.Exec(ctx, string(sql)); err != nil {
			t.Fatalf("apply %s: %v", rolesFile, err)
		}
	}
	return &env{
		url:      dbURL,
		owner:    owner,
		agent:    loginPool(t, owner, dbURL, "reconciler_agent"),
		worker:   loginPool(t, owner, dbURL, "reconciler_worker"),
		reviewer: loginPool(t, owner, dbURL, "reconciler_reviewer"),
	}
}

// loginPool creates a login user in group (unique per run, since roles are
// server-wide), drops it when the test ends, and returns a pool connected
// as that user.
func loginPool(t *testing.T, owner *pgxpool.Pool, dbURL, group string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	name, pw := "rt_"+randomHex(6), randomHex(16)
	if _, err := owner.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD '%s' IN ROLE %s`,
		pgx.Identifier{name}.Sanitize(), pw, pgx.Identifier{group}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	// Registered before the user's pool, so it runs after the pool closes
	// (and before the database is dropped).
	t.Cleanup(func() {
		id := pgx.Identifier{name}.Sanitize()
		for _, q := range []string{`DROP OWNED BY ` + id, `DROP ROLE ` + id} {
			if _, err := owner.Exec(ctx, q); err != nil {
				t.Errorf("cleanup %s: %v", q, err)
			}
		}
	})
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(name, pw)
	p := pgtest.Pool(t, u.String())
	var who string
	if err := p.QueryRow(ctx, `SELECT current_user`).Scan(&who); err != nil || who != name {
		t.Fatalf("connected as %q (%v), want %q", who, err, name)
	}
	return p
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func intent(key, dep string) ledger.Intent {
	return ledger.Intent{IdempotencyKey: key, Operation: "things.create", Dependency: dep,
		Method: "POST", Target: "/things", Payload: json.RawMessage(`{"name":"` + key + `"}`)}
}

// unknown plans, submits and loses the answer of a call, as the agent.
func unknown(t *testing.T, c *ledger.Client, key, dep string) *ledger.Receipt {
	t.Helper()
	ctx := context.Background()
	r, err := c.Plan(ctx, intent(key, dep))
	if err != nil {
		t.Fatal(err)
	}
	if r, err = c.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = c.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	return r
}

func wantCode(t *testing.T, what string, err error, code string) {
	t.Helper()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Errorf("%s: got %v, want SQLSTATE %s", what, err, code)
		return
	}
	if pe.Code != code {
		t.Errorf("%s: got SQLSTATE %s (%s), want %s", what, pe.Code, pe.Message, code)
	}
}

type stmt struct {
	name string
	sql  string
	args []any
}

// refuse runs each statement in a transaction that is rolled back, and
// wants each refused with code.
func refuse(t *testing.T, p *pgxpool.Pool, code string, stmts []stmt) {
	t.Helper()
	ctx := context.Background()
	for _, s := range stmts {
		tx, err := p.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, s.sql, s.args...)
		_ = tx.Rollback(ctx)
		wantCode(t, s.name, err, code)
	}
}

// forgeries are the writes of history no role may make.
func forgeries(id int64) []stmt {
	return []stmt{
		{"insert receipt_events", `INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor)
			VALUES ($1, 99, 'succeeded', now(), 'human:forger')`, []any{id}},
		{"update receipt_events", `UPDATE reconciler.receipt_events SET actor = 'human:forger' WHERE receipt_id = $1`, []any{id}},
		{"delete receipt_events", `DELETE FROM reconciler.receipt_events WHERE receipt_id = $1`, []any{id}},
		{"truncate receipt_events", `TRUNCATE reconciler.receipt_events`, nil},
		{"insert receipt_keys", `INSERT INTO reconciler.receipt_keys VALUES ('forged', $1)`, []any{id}},
		{"update receipt_keys", `UPDATE reconciler.receipt_keys SET receipt_id = $1`, []any{id}},
		{"delete receipt_keys", `DELETE FROM reconciler.receipt_keys`, nil},
		{"truncate receipt_keys", `TRUNCATE reconciler.receipt_keys`, nil},
		{"update readback_checks", `UPDATE reconciler.readback_checks SET verdict = 'present'`, nil},
		{"delete readback_checks", `DELETE FROM reconciler.readback_checks`, nil},
		{"truncate readback_checks", `TRUNCATE reconciler.readback_checks`, nil},
		{"update duplicate_alarms", `UPDATE reconciler.duplicate_alarms SET instance = 'x'`, nil},
		{"delete duplicate_alarms", `DELETE FROM reconciler.duplicate_alarms`, nil},
		{"truncate duplicate_alarms", `TRUNCATE reconciler.duplicate_alarms`, nil},
		{"delete receipts", `DELETE FROM reconciler.receipts WHERE id = $1`, []any{id}},
		{"truncate receipts", `TRUNCATE reconciler.receipts CASCADE`, nil},
		// The intent and the history bookkeeping of a receipt are not
		// granted to anyone, nor is choosing an id.
		{"update receipts intent", `UPDATE reconciler.receipts SET intent = '{"forged":true}' WHERE id = $1`, []any{id}},
		{"update receipts target", `UPDATE reconciler.receipts SET target = '/forged' WHERE id = $1`, []any{id}},
		{"update receipts version", `UPDATE reconciler.receipts SET version = 1 WHERE id = $1`, []any{id}},
		{"update receipts moved_from", `UPDATE reconciler.receipts SET moved_from = 'planned' WHERE id = $1`, []any{id}},
		{"update receipts created_at", `UPDATE reconciler.receipts SET created_at = now() WHERE id = $1`, []any{id}},
		{"insert receipts with an id", `INSERT INTO reconciler.receipts
			(id, idempotency_key, operation, dependency, method, target, fingerprint, state_actor)
			OVERRIDING SYSTEM VALUE VALUES (1000000, 'forged', 'op', 'dep', 'POST', '/x',
			'sha256:' || repeat('a', 64), 'agent:forger')`, nil},
	}
}

func history(t *testing.T, p *pgxpool.Pool, id int64) []map[string]any {
	t.Helper()
	rows, err := p.Query(context.Background(),
		`SELECT * FROM reconciler.receipt_events WHERE receipt_id = $1 ORDER BY seq`, id)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToMap)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestAgent(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	c, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}

	// The ledger lifecycle as the agent, which has no INSERT on
	// receipt_events or receipt_keys: the SECURITY DEFINER history triggers
	// write both.
	r, err := c.Plan(ctx, intent("task-1:step-1:create", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Plan(ctx, intent("task-1:step-1:create", "blog-api"))
	if err != nil || again.ID != r.ID {
		t.Fatalf("re-plan of a known key: %v, %v (want receipt %d)", again, err, r.ID)
	}
	if r, err = c.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = c.Succeed(ctx, r, "post-7", ledger.Detail{Reason: "201"}); err != nil {
		t.Fatal(err)
	}
	events, err := c.History(ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	var moves []string
	for _, ev := range events {
		if ev.Actor != agentID {
			t.Errorf("event %d by %s, want %s", ev.Seq, ev.Actor, agentID)
		}
		moves = append(moves, fmt.Sprintf("%d:%s>%s", ev.Seq, ev.From, ev.To))
	}
	if want := []string{"1:>planned", "2:planned>submitted", "3:submitted>succeeded"}; !reflect.DeepEqual(moves, want) {
		t.Errorf("history %v, want %v", moves, want)
	}
	var keyOwner int64
	if err := e.owner.QueryRow(ctx, `SELECT receipt_id FROM reconciler.receipt_keys WHERE idempotency_key = $1`,
		r.IdempotencyKey).Scan(&keyOwner); err != nil || keyOwner != r.ID {
		t.Errorf("receipt_keys row: %d, %v (want %d)", keyOwner, err, r.ID)
	}

	// A retryable rejection, then its retry: plan locks the previous
	// receipt FOR UPDATE and inserts attempt 2, with the agent's rights.
	r2, err := c.Plan(ctx, intent("task-1:step-2:create", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if r2, err = c.Reject(ctx, r2, ledger.Detail{Error: &ledger.CallError{Code: "rate_limited", Retryable: true}}); err != nil {
		t.Fatal(err)
	}
	retry, err := c.Retry(ctx, r2, intent("task-1:step-2:create", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if retry.Attempt != 2 || retry.RetryOf != r2.ID {
		t.Errorf("retry: attempt %d of %d, want 2 of %d", retry.Attempt, retry.RetryOf, r2.ID)
	}

	// The SQL API: reconciler.transition.
	var state string
	if err := e.agent.QueryRow(ctx, `SELECT state FROM reconciler.transition($1, 'submitted', $2)`,
		retry.ID, agentID).Scan(&state); err != nil || state != "submitted" {
		t.Fatalf("reconciler.transition as the agent: %q, %v", state, err)
	}
	if n := len(history(t, e.owner, retry.ID)); n != 2 {
		t.Errorf("retry has %d events, want 2", n)
	}
	// The state machine still applies to the agent (and transition_error,
	// which explains the refusal, runs with its rights).
	_, err = e.agent.Exec(ctx, `UPDATE reconciler.receipts SET state = 'planned', state_actor = $2 WHERE id = $1`,
		retry.ID, agentID)
	wantCode(t, "submitted -> planned", err, illegal)

	refuse(t, e.agent, denied, append(forgeries(r.ID),
		stmt{"insert readback_checks", `INSERT INTO reconciler.readback_checks
			(receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 1, now(), 'x', 'x', 'x', 'present', 0)`, []any{r.ID}},
		stmt{"insert duplicate_alarms", `INSERT INTO reconciler.duplicate_alarms
			(receipt_id, detected_at, instance, adapter, dependency, external_ids)
			VALUES ($1, now(), 'x', 'x', 'x', '{}')`, []any{r.ID}},
		stmt{"select dependency_breakers", `SELECT * FROM reconciler.dependency_breakers`, nil},
		stmt{"insert dependency_breakers", `INSERT INTO reconciler.dependency_breakers
			(dependency, open_until, opened_by) VALUES ('blog-api', now(), 'x')`, nil},
		stmt{"update dependency_breakers", `UPDATE reconciler.dependency_breakers SET open_until = now()`, nil},
		stmt{"update receipts lease", `UPDATE reconciler.receipts SET lease_owner = 'x' WHERE id = $1`, []any{r.ID}},
	))
}

// dupAdapter finds two resources for every receipt: a duplicated create.
type dupAdapter struct{}

func (dupAdapter) Check(_ context.Context, r readback.Receipt) (readback.Result, error) {
	return readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, Query: "dup",
		ExternalIDs: []string{fmt.Sprintf("a-%d", r.ID), fmt.Sprintf("b-%d", r.ID)}}, nil
}

func TestWorker(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	present := unknown(t, agent, "w:present", "static-api")
	dup := unknown(t, agent, "w:dup", "dup-api")
	orphan, err := agent.Plan(ctx, intent("w:orphan", "static-api"))
	if err != nil {
		t.Fatal(err)
	}
	if orphan, err = agent.Submit(ctx, orphan); err != nil {
		t.Fatal(err)
	}

	reg := readback.NewRegistry()
	for _, b := range []readback.Binding{
		{Name: "static", Type: "static", Kind: readback.Create, Dependency: "static-api",
			Adapter: readback.Static{Verdict: readback.VerdictPresent, Authoritative: true}, Policy: readback.DefaultPolicy()},
		{Name: "dup", Kind: readback.Create, Dependency: "dup-api", Adapter: dupAdapter{}, Policy: readback.DefaultPolicy()},
	} {
		if err := reg.Register(b); err != nil {
			t.Fatal(err)
		}
	}
	// Ten minutes ahead, so the submitted receipt is an orphan (default
	// timeout 5m) the sweep moves to outcome_unknown.
	now := func() time.Time { return time.Now().Add(10 * time.Minute) }
	pool, err := reconcile.New(e.worker, reconcile.Config{Instance: workerID, Registry: reg, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Orphans != 1 || sum.DBErrors != 0 || sum.Duplicates != 1 {
		t.Errorf("drain as the worker: %+v, want 1 orphan, 1 duplicate, no database errors", sum)
	}
	for _, id := range []int64{present.ID, dup.ID, orphan.ID} {
		got, err := agent.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if got.State != statemachine.Succeeded {
			t.Errorf("receipt %d is %s after the worker's drain, want succeeded", id, got.State)
			continue
		}
		h := history(t, e.owner, id)
		last := h[len(h)-1]
		if last["actor"] != "reconciler:"+workerID || last["to_state"] != "succeeded" {
			t.Errorf("receipt %d: last event %v, want succeeded by reconciler:%s", id, last, workerID)
		}
	}
	var checks, alarms int
	if err := e.owner.QueryRow(ctx, `SELECT (SELECT count(*) FROM reconciler.readback_checks),
		(SELECT count(*) FROM reconciler.duplicate_alarms WHERE receipt_id = $1)`, dup.ID).Scan(&checks, &alarms); err != nil {
		t.Fatal(err)
	}
	if checks != 3 || alarms != 1 {
		t.Errorf("%d readback checks and %d duplicate alarms, want 3 and 1", checks, alarms)
	}
	// A write of checks whose commit outcome was unknown is repeated: it
	// looks the checks up first (the worker reads readback_checks for that),
	// and a check recorded already is not recorded again.
	again := &reconcile.CheckRecord{CheckNo: 9, At: now(), Adapter: "static", Dependency: "static-api",
		Verdict: "present", Authoritative: true, Latency: time.Millisecond}
	for range 2 {
		if err := pool.Store().RecordChecksAgain(ctx, []reconcile.ReceiptCheck{{ReceiptID: present.ID, Check: again}}); err != nil {
			t.Fatalf("a repeated write of checks as the worker: %v", err)
		}
	}
	if err := e.owner.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks WHERE receipt_id = $1 AND check_no = 9`,
		present.ID).Scan(&checks); err != nil || checks != 1 {
		t.Errorf("the repeated check is recorded %d times (%v), want once", checks, err)
	}
	b, err := pool.Store().Backlog(ctx, now(), time.Hour, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if b.Duplicates != 1 {
		t.Errorf("backlog as the worker: %+v, want 1 duplicate", b)
	}
	if _, err := e.worker.Exec(ctx, `LISTEN reconciler_due`); err != nil {
		t.Errorf("LISTEN as the worker: %v", err)
	}

	// Shared breaker state.
	store := protect.NewPGStore(e.worker)
	until := time.Now().Add(time.Minute).Truncate(time.Microsecond)
	for range 2 { // insert, then the conflicting update
		got, err := store.Open(ctx, "static-api", until, workerID, "test")
		if err != nil || !got.Until.Equal(until) {
			t.Fatalf("breaker open as the worker: %+v, %v", got, err)
		}
	}
	if got, err := store.Load(ctx, "static-api"); err != nil || got.By != workerID {
		t.Errorf("breaker load as the worker: %+v, %v", got, err)
	}

	refuse(t, e.worker, denied, append(forgeries(present.ID),
		stmt{"plan", `SELECT reconciler.plan('k', 'op', 'dep', 'POST', '/x', 'sha256:' || repeat('a', 64), '{}', 'reconciler:x')`, nil},
		stmt{"insert receipts", `INSERT INTO reconciler.receipts
			(idempotency_key, operation, dependency, method, target, fingerprint, state_actor)
			VALUES ('k', 'op', 'dep', 'POST', '/x', 'sha256:' || repeat('a', 64), 'reconciler:x')`, nil},
	))
}

func TestReviewer(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	held := unknown(t, agent, "r:held", "blog-api")
	if _, err := e.owner.Exec(ctx, `SELECT reconciler.transition($1, 'manual_review', 'reconciler:x')`, held.ID); err != nil {
		t.Fatal(err)
	}

	// Writing a human actor does not make an agent's or the daemon's login
	// a reviewer.
	for name, p := range map[string]*pgxpool.Pool{"agent": e.agent, "worker": e.worker} {
		_, err := p.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'human:mallory'
			WHERE id = $1`, held.ID)
		wantCode(t, name+" leaving manual_review as human:mallory", err, illegal)
	}

	list, err := review.List(ctx, e.reviewer, review.Filter{})
	if err != nil || len(list) != 1 || list[0].ID != held.ID {
		t.Fatalf("review list as the reviewer: %+v, %v", list, err)
	}
	if tl, err := review.Show(ctx, e.reviewer, held.ID); err != nil || len(tl.Events) != 4 {
		t.Fatalf("review show as the reviewer: %+v, %v", tl, err)
	}
	// Only a human leaves manual_review, whoever holds the privilege.
	_, err = e.reviewer.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'agent:x' WHERE id = $1`, held.ID)
	wantCode(t, "leave manual_review as agent:x", err, illegal)
	got, err := review.Resolve(ctx, e.reviewer, review.Resolution{ID: held.ID, To: statemachine.Succeeded,
		Operator: "alice", Reason: "found it", ExternalID: "post-9"})
	if err != nil || got.State != statemachine.Succeeded {
		t.Fatalf("resolve as the reviewer: %+v, %v", got, err)
	}
	h := history(t, e.owner, held.ID)
	if last := h[len(h)-1]; last["actor"] != "human:alice" || last["from_state"] != "manual_review" {
		t.Errorf("last event %v, want manual_review > succeeded by human:alice", last)
	}
	// Reading the reconciler's evidence, and the breakers for the summary
	// bar of `reconciler ui`.
	for _, q := range []string{`SELECT count(*) FROM reconciler.readback_checks`, `SELECT count(*) FROM reconciler.duplicate_alarms`,
		`SELECT count(*) FROM reconciler.dependency_breakers`} {
		if _, err := e.reviewer.Exec(ctx, q); err != nil {
			t.Errorf("%s as the reviewer: %v", q, err)
		}
	}

	refuse(t, e.reviewer, denied, append(forgeries(held.ID),
		stmt{"plan", `SELECT reconciler.plan('k', 'op', 'dep', 'POST', '/x', 'sha256:' || repeat('a', 64), '{}', 'human:x')`, nil},
		stmt{"insert receipts", `INSERT INTO reconciler.receipts
			(idempotency_key, operation, dependency, method, target, fingerprint, state_actor)
			VALUES ('k', 'op', 'dep', 'POST', '/x', 'sha256:' || repeat('a', 64), 'human:x')`, nil},
		stmt{"insert readback_checks", `INSERT INTO reconciler.readback_checks
			(receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 1, now(), 'x', 'x', 'x', 'present', 0)`, []any{held.ID}},
		stmt{"update dependency_breakers", `UPDATE reconciler.dependency_breakers SET open_until = now()`, nil},
	))
}

// TestNobodyRewritesHistory: whatever each role may UPDATE on receipts, a
// settled receipt's history stays as it was; and even the owner, who holds
// every privilege, is refused by the append-only triggers.
func TestNobodyRewritesHistory(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, intent("h:settled", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Succeed(ctx, r, "post-1", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	before := history(t, e.owner, r.ID)

	for _, c := range []struct {
		role string
		pool *pgxpool.Pool
	}{{"agent", e.agent}, {"worker", e.worker}, {"reviewer", e.reviewer}} {
		t.Run(c.role, func(t *testing.T) {
			// Every move out of a terminal state is refused, by any actor.
			for _, to := range []string{"planned", "submitted", "outcome_unknown", "manual_review", "rejected"} {
				_, err := c.pool.Exec(ctx, `UPDATE reconciler.receipts SET state = $2, state_actor = 'human:x' WHERE id = $1`, r.ID, to)
				wantCode(t, c.role+": succeeded -> "+to, err, illegal)
			}
			// Issue 7, path 9: an update of the granted columns that is no
			// move may not rewrite what the latest move recorded.
			refuse(t, c.pool, rewrite, []stmt{
				{c.role + ": non-move actor and detail", `UPDATE reconciler.receipts
					SET state_actor = 'human:x', state_detail = '{"x":1}' WHERE id = $1`, []any{r.ID}},
				{c.role + ": non-move external id", `UPDATE reconciler.receipts SET external_id = 'forged' WHERE id = $1`, []any{r.ID}},
			})
			refuse(t, c.pool, denied, forgeries(r.ID))
		})
	}
	if after := history(t, e.owner, r.ID); !reflect.DeepEqual(before, after) {
		t.Errorf("history changed:\nbefore %v\nafter  %v", before, after)
	}

	// The owner has the privileges; the triggers refuse anyway.
	refuse(t, e.owner, rewrite, []stmt{
		{"owner: update receipt_events", `UPDATE reconciler.receipt_events SET actor = 'human:x' WHERE receipt_id = $1`, []any{r.ID}},
		{"owner: delete receipt_events", `DELETE FROM reconciler.receipt_events WHERE receipt_id = $1`, []any{r.ID}},
		{"owner: truncate receipt_events", `TRUNCATE reconciler.receipt_events`, nil},
		{"owner: update receipt_keys", `UPDATE reconciler.receipt_keys SET receipt_id = 0`, nil},
		{"owner: delete receipts", `DELETE FROM reconciler.receipts WHERE id = $1`, []any{r.ID}},
		{"owner: rewind version", `UPDATE reconciler.receipts SET version = 1 WHERE id = $1`, []any{r.ID}},
	})
}

// TestHistoryFunctionsPinned: the history triggers run as their owner with
// a pinned search_path (migration 00001), which is what lets roles without
// INSERT on the history tables move receipts.
func TestHistoryFunctionsPinned(t *testing.T) {
	e := setup(t)
	rows, err := e.owner.Query(context.Background(), `
		SELECT p.proname, p.prosecdef, coalesce(array_to_string(p.proconfig, ','), ''),
		       pg_get_userbyid(p.proowner) = pg_get_userbyid(c.relowner)
		FROM pg_proc p, pg_class c
		WHERE p.pronamespace = 'reconciler'::regnamespace
		  AND p.proname IN ('receipts_record_insert', 'receipts_record_update')
		  AND c.oid = 'reconciler.receipt_events'::regclass
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	type fn struct {
		Name      string
		Definer   bool
		Config    string
		SameOwner bool
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[fn])
	if err != nil {
		t.Fatal(err)
	}
	const path = "search_path=pg_catalog, reconciler, pg_temp"
	want := []fn{{"receipts_record_insert", true, path, true}, {"receipts_record_update", true, path, true}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("history functions %+v, want %+v", got, want)
	}
}

// TestOnlyReconcilerSettles: issue 7, path 8. An agent's login records its
// own calls only: it cannot move a receipt to or from reconciling, nor to
// manual_review, by UPDATE or through reconciler.transition, so it cannot
// settle its own receipt safe_to_retry and retry it without a readback. The
// worker's login (and a reviewer's) can.
func TestOnlyReconcilerSettles(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	const (
		update   = `UPDATE reconciler.receipts SET state = $2, state_actor = $3 WHERE id = $1`
		function = `SELECT reconciler.transition($1, $2, $3)`
	)
	agentMayNot := func(id int64, from, to string) {
		t.Helper()
		for name, q := range map[string]string{"update": update, "transition": function} {
			for _, actor := range []string{agentID, "reconciler:forged"} {
				before := history(t, e.owner, id)
				_, err := e.agent.Exec(ctx, q, id, to, actor)
				wantCode(t, fmt.Sprintf("agent login: %s -> %s by %s via %s", from, to, actor, name), err, illegal)
				if after := history(t, e.owner, id); !reflect.DeepEqual(before, after) {
					t.Errorf("agent login: %s -> %s via %s refused but history changed", from, to, name)
				}
			}
		}
	}

	r := unknown(t, agent, "p8:settle-own", "blog-api")
	agentMayNot(r.ID, "outcome_unknown", "reconciling")
	agentMayNot(r.ID, "outcome_unknown", "manual_review")
	// The worker claims it (a plain UPDATE: the worker has no EXECUTE on
	// reconciler.transition), then the agent tries to settle it.
	if _, err := e.worker.Exec(ctx, update, r.ID, "reconciling", "reconciler:"+workerID); err != nil {
		t.Fatalf("worker: outcome_unknown -> reconciling: %v", err)
	}
	for _, to := range []string{"safe_to_retry", "succeeded", "manual_review"} {
		agentMayNot(r.ID, "reconciling", to)
	}
	if _, err := e.worker.Exec(ctx, update, r.ID, "safe_to_retry", "reconciler:"+workerID); err != nil {
		t.Fatalf("worker: reconciling -> safe_to_retry: %v", err)
	}
	got, err := agent.Get(ctx, r.ID)
	if err != nil || got.State != statemachine.SafeToRetry {
		t.Fatalf("after the worker settled: %+v, %v", got, err)
	}
	h := history(t, e.owner, r.ID)
	if last := h[len(h)-1]; last["actor"] != "reconciler:"+workerID {
		t.Errorf("settled by %v, want reconciler:%s", last["actor"], workerID)
	}

	// A reviewer may hold a receipt for review (through transition).
	held := unknown(t, agent, "p8:hold", "blog-api")
	agentMayNot(held.ID, "outcome_unknown", "manual_review")
	if _, err := e.reviewer.Exec(ctx, function, held.ID, "manual_review", "human:alice"); err != nil {
		t.Errorf("reviewer: outcome_unknown -> manual_review: %v", err)
	}
	// The agent's own moves still work: plan, submit, settle from submitted.
	ok, err := agent.Plan(ctx, intent("p8:own", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if ok, err = agent.Submit(ctx, ok); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.Succeed(ctx, ok, "post-1", ledger.Detail{}); err != nil {
		t.Errorf("agent: submitted -> succeeded: %v", err)
	}
}

// TestLateOutcomeRoles: the agent records a late outcome only through
// reconciler.record_late_outcome (SECURITY DEFINER), for the receipt it
// submitted after the worker's orphan sweep moved it; the worker and the
// reviewer read late outcomes; nobody writes them directly.
func TestLateOutcomeRoles(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, intent("late:1", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	// The orphan sweep, as the worker.
	if _, err := e.worker.Exec(ctx, `UPDATE reconciler.receipts SET state = 'outcome_unknown',
		state_actor = 'reconciler:sweep' WHERE id = $1 AND state = 'submitted'`, r.ID); err != nil {
		t.Fatal(err)
	}
	const rec = `SELECT reconciler.record_late_outcome($1, $2, 'succeeded', 201, 'post-1', '{"reason":"201"}')`
	if _, err := e.agent.Exec(ctx, rec, r.ID, agentID); err != nil {
		t.Fatalf("agent: record_late_outcome: %v", err)
	}
	_, err = e.agent.Exec(ctx, rec, r.ID, "agent:someone-else")
	wantCode(t, "agent: late outcome of a receipt it did not submit", err, "RL002")
	// The agent reads them too: whether a receipt may be retried depends on
	// them (reconciler.retry_error runs with the agent's rights).
	for name, p := range map[string]*pgxpool.Pool{"agent": e.agent, "worker": e.worker, "reviewer": e.reviewer} {
		var n int
		if err := p.QueryRow(ctx, `SELECT count(*) FROM reconciler.late_outcomes WHERE receipt_id = $1`, r.ID).Scan(&n); err != nil || n != 1 {
			t.Errorf("%s: read late outcomes: %d, %v", name, n, err)
		}
	}
	insert := stmt{"insert late_outcomes", `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome)
		VALUES ($1, 'agent:billing', 'succeeded')`, []any{r.ID}}
	refuse(t, e.agent, denied, []stmt{insert,
		{"agent: update late_outcomes", `UPDATE reconciler.late_outcomes SET outcome = 'rejected'`, nil}})
	for name, p := range map[string]*pgxpool.Pool{"worker": e.worker, "reviewer": e.reviewer} {
		refuse(t, p, denied, []stmt{insert,
			{name + ": record_late_outcome", rec, []any{r.ID, agentID}},
			{name + ": delete late_outcomes", `DELETE FROM reconciler.late_outcomes`, nil}})
	}
	// The late success keeps the worker from settling safe_to_retry.
	const update = `UPDATE reconciler.receipts SET state = $2, state_actor = 'reconciler:w' WHERE id = $1`
	if _, err := e.worker.Exec(ctx, update, r.ID, "reconciling"); err != nil {
		t.Fatal(err)
	}
	_, err = e.worker.Exec(ctx, update, r.ID, "safe_to_retry")
	wantCode(t, "worker: safe_to_retry despite a late success", err, "RL002")
}

// TestReadonly: reconciler_readonly (stats, dashboards) reads the ledger,
// the reconciler's records, breaker state and the schema version, and
// writes nothing.
func TestReadonly(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	ro := loginPool(t, e.owner, e.url, "reconciler_readonly")
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	r := unknown(t, agent, "ro:1", "blog-api")
	for _, table := range []string{"receipts", "receipt_events", "readback_checks", "duplicate_alarms",
		"late_outcomes", "lifetime_alarms", "dependency_breakers", "goose_db_version", "verdict_audits", "window_alarms", "audit_queue"} {
		if _, err := ro.Exec(ctx, `SELECT count(*) FROM reconciler.`+table); err != nil {
			t.Errorf("readonly: read %s: %v", table, err)
		}
	}
	store, err := reconcile.NewStore(ro, "stats")
	if err != nil {
		t.Fatal(err)
	}
	b, err := store.Backlog(ctx, time.Now(), time.Hour, 5*time.Minute)
	if err != nil || b.OutcomeUnknown != 1 {
		t.Errorf("readonly: backlog %+v, %v; want 1 outcome_unknown", b, err)
	}
	refuse(t, ro, denied, append(forgeries(r.ID),
		stmt{"move", `UPDATE reconciler.receipts SET state = 'reconciling', state_actor = 'reconciler:x' WHERE id = $1`, []any{r.ID}},
		stmt{"lease", `UPDATE reconciler.receipts SET lease_owner = 'x' WHERE id = $1`, []any{r.ID}},
		stmt{"plan", `SELECT reconciler.plan('k', 'op', 'dep', 'POST', '/x', 'sha256:' || repeat('a', 64), '{}', 'agent:x')`, nil},
		stmt{"transition", `SELECT reconciler.transition($1, 'reconciling', 'reconciler:x')`, []any{r.ID}},
		stmt{"record_late_outcome", `SELECT reconciler.record_late_outcome($1, 'agent:billing', 'succeeded')`, []any{r.ID}},
		stmt{"insert readback_checks", `INSERT INTO reconciler.readback_checks
			(receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 1, now(), 'x', 'x', 'x', 'present', 0)`, []any{r.ID}},
		stmt{"insert dependency_breakers", `INSERT INTO reconciler.dependency_breakers
			(dependency, open_until, opened_by) VALUES ('blog-api', now(), 'x')`, nil},
		stmt{"update goose_db_version", `UPDATE reconciler.goose_db_version SET is_applied = false`, nil},
		stmt{"read receipt_keys", `SELECT * FROM reconciler.receipt_keys`, nil},
	))
}

// TestEveryRoleChecksSchema: each role of docs/roles.sql can run the
// read-only schema check every runtime command starts with (issue 10,
// item 1), and a login in none of them is told it cannot read the version.
func TestEveryRoleChecksSchema(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	ro := loginPool(t, e.owner, e.url, "reconciler_readonly")
	for name, p := range map[string]*pgxpool.Pool{"agent": e.agent, "worker": e.worker, "reviewer": e.reviewer, "readonly": ro} {
		if err := migrations.Check(ctx, p); err != nil {
			t.Errorf("%s: schema check: %v", name, err)
		}
	}
	nobody := loginPool(t, e.owner, e.url, "pg_monitor") // a role, but none of docs/roles.sql
	if err := migrations.Check(ctx, nobody); !errors.Is(err, migrations.ErrSchemaUnreadable) {
		t.Errorf("login in no reconciler role: schema check: %v, want ErrSchemaUnreadable", err)
	}
}
