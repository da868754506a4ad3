package integration

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// upgradeDependency is the dependency of every receipt the upgrade tests
// record; its readback adapter answers present.
const upgradeDependency = "upgrade-api"

// provider returns a goose provider over pool for the embedded migrations.
func provider(t testing.TB, pool *pgxpool.Pool) *goose.Provider {
	t.Helper()
	db := migrations.OpenDB(pool)
	t.Cleanup(func() { db.Close() })
	p, err := migrations.NewProvider(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// ledgerAt returns a pool on a new database migrated up to version v, and
// the provider that migrated it.
func ledgerAt(t testing.TB, v int64) (*pgxpool.Pool, *goose.Provider) {
	t.Helper()
	db := pgtest.Pool(t, pgtest.NewEmptyDatabase(t))
	p := provider(t, db)
	if _, err := p.UpTo(context.Background(), v); err != nil {
		t.Fatalf("migrate up to %05d: %v", v, err)
	}
	return db, p
}

// olderVersions are the versions a database may be at when `migrate up`
// brings it to the latest: every embedded migration but the latest. Each
// was the schema of some release, and a `migrate up` that stopped part way
// (one migration is one transaction) leaves a database at any of them.
func olderVersions(t testing.TB) []int64 {
	t.Helper()
	names, err := fs.Glob(migrations.FS(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	var vs []int64
	for _, name := range names {
		prefix, _, _ := strings.Cut(name, "_")
		v, err := strconv.ParseInt(prefix, 10, 64)
		if err != nil {
			t.Fatalf("migration %s: %v", name, err)
		}
		if v < migrations.Latest() {
			vs = append(vs, v)
		}
	}
	return vs
}

// flightMove is one move of a receipt after its plan, made with what every
// schema version offers: reconciler.transition, or for a claim the UPDATE
// the reconciler makes (state and lease in one statement).
type flightMove struct {
	to, actor, detail, externalID string
	lease                         bool
}

var (
	mvSubmit  = flightMove{to: "submitted", actor: "agent:old"}
	mvUnknown = flightMove{to: "outcome_unknown", actor: "agent:old", detail: `{"error": {"code": "timeout"}}`}
	mvClaim   = flightMove{to: "reconciling", actor: "reconciler:old"}
	mvLease   = flightMove{to: "reconciling", actor: "reconciler:old", lease: true}
	mvReview  = flightMove{to: "manual_review", actor: "reconciler:old", detail: `{"reason": "blind endpoint"}`}
	mvSafe    = flightMove{to: "safe_to_retry", actor: "reconciler:old", detail: `{"evidence": {"absent": true}}`}
	mvSucceed = flightMove{to: "succeeded", actor: "agent:old", externalID: "thing-old"}
	mvReject  = flightMove{to: "rejected", actor: "agent:old", detail: `{"error": {"code": "not_sent", "retryable": true}}`}
)

// inFlight is a ledger as an operator upgrades it: a receipt in every
// state, with the moves that brought it there. A case with retry also has
// its next attempt planned (the "<name>#2" receipt).
var inFlight = []struct {
	name  string
	moves []flightMove
	retry bool
}{
	{name: "planned"},
	{name: "submitted", moves: []flightMove{mvSubmit}}, // an agent mid-call
	{name: "unknown", moves: []flightMove{mvSubmit, mvUnknown}},
	{name: "leased", moves: []flightMove{mvSubmit, mvUnknown, mvLease}},
	{name: "review", moves: []flightMove{mvSubmit, mvUnknown, mvClaim, mvReview}},
	{name: "succeeded", moves: []flightMove{mvSubmit, mvSucceed}},
	{name: "safe", moves: []flightMove{mvSubmit, mvUnknown, mvClaim, mvSafe}, retry: true},
	{name: "rejected", moves: []flightMove{mvSubmit, mvReject}},
}

// oldLease is the lease a claim made before the upgrade holds: longer than
// the test takes, so only the injected clock makes it expire.
const oldLease = 10 * time.Minute

// flightIntent is the intent of case name in a ledger seeded with tag.
func flightIntent(tag, name string) ledger.Intent {
	return ledger.Intent{IdempotencyKey: "upgrade:" + tag + ":" + name, Operation: "things.create",
		Dependency: upgradeDependency, Method: "POST", Target: "/things",
		Payload: []byte(fmt.Sprintf(`{"case": %q, "tag": %q}`, name, tag))}
}

// planSQL plans with the arguments reconciler.plan has had since 00001.
const planSQL = `SELECT id FROM reconciler.plan($1, $2, $3, $4, $5, $6, $7::jsonb, $8, retry_of => $9)`

// planAt plans in with the SQL function every version has.
func planAt(t testing.TB, db *pgxpool.Pool, in ledger.Intent, retryOf *int64) int64 {
	t.Helper()
	fp, err := fingerprint.Compute(in.Method, in.Target, in.Payload)
	if err != nil {
		t.Fatal(err)
	}
	var id int64
	if err := db.QueryRow(context.Background(), planSQL, in.IdempotencyKey, in.Operation, in.Dependency,
		in.Method, in.Target, fp.Fingerprint, string(fp.Intent), "agent:old", retryOf).Scan(&id); err != nil {
		t.Fatalf("plan %s: %v", in.IdempotencyKey, err)
	}
	return id
}

// moveAt makes m on receipt id with what every version has.
func moveAt(t testing.TB, db *pgxpool.Pool, id int64, m flightMove) {
	t.Helper()
	ctx := context.Background()
	if m.lease {
		tag, err := db.Exec(ctx, `UPDATE reconciler.receipts
			SET state = 'reconciling', state_actor = $2, lease_owner = 'old-instance/0badf00d/1',
			    lease_expires_at = clock_timestamp() + $3::interval, next_check_at = clock_timestamp() + $3::interval
			WHERE id = $1 AND state = 'outcome_unknown'`, id, m.actor, oldLease.String())
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("claim receipt %d: %v (%d rows)", id, err, tag.RowsAffected())
		}
		return
	}
	detail, ext := m.detail, &m.externalID
	if detail == "" {
		detail = "{}"
	}
	if m.externalID == "" {
		ext = nil
	}
	if _, err := db.Exec(ctx, `SELECT FROM reconciler.transition($1, $2, $3, $4::jsonb, $5)`,
		id, m.to, m.actor, detail, ext); err != nil {
		t.Fatalf("receipt %d -> %s: %v", id, m.to, err)
	}
}

// seedFlight records the inFlight receipts (tag keeps their keys and
// intents apart from other seeds) and returns their ids by case name.
func seedFlight(t testing.TB, db *pgxpool.Pool, tag string) map[string]int64 {
	t.Helper()
	ids := map[string]int64{}
	for _, c := range inFlight {
		in := flightIntent(tag, c.name)
		id := planAt(t, db, in, nil)
		for _, m := range c.moves {
			moveAt(t, db, id, m)
		}
		ids[c.name] = id
		if c.retry {
			in.IdempotencyKey += "#2"
			ids[c.name+"#2"] = planAt(t, db, in, &id)
		}
	}
	return ids
}

// lifecycleAt plans, submits and settles a new receipt succeeded with the
// SQL functions every version has: the ledger at that version works.
func lifecycleAt(t testing.TB, db *pgxpool.Pool, tag string) {
	t.Helper()
	id := planAt(t, db, flightIntent(tag, "new"), nil)
	moveAt(t, db, id, mvSubmit)
	moveAt(t, db, id, mvSucceed)
	var state string
	var events int
	if err := db.QueryRow(context.Background(), `SELECT state, (SELECT count(*) FROM reconciler.receipt_events
		WHERE receipt_id = $1) FROM reconciler.receipts WHERE id = $1`, id).Scan(&state, &events); err != nil {
		t.Fatal(err)
	}
	if state != "succeeded" || events != 3 {
		t.Fatalf("new receipt %d: %s with %d events, want succeeded with 3", id, state, events)
	}
}

// ledgerRows is what must survive a migration unchanged: each receipt's
// identity, state and latest move, and each history event, as text.
type ledgerRows struct {
	receipts map[int64]string
	events   map[string]string
}

func snapshot(t testing.TB, db *pgxpool.Pool) ledgerRows {
	t.Helper()
	ctx := context.Background()
	s := ledgerRows{receipts: map[int64]string{}, events: map[string]string{}}
	rows, err := db.Query(ctx, `SELECT id, concat_ws('|', idempotency_key, operation, dependency, method, target,
		fingerprint, intent, state, version, external_id, attempt, retry_of, state_actor, state_detail,
		lease_owner, lease_expires_at, next_check_at, created_at, submitted_at, check_count)
		FROM reconciler.receipts`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var v string
		if err := rows.Scan(&id, &v); err != nil {
			t.Fatal(err)
		}
		s.receipts[id] = v
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	rows, err = db.Query(ctx, `SELECT receipt_id || '/' || seq, concat_ws('|', from_state, to_state, at, actor,
		error, evidence, detail, external_id) FROM reconciler.receipt_events`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			t.Fatal(err)
		}
		s.events[k] = v
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	return s
}

// sameLedger fails unless every receipt and event of before is in after,
// unchanged, and after has no other.
func sameLedger(t testing.TB, when string, before, after ledgerRows) {
	t.Helper()
	for id, v := range before.receipts {
		if after.receipts[id] != v {
			t.Errorf("%s: receipt %d changed:\n was %s\n now %s", when, id, v, after.receipts[id])
		}
	}
	for k, v := range before.events {
		if after.events[k] != v {
			t.Errorf("%s: event %s changed:\n was %s\n now %s", when, k, v, after.events[k])
		}
	}
	if len(after.receipts) != len(before.receipts) || len(after.events) != len(before.events) {
		t.Errorf("%s: %d receipts and %d events, want %d and %d", when, len(after.receipts), len(after.events),
			len(before.receipts), len(before.events))
	}
}

// intactHistories fails unless every receipt's history is gap-free (seq 1
// to its version), starts planned, chains each move from the state the
// previous one reached, makes only moves the state machine allows its
// actor, and ends in the receipt's state; and no event names a receipt
// that does not exist.
func intactHistories(t testing.TB, db *pgxpool.Pool) {
	t.Helper()
	rows, err := db.Query(context.Background(), `
		SELECT r.id, r.state, r.version, e.seq, coalesce(e.from_state, ''), e.to_state, e.actor
		FROM reconciler.receipts r LEFT JOIN reconciler.receipt_events e ON e.receipt_id = r.id
		ORDER BY r.id, e.seq`)
	if err != nil {
		t.Fatal(err)
	}
	type event struct {
		id       int64
		state    string
		version  int
		seq      *int
		from, to *string
		actor    *string
	}
	evs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (event, error) {
		var e event
		err := r.Scan(&e.id, &e.state, &e.version, &e.seq, &e.from, &e.to, &e.actor)
		return e, err
	})
	if err != nil {
		t.Fatal(err)
	}
	type progress struct {
		state string
		seq   int
	}
	last := map[int64]progress{}
	want := map[int64]event{}
	for _, e := range evs {
		want[e.id] = e
		if e.seq == nil {
			t.Errorf("receipt %d (%s) has no history", e.id, e.state)
			continue
		}
		p := last[e.id]
		switch {
		case *e.seq != p.seq+1:
			t.Errorf("receipt %d: event seq %d after %d: history has a gap", e.id, *e.seq, p.seq)
		case p.seq == 0 && (*e.from != "" || *e.to != "planned"):
			t.Errorf("receipt %d: first event %q -> %s, want (new) -> planned", e.id, *e.from, *e.to)
		case p.seq > 0 && *e.from != p.state:
			t.Errorf("receipt %d: event %d moves from %s, but the previous one reached %s", e.id, *e.seq, *e.from, p.state)
		case p.seq > 0:
			if err := statemachine.Check(statemachine.Actor(*e.actor), statemachine.State(*e.from), statemachine.State(*e.to)); err != nil {
				t.Errorf("receipt %d: event %d: %v", e.id, *e.seq, err)
			}
		}
		last[e.id] = progress{state: *e.to, seq: *e.seq}
	}
	for id, e := range want {
		if p := last[id]; p.seq != e.version || p.state != e.state {
			t.Errorf("receipt %d is %s at version %d, but its history ends at seq %d in %s", id, e.state, e.version, p.seq, p.state)
		}
	}
	var orphans int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipt_events e
		WHERE NOT EXISTS (SELECT FROM reconciler.receipts r WHERE r.id = e.receipt_id)`).Scan(&orphans); err != nil {
		t.Fatal(err)
	}
	if orphans != 0 {
		t.Errorf("%d history events name no receipt", orphans)
	}
}

// useUpgraded works the inFlight receipts (seeded with tag, ids) on the
// latest schema as the current agents, reviewers and reconciler do: the
// duplicate guard still refuses each unresolved intent, the agent
// mid-call records its outcome, planned receipts and pending retries go
// out, a retryable rejection is retried, a human resolves the held one,
// and the reconciler settles what is due, then the receipt a reconciler
// leased before the upgrade once its lease has run out.
func useUpgraded(t *testing.T, db *pgxpool.Pool, tag string, ids map[string]int64) {
	t.Helper()
	ctx := context.Background()
	agent, err := ledger.New(db, "agent:new")
	if err != nil {
		t.Fatal(err)
	}
	var before int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"submitted", "unknown", "leased", "review"} {
		in := flightIntent(tag, name)
		in.IdempotencyKey += ":again"
		_, err := agent.Plan(ctx, in)
		var dup *ledger.DuplicateError
		if !errors.As(err, &dup) || dup.Existing.ID != ids[name] {
			t.Errorf("re-plan of the %s intent: %v, want a DuplicateError naming receipt %d", name, err, ids[name])
		}
		in.IdempotencyKey += ":submit"
		if _, err := agent.PlanAndSubmit(ctx, in); !errors.As(err, &dup) || dup.Existing.ID != ids[name] {
			t.Errorf("plan-and-submit of the %s intent: %v, want a DuplicateError naming receipt %d", name, err, ids[name])
		}
	}
	var after int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("refused duplicates recorded %d receipts", after-before)
	}

	get := func(name string) *ledger.Receipt {
		t.Helper()
		r, err := agent.Get(ctx, ids[name])
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	settle := func(what string, r *ledger.Receipt) {
		t.Helper()
		var err error
		if r.State == statemachine.Planned {
			if r, err = agent.Submit(ctx, r); err != nil {
				t.Fatalf("%s: submit: %v", what, err)
			}
		}
		if r, err = agent.Succeed(ctx, r, "thing-"+strings.ReplaceAll(what, " ", "-"), ledger.Detail{}); err != nil || r.State != statemachine.Succeeded {
			t.Fatalf("%s: succeed: %v", what, err)
		}
	}
	settle("the call in flight", get("submitted"))
	settle("the planned receipt", get("planned"))
	settle("the pending retry", get("safe#2"))
	prev := get("rejected")
	if !prev.Retryable {
		t.Fatalf("the retryable rejection lost its retryable flag: %+v", prev)
	}
	retry, err := agent.Retry(ctx, prev, flightIntent(tag, "rejected"))
	if err != nil || retry.Attempt != 2 || retry.RetryOf != prev.ID {
		t.Fatalf("retry of the retryable rejection: %+v, %v", retry, err)
	}
	settle("the new retry", retry)
	if _, err := agent.As("human:operator").Transition(ctx, ledger.Move{ID: ids["review"], From: statemachine.ManualReview,
		To: statemachine.Succeeded, ExternalID: "thing-reviewed", Detail: ledger.Detail{Reason: "checked by hand"}}); err != nil {
		t.Fatalf("human resolution of the held receipt: %v", err)
	}

	clk := testkit.NewClock(dbNow(t, db))
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: upgradeDependency, Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-read-back", Authoritative: true}}
	pool := newPool(t, db, reconcile.Config{Instance: "upgraded", Registry: registry(t, nil, shortPolicy(), present), Now: clk.Now})
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if r := receipt(t, db, ids["unknown"]); r.State != "succeeded" || r.ExternalID != "thing-read-back" {
		t.Errorf("the due outcome_unknown receipt after a drain: %+v, want succeeded from its readback", r)
	}
	if r := receipt(t, db, ids["leased"]); r.State != "reconciling" || r.LeaseOwner != "old-instance/0badf00d/1" {
		t.Errorf("the receipt leased before the upgrade, lease live: %+v, want left to its holder", r)
	}
	clk.Advance(oldLease + time.Minute)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if r := receipt(t, db, ids["leased"]); r.State != "succeeded" || r.ExternalID != "thing-read-back" {
		t.Errorf("the receipt leased before the upgrade, lease expired: %+v, want reclaimed and settled", r)
	}
	var unsettled int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE state <> 'succeeded'
		AND NOT (state IN ('safe_to_retry', 'rejected') AND id IN ($1, $2))`, ids["safe"], ids["rejected"]).Scan(&unsettled); err != nil {
		t.Fatal(err)
	}
	if unsettled != 0 {
		t.Errorf("%d receipts left unsettled after the upgraded ledger worked them", unsettled)
	}
	intactHistories(t, db)
}

// An operator runs `migrate up` on a ledger holding receipts in every
// state, from each older version: every receipt and its history come
// through unchanged, and the current agents, reviewers and reconciler
// carry on from where the old ones stopped.
func TestUpgradeWithReceiptsInFlight(t *testing.T) {
	for _, v := range olderVersions(t) {
		t.Run(fmt.Sprintf("from_%05d", v), func(t *testing.T) {
			t.Parallel()
			db, p := ledgerAt(t, v)
			tag := fmt.Sprintf("v%d", v)
			ids := seedFlight(t, db, tag)
			intactHistories(t, db)
			before := snapshot(t, db)
			start := time.Now()
			if _, err := p.Up(context.Background()); err != nil {
				t.Fatalf("migrate up from %05d with receipts in flight: %v", v, err)
			}
			t.Logf("migrate up %05d -> %05d with %d receipts: %s", v, migrations.Latest(), len(before.receipts),
				time.Since(start).Round(time.Millisecond))
			sameLedger(t, "after migrate up", before, snapshot(t, db))
			intactHistories(t, db)
			useUpgraded(t, db, tag, ids)
		})
	}
}

// columns lists the reconciler schema's tables and columns, for what a
// Down removes.
func columns(t testing.TB, db *pgxpool.Pool) map[string]bool {
	t.Helper()
	// (A partition's columns are its parent's: migration 00021.)
	rows, err := db.Query(context.Background(), `SELECT table_name || '.' || column_name
		FROM information_schema.columns WHERE table_schema = 'reconciler'
		  AND NOT (SELECT c.relispartition FROM pg_catalog.pg_class c
		           WHERE c.oid = format('%I.%I', table_schema, table_name)::regclass)`)
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, n := range names {
		set[n] = true
	}
	return set
}

// An operator rolls a bad release back one migration at a time, then
// upgrades again: at each version the receipts and their history are
// intact and the ledger records a new lifecycle; back at the latest, the
// current ledger carries on with every receipt. (Below 00004 a Down drops
// what the soundness rules rest on: max_send_delay, guarded, submitted_by
// and the late outcomes; that is the schema of 00003, not a ledger a
// current reconciler may run on.)
func TestDowngradeAndUpgradeWithReceipts(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Pool(t, pgtest.NewDatabase(t))
	p := provider(t, db)
	ids := seedFlight(t, db, "round")
	intactHistories(t, db)
	before := snapshot(t, db)
	// What each Down removes with its rows: the record of compacted history
	// partitions, while there was none (00024 refuses to go down once there
	// is), the record of dropped history partitions, while there was none (00022 refuses to go down once there
	// is: see package retention), the partitions' width (the
	// history goes back into plain tables, every row), retention's record of removals,
	// while there were none (00020 refuses to go down once there are: see
	// package retention), the verdict audits and window alarms (the
	// effective windows fall back to the declared ones), the lifetime
	// alarms, the gateway's replay cache and webhook queue, and the waits
	// counted since a receipt became outcome_unknown. Receipts and history
	// are never among them.
	loses := map[string]string{
		"00024_partition_compaction.sql": "column retention_batches.kept",
		"00022_partition_retention.sql":  "column retention_batches.by_batch, column retention_batches.range_hi, column retention_batches.range_lo",
		"00021_partitioned_history.sql":  "table history_partitioning",
		"00020_retention.sql":            "table removed_receipts, table retention_batches",
		"00015_verdict_audits.sql":       "table audit_queue, table verdict_audits, table window_alarms",
		"00014_rules_of_time.sql":        "table lifetime_alarms",
		"00010_webhooks.sql":             "table webhook_deliveries, table webhook_receipts",
		"00009_gateway.sql":              "table gateway_responses",
		"00006_wait_count.sql":           "column receipts.wait_count",
	}
	step := func(what string, f func() (*goose.MigrationResult, error)) {
		t.Helper()
		cols := columns(t, db)
		res, err := f()
		if err != nil {
			t.Fatalf("%s with receipts: %v", what, err)
		}
		now := columns(t, db)
		tables := map[string]bool{}
		for c := range now {
			tables[strings.Split(c, ".")[0]] = true
		}
		var gone []string
		for c := range cols {
			if now[c] {
				continue
			}
			table := strings.Split(c, ".")[0]
			what := "table " + table
			if tables[table] {
				what = "column " + c
			}
			if !slices.Contains(gone, what) {
				gone = append(gone, what)
			}
		}
		slices.Sort(gone)
		t.Logf("%s %s (%s); removes: %v", what, res.Source.Path, res.Duration.Round(time.Millisecond), gone)
		if want := map[bool]string{true: loses[res.Source.Path]}[what == "down"]; strings.Join(gone, ", ") != want {
			t.Errorf("%s %s removes %q, want %q", what, res.Source.Path, strings.Join(gone, ", "), want)
		}
		sameLedger(t, what+" "+res.Source.Path, before, snapshot(t, db))
		intactHistories(t, db)
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			t.Fatal(err)
		}
		lifecycleAt(t, db, fmt.Sprintf("%s-%05d", what, v))
		before = snapshot(t, db)
	}
	for {
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v <= 4 {
			break
		}
		step("down", func() (*goose.MigrationResult, error) { return p.Down(ctx) })
	}
	for {
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v == migrations.Latest() {
			break
		}
		step("up", func() (*goose.MigrationResult, error) { return p.UpByOne(ctx) })
	}
	if err := migrations.Check(ctx, db); err != nil {
		t.Fatal(err)
	}
	useUpgraded(t, db, "round", ids)
}

// withParam adds a connection parameter to url.
func withParam(url, param string) string {
	if strings.Contains(url, "?") {
		return url + "&" + param
	}
	return url + "?" + param
}

// liveLifecycle is one agent's call recorded through the current ledger
// client, one of four shapes by n: plan-and-submit then succeed; plan,
// submit, succeed; plan-and-submit then lose the answer (the reconciler
// settles it); plan-and-submit, rejected as not sent, retried and
// succeeded. It returns each receipt it recorded with the state it must
// end in.
func liveLifecycle(ctx context.Context, agent *ledger.Client, g, n int) (map[int64]string, error) {
	in := ledger.Intent{IdempotencyKey: fmt.Sprintf("live:%d:%d", g, n), Operation: "things.create",
		Dependency: upgradeDependency, Method: "POST", Target: "/things",
		Payload: []byte(fmt.Sprintf(`{"agent": %d, "n": %d}`, g, n))}
	var r *ledger.Receipt
	var err error
	if n%4 == 1 {
		if r, err = agent.Plan(ctx, in); err == nil {
			r, err = agent.Submit(ctx, r)
		}
	} else {
		r, err = agent.PlanAndSubmit(ctx, in)
	}
	if err != nil {
		return nil, err
	}
	switch n % 4 {
	case 2:
		_, err = agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}})
		return map[int64]string{r.ID: "succeeded"}, err
	case 3:
		if r, err = agent.Reject(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "not_sent", Retryable: true}}); err != nil {
			return nil, err
		}
		retry, err := agent.Retry(ctx, r, in)
		if err == nil {
			if retry, err = agent.Submit(ctx, retry); err == nil {
				_, err = agent.Succeed(ctx, retry, "thing-live", ledger.Detail{})
			}
		}
		if err != nil {
			return nil, err
		}
		return map[int64]string{r.ID: "rejected", retry.ID: "succeeded"}, nil
	}
	_, err = agent.Succeed(ctx, r, "thing-live", ledger.Detail{})
	return map[int64]string{r.ID: "succeeded"}, err
}

