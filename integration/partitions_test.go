package integration

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/reconcile"
)

// historyTables are the tables migration 00021 partitions.
var historyTables = []string{"receipt_events", "readback_checks", "verdict_audits"}

// historyRows is every row of each history table, as JSON, in key order.
func historyRows(t testing.TB, db *pgxpool.Pool) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, table := range historyTables {
		order := "receipt_id, id"
		if table == "receipt_events" {
			order = "receipt_id, seq"
		}
		rows, err := db.Query(context.Background(), `SELECT to_jsonb(x)::text FROM reconciler.`+table+` x ORDER BY `+order)
		if err != nil {
			t.Fatal(err)
		}
		if out[table], err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// sameHistory fails unless after holds exactly the rows of before.
func sameHistory(t testing.TB, when string, before, after map[string][]string) {
	t.Helper()
	for _, table := range historyTables {
		if !slices.Equal(before[table], after[table]) {
			t.Errorf("%s: %s changed:\n was %v\n now %v", when, table, before[table], after[table])
		}
	}
}

// partitionOf returns, for each receipt id with rows in table, the
// partitions holding them.
func partitionOf(t testing.TB, db *pgxpool.Pool, table string) map[int64][]string {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT DISTINCT x.receipt_id, c.relname::text
		FROM reconciler.`+table+` x JOIN pg_class c ON c.oid = x.tableoid ORDER BY 1, 2`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64][]string{}
	for rows.Next() {
		var id int64
		var part string
		if err := rows.Scan(&id, &part); err != nil {
			t.Fatal(err)
		}
		out[id] = append(out[id], part)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Issue 25: `migrate up` to 00021 (the history tables become partitions)
// with receipts in every state, with readback checks and verdict audits,
// keeps every row of the three tables, byte for byte, all in the old
// table's range; the ledger then carries on: the receipts in flight move
// on (settled, reviewed, retried, reclaimed), their history lands with
// the old rows, a receipt planned past that range lands in the next
// partition, nothing is refused and every history stays gap-free. Down
// turns the tables back into plain ones holding every row.
func TestPartitioningKeepsEveryRow(t *testing.T) {
	ctx := context.Background()
	db, p := ledgerAt(t, 20)
	ids := seedFlight(t, db, "part")
	// What the reconciler and the auditor wrote at 00020: a check of
	// every receipt and an audit of the settled absence.
	for _, q := range []string{
		`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict,
			authoritative, matches, latency_us, error_class, error, evidence)
		 SELECT id, 1, clock_timestamp(), 'old', 'static', dependency, 'inconclusive', false, 0, 1200, 'transient',
			'timeout', '{"read_at": "2026-01-01T00:00:00Z"}' FROM reconciler.receipts`,
		`INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter, settled_state, settled_at,
			at, instance, verdict, matches, retries, observed_lag, evidence)
		 SELECT id, dependency, operation, 'static', 'safe_to_retry', updated_at, clock_timestamp(), 'old',
			'confirmed', 0, 1, interval '3 seconds', '{"k": 1}' FROM reconciler.receipts WHERE state = 'safe_to_retry'`,
	} {
		if _, err := db.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	before := historyRows(t, db)
	ledgerBefore := snapshot(t, db)
	if len(before["verdict_audits"]) == 0 || len(before["readback_checks"]) != len(ledgerBefore.receipts) {
		t.Fatalf("seed: %d checks, %d audits", len(before["readback_checks"]), len(before["verdict_audits"]))
	}
	var maxCheck int64
	if err := db.QueryRow(ctx, `SELECT max(id) FROM reconciler.readback_checks`).Scan(&maxCheck); err != nil {
		t.Fatal(err)
	}

	if _, err := p.UpTo(ctx, 21); err != nil {
		t.Fatalf("migrate up to 00021 with receipts in flight: %v", err)
	}
	sameHistory(t, "after migrate up", before, historyRows(t, db))
	sameLedger(t, "after migrate up", ledgerBefore, snapshot(t, db))
	intactHistories(t, db)
	for _, table := range historyTables {
		for id, parts := range partitionOf(t, db, table) {
			if !slices.Equal(parts, []string{table + "_legacy"}) {
				t.Errorf("%s of receipt %d in %v, want %s_legacy", table, id, parts, table)
			}
		}
	}

	useUpgraded(t, db, "part", ids)
	// A receipt planned past the old table's range (ids below 1,000,000).
	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), 1000000, false)`); err != nil {
		t.Fatal(err)
	}
	lifecycleAt(t, db, "past-legacy")
	var past int64
	if err := db.QueryRow(ctx, `SELECT max(id) FROM reconciler.receipts`).Scan(&past); err != nil || past != 1000000 {
		t.Fatalf("receipt past the old range: %d, %v", past, err)
	}
	if _, err := db.Exec(ctx, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter,
		dependency, verdict, latency_us) VALUES ($1, 1, clock_timestamp(), 'new', 'static', 'upgrade-api', 'present', 10)`, past); err != nil {
		t.Fatal(err)
	}
	intactHistories(t, db)
	for _, table := range []string{"receipt_events", "readback_checks"} {
		for id, parts := range partitionOf(t, db, table) {
			want := table + "_legacy"
			if id >= 1000000 {
				want = table + "_p0000000000001000000"
			}
			if !slices.Equal(parts, []string{want}) {
				t.Errorf("%s of receipt %d in %v, want %s", table, id, parts, want)
			}
		}
	}
	// The checks written after the upgrade continue the old ids.
	var fresh int64
	if err := db.QueryRow(ctx, `SELECT min(id) FROM reconciler.readback_checks WHERE id > $1`, maxCheck).Scan(&fresh); err != nil {
		t.Fatal(err)
	}
	if fresh != maxCheck+1 {
		t.Errorf("first readback check after the upgrade has id %d, want %d", fresh, maxCheck+1)
	}

	before, ledgerBefore = historyRows(t, db), snapshot(t, db)
	var lastCheck int64
	if err := db.QueryRow(ctx, `SELECT max(id) FROM reconciler.readback_checks`).Scan(&lastCheck); err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, 20); err != nil {
		t.Fatalf("migrate down to 00020: %v", err)
	}
	sameHistory(t, "after migrate down", before, historyRows(t, db))
	sameLedger(t, "after migrate down", ledgerBefore, snapshot(t, db))
	intactHistories(t, db)
	var partitioned int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relnamespace = 'reconciler'::regnamespace
		AND (relkind = 'p' OR relispartition)`).Scan(&partitioned); err != nil || partitioned != 0 {
		t.Errorf("after migrate down: %d partitioned tables or partitions (%v), want none", partitioned, err)
	}
	lifecycleAt(t, db, "down")
	var next int64
	if err := db.QueryRow(ctx, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter,
		dependency, verdict, latency_us) VALUES (1, 9, clock_timestamp(), 'down', 'static', 'upgrade-api', 'present', 10)
		RETURNING id`).Scan(&next); err != nil {
		t.Fatal(err)
	}
	if next != lastCheck+1 {
		t.Errorf("first readback check after migrate down has id %d, want %d", next, lastCheck+1)
	}
}

// A receipt planned past every range (the partitions ahead ran out) is
// recorded, its history kept in the default partitions, and the keeper
// reports it (metric, ERROR log); the next round starts the ranges above
// it, so the next receipts' history lands in a range again.
func TestHistoryPastEveryRangeLandsInDefault(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Pool(t, pgtest.NewDatabase(t))
	// The migration left ranges up to 5,000,000.
	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), 7000000, false)`); err != nil {
		t.Fatal(err)
	}
	id := planAt(t, db, flightIntent("default", "past"), nil)
	moveAt(t, db, id, mvSubmit)
	moveAt(t, db, id, mvUnknown)
	if _, err := db.Exec(ctx, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter,
		dependency, verdict, latency_us) VALUES ($1, 1, clock_timestamp(), 'x', 'static', 'upgrade-api', 'absent', 10)`, id); err != nil {
		t.Fatalf("readback check past every range: %v", err)
	}
	for _, table := range []string{"receipt_events", "readback_checks"} {
		if got := partitionOf(t, db, table)[id]; !slices.Equal(got, []string{table + "_default"}) {
			t.Errorf("%s of receipt %d in %v, want %s_default", table, id, got, table)
		}
	}

	var logs testkit.LogBuffer
	reg := prometheus.NewRegistry()
	k := reconcile.NewPartitionKeeper(db, reconcile.PartitionConfig{
		Logger:  slog.New(slog.NewJSONHandler(&logs, nil)),
		Metrics: reconcile.NewPartitionMetrics(reg),
	})
	st, err := k.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Width 1,000,000, 4 ahead: above 7,000,000 the ranges from 8,000,000
	// to 12,000,000, per table.
	if st.Created != 3*4 || st.Ahead != 4 || st.DefaultRows != 4 || st.LastID != id {
		t.Errorf("round after a receipt past every range: %+v, want 12 created, 4 ahead, 4 rows in the defaults", st)
	}
	// (The three tables share their ranges.)
	for _, p := range st.Partitions {
		if p.From != nil && *p.From >= 5000000 && *p.From < 8000000 {
			t.Errorf("%s starts at %d, below the default's rows' ids (up to %d)", p.Name, *p.From, id)
		}
	}
	if v := testkit.Metric(t, reg, "reconciler_history_default_rows", nil); v != 4 {
		t.Errorf("reconciler_history_default_rows = %v, want 4", v)
	}
	if v := testkit.Metric(t, reg, "reconciler_history_partitions_ahead", nil); v != 4 {
		t.Errorf("reconciler_history_partitions_ahead = %v, want 4", v)
	}
	if !strings.Contains(logs.String(), `"level":"ERROR","msg":"history default partitions hold rows`) ||
		!strings.Contains(logs.String(), `"msg":"history partitions created","created":12`) {
		t.Errorf("logs:\n%s", logs.String())
	}

	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), 8000000, false)`); err != nil {
		t.Fatal(err)
	}
	next := planAt(t, db, flightIntent("default", "next"), nil)
	if got := partitionOf(t, db, "receipt_events")[next]; !slices.Equal(got, []string{"receipt_events_p0000000000008000000"}) {
		t.Errorf("events of receipt %d in %v, want receipt_events_p0000000000008000000", next, got)
	}
}

// Two sessions keeping the partitions at once create each partition once:
// the one holding the advisory lock creates them, the other returns 0 at
// once rather than wait behind it, and after it commits finds none due.
func TestEnsurePartitionsOnce(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Pool(t, pgtest.NewDatabase(t))
	if _, err := db.Exec(ctx, `UPDATE reconciler.history_partitioning SET width = 100`); err != nil {
		t.Fatal(err)
	}
	leader, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = leader.Rollback(ctx) }()
	var made int
	if err := leader.QueryRow(ctx, `SELECT reconciler.ensure_history_partitions(5000000)`).Scan(&made); err != nil || made != 3*5 {
		t.Fatalf("leader: created %d, %v; want 5 per table", made, err)
	}
	// (A lock timeout, so that a call that waited for the leader's
	// locks fails here instead of hanging.)
	other, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
		t.Fatal(err)
	}
	if err := other.QueryRow(ctx, `SELECT reconciler.ensure_history_partitions(5000000)`).Scan(&made); err != nil || made != 0 {
		t.Errorf("while the leader holds the round: created %d, %v; want 0 at once", made, err)
	}
	_ = other.Rollback(ctx)
	if err := leader.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// Many at once, after: none due, none fails.
	var wg sync.WaitGroup
	results := make([]int, 8)
	errs := make([]error, 8)
	for i := range results {
		wg.Go(func() {
			errs[i] = db.QueryRow(ctx, `SELECT reconciler.ensure_history_partitions(5000000)`).Scan(&results[i])
		})
	}
	wg.Wait()
	for i := range results {
		if errs[i] != nil || results[i] != 0 {
			t.Errorf("call %d after the leader: created %d, %v; want 0", i, results[i], errs[i])
		}
	}
	// And many at once with ranges due: each created once, in all.
	var total int
	for i := range results {
		wg.Go(func() {
			errs[i] = db.QueryRow(ctx, `SELECT reconciler.ensure_history_partitions(5001000)`).Scan(&results[i])
		})
	}
	wg.Wait()
	for i := range results {
		if errs[i] != nil {
			t.Errorf("concurrent call %d: %v", i, errs[i])
		}
		total += results[i]
	}
	var parts int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'reconciler.receipt_events'::regclass`).Scan(&parts); err != nil {
		t.Fatal(err)
	}
	// legacy, 4 of the migration, default, 5 of the leader (5,000,000 to
	// 5,000,500), then up to (5,001,000 / 100 + 1 + 4) * 100 = 5,001,500.
	if want := 1 + 4 + 1 + 5 + 10; parts != want || total != 3*10 {
		t.Errorf("%d partitions of receipt_events after concurrent rounds creating %d in all, want %d (%d created)",
			parts, total, want, 3*10)
	}
}

