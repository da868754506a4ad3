package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// scaleRows is the size of the table the scale test and benchmark build.
const scaleRows = 1_000_000

// fillScale fills a fresh database with scaleRows receipts in one INSERT
// from generate_series, with the triggers off (session_replication_role =
// replica) and the table unlogged: the plans depend on the rows, not on
// their history or durability, and through the triggers the fill takes
// minutes. Per 1,000 receipts: 20 outcome_unknown
// (due), 2 reconciling (leased), 20 submitted (one in 20 of them older than
// the orphan cut-off: one in 1,000 receipts), 10 planned, 2 manual_review (each with the history
// event review list joins), the rest succeeded; 20 dependencies. Then
// ANALYZE, as autovacuum would after such a load.
func fillScale(tb testing.TB, db *pgxpool.Pool) {
	tb.Helper()
	ctx := context.Background()
	conn, err := db.Acquire(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Release()
	for _, q := range []string{
		// A throwaway table need not survive a crash: unlogged, the fill
		// writes no WAL (several times faster); plans do not depend on it.
		// A logged table may not reference an unlogged one, so the tables
		// holding a foreign key to receipts go first.
		`DO $$
		 DECLARE t regclass;
		 BEGIN
		   FOR t IN SELECT DISTINCT conrelid::regclass FROM pg_constraint
		             WHERE contype = 'f' AND confrelid = 'reconciler.receipts'::regclass
		               AND conrelid <> 'reconciler.receipts'::regclass LOOP
		     EXECUTE format('ALTER TABLE %s SET UNLOGGED', t);
		   END LOOP;
		 END $$`,
		`ALTER TABLE reconciler.receipts SET UNLOGGED`,
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		                                  state, state_actor, created_at, submitted_at, updated_at, unknown_since,
		                                  next_check_at, lease_owner, lease_expires_at, guarded, version)
		SELECT 'scale:' || g, 'things.create', 'dep-' || (g % 20), 'POST', '/things', 'sha256:' || md5(g::text),
		       s.state, 'agent:scale', now() - interval '1 day', now() - interval '1 day',
		       CASE WHEN s.state = 'submitted' AND g % 20 = 0 THEN now() - interval '1 hour'
		            WHEN s.state IN ('submitted', 'planned') THEN now()
		            ELSE now() - interval '1 day' END,
		       CASE WHEN s.state IN ('outcome_unknown', 'reconciling') THEN now() - interval '1 day' END,
		       CASE s.state WHEN 'outcome_unknown' THEN now() - make_interval(secs => g % 600)
		                    WHEN 'reconciling' THEN now() + interval '1 hour' END,
		       CASE WHEN s.state = 'reconciling' THEN 'other/00000000/1' END,
		       CASE WHEN s.state = 'reconciling' THEN now() + interval '1 hour' END,
		       false,
		       CASE s.state WHEN 'succeeded' THEN 5 WHEN 'manual_review' THEN 5 WHEN 'planned' THEN 1 ELSE 3 END
		FROM generate_series(1, $1::int) g
		CROSS JOIN LATERAL (SELECT CASE
		    WHEN g % 1000 < 20 THEN 'outcome_unknown'
		    WHEN g % 1000 < 22 THEN 'reconciling'
		    WHEN g % 1000 < 42 THEN 'submitted'
		    WHEN g % 1000 < 52 THEN 'planned'
		    WHEN g % 1000 < 54 THEN 'manual_review'
		    ELSE 'succeeded' END AS state) s`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, from_state, to_state, at, actor, detail)
		SELECT id, version, 'reconciling', 'manual_review', updated_at, 'reconciler:scale', '{"reason": "bound_reached"}'
		FROM reconciler.receipts WHERE state = 'manual_review'`,
		`RESET session_replication_role`,
		`ANALYZE reconciler.receipts, reconciler.receipt_events`,
	} {
		args := []any{}
		if strings.Contains(q, "$1") {
			args = append(args, scaleRows)
		}
		if _, err := conn.Exec(ctx, q, args...); err != nil {
			tb.Fatalf("fill: %v", err)
		}
	}
}

// recorder is a pgx tracer that keeps every statement run and its
// arguments, so a test can EXPLAIN exactly what the code ran.
type recorder struct {
	mu    sync.Mutex
	stmts []traced
}

type traced struct {
	sql  string
	args []any
}

func (r *recorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	args := make([]any, 0, len(d.Args))
	for _, a := range d.Args {
		if _, mode := a.(pgx.QueryExecMode); !mode {
			args = append(args, a)
		}
	}
	r.mu.Lock()
	r.stmts = append(r.stmts, traced{sql: d.SQL, args: args})
	r.mu.Unlock()
	return ctx
}

