package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/statemachine"
)

// pathTo lists the legal moves that take a fresh receipt to each state.
var pathTo = map[statemachine.State][]statemachine.State{
	statemachine.Planned:        nil,
	statemachine.Submitted:      {"submitted"},
	statemachine.OutcomeUnknown: {"submitted", "outcome_unknown"},
	statemachine.Reconciling:    {"submitted", "outcome_unknown", "reconciling"},
	statemachine.Succeeded:      {"submitted", "succeeded"},
	statemachine.SafeToRetry:    {"submitted", "outcome_unknown", "reconciling", "safe_to_retry"},
	statemachine.Rejected:       {"rejected"},
	statemachine.ManualReview:   {"submitted", "outcome_unknown", "manual_review"},
}

// specLegal is SPEC §3 written out once more, independently of both the Go
// table and the SQL one, so a drift in either fails this test.
var specLegal = map[string]bool{
	"planned>submitted": true, "planned>rejected": true,
	"submitted>succeeded": true, "submitted>rejected": true, "submitted>outcome_unknown": true,
	"outcome_unknown>reconciling": true, "outcome_unknown>manual_review": true,
	"reconciling>succeeded": true, "reconciling>safe_to_retry": true, "reconciling>manual_review": true,
	"manual_review>succeeded": true, "manual_review>safe_to_retry": true,
	"manual_review>rejected": true, "manual_review>outcome_unknown": true,
	// SPEC §5a: a retry past a native key's retention needs a fresh proof,
	// which sends the receipt back to the reconciler (migration 00014).
	"safe_to_retry>outcome_unknown": true,
}

const fp = "sha256:0000000000000000000000000000000000000000000000000000000000000000"

// rawReceipt plans a receipt through the SQL API and walks it to state.
func rawReceipt(t *testing.T, pool *pgxpool.Pool, key string, state statemachine.State) int64 {
	t.Helper()
	ctx := context.Background()
	var id int64
	err := pool.QueryRow(ctx, `SELECT id FROM reconciler.plan(idempotency_key => $1, operation => 'articles.create',
		dependency => 'blog-api', method => 'post', target => '/articles', fingerprint => $2,
		intent => '{}', actor => 'agent:test', allow_duplicate => true)`, key, fp).Scan(&id)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	actor := "agent:test"
	for _, s := range pathTo[state] {
		if _, err := pool.Exec(ctx, `SELECT reconciler.transition(receipt_id => $1, to_state => $2, actor => $3)`,
			id, string(s), actor); err != nil {
			t.Fatalf("walk to %s: %v", s, err)
		}
	}
	return id
}

type snapshot struct {
	state   string
	version int
	events  int
}

func snap(t *testing.T, pool *pgxpool.Pool, id int64) snapshot {
	t.Helper()
	var s snapshot
	err := pool.QueryRow(context.Background(), `SELECT state, version,
		(SELECT count(*) FROM reconciler.receipt_events WHERE receipt_id = r.id)
		FROM reconciler.receipts r WHERE id = $1`, id).Scan(&s.state, &s.version, &s.events)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// TestDatabaseMatrix checks all 64 moves against the database, through
// reconciler.transition and through a raw UPDATE of the state: legal moves
// are accepted and recorded in history, illegal ones are refused with
// RL001 and leave the receipt exactly as it was. (An UPDATE that sets the
// state a receipt already has is not a move; here it also rewrites the
// actor, which only a move may: refused with RL006.)
func TestDatabaseMatrix(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	via := map[string]string{
		"function": `SELECT 1 FROM reconciler.transition(receipt_id => $1, to_state => $2, actor => $3)`,
		"update":   `UPDATE reconciler.receipts SET state = $2, state_actor = $3 WHERE id = $1`,
	}
	for _, from := range statemachine.States() {
		for _, to := range statemachine.States() {
			for name, stmt := range via {
				for _, actor := range []string{"reconciler:r1", "human:ann"} {
					key := fmt.Sprintf("%s-%s-%s-%s", from, to, name, actor)
					id := rawReceipt(t, pool, key, from)
					before := snap(t, pool, id)
					_, err := pool.Exec(ctx, stmt, id, string(to), actor)
					legal := specLegal[string(from)+">"+string(to)] &&
						(from != statemachine.ManualReview || strings.HasPrefix(actor, "human:"))
					goErr := statemachine.Check(statemachine.Actor(actor), from, to)
					if legal != (goErr == nil) {
						t.Errorf("statemachine.Check(%s, %s -> %s) = %v, spec says legal=%v", actor, from, to, goErr, legal)
					}
					after := snap(t, pool, id)
					if legal {
						if err != nil {
							t.Errorf("%s %s -> %s by %s refused: %v", name, from, to, actor, err)
							continue
						}
						want := snapshot{state: string(to), version: before.version + 1, events: before.events + 1}
						if after != want {
							t.Errorf("%s %s -> %s: got %+v, want %+v", name, from, to, after, want)
						}
						continue
					}
					if name == "update" && from == to {
						// Setting the state a receipt already has is no move,
						// so it may not rewrite the latest move's actor
						// either (issue 7, path 9): refused, nothing changes.
						if sqlState(err) != "RL006" || after != before {
							t.Errorf("update %s -> %s by %s: got %v, %+v -> %+v; want RL006 and no change", from, to, actor, err, before, after)
						}
						continue
					}
					if sqlState(err) != "RL001" || !strings.Contains(err.Error(), string(from)+" -> "+string(to)) {
						t.Errorf("%s %s -> %s by %s: got %v, want RL001 naming the move", name, from, to, actor, err)
					}
					if after != before {
						t.Errorf("%s %s -> %s refused but receipt changed: %+v -> %+v", name, from, to, before, after)
					}
				}
			}
		}
	}
}

func TestUnknownStateRefused(t *testing.T) {
	pool := pgtest.NewPool(t)
	id := rawReceipt(t, pool, "k", statemachine.Submitted)
	before := snap(t, pool, id)
	_, err := pool.Exec(context.Background(), `UPDATE reconciler.receipts SET state = 'failed' WHERE id = $1`, id)
	if err == nil || sqlState(err) != "23514" && sqlState(err) != "RL001" {
		t.Fatalf("unknown state: got %v, want a refusal", err)
	}
	if after := snap(t, pool, id); after != before {
		t.Fatalf("receipt changed: %+v -> %+v", before, after)
	}
}

func TestHistoryIsAppendOnly(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := rawReceipt(t, pool, "k", statemachine.Succeeded)
	before := snap(t, pool, id)
	for _, stmt := range []string{
		`UPDATE reconciler.receipt_events SET actor = 'human:mallory'`,
		`UPDATE reconciler.receipt_events SET to_state = 'rejected' WHERE receipt_id = ` + fmt.Sprint(id),
		`DELETE FROM reconciler.receipt_events`,
		`DELETE FROM reconciler.receipt_events WHERE receipt_id = ` + fmt.Sprint(id),
		`TRUNCATE reconciler.receipt_events`,
		`TRUNCATE reconciler.receipts CASCADE`,
		`DELETE FROM reconciler.receipts`,
	} {
		if _, err := pool.Exec(ctx, stmt); sqlState(err) != "RL006" {
			t.Errorf("%s: got %v, want RL006 (append-only)", stmt, err)
		}
	}
	if after := snap(t, pool, id); after != before {
		t.Fatalf("history changed: %+v -> %+v", before, after)
	}
}

// fpOf returns a valid fingerprint distinct for each n.
func fpOf(n int) string { return fmt.Sprintf("sha256:%064x", n) }

// querier is what both a pool and a transaction offer.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// planArgs are the arguments of one reconciler.plan call.
type planArgs struct {
	key, dep, fp string
	allowDup     bool
	retryOf      int64  // 0: a first attempt
	delay        string // max_send_delay; "" leaves the parameter out (its default)
}

// planSQL calls reconciler.plan with named arguments and returns the id.
func planSQL(ctx context.Context, q querier, a planArgs) (int64, error) {
	if a.dep == "" {
		a.dep = "blog-api"
	}
	var retry *int64
	if a.retryOf != 0 {
		retry = &a.retryOf
	}
	sql := `SELECT id FROM reconciler.plan(idempotency_key => $1, operation => 'articles.create',
		dependency => $2, method => 'POST', target => '/articles', fingerprint => $3, intent => '{}',
		actor => 'agent:test', allow_duplicate => $4, retry_of => $5`
	args := []any{a.key, a.dep, a.fp, a.allowDup, retry}
	if a.delay != "" {
		sql += `, max_send_delay => $6::interval`
		args = append(args, a.delay)
	}
	var id int64
	err := q.QueryRow(ctx, sql+`)`, args...).Scan(&id)
	return id, err
}

func mustPlan(t *testing.T, q querier, a planArgs) int64 {
	t.Helper()
	id, err := planSQL(context.Background(), q, a)
	if err != nil {
		t.Fatalf("plan %q: %v", a.key, err)
	}
	return id
}

// move makes one move through reconciler.transition.
func move(ctx context.Context, q querier, id int64, to, actor string) error {
	_, err := q.Exec(ctx, `SELECT reconciler.transition(receipt_id => $1, to_state => $2, actor => $3)`, id, to, actor)
	return err
}

func mustMove(t *testing.T, q querier, id int64, actor string, to ...string) {
	t.Helper()
	for _, s := range to {
		if err := move(context.Background(), q, id, s, actor); err != nil {
			t.Fatalf("receipt %d -> %s: %v", id, s, err)
		}
	}
}

func pgErr(err error) *pgconn.PgError {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe
	}
	return nil
}