// lockWaits samples, until stop is closed, whether the backends of
// application app wait for a lock, and whether any other backend does; it
// returns the number of samples of each and the sampling period.
func lockWaits(ctx context.Context, db *pgxpool.Pool, app string, stop <-chan struct{}) (mine, others, samples int, period time.Duration) {
	period = 2 * time.Millisecond
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		var m, o bool
		if err := db.QueryRow(ctx, `SELECT coalesce(bool_or(application_name = $1), false),
			coalesce(bool_or(application_name <> $1), false)
			FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`, app).Scan(&m, &o); err != nil {
			continue
		}
		samples++
		if m {
			mine++
		}
		if o {
			others++
		}
	}
}

// An operator runs `migrate up` from 00010 (before 00011 replaced the
// triggers of every move) while agents record calls through the current
// ledger client and a reconciler settles their lost answers: the migration
// finishes, no agent call fails, and every call that returned is recorded
// with a legal history and settles where it should.
func TestMigrationWhileAgentsWrite(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewEmptyDatabase(t)
	db := pgtest.Pool(t, url)
	const app = "upgrade-migrate"
	p := provider(t, pgtest.Pool(t, withParam(url, "application_name="+app)))
	if _, err := p.UpTo(ctx, 10); err != nil {
		t.Fatal(err)
	}
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: upgradeDependency, Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, Authoritative: true}}
	stopPool := runPool(t, newPool(t, db, reconcile.Config{Instance: "live", PollInterval: 20 * time.Millisecond,
		Registry: registry(t, nil, shortPolicy(), present)}))
	agent, err := ledger.New(db, "agent:live")
	if err != nil {
		t.Fatal(err)
	}

	const agents = 4
	type result struct {
		want     map[int64]string
		err      error
		took     time.Duration
		start    time.Time
		agent, n int
	}
	results := make(chan result, 1<<14)
	var done atomic.Int64
	quit := make(chan struct{})
	var wg sync.WaitGroup
	for g := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ; n++ {
				select {
				case <-quit:
					return
				default:
				}
				start := time.Now()
				want, err := liveLifecycle(ctx, agent, g, n)
				results <- result{want: want, err: err, took: time.Since(start), start: start, agent: g, n: n}
				done.Add(1)
			}
		}()
	}
	waitUntil(t, "the agents at work before the migration", func() bool { return done.Load() >= 40 })

	stopSampling := make(chan struct{})
	sampled := make(chan [3]int, 1)
	var period time.Duration
	go func() {
		m, o, n, per := lockWaits(ctx, db, app, stopSampling)
		period = per
		sampled <- [3]int{m, o, n}
	}()
	began := time.Now()
	res, err := p.Up(ctx)
	ended := time.Now()
	close(stopSampling)
	waits := <-sampled
	if err != nil {
		t.Fatalf("migrate up while agents write: %v", err)
	}
	for _, r := range res {
		t.Logf("applied %s in %s", r.Source.Path, r.Duration.Round(time.Millisecond))
	}
	mark := done.Load()
	waitUntil(t, "the agents at work after the migration", func() bool { return done.Load() >= mark+40 })
	close(quit)
	wg.Wait()
	close(results)

	want := map[int64]string{}
	var total, during int
	var slowest time.Duration
	for r := range results {
		total++
		if r.err != nil {
			t.Errorf("agent %d, call %d (started %s after the migration began): %v", r.agent, r.n, r.start.Sub(began), r.err)
			continue
		}
		for id, s := range r.want {
			want[id] = s
		}
		if r.start.Before(ended) && r.start.Add(r.took).After(began) {
			during++
			slowest = max(slowest, r.took)
		}
	}
	waitUntil(t, "the reconciler settled every lost answer", func() bool {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts
			WHERE state IN ('outcome_unknown', 'reconciling')`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	stopPool()
	t.Logf("migrate up 00010 -> %05d took %s under %d agents; the migration waited for a lock in %d of %d samples (every %s), "+
		"other sessions in %d; %d lifecycles in all, %d overlapping the migration, the slowest of them %s",
		migrations.Latest(), ended.Sub(began).Round(time.Millisecond), agents, waits[0], waits[2], period, waits[1],
		total, during, slowest.Round(time.Millisecond))

	rows, err := db.Query(ctx, `SELECT id, state FROM reconciler.receipts`)
	if err != nil {
		t.Fatal(err)
	}
	states := map[int64]string{}
	for rows.Next() {
		var id int64
		var s string
		if err := rows.Scan(&id, &s); err != nil {
			t.Fatal(err)
		}
		states[id] = s
	}
	for id, w := range want {
		if states[id] != w {
			t.Errorf("receipt %d is %q, want %s", id, states[id], w)
		}
	}
	for id, s := range states {
		if _, ok := want[id]; !ok {
			t.Errorf("receipt %d (%s) was recorded by no call that returned", id, s)
		}
	}
	intactHistories(t, db)
}

// waitingForLock reports whether a backend of the test's database waits
// for a lock, among those of application app (or, with others, among the
// rest).
func waitingForLock(t *testing.T, db *pgxpool.Pool, app string, others bool) bool {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock' AND (application_name = $1) <> $2`,
		app, others).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// A transaction that read receipts and stays open (a report, a psql
// session left in BEGIN) holds a lock the migration's DDL on receipts must
// wait for, and Postgres queues every agent's next write behind the
// waiting migration. Without a lock timeout the agents stall for as long
// as that transaction lasts; with one (what `reconciler migrate up
// --lock-timeout` sets, 5 s by default) the migration gives up, rolled
// back, and the agents go on while the transaction is still open.
func TestAgentsQueueBehindAWaitingMigration(t *testing.T) {
	for _, tc := range []struct {
		name        string
		lockTimeout time.Duration
	}{{"without lock timeout", 0}, {"with lock timeout", time.Second}} {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			ctx := context.Background()
			url := pgtest.NewEmptyDatabase(t)
			db := pgtest.Pool(t, url)
			const app = "upgrade-migrate"
			murl := withParam(url, "application_name="+app)
			if tc.lockTimeout > 0 {
				murl = withParam(murl, fmt.Sprintf("lock_timeout=%d", tc.lockTimeout.Milliseconds()))
			}
			p := provider(t, pgtest.Pool(t, murl))
			if _, err := p.UpTo(ctx, 10); err != nil {
				t.Fatal(err)
			}
			reader, err := db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer reader.Rollback(ctx)
			if _, err := reader.Exec(ctx, `SELECT count(*) FROM reconciler.receipts`); err != nil {
				t.Fatal(err)
			}
			migrated := make(chan error, 1)
			go func() {
				_, err := p.Up(ctx)
				migrated <- err
			}()
			waitUntil(t, "the migration waiting for the reader's lock", func() bool { return waitingForLock(t, db, app, false) })

			agent, err := ledger.New(db, "agent:queued")
			if err != nil {
				t.Fatal(err)
			}
			recorded := make(chan error, 1)
			start := time.Now()
			var took time.Duration
			go func() {
				_, err := agent.PlanAndSubmit(ctx, flightIntent("queued", "call"))
				took = time.Since(start)
				recorded <- err
			}()
			if tc.lockTimeout == 0 {
				waitUntil(t, "the agent queued behind the migration", func() bool { return waitingForLock(t, db, app, true) })
				held := time.Now()
				if err := reader.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
				if err := <-migrated; err != nil {
					t.Fatalf("migrate up once the reader ended: %v", err)
				}
				if err := <-recorded; err != nil {
					t.Fatal(err)
				}
				t.Logf("the agent's call waited %s behind the migration, %s of it while the reader held its lock",
					took.Round(time.Millisecond), held.Sub(start).Round(time.Millisecond))
				return
			}
			err = <-migrated
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "55P03" {
				t.Fatalf("migrate up behind the reader with lock_timeout %s: %v, want lock_not_available (55P03)", tc.lockTimeout, err)
			}
			if err := <-recorded; err != nil {
				t.Fatal(err)
			}
			t.Logf("the migration gave up after %s; the agent's call took %s, the reader still open", tc.lockTimeout, took.Round(time.Millisecond))
			if v, err := p.GetDBVersion(ctx); err != nil || v != 10 {
				t.Fatalf("schema at %d (%v) after the refused migration, want 10", v, err)
			}
			if err := reader.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up again once the reader ended: %v", err)
			}
			intactHistories(t, db)
		})
	}
}