func (r *recorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// find returns the last statement run that contains marker.
func (r *recorder) find(tb testing.TB, marker string) traced {
	tb.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range slices.Backward(r.stmts) {
		if strings.Contains(s.sql, marker) {
			return s
		}
	}
	tb.Fatalf("no statement containing %q was run", marker)
	return traced{}
}

// tracedPool opens a pool on url whose statements rec keeps.
func tracedPool(tb testing.TB, url string, rec *recorder) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.ConnConfig.Tracer = rec
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// explain plans s with its own arguments, as the code ran it (the unnamed
// statement: a plan for these values).
func explain(tb testing.TB, db *pgxpool.Pool, s traced) pgtest.PlanNode {
	tb.Helper()
	var out []struct{ Plan pgtest.PlanNode }
	var raw []byte
	if err := db.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON) "+s.sql, s.args...).Scan(&raw); err != nil {
		tb.Fatalf("explain: %v\n%s", err, s.sql)
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
		tb.Fatalf("explain output %s: %v", raw, err)
	}
	return out[0].Plan
}

// Issue 9, item 7: at 1,000,000 receipts (mostly settled) the claim, the
// orphan sweep and review list read receipts through an index, never a
// sequential scan of the table: the plans of the statements exactly as the
// code runs them (captured with their arguments), after ANALYZE.
func TestPlansAtAMillionReceipts(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	rec := &recorder{}
	db := tracedPool(t, url, rec)
	start := time.Now()
	fillScale(t, db)
	t.Logf("filled %d receipts in %s", scaleRows, time.Since(start).Round(time.Millisecond))

	store, err := reconcile.NewStore(db, "scale")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	claimed, err := store.Claim(ctx, now, 512, time.Minute)
	if err != nil || len(claimed) != 512 {
		t.Fatalf("claim: %d rows, %v", len(claimed), err)
	}
	small, err := store.Claim(ctx, now, 8, time.Minute)
	if err != nil || len(small) != 8 {
		t.Fatalf("small claim: %d rows, %v", len(small), err)
	}
	// (Taken now: the EXPLAINs below run through the same tracer.)
	claimStmt := rec.find(t, "SET state = 'reconciling'")
	orphans, err := store.SweepOrphans(ctx, now, 5*time.Minute, 512, 0)
	if err != nil || len(orphans) != scaleRows/1000 {
		t.Fatalf("sweep: %d rows, %v", len(orphans), err)
	}
	held, err := review.List(ctx, db, review.Filter{Limit: 50})
	if err != nil || len(held) != 50 {
		t.Fatalf("review list: %d rows, %v", len(held), err)
	}
	if _, err := review.List(ctx, db, review.Filter{Dependency: "dep-3", OlderThan: time.Hour, Limit: 50}); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name, marker, index string
	}{
		{"claim", "SET state = 'reconciling'", "receipts_due"},
		{"orphan sweep", "SET state = 'outcome_unknown'", "receipts_stale"},
		// The last list run filters by dependency: its partial index
		// (migration 00018), in held order.
		{"review list", "WHERE r.state = 'manual_review'", "receipts_held_dependency"},
	} {
		stmt := rec.find(t, c.marker)
		plan := explain(t, db, stmt)
		var scans []string
		used := false
		plan.Walk(func(n pgtest.PlanNode) {
			if n.Relation == "receipts" {
				scans = append(scans, fmt.Sprintf("%s %s", n.NodeType, n.IndexName))
				if n.NodeType == "Seq Scan" {
					t.Errorf("%s: sequential scan of receipts at %d rows", c.name, scaleRows)
				}
			}
			used = used || n.IndexName == c.index
		})
		if !used {
			t.Errorf("%s: %s not used; scans of receipts: %v", c.name, c.index, scans)
		}
		t.Logf("%s: %v", c.name, scans)
	}

	// The claim's filters for receipts whose claim the database refused:
	// leaving 100 of them out, and claiming 8 of them apart, it still walks
	// receipts_due and probes the primary key.
	stmt := claimStmt
	named := -1
	for i, a := range stmt.args {
		if na, ok := a.(pgx.NamedArgs); ok && na["due_by"] != nil {
			named = i
		}
	}
	if named < 0 || !strings.Contains(stmt.sql, "@skip::bigint[] IS NULL") || !strings.Contains(stmt.sql, "@only::bigint[] IS NULL") {
		t.Fatalf("the claim no longer takes @skip and @only as named arguments:\n%s", stmt.sql)
	}
	rows, err := db.Query(ctx, `SELECT id FROM reconciler.receipts WHERE state = 'outcome_unknown' ORDER BY next_check_at LIMIT 100`)
	if err != nil {
		t.Fatal(err)
	}
	due, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(due) != 100 {
		t.Fatalf("due rows: %d, %v", len(due), err)
	}
	for _, v := range []struct {
		name       string
		skip, only []int64
	}{{"claim leaving 100 out", due, nil}, {"claim of 8 apart", nil, due[:8]}} {
		args := slices.Clone(stmt.args)
		na := pgx.NamedArgs{"skip": v.skip, "only": v.only}
		for k, a := range args[named].(pgx.NamedArgs) {
			if k != "skip" && k != "only" {
				na[k] = a
			}
		}
		args[named] = na
		var scans []string
		explain(t, db, traced{sql: stmt.sql, args: args}).Walk(func(n pgtest.PlanNode) {
			if n.Relation == "receipts" {
				scans = append(scans, fmt.Sprintf("%s %s", n.NodeType, n.IndexName))
			}
		})
		if !slices.Contains(scans, "Index Scan receipts_pkey") || slices.Contains(scans, "Seq Scan ") {
			t.Errorf("%s: scans of receipts %v, want an index walk and receipts_pkey", v.name, scans)
		}
		t.Logf("%s: %v", v.name, scans)
	}
}