func stateOf(t *testing.T, q querier, id int64) string {
	t.Helper()
	var s string
	if err := q.QueryRow(context.Background(), `SELECT state FROM reconciler.receipts WHERE id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// Issue 7, path 1: two receipts of one intent planned under two keys before
// either is submitted both pass plan's guard; the submission re-checks it
// under plan's lock, so the second is refused (RL005, DETAIL = the first)
// and stays planned. Receipts planned with allow_duplicate are not guarded.
func TestSubmitRechecksDuplicateGuard(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	first := mustPlan(t, pool, planArgs{key: "task-1:step-1:create", fp: fpOf(1)})
	second := mustPlan(t, pool, planArgs{key: "task-2:step-1:create", fp: fpOf(1)})
	optedOut := mustPlan(t, pool, planArgs{key: "task-3:step-1:create", fp: fpOf(1), allowDup: true})
	mustMove(t, pool, first, "agent:a", "submitted")

	for name, stmt := range map[string]string{
		"update":   `UPDATE reconciler.receipts SET state = 'submitted', state_actor = 'agent:b' WHERE id = $1`,
		"function": `SELECT reconciler.transition($1, 'submitted', 'agent:b')`,
	} {
		before := snap(t, pool, second)
		_, err := pool.Exec(ctx, stmt, second)
		pe := pgErr(err)
		if pe == nil || pe.Code != "RL005" || pe.Detail != fmt.Sprint(first) {
			t.Errorf("%s: second submission of the intent: got %v, want RL005 with DETAIL %d", name, err, first)
		}
		if after := snap(t, pool, second); after != before || after.state != "planned" {
			t.Errorf("%s: refused receipt changed: %+v -> %+v", name, before, after)
		}
	}
	// The other outcomes of a planned receipt stay open to it.
	mustMove(t, pool, second, "agent:b", "rejected")
	// Opting out at plan opts out at submission too.
	mustMove(t, pool, optedOut, "agent:c", "submitted")
	var guarded []bool
	rows, err := pool.Query(ctx, `SELECT guarded FROM reconciler.receipts WHERE id = ANY($1) ORDER BY id`,
		[]int64{first, second, optedOut})
	if err != nil {
		t.Fatal(err)
	}
	if guarded, err = pgx.CollectRows(rows, pgx.RowTo[bool]); err != nil {
		t.Fatal(err)
	}
	if want := []bool{true, true, false}; !reflect.DeepEqual(guarded, want) {
		t.Errorf("guarded = %v, want %v", guarded, want)
	}
}

// Issue 7, path 1 (acceptance 2, at the database): 50 goroutines plan and
// submit 10 intents, each under 2 keys, all at once, by SQL. Every intent is
// submitted exactly once; its other receipt stays planned (or was refused
// at plan once the first was submitted).
func TestConcurrentSameIntentSubmittedOnce(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	const goroutines, intents = 50, 10
	start := make(chan struct{})
	errs := make(chan error, goroutines*intents)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range intents {
				// Half the goroutines use each key; start at a different
				// intent each, so they collide in every order.
				n := (i + g) % intents
				key := fmt.Sprintf("intent-%d:key-%d", n, g%2)
				id, err := planSQL(ctx, pool, planArgs{key: key, fp: fpOf(n)})
				if code := sqlState(err); code == "RL005" {
					continue // the other key is already submitted
				} else if err != nil {
					errs <- fmt.Errorf("plan %s: %w", key, err)
					continue
				}
				_, err = pool.Exec(ctx, `UPDATE reconciler.receipts SET state = 'submitted', state_actor = $2
					WHERE id = $1 AND state = 'planned'`, id, fmt.Sprintf("agent:%d", g))
				if err != nil && sqlState(err) != "RL005" {
					errs <- fmt.Errorf("submit %s: %w", key, err)
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	rows, err := pool.Query(ctx, `
		SELECT fingerprint, count(*) FILTER (WHERE state = 'submitted'),
		       (SELECT count(*) FROM reconciler.receipt_events e
		        WHERE e.receipt_id = ANY (array_agg(r.id)) AND e.to_state = 'submitted')
		FROM reconciler.receipts r GROUP BY fingerprint ORDER BY fingerprint`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		FP                string
		Submitted, Events int
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != intents {
		t.Fatalf("%d intents planned, want %d", len(got), intents)
	}
	for _, r := range got {
		if r.Submitted != 1 || r.Events != 1 {
			t.Errorf("intent %s: %d receipts submitted (%d submitted events), want exactly 1", r.FP, r.Submitted, r.Events)
		}
	}
}

// Issue 7, path 3: every time the triggers stamp is clock_timestamp(), the
// moment the statement ran: a client that plans, waits and submits in one
// open transaction gets a submitted_at after the wait (now() would give the
// transaction's start), and times a client sends on INSERT are overwritten.
func TestTimesAreClockTimestamp(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	id := mustPlan(t, tx, planArgs{key: "slow-client", fp: fpOf(1)})
	if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.2)`); err != nil {
		t.Fatal(err)
	}
	mustMove(t, tx, id, "agent:a", "submitted")
	if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.2)`); err != nil {
		t.Fatal(err)
	}
	mustMove(t, tx, id, "agent:a", "outcome_unknown")
	var sinceCreate, sinceSubmit float64
	var stampsAgree bool
	err = tx.QueryRow(ctx, `
		SELECT extract(epoch FROM r.submitted_at - r.created_at),
		       extract(epoch FROM r.unknown_since - r.submitted_at),
		       r.updated_at = r.unknown_since AND r.next_check_at = r.unknown_since
		       AND (SELECT array_agg(e.at ORDER BY e.seq) FROM reconciler.receipt_events e WHERE e.receipt_id = r.id)
		           = ARRAY[r.created_at, r.submitted_at, r.unknown_since]
		FROM reconciler.receipts r WHERE r.id = $1`, id).Scan(&sinceCreate, &sinceSubmit, &stampsAgree)
	if err != nil {
		t.Fatal(err)
	}
	if sinceCreate < 0.2 || sinceSubmit < 0.2 {
		t.Errorf("submitted_at - created_at = %.3fs, unknown_since - submitted_at = %.3fs; want both >= 0.2s", sinceCreate, sinceSubmit)
	}
	if !stampsAgree {
		t.Error("updated_at, next_check_at and the history's times are not the stamps of the moves")
	}
	_ = tx.Rollback(ctx)

	// A client's own times are not taken on INSERT.
	var skew float64
	err = pool.QueryRow(ctx, `
		INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target,
		    fingerprint, state_actor, created_at, updated_at, submitted_at, unknown_since)
		VALUES ('forged-times', 'op', 'dep', 'POST', '/x', $1, 'agent:a',
		    '2000-01-01', '2000-01-01', '2000-01-01', '2000-01-01')
		RETURNING abs(extract(epoch FROM created_at - clock_timestamp()))
		    + CASE WHEN updated_at = created_at AND submitted_at IS NULL AND unknown_since IS NULL THEN 0 ELSE 1e9 END`,
		fpOf(2)).Scan(&skew)
	if err != nil || skew > 5 {
		t.Errorf("insert with client times: %v, skew %.0fs: want the database's clock and no submitted_at/unknown_since", err, skew)
	}
}

// Issue 7, path 3: the send deadline is fixed at plan, within (0, 10 min];
// the default is 5 s; submitted_at + max_send_delay is the deadline.
func TestMaxSendDelay(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	for i, c := range []struct {
		delay string
		ok    bool
		want  string
	}{
		{"", true, "00:00:05"},
		{"1 millisecond", true, "00:00:00.001"},
		{"10 minutes", true, "00:10:00"},
		{"0", false, ""},
		{"-1 second", false, ""},
		{"10 minutes 0.001 seconds", false, ""},
		{"1 day", false, ""},
	} {
		id, err := planSQL(ctx, pool, planArgs{key: fmt.Sprintf("delay-%d", i), fp: fpOf(i), delay: c.delay})
		if !c.ok {
			if sqlState(err) != "23514" {
				t.Errorf("max_send_delay %q: got %v, want check_violation", c.delay, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("max_send_delay %q: %v", c.delay, err)
			continue
		}
		mustMove(t, pool, id, "agent:a", "submitted")
		var got string
		var deadlineOK bool
		if err := pool.QueryRow(ctx, `SELECT max_send_delay::text,
			submitted_at + max_send_delay > submitted_at FROM reconciler.receipts WHERE id = $1`, id).
			Scan(&got, &deadlineOK); err != nil || got != c.want || !deadlineOK {
			t.Errorf("max_send_delay %q: stored %q (%v), want %q", c.delay, got, err, c.want)
		}
	}
	// A plain INSERT is held to the same bounds.
	_, err := pool.Exec(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
		target, fingerprint, state_actor, max_send_delay) VALUES ('raw', 'op', 'dep', 'POST', '/x', $1, 'agent:a', '11 minutes')`, fpOf(99))
	if sqlState(err) != "23514" {
		t.Errorf("insert with max_send_delay 11 minutes: got %v, want check_violation", err)
	}
}