// BenchmarkMigratePartitionsAtAMillion measures `migrate up` to 00021 on
// a ledger of 1,000,000 receipts with 3,000,000 events, 1,000,000
// readback checks and 100,000 verdict audits (logged, ANALYZEd): the
// whole migration holds an exclusive lock on the three tables, and ATTACH
// scans each once to validate the old table's range. It reports the
// migration's seconds (agents' plans wait that long) and the partitions'
// rows it kept:
//
//	go test ./integration -run '^$' -bench MigratePartitionsAtAMillion -benchtime 1x
func BenchmarkMigratePartitionsAtAMillion(b *testing.B) {
	ctx := context.Background()
	for b.Loop() {
		b.StopTimer()
		db, p := ledgerAt(b, 20)
		conn, err := db.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for _, q := range []string{
			`SET session_replication_role = replica`,
			`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
			     state, state_actor, created_at, submitted_at, updated_at, version)
			 SELECT 'k' || g, 'things.create', 'dep-' || (g % 20), 'POST', '/things', 'sha256:' || md5(g::text) || md5(g::text),
			     'succeeded', 'agent:a', now(), now(), now(), 3
			 FROM generate_series(1, 1000000) g`,
			`INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor)
			 SELECT id, s, state, updated_at, 'agent:a' FROM reconciler.receipts, generate_series(1, 3) s`,
			`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			 SELECT id, 1, updated_at, 'a', 'static', dependency, 'present', 100 FROM reconciler.receipts`,
			`INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter, settled_state, settled_at, at,
			     instance, verdict)
			 SELECT id, dependency, operation, 'static', 'succeeded', updated_at, updated_at, 'a', 'confirmed'
			 FROM reconciler.receipts WHERE id % 10 = 0`,
			`RESET session_replication_role`,
			`ANALYZE`,
			`CHECKPOINT`,
		} {
			if _, err := conn.Exec(ctx, q); err != nil {
				b.Fatalf("%s: %v", q, err)
			}
		}
		conn.Release()
		b.StartTimer()
		start := time.Now()
		if _, err := p.UpTo(ctx, 21); err != nil {
			b.Fatal(err)
		}
		took := time.Since(start)
		b.StopTimer()
		var legacy int64
		if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM reconciler.receipt_events_legacy)
			+ (SELECT count(*) FROM reconciler.readback_checks_legacy) + (SELECT count(*) FROM reconciler.verdict_audits_legacy)`).Scan(&legacy); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(took.Seconds(), "migrate_s")
		b.ReportMetric(float64(legacy), "rows_kept")
		b.StartTimer()
	}
}

// The daemon's keeper makes a round at start and one per tick (the
// injected clock): receipts planned past the ranges ahead get new ranges
// at the next round, and the gauges follow.
func TestPartitionKeeperKeepsRangesAhead(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	db := pgtest.Pool(t, pgtest.NewDatabase(t))
	reg := prometheus.NewRegistry()
	tick := make(chan time.Time)
	k := reconcile.NewPartitionKeeper(db, reconcile.PartitionConfig{Tick: tick, Metrics: reconcile.NewPartitionMetrics(reg)})
	var wg sync.WaitGroup
	wg.Go(func() { k.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	ahead := func() float64 { return testkit.Metric(t, reg, "reconciler_history_partitions_ahead", nil) }
	testkit.WaitFor(t, "the first round", func() bool { return ahead() == 4 })

	// Receipts up to 2,500,000: the ranges above it are 3,000,000 and
	// 4,000,000 until the next round adds 5,000,000 and 6,000,000.
	if _, err := db.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), 2500000, false)`); err != nil {
		t.Fatal(err)
	}
	planAt(t, db, flightIntent("keeper", "late"), nil)
	st, err := k.Status(ctx)
	if err != nil || st.Ahead != 2 || st.LastID != 2500000 {
		t.Fatalf("before the next round: %+v, %v; want 2 ranges ahead of 2,500,000", st, err)
	}
	tick <- time.Now()
	testkit.WaitFor(t, "the round after the tick", func() bool {
		st, err := k.Status(ctx)
		return err == nil && len(st.Partitions) == 3*(1+6+1) && ahead() == 4
	})
	if st, err := k.Status(ctx); err != nil || st.Ahead != 4 {
		t.Errorf("after the round: %d ahead, %v; want 4", st.Ahead, err)
	}
}