// BenchmarkClaimAtAMillionReceipts measures the claim's latency against the
// table of TestPlansAtAMillionReceipts, for a full batch (512) and for the
// small claims of a pool whose checks are slow. Each claim is due one
// second after the last, with a lease of a millisecond, so every claim
// finds due rows (outcome_unknown at first, then the reconciling rows of the
// claims before it). It reports p50 and p99 in milliseconds:
//
//	go test ./integration -run '^$' -bench ClaimAtAMillion -benchtime 200x
func BenchmarkClaimAtAMillionReceipts(b *testing.B) {
	db := pgtest.Pool(b, pgtest.NewDatabase(b))
	fillScale(b, db)
	store, err := reconcile.NewStore(db, "bench")
	if err != nil {
		b.Fatal(err)
	}
	at := time.Now()
	for _, limit := range []int{512, 32} {
		b.Run(fmt.Sprintf("limit=%d", limit), func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			for b.Loop() {
				at = at.Add(time.Second)
				start := time.Now()
				got, err := store.ClaimAt(context.Background(), at, at, limit, time.Millisecond)
				lat = append(lat, time.Since(start))
				if err != nil || len(got) != limit {
					b.Fatalf("claimed %d of %d: %v", len(got), limit, err)
				}
			}
			slices.Sort(lat)
			q := func(p float64) float64 {
				return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
			}
			b.ReportMetric(q(0.50), "p50_ms")
			b.ReportMetric(q(0.99), "p99_ms")
		})
	}
}

// An agent's move (ledger.Client.Transition: Succeed here) probes the
// primary key, planned for its own values as pgx runs it: with a few
// receipts in flight and many settled, "state = 'submitted'" would prove
// receipts_stale's predicate, and the planner, costing that partial index
// by its few live rows, chose it, scanning every receipt in flight and the
// dead entries of those that had moved on, on every call (migration 00011,
// the "C" collation of the expected state).
func TestAgentMoveProbesThePrimaryKey(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	rec := &recorder{}
	db := tracedPool(t, url, rec)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		                                  state, state_actor, submitted_at, guarded, version)
		 SELECT 'settled:' || g, 'things.create', 'dep', 'POST', '/things', 'sha256:' || md5(g::text),
		        'succeeded', 'agent:fill', now(), false, 3
		 FROM generate_series(1, 20000) g`,
		`RESET session_replication_role`,
		`ANALYZE reconciler.receipts`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("fill: %v", err)
		}
	}
	conn.Release()

	c, err := ledger.New(db, "agent:plans")
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: "plans:1", Operation: "things.create",
		Dependency: "dep", Method: "POST", Target: "/things", Payload: []byte(`{"n":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Succeed(ctx, r, "thing-1", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	var scans []string
	explain(t, db, rec.find(t, "SET state = $2")).Walk(func(n pgtest.PlanNode) {
		if n.Relation == "receipts" && n.NodeType != "ModifyTable" {
			scans = append(scans, strings.TrimSpace(n.NodeType+" "+n.IndexName))
		}
	})
	if !slices.Equal(scans, []string{"Index Scan receipts_pkey"}) {
		t.Fatalf("the agent's move reads receipts by %v, want one probe of receipts_pkey", scans)
	}
}