// Issue 7, path 7: a logical key (the key without a final #<digits>) is
// unambiguous for every key the SQL API accepts: first keys may hold "#",
// quotes and unicode, up to 255 bytes, but may not end in #<digits>; a
// retry's key is exactly "<logical key>#<attempt>".
func TestIdempotencyKeys(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	b255 := strings.Repeat("é", 127) + "k" // 255 bytes, 128 characters
	for i, c := range []struct {
		key string
		ok  bool
	}{
		{"order#8812:charge", true},
		{`it's "quoted" \ and ; semi`, true},
		{"ключ:שלב:🔑", true},
		{"x#", true},
		{"x#1a", true},
		{"#", true},
		{b255, true},
		{"x#1", false},
		{"x#0", false},
		{"order#8812", false},
		{"x##12", false},
		{b255 + "k", false},
		{strings.Repeat("k", 256), false},
	} {
		_, err := planSQL(ctx, pool, planArgs{key: c.key, fp: fpOf(i)})
		if c.ok && err != nil {
			t.Errorf("key %q (%d bytes): %v, want accepted", c.key, len(c.key), err)
		}
		if !c.ok && sqlState(err) != "RL007" {
			t.Errorf("key %q (%d bytes): got %v, want RL007", c.key, len(c.key), err)
		}
	}
	// A plain INSERT is held to the same rule.
	for _, key := range []string{"raw#7", strings.Repeat("k", 256)} {
		_, err := pool.Exec(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
			target, fingerprint, state_actor) VALUES ($1, 'op', 'dep', 'POST', '/x', $2, 'agent:a')`, key, fpOf(200))
		if sqlState(err) != "RL007" {
			t.Errorf("insert key %.20q: got %v, want RL007", key, err)
		}
	}

	// Retries of "order#8812:charge": only "order#8812:charge#2", then #3.
	first := mustPlan(t, pool, planArgs{key: "pay:order#8812:charge", fp: fpOf(500)})
	retryable := `{"error":{"code":"rate_limited","retryable":true}}`
	reject := func(id int64) {
		t.Helper()
		if _, err := pool.Exec(ctx, `SELECT reconciler.transition($1, 'rejected', 'agent:a', $2::jsonb)`, id, retryable); err != nil {
			t.Fatal(err)
		}
	}
	reject(first)
	for _, key := range []string{"pay:order#2", "pay:order#8812:charge#1", "pay:order#8812:charge#3",
		"pay:order#8812:charge#02", "pay:order#8812:charge2", "other#2"} {
		if _, err := planSQL(ctx, pool, planArgs{key: key, fp: fpOf(500), retryOf: first}); sqlState(err) != "RL007" {
			t.Errorf("retry of %d keyed %q: got %v, want RL007", first, key, err)
		}
	}
	second := mustPlan(t, pool, planArgs{key: "pay:order#8812:charge#2", fp: fpOf(500), retryOf: first})
	reject(second)
	if _, err := planSQL(ctx, pool, planArgs{key: "pay:order#8812:charge#2#3", fp: fpOf(500), retryOf: second}); sqlState(err) != "RL007" {
		t.Errorf("retry of a retry keyed on its full key: got %v, want RL007", err)
	}
	third := mustPlan(t, pool, planArgs{key: "pay:order#8812:charge#3", fp: fpOf(500), retryOf: second})
	// Every attempt shares one logical key, and no other receipt has it.
	rows, err := pool.Query(ctx, `SELECT id, attempt FROM reconciler.receipts
		WHERE regexp_replace(idempotency_key, '#[0-9]+$', '') = 'pay:order#8812:charge' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	type att struct{ ID, Attempt int64 }
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[att])
	if err != nil {
		t.Fatal(err)
	}
	if want := []att{{first, 1}, {second, 2}, {third, 3}}; !reflect.DeepEqual(got, want) {
		t.Errorf("attempts of logical key pay:order#8812:charge: %v, want %v", got, want)
	}
}

// Issue 7 (suspicion "Client.Retry with a changed payload wedges the step
// on RL004"): confirmed on the old schema, which inserted the retry's key
// with the new fingerprint, so every later retry hit RL004 on that key.
// Now plan refuses a retry whose intent differs before inserting anything
// (RL004), the key stays free, and the correct retry then works. A known key
// asked for with another retry_of is RL004 too.
func TestRetryWithAnotherIntent(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	prev := mustPlan(t, pool, planArgs{key: "t:s:create", fp: fpOf(1)})
	if _, err := pool.Exec(ctx, `SELECT reconciler.transition($1, 'rejected', 'agent:a',
		'{"error":{"code":"not_sent","retryable":true}}')`, prev); err != nil {
		t.Fatal(err)
	}
	for name, a := range map[string]planArgs{
		"changed payload":    {key: "t:s:create#2", fp: fpOf(2), retryOf: prev},
		"changed dependency": {key: "t:s:create#2", fp: fpOf(1), dep: "other-api", retryOf: prev},
	} {
		if _, err := planSQL(ctx, pool, a); sqlState(err) != "RL004" {
			t.Errorf("%s: got %v, want RL004", name, err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM reconciler.receipt_keys WHERE idempotency_key = 't:s:create#2')
		+ (SELECT count(*) FROM reconciler.receipts WHERE retry_of = $1)`, prev).Scan(&n); err != nil || n != 0 {
		t.Fatalf("refused retries left %d rows (%v), want none", n, err)
	}
	retry := mustPlan(t, pool, planArgs{key: "t:s:create#2", fp: fpOf(1), retryOf: prev})
	again := mustPlan(t, pool, planArgs{key: "t:s:create#2", fp: fpOf(1), retryOf: prev})
	if again != retry {
		t.Errorf("re-plan of the retry: receipt %d, want %d", again, retry)
	}
	if _, err := planSQL(ctx, pool, planArgs{key: "t:s:create#2", fp: fpOf(1)}); sqlState(err) != "RL004" {
		t.Errorf("the retry's key as a first attempt: got %v, want RL004", err)
	}
	if _, err := planSQL(ctx, pool, planArgs{key: "t:s:create", fp: fpOf(1), retryOf: prev}); sqlState(err) != "RL004" {
		t.Errorf("the first key as a retry: got %v, want RL004", err)
	}
}

// Issue 7, path 9: columns that describe the intent or a past move never
// change, whoever writes (here the owner, who holds every privilege): each
// UPDATE is refused with RL006 and the receipt is left as it was. An UPDATE
// that is no move may not rewrite the latest move's actor, detail or
// external id. The reconciler's bookkeeping stays writable.
func TestImmutableColumns(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	// A deterministic 400: not retryable.
	rejected := mustPlan(t, pool, planArgs{key: "k:rejected", fp: fpOf(1)})
	if _, err := pool.Exec(ctx, `SELECT reconciler.transition($1, 'rejected', 'agent:a',
		'{"error":{"code":"http_400","retryable":false}}')`, rejected); err != nil {
		t.Fatal(err)
	}
	unknown := mustPlan(t, pool, planArgs{key: "k:unknown", fp: fpOf(2)})
	mustMove(t, pool, unknown, "agent:a", "submitted")
	if _, err := pool.Exec(ctx, `SELECT reconciler.transition($1, 'outcome_unknown', 'agent:a',
		'{"error":{"code":"timeout","retryable":false}}')`, unknown); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct{ name, set string }{
		{"state_detail retryable without a move", `state_detail = jsonb_set(state_detail, '{error,retryable}', 'true')`},
		{"state_detail", `state_detail = '{}'`},
		{"state_actor", `state_actor = 'human:mallory'`},
		{"external_id", `external_id = 'forged'`},
		{"idempotency_key", `idempotency_key = 'k:other'`},
		{"operation", `operation = 'articles.delete'`},
		{"dependency", `dependency = 'other-api'`},
		{"method", `method = 'GET'`},
		{"target", `target = '/elsewhere'`},
		{"fingerprint", `fingerprint = 'sha256:' || repeat('f', 64)`},
		{"intent", `intent = '{"forged":true}'`},
		{"pre_image", `pre_image = '{"forged":true}'`},
		{"attempt", `attempt = 2`},
		{"retry_of", `retry_of = id`},
		{"created_at", `created_at = created_at - interval '1 hour'`},
		{"max_send_delay", `max_send_delay = '10 minutes'`},
		{"guarded", `guarded = false`},
		{"submitted_at", `submitted_at = clock_timestamp() + interval '1 hour'`},
		// Issue 7, adversarial review: who submitted decides which agent
		// login may settle; nobody rewrites it.
		{"submitted_by", `submitted_by = 'mallory'`},
		{"submitted_by set or cleared", `submitted_by = CASE WHEN submitted_by IS NULL THEN current_user END`},
		{"unknown_since", `unknown_since = clock_timestamp()`},
		{"updated_at", `updated_at = clock_timestamp()`},
		{"version", `version = version + 1`},
	} {
		for _, id := range []int64{rejected, unknown} {
			before := rowJSON(t, pool, id)
			_, err := pool.Exec(ctx, `UPDATE reconciler.receipts SET `+c.set+` WHERE id = $1`, id)
			if sqlState(err) != "RL006" {
				t.Errorf("receipt %d: %s: got %v, want RL006", id, c.name, err)
			}
			if after := rowJSON(t, pool, id); after != before {
				t.Errorf("receipt %d: %s refused but the row changed:\n%s\n%s", id, c.name, before, after)
			}
		}
	}
	// Also alongside a legal move: the trigger stamps submitted_at itself.
	planned := mustPlan(t, pool, planArgs{key: "k:planned", fp: fpOf(3)})
	_, err := pool.Exec(ctx, `UPDATE reconciler.receipts SET state = 'submitted', state_actor = 'agent:a',
		submitted_at = clock_timestamp() + interval '1 hour' WHERE id = $1`, planned)
	if sqlState(err) != "RL006" || stateOf(t, pool, planned) != "planned" {
		t.Errorf("submit with a chosen submitted_at: got %v, want RL006 and still planned", err)
	}
	// The 400 stays a 400: it cannot be retried.
	if _, err := planSQL(ctx, pool, planArgs{key: "k:rejected#2", fp: fpOf(1), retryOf: rejected}); sqlState(err) != "RL002" {
		t.Errorf("retry of a deterministic rejection: got %v, want RL002", err)
	}
	// Bookkeeping is not history.
	if _, err := pool.Exec(ctx, `UPDATE reconciler.receipts SET lease_owner = 'w', lease_expires_at = clock_timestamp(),
		next_check_at = clock_timestamp(), check_count = 3, last_check_transient = true WHERE id = $1`, unknown); err != nil {
		t.Errorf("bookkeeping update: %v", err)
	}
}

func rowJSON(t *testing.T, pool *pgxpool.Pool, id int64) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT to_jsonb(r)::text || (SELECT count(*) FROM reconciler.receipt_events
		WHERE receipt_id = r.id) FROM reconciler.receipts r WHERE id = $1`, id).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// Issue 7 (suspicion "a requeued receipt keeps its check count and deadline
// and goes straight back to manual_review"): confirmed on the old schema.
// Every move to outcome_unknown, a requeue included, starts a fresh check
// budget: check_count 0, unknown_since and next_check_at the move's time.
func TestRequeueStartsFreshBudget(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := mustPlan(t, pool, planArgs{key: "requeue", fp: fpOf(1)})
	mustMove(t, pool, id, "agent:a", "submitted", "outcome_unknown")
	mustMove(t, pool, id, "reconciler:r1", "reconciling")
	if _, err := pool.Exec(ctx, `UPDATE reconciler.receipts SET check_count = 12, last_check_transient = true
		WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	mustMove(t, pool, id, "reconciler:r1", "manual_review")
	var firstUnknown time.Time
	if err := pool.QueryRow(ctx, `SELECT unknown_since FROM reconciler.receipts WHERE id = $1`, id).Scan(&firstUnknown); err != nil {
		t.Fatal(err)
	}
	mustMove(t, pool, id, "human:ann", "outcome_unknown")
	var checks int
	var transient, fresh bool
	err := pool.QueryRow(ctx, `SELECT check_count, last_check_transient,
		unknown_since > $2 AND next_check_at = unknown_since AND unknown_since = updated_at
		FROM reconciler.receipts WHERE id = $1`, id, firstUnknown).Scan(&checks, &transient, &fresh)
	if err != nil {
		t.Fatal(err)
	}
	if checks != 0 || transient || !fresh {
		t.Errorf("after requeue: check_count %d, last_check_transient %v, fresh unknown_since/next_check_at %v; want 0, false, true",
			checks, transient, fresh)
	}
}

// Issue 7 (suspicion "the orphan sweep moving a receipt while its agent is
// between submitted and the response: the agent's 2xx and external id must
// not be lost"): the agent records what it learned through
// reconciler.record_late_outcome, only for its own receipt once the sweep
// moved it; a late success keeps the receipt from safe_to_retry.
func TestLateOutcomes(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	swept := mustPlan(t, pool, planArgs{key: "late:swept", fp: fpOf(1)})
	mustMove(t, pool, swept, "agent:a", "submitted")
	mustMove(t, pool, swept, "reconciler:r1", "outcome_unknown") // the orphan sweep
	live := mustPlan(t, pool, planArgs{key: "late:live", fp: fpOf(2)})
	mustMove(t, pool, live, "agent:a", "submitted")
	done := mustPlan(t, pool, planArgs{key: "late:done", fp: fpOf(3)})
	mustMove(t, pool, done, "agent:a", "submitted", "succeeded")

	record := func(id int64, actor, outcome string) error {
		_, err := pool.Exec(ctx, `SELECT reconciler.record_late_outcome(receipt_id => $1, actor => $2, outcome => $3,
			http_status => 201, external_id => 'post-7', detail => '{"reason":"201"}')`, id, actor, outcome)
		return err
	}
	for _, c := range []struct {
		name    string
		id      int64
		actor   string
		outcome string
		code    string
	}{
		{"another agent", swept, "agent:b", "succeeded", "RL002"},
		{"still submitted", live, "agent:a", "succeeded", "RL002"},
		{"already settled", done, "agent:a", "succeeded", "RL002"},
		{"no such receipt", 1 << 40, "agent:a", "succeeded", "RL002"},
		{"unknown outcome", swept, "agent:a", "safe_to_retry", "23514"},
	} {
		if err := record(c.id, c.actor, c.outcome); sqlState(err) != c.code {
			t.Errorf("%s: got %v, want %s", c.name, err, c.code)
		}
	}
	if err := record(swept, "agent:a", "succeeded"); err != nil {
		t.Fatalf("late outcome of the agent's own swept receipt: %v", err)
	}
	var outcome, ext string
	var status int
	var recent bool
	if err := pool.QueryRow(ctx, `SELECT outcome, http_status, external_id, at > clock_timestamp() - interval '1 minute'
		FROM reconciler.late_outcomes WHERE receipt_id = $1`, swept).Scan(&outcome, &status, &ext, &recent); err != nil ||
		outcome != "succeeded" || status != 201 || ext != "post-7" || !recent {
		t.Errorf("late outcome row: %s %d %s %v (%v)", outcome, status, ext, recent, err)
	}
	for _, stmt := range []string{
		`UPDATE reconciler.late_outcomes SET outcome = 'rejected'`,
		`DELETE FROM reconciler.late_outcomes`,
		`TRUNCATE reconciler.late_outcomes`,
	} {
		if _, err := pool.Exec(ctx, stmt); sqlState(err) != "RL006" {
			t.Errorf("%s: got %v, want RL006", stmt, err)
		}
	}
	// The effect exists: never safe_to_retry; succeeded with the agent's id.
	mustMove(t, pool, swept, "reconciler:r1", "reconciling")
	before := snap(t, pool, swept)
	if err := move(ctx, pool, swept, "safe_to_retry", "reconciler:r1"); sqlState(err) != "RL002" {
		t.Errorf("safe_to_retry despite a late success: got %v, want RL002", err)
	}
	if after := snap(t, pool, swept); after != before {
		t.Errorf("refused settlement changed the receipt: %+v -> %+v", before, after)
	}
	if _, err := pool.Exec(ctx, `SELECT reconciler.transition($1, 'succeeded', 'reconciler:r1', '{"reason":"agent_response"}', 'post-7')`,
		swept); err != nil {
		t.Errorf("settle from the late outcome: %v", err)
	}
	// A late rejection is no effect: absence may still be proven.
	other := mustPlan(t, pool, planArgs{key: "late:rejected", fp: fpOf(4)})
	mustMove(t, pool, other, "agent:a", "submitted")
	mustMove(t, pool, other, "reconciler:r1", "outcome_unknown", "reconciling")
	if err := record(other, "agent:a", "rejected"); err != nil {
		t.Fatal(err)
	}
	mustMove(t, pool, other, "reconciler:r1", "safe_to_retry")
}

// TestLateSuccessAfterSafeToRetry: a success that reaches the agent after
// the reconciler settled its receipt safe_to_retry (a declared window too
// short) is recorded, and from then on the database refuses every retry of
// that receipt: the effect exists, so attempt n+1 would be a duplicate.
// (Issue 7, late outcomes; the risk left by the orphan-sweep fix.)
func TestLateSuccessAfterSafeToRetry(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := mustPlan(t, pool, planArgs{key: "late:settled", fp: fpOf(5)})
	mustMove(t, pool, id, "agent:a", "submitted")
	mustMove(t, pool, id, "reconciler:r1", "outcome_unknown", "reconciling", "safe_to_retry")
	if _, err := pool.Exec(ctx, `SELECT reconciler.record_late_outcome(receipt_id => $1, actor => 'agent:a',
		outcome => 'succeeded', http_status => 201, external_id => 'post-9')`, id); err != nil {
		t.Fatalf("late success after safe_to_retry: %v", err)
	}
	_, err := planSQL(ctx, pool, planArgs{key: "late:settled#2", fp: fpOf(5), retryOf: id})
	if sqlState(err) != "RL002" || !strings.Contains(err.Error(), "success") {
		t.Fatalf("retry of a receipt with a late success: got %v, want RL002 naming the late success", err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE retry_of = $1`, id).Scan(&n); err != nil || n != 0 {
		t.Errorf("refused retry left %d receipts (%v)", n, err)
	}
}

// TestInsertedRetryObeysRetryRules: a client that INSERTs a retry itself
// instead of calling reconciler.plan meets the same rule: only a
// safe_to_retry receipt or a retryable rejection may be retried. Otherwise
// a retry of an outcome_unknown receipt, inserted unguarded, would be sent
// while the original may have taken effect.
func TestInsertedRetryObeysRetryRules(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	unknown := mustPlan(t, pool, planArgs{key: "insert:unknown", fp: fpOf(6)})
	mustMove(t, pool, unknown, "agent:a", "submitted", "outcome_unknown")
	_, err := pool.Exec(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
		target, fingerprint, intent, state_actor, attempt, retry_of, guarded)
		VALUES ('insert:unknown#2', 'articles.create', 'blog-api', 'POST', '/articles', $1, '{}', 'agent:a', 2, $2, false)`,
		fpOf(6), unknown)
	if sqlState(err) != "RL002" {
		t.Fatalf("inserted retry of an outcome_unknown receipt: got %v, want RL002", err)
	}
}

// TestMigration00004Down: the soundness migration's Down restores the
// schema of 00003 (plan's old signature, no new columns or tables), and Up
// applies again on top of it.
func TestMigration00004Down(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.NewEmptyDatabase(t))
	db := migrations.OpenDB(pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	// Below 00004 the Down refuses while a receipt is unsettled
	// (integration.TestDownBelowSoundnessKeepsItsData): this one is
	// settled before going down.
	before := mustPlan(t, pool, planArgs{key: "before-down", fp: fpOf(1)})
	mustMove(t, pool, before, "agent:a", "rejected")
	if _, err := p.DownTo(ctx, 3); err != nil {
		t.Fatalf("down to 3: %v", err)
	}
	var cols, tables int
	var oldPlan bool
	if err := pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM information_schema.columns WHERE table_schema = 'reconciler' AND table_name = 'receipts'
		 AND column_name IN ('max_send_delay', 'guarded', 'unknown_since', 'submitted_by')),
		(SELECT count(*) FROM information_schema.tables WHERE table_schema = 'reconciler' AND table_name = 'late_outcomes'),
		to_regprocedure('reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb)') IS NOT NULL`).
		Scan(&cols, &tables, &oldPlan); err != nil {
		t.Fatal(err)
	}
	if cols != 0 || tables != 0 || !oldPlan {
		t.Errorf("after down: %d new columns, %d late_outcomes tables, old plan %v", cols, tables, oldPlan)
	}
	var id int64
	if err := pool.QueryRow(ctx, `SELECT id FROM reconciler.plan('after-down', 'op', 'dep', 'POST', '/x', $1, '{}', 'agent:a')`,
		fpOf(2)).Scan(&id); err != nil {
		t.Errorf("old plan after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("up again: %v", err)
	}
	mustPlan(t, pool, planArgs{key: "after-up", fp: fpOf(3)})
}

// lateSettled plans and submits a receipt as agent:a, lets the orphan sweep
// and the reconciler move it to reconciling, records a late outcome there
// if atReconciling is set, and settles it safe_to_retry.
func lateSettled(t *testing.T, pool *pgxpool.Pool, key string, n int, atReconciling string) int64 {
	t.Helper()
	// A send deadline of 10 minutes: a late outcome recorded while
	// reconciling is inside the (undeclared, so strictest) absence window
	// however slow the machine, and does not void it (migration 00014).
	id := mustPlan(t, pool, planArgs{key: key, fp: fpOf(n), delay: "10 minutes"})
	mustMove(t, pool, id, "agent:a", "submitted")
	mustMove(t, pool, id, "reconciler:r1", "outcome_unknown", "reconciling")
	if atReconciling != "" {
		recordLate(t, pool, id, atReconciling)
	}
	mustMove(t, pool, id, "reconciler:r1", "safe_to_retry")
	return id
}

func recordLate(t *testing.T, q querier, id int64, outcome string) {
	t.Helper()
	recordLateStatus(t, q, id, outcome, 502)
}

// recordLateStatus records a late outcome with the HTTP status the agent
// saw; 0 records none (a client-side timeout or reset).
func recordLateStatus(t *testing.T, q querier, id int64, outcome string, status int) {
	t.Helper()
	var st *int
	if status != 0 {
		st = &status
	}
	if _, err := q.Exec(context.Background(), `SELECT reconciler.record_late_outcome(receipt_id => $1,
		actor => 'agent:a', outcome => $2, http_status => $3)`, id, outcome, st); err != nil {
		t.Fatalf("late %s of receipt %d: %v", outcome, id, err)
	}
}

// A late outcome_unknown without an HTTP status (the agent's own timeout)
// recorded while the reconciler was still reading back does not refuse the
// retry: the window the settlement waited out already covers a request the
// client gave up on. The same timeout recorded after the settlement does:
// the call was still alive past the window.
func TestLateClientTimeoutBeforeSettlementAllowsRetry(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	before := mustPlan(t, pool, planArgs{key: "late-timeout-before", fp: fpOf(301), delay: "10 minutes"})
	mustMove(t, pool, before, "agent:a", "submitted")
	mustMove(t, pool, before, "reconciler:r1", "outcome_unknown", "reconciling")
	recordLateStatus(t, pool, before, "outcome_unknown", 0)
	mustMove(t, pool, before, "reconciler:r1", "safe_to_retry")
	if _, err := planSQL(ctx, pool, planArgs{key: "late-timeout-before#2", fp: fpOf(301), retryOf: before}); err != nil {
		t.Errorf("retry after a client timeout recorded before the settlement: %v", err)
	}

	after := mustPlan(t, pool, planArgs{key: "late-timeout-after", fp: fpOf(302)})
	mustMove(t, pool, after, "agent:a", "submitted")
	mustMove(t, pool, after, "reconciler:r1", "outcome_unknown", "reconciling", "safe_to_retry")
	recordLateStatus(t, pool, after, "outcome_unknown", 0)
	_, err := planSQL(ctx, pool, planArgs{key: "late-timeout-after#2", fp: fpOf(302), retryOf: after})
	checkRefusal(t, "retry after a client timeout recorded after the settlement", err, true, "still alive")
}

// Issue 7, adversarial review: a late outcome 'succeeded' (the effect
// exists) or 'outcome_unknown' (a 502 or a timeout: the original outlived
// the window the settlement assumed) refuses every retry of the receipt,
// with RL002 saying what the agent saw and that a human must look; a late
// 'rejected' proves no effect and refuses nothing. The rule holds whether
// the late outcome came before the retry was planned (plan refuses) or
// after it was planned and before it was submitted (the submission re-runs
// reconciler.retry_error; the retry stays planned and nothing is recorded).
func TestLateOutcomeRefusesRetry(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	for i, c := range []struct {
		late, when string
		refused    bool
		says       string // in the refusal
	}{
		{"succeeded", "before plan", true, "received a success"},
		{"succeeded", "before submit", true, "received a success"},
		{"outcome_unknown", "before plan", true, "still alive"},
		{"outcome_unknown", "before submit", true, "still alive"},
		{"outcome_unknown", "while reconciling", true, "still alive"},
		{"rejected", "before plan", false, ""},
		{"rejected", "before submit", false, ""},
		{"rejected", "while reconciling", false, ""},
		{"", "never", false, ""},
	} {
		name := fmt.Sprintf("late %q %s", c.late, c.when)
		key := fmt.Sprintf("late-retry-%d", i)
		var prev int64
		if c.when == "while reconciling" {
			prev = lateSettled(t, pool, key, 100+i, c.late)
		} else {
			prev = lateSettled(t, pool, key, 100+i, "")
		}
		if c.when == "before plan" {
			recordLate(t, pool, prev, c.late)
		}
		retry, err := planSQL(ctx, pool, planArgs{key: key + "#2", fp: fpOf(100 + i), retryOf: prev})
		if c.when != "before submit" {
			checkRefusal(t, name+": plan", err, c.refused, c.says)
			if err == nil {
				mustMove(t, pool, retry, "agent:a", "submitted")
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: plan: %v", name, err)
		}
		recordLate(t, pool, prev, c.late)
		before := snap(t, pool, retry)
		err = move(ctx, pool, retry, "submitted", "agent:a")
		checkRefusal(t, name+": submit", err, c.refused, c.says)
		if c.refused {
			if pe := pgErr(err); pe == nil || pe.Detail != fmt.Sprint(prev) {
				t.Errorf("%s: refusal's DETAIL is not the retried receipt %d: %v", name, prev, err)
			}
			if after := snap(t, pool, retry); after != before {
				t.Errorf("%s: refused submission changed the retry: %+v -> %+v", name, before, after)
			}
			// The other outcome of a planned receipt stays open.
			mustMove(t, pool, retry, "agent:a", "rejected")
		}
	}
}

func checkRefusal(t *testing.T, what string, err error, refused bool, says string) {
	t.Helper()
	if !refused {
		if err != nil {
			t.Errorf("%s: %v, want accepted", what, err)
		}
		return
	}
	if sqlState(err) != "RL002" || !strings.Contains(err.Error(), says) || !strings.Contains(err.Error(), "a human must look") {
		t.Errorf("%s: got %v, want RL002 saying %q and that a human must look", what, err, says)
	}
}

// Issue 7, adversarial review: reconciler.record_late_outcome keeps any
// outcome an agent observed for its call once the orphan sweep moved it
// (outcome_unknown, reconciling, manual_review, safe_to_retry), not only
// successes; in the agent's own states (planned, submitted) and the other
// settled ones it refuses with RL002.
func TestLateOutcomeAnyOutcome(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	at := map[string][]string{
		"planned":         nil,
		"submitted":       {"agent:a:submitted"},
		"succeeded":       {"agent:a:submitted", "agent:a:succeeded"},
		"rejected":        {"agent:a:rejected"},
		"outcome_unknown": {"agent:a:submitted", "reconciler:r1:outcome_unknown"},
		"reconciling":     {"agent:a:submitted", "reconciler:r1:outcome_unknown", "reconciler:r1:reconciling"},
		"manual_review":   {"agent:a:submitted", "reconciler:r1:outcome_unknown", "reconciler:r1:manual_review"},
		"safe_to_retry": {"agent:a:submitted", "reconciler:r1:outcome_unknown", "reconciler:r1:reconciling",
			"reconciler:r1:safe_to_retry"},
	}
	n := 0
	for state, moves := range at {
		accepted := state == "outcome_unknown" || state == "reconciling" || state == "manual_review" || state == "safe_to_retry"
		for _, outcome := range []string{"succeeded", "rejected", "outcome_unknown"} {
			n++
			id := mustPlan(t, pool, planArgs{key: fmt.Sprintf("late-any-%d", n), fp: fpOf(300 + n)})
			for _, m := range moves {
				i := strings.LastIndex(m, ":")
				mustMove(t, pool, id, m[:i], m[i+1:])
			}
			_, err := pool.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:a', $2)`, id, outcome)
			if accepted && err != nil {
				t.Errorf("late %s of a receipt in %s: %v, want recorded", outcome, state, err)
			}
			if !accepted && sqlState(err) != "RL002" {
				t.Errorf("late %s of a receipt in %s: got %v, want RL002", outcome, state, err)
			}
		}
	}
}

// Issue 7, adversarial review: record_late_outcome holds the receipt FOR
// UPDATE and a retry's submission holds it FOR SHARE while it re-runs
// retry_error, so the two serialize: a submission waiting on a late
// success being recorded sees it once it commits and is refused; a late
// outcome recorded while a retry's submission is open waits for it.
func TestLateOutcomeSerializesWithRetrySubmission(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	waitLocked := func(query string) {
		t.Helper()
		for range 200 {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, query).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("no session waits on a lock in %q", query)
	}

	// 1. The late success first: the submission waits, then is refused.
	prev := lateSettled(t, pool, "serial-1", 401, "")
	retry := mustPlan(t, pool, planArgs{key: "serial-1#2", fp: fpOf(401), retryOf: prev})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	recordLate(t, tx, prev, "succeeded")
	done := make(chan error, 1)
	go func() { done <- move(ctx, pool, retry, "submitted", "agent:a") }()
	waitLocked("reconciler.transition")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; sqlState(err) != "RL002" {
		t.Errorf("submission that waited for a late success: got %v, want RL002", err)
	}
	if s := stateOf(t, pool, retry); s != "planned" {
		t.Errorf("retry is %s, want planned", s)
	}

	// 2. The submission first: the late outcome waits for it.
	prev = lateSettled(t, pool, "serial-2", 402, "")
	retry = mustPlan(t, pool, planArgs{key: "serial-2#2", fp: fpOf(402), retryOf: prev})
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	mustMove(t, tx, retry, "agent:a", "submitted")
	go func() {
		_, err := pool.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:a', 'succeeded')`, prev)
		done <- err
	}()
	waitLocked("record_late_outcome")
	select {
	case err := <-done:
		t.Fatalf("late outcome recorded while the retry's submission held the receipt: %v", err)
	default:
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Errorf("late outcome after the submission committed: %v", err)
	}
}

// Issue 7, adversarial review: submitted_by is the database login that
// moved the receipt planned -> submitted, stamped by the trigger: NULL on
// insert whatever the client sends, current_user on submission, and then
// immutable (TestImmutableColumns).
func TestSubmittedBy(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	var id int64
	var by *string
	if err := pool.QueryRow(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
		target, fingerprint, state_actor, submitted_by) VALUES ('by-forged', 'op', 'dep', 'POST', '/x', $1, 'agent:a', 'mallory')
		RETURNING id, submitted_by`, fpOf(500)).Scan(&id, &by); err != nil || by != nil {
		t.Fatalf("insert with submitted_by: %v, %v; want NULL", by, err)
	}
	mustMove(t, pool, id, "agent:a", "submitted")
	var same bool
	if err := pool.QueryRow(ctx, `SELECT submitted_by = current_user FROM reconciler.receipts WHERE id = $1`, id).Scan(&same); err != nil || !same {
		t.Errorf("submitted_by after submission is not current_user (%v)", err)
	}
	// The move out of submitted by the same login: one name comparison.
	mustMove(t, pool, id, "agent:a", "succeeded")
}
