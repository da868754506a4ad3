package retention_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/retention"
)

// width is the receipt ids per history partition in these tests.
const width = 10

// partitionBy makes the history partitions above the ones the migration
// created width ids wide, as the owner would, and starts the receipts
// sequence at the first of them; it returns that id. (The ranges below,
// empty, are due at once: the first pass drops them.)
func partitionBy(t *testing.T, db *pgxpool.Pool) int64 { return partitionByWidth(t, db, width) }

// partitionByWidth is partitionBy with ranges w ids wide, with room for
// the 100 receipts a test writes at most, and more ahead.
func partitionByWidth(t *testing.T, db *pgxpool.Pool, w int64) int64 {
	t.Helper()
	ctx := context.Background()
	var top int64
	if err := db.QueryRow(ctx, `SELECT max(to_id) FROM reconciler.history_partitions()`).Scan(&top); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), $1)`, top-1)
	mustExec(t, db, `UPDATE reconciler.history_partitioning SET width = $1`, w)
	mustExec(t, db, `SELECT reconciler.ensure_history_partitions($1)`, top+100+w)
	return top
}

// ranges lists the partition ranges of each history table, as "lo-hi"
// ("min-hi" for the first).
func ranges(t *testing.T, db *pgxpool.Pool) map[string][]string {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT r.parent, coalesce(r.from_id::text, 'min') || '-' || r.to_id
		FROM reconciler.history_partitions() r WHERE r.to_id IS NOT NULL ORDER BY r.to_id`)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	var tbl, rng string
	if _, err := pgx.ForEachRow(rows, []any{&tbl, &rng}, func() error {
		out[tbl] = append(out[tbl], rng)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// hasRange says whether every history table still has the partition [lo, lo+width).
func hasRange(t *testing.T, db *pgxpool.Pool, lo int64) bool {
	t.Helper()
	rng := fmt.Sprintf("%d-%d", lo, lo+width)
	rs := ranges(t, db)
	n := 0
	for _, tbl := range []string{"receipt_events", "readback_checks", "verdict_audits"} {
		if slices.Contains(rs[tbl], rng) {
			n++
		}
	}
	if n != 0 && n != 3 {
		t.Fatalf("range %s in %d of the 3 history tables: %v", rng, n, rs)
	}
	return n == 3
}

// rowsOf is every history row of the receipts [lo, hi), as to_jsonb wrote
// it, by table.
func rowsOf(t *testing.T, db *pgxpool.Pool, lo, hi int64) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, tbl := range []string{"receipt_events", "readback_checks", "verdict_audits"} {
		rows, err := db.Query(context.Background(), `SELECT to_jsonb(x)::text FROM reconciler.`+tbl+` x
			WHERE x.receipt_id >= $1 AND x.receipt_id < $2`, lo, hi)
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

// archivedRows reads the archive files, by table.
func archivedRows(t *testing.T, files ...string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, f := range files {
		lines, err := retention.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range lines {
			out[l.Table] = append(out[l.Table], string(l.Row))
		}
	}
	for tbl, rows := range out {
		out[tbl] = canonical(t, rows)
	}
	return out
}

// olds is n receipts settled long ago that retention removes, keyed
// prefix-1..n.
func olds(prefix string, n int, settled time.Duration) []receipt {
	rs := make([]receipt, n)
	for i := range rs {
		rs[i] = receipt{key: fmt.Sprintf("%s-%d", prefix, i+1), state: "succeeded", settled: settled}
	}
	return rs
}

func partitionFile(lo, hi int64) string {
	return fmt.Sprintf("history-p%019d-%019d.jsonl.gz", lo, hi)
}

// Issue 25: a range whose receipts all left, each past the history
// policy, leaves whole: its partitions of the three history tables are
// exported to one file (its rows exactly, checksum beside it) and dropped,
// and the row-by-row path does not take those receipts' history again. The
// first partition (the rows from before 00021) leaves by the same rule.
func TestHistoryPartitionLeavesWhole(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	legacy := insert(t, db, olds("legacy", 3, 400*day))
	lo := partitionBy(t, db)
	rs := olds("old", width, 400*day)
	rs[0].audit = "inconclusive" // leaves with its receipt, before the partition
	ids := insert(t, db, rs)
	if ids["old-1"] != lo || ids[fmt.Sprintf("old-%d", width)] != lo+width-1 {
		t.Fatalf("ids %v, want %d..%d", ids, lo, lo+width-1)
	}
	// The next range holds a receipt retention keeps: the sequence is past
	// the first one.
	insert(t, db, []receipt{{key: "recent", state: "succeeded", settled: day}})
	before := rowsOf(t, db, lo, lo+width)
	legacyBefore := rowsOf(t, db, legacy["legacy-1"], legacy["legacy-3"]+1)
	if len(before["receipt_events"]) != 3*width || len(before["readback_checks"]) != width {
		t.Fatalf("fixture: %d events, %d checks", len(before["receipt_events"]), len(before["readback_checks"]))
	}

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour, Batch: 4}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if hasRange(t, db, lo) {
		t.Errorf("range [%d, %d) still partitioned: %v", lo, lo+width, ranges(t, db))
	}
	if !hasRange(t, db, lo+width) {
		t.Errorf("range [%d, %d) holding a kept receipt dropped", lo+width, lo+2*width)
	}
	if got := rowsOf(t, db, 0, lo+width); len(got["receipt_events"])+len(got["readback_checks"]) != 0 {
		t.Errorf("history rows left below %d: %v", lo+width, got)
	}
	if rs := ranges(t, db)["receipt_events"]; len(rs) == 0 || strings.HasPrefix(rs[0], "min-") {
		t.Errorf("the first partition (all its receipts gone) is still there: %v", rs)
	}

	// One file for the range, holding exactly its rows; the first
	// partition's file holds the receipts from before.
	file := filepath.Join(dir, partitionFile(lo, lo+width))
	if !slices.Contains(rep.Files, file) {
		t.Fatalf("files %v, want %s", rep.Files, file)
	}
	if got := archivedRows(t, file); !mapsEqual(got, map[string][]string{
		"receipt_events": before["receipt_events"], "readback_checks": before["readback_checks"]}) {
		t.Errorf("archive of the range:\n%v\nwant\n%v", got, before)
	}
	var legacyFile []string
	for _, f := range rep.Files {
		if strings.Contains(f, "history-pmin-") {
			legacyFile = append(legacyFile, f)
		}
	}
	if got := archivedRows(t, legacyFile...); len(legacyFile) != 1 || !mapsEqual(got, map[string][]string{
		"receipt_events": legacyBefore["receipt_events"], "readback_checks": legacyBefore["readback_checks"]}) {
		t.Errorf("archive of the first partition %v:\n%v\nwant\n%v", legacyFile, got, legacyBefore)
	}
	if rep.HistoryBatches != 0 || rep.HistoryPartitions < 2 {
		t.Errorf("report %+v: want the history gone by partitions only", rep)
	}
	if rep.Rows["receipt_events"] != int64(3*(width+3)) || rep.Rows["readback_checks"] != int64(width+3) {
		t.Errorf("rows removed %v, want %d events and %d checks", rep.Rows, 3*(width+3), width+3)
	}

	// Recorded: the range with its file and counts, and every receipts
	// batch of it marked done by the drop, so the row path leaves them.
	var removed string
	if err := db.QueryRow(ctx, `SELECT removed::text FROM reconciler.retention_batches
		WHERE kind = 'partition' AND range_lo = $1 AND range_hi = $2 AND archive = $3`, lo, lo+width, file).Scan(&removed); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`{"receipt_events": %d, "verdict_audits": 0, "readback_checks": %d}`, 3*width, width); removed != want {
		t.Errorf("partition batch removed %s, want %s", removed, want)
	}
	var undone int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches b WHERE b.kind = 'receipts'
		AND NOT EXISTS (SELECT FROM reconciler.retention_batches h WHERE h.kind = 'history' AND h.of_batch = b.id AND h.by_batch IS NOT NULL)`).Scan(&undone); err != nil {
		t.Fatal(err)
	}
	if undone != 0 {
		t.Errorf("%d receipts batches not marked done by the partition drops", undone)
	}
	rep, err = retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0)
	if err != nil || rep.HistoryBatches != 0 || rep.HistoryPartitions != 0 || len(rep.Files) != 0 {
		t.Errorf("second pass: %+v, %v; want nothing", rep, err)
	}

	// Going below 00022 would lose the record of the dropped ranges.
	p, err := migrations.NewProvider(ctx, migrations.OpenDB(db))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, 21); err == nil || !strings.Contains(err.Error(), "records dropped history partitions") {
		t.Errorf("down past 00022 with dropped partitions: %v", err)
	}
}

// A receipt a guarantee keeps pins its range: the range is not dropped,
// the history of the receipts that left goes row by row (one kept in ten:
// too many for a compaction, see compact_test.go), and the kept
// receipt's history stays complete. A receipts batch with receipts in a
// range that leaves whole and in pinned ones: the range's history leaves
// with it, the rest of the batch's row by row.
func TestKeptReceiptPinsItsRange(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	kept := []receipt{
		{key: "held", state: "manual_review", settled: 400 * day},
		{key: "open-chain", state: "safe_to_retry", settled: 400 * day},
		{key: "native-key", state: "safe_to_retry", settled: 400 * day,
			detail: `{"evidence": {"reuse_idempotency_key_before": "` + future(day) + `"}}`},
		{key: "unsettled", state: "outcome_unknown", settled: 400 * day},
	}
	fixture := olds("whole", width, 400*day)
	for _, k := range kept {
		fixture = append(fixture, olds(k.key, width-1, 400*day)...)
		fixture = append(fixture, k)
	}
	fixture = append(fixture, receipt{key: "next", state: "succeeded", settled: day})
	ids := insert(t, db, fixture)
	var keptRows []map[string][]string
	for _, k := range kept {
		keptRows = append(keptRows, rowsOf(t, db, ids[k.key], ids[k.key]+1))
	}
	before := rowsOf(t, db, lo, lo+int64(len(kept)+1)*width)

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if hasRange(t, db, lo) {
		t.Errorf("the range of receipts that all left [%d, %d) is still there", lo, lo+width)
	}
	for i, k := range kept {
		rlo := lo + int64(i+1)*width
		if !hasRange(t, db, rlo) {
			t.Errorf("%s: its range [%d, %d) was dropped", k.key, rlo, rlo+width)
		}
		if got := receiptIDs(t, db, "receipts", "id"); !slices.Contains(got, ids[k.key]) {
			t.Errorf("%s: receipt removed", k.key)
		}
		if got := rowsOf(t, db, rlo, rlo+width); !mapsEqual(got, keptRows[i]) {
			t.Errorf("%s: history of its range %v, want only its own, complete: %v", k.key, got, keptRows[i])
		}
	}
	// One receipts batch (5000 receipts) held them all: the range's
	// history left in its partition's file, the rest in the batch's
	// history file, each row once.
	if rep.ReceiptBatches != 1 || rep.HistoryBatches != 1 || rep.Rows["receipts"] != int64(width+len(kept)*(width-1)) {
		t.Errorf("report %+v: want one receipts batch, its history row by row and the %d removable receipts",
			rep, width+len(kept)*(width-1))
	}
	var files []string
	for _, f := range rep.Files {
		if strings.Contains(f, "history-") {
			files = append(files, f)
		}
	}
	after := rowsOf(t, db, lo, lo+int64(len(kept)+1)*width)
	archived := archivedRows(t, files...)
	for _, tbl := range []string{"receipt_events", "readback_checks"} {
		var gone []string
		for _, r := range before[tbl] {
			if !slices.Contains(after[tbl], r) {
				gone = append(gone, r)
			}
		}
		if !slices.Equal(archived[tbl], gone) {
			t.Errorf("%s: archived %d rows, removed %d", tbl, len(archived[tbl]), len(gone))
		}
	}
}

// partitionRace writes an archive, then, for the partition files only,
// lets something happen before the drop.
type partitionRace struct {
	retention.Dir
	race func()
}

func (s partitionRace) Write(ctx context.Context, name string, write func(io.Writer) error) (string, string, error) {
	loc, sum, err := s.Dir.Write(ctx, name, write)
	if strings.HasPrefix(name, "history-p") {
		s.race()
	}
	return loc, sum, err
}

// A row written into the range between its export and the drop refuses
// the drop (RL020): nothing of the range removed. The next pass exports it
// with the rest and drops the range.
func TestRowWrittenAfterPartitionExportRefusesTheDrop(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	ids := insert(t, db, append(olds("old", width, 100*day), receipt{key: "next", state: "succeeded", settled: day}))
	p := retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}
	// Receipts removed, their history kept (a year's policy).
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	before := rowsOf(t, db, lo, lo+width)
	raced := false
	sink := partitionRace{Dir: retention.Dir(t.TempDir()), race: func() {
		if raced {
			return
		}
		raced = true
		mustExec(t, db, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 2, clock_timestamp(), 'late', 'test', 'api', 'present', 1)`, ids["old-1"])
	}}
	_, err := retention.New(db, sink, nil).Run(ctx, p, 0)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "RL020" {
		t.Fatalf("pass with a row written after the export: %v, want RL020", err)
	}
	t.Log(err)
	if !hasRange(t, db, lo) {
		t.Fatal("the range was dropped")
	}
	after := rowsOf(t, db, lo, lo+width)
	if len(after["readback_checks"]) != len(before["readback_checks"])+1 || !slices.Equal(after["receipt_events"], before["receipt_events"]) {
		t.Errorf("rows of the range changed beyond the late check: %v", after)
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches WHERE kind = 'partition' AND range_hi = $1`, lo+width).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d partition batches recorded for the range, %v", n, err)
	}

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx, p, 0)
	if err != nil {
		t.Fatal(err)
	}
	if hasRange(t, db, lo) {
		t.Error("the next pass left the range")
	}
	if got := archivedRows(t, filepath.Join(dir, partitionFile(lo, lo+width))); !mapsEqual(got, map[string][]string{
		"receipt_events": after["receipt_events"], "readback_checks": after["readback_checks"]}) {
		t.Errorf("next pass archived %v, want %v", got, after)
	}
	if rep.HistoryPartitions == 0 {
		t.Errorf("next pass: %+v", rep)
	}
}

// An archive directory that cannot be written: no partition dropped, no
// row removed, nothing recorded.
func TestUnwritableArchiveDropsNoPartition(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	insert(t, db, append(olds("old", width, 100*day), receipt{key: "next", state: "succeeded", settled: day}))
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	notADir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notADir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, db)
	parts := ranges(t, db)
	var batches int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches`).Scan(&batches); err != nil {
		t.Fatal(err)
	}
	_, err := retention.New(db, retention.Dir(filepath.Join(notADir, "archive")), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err == nil {
		t.Fatal("the pass succeeded")
	}
	t.Log(err)
	if !hasRange(t, db, lo) || !mapsEqual(parts, ranges(t, db)) {
		t.Errorf("partitions changed: %v, were %v", ranges(t, db), parts)
	}
	if after := snapshot(t, db); !mapsEqual(before, after) {
		t.Error("rows changed after a failed export")
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches`).Scan(&n); err != nil || n != batches {
		t.Errorf("%d batches recorded, were %d (%v)", n, batches, err)
	}
}

// The partition the receipts sequence is in and those ahead are never
// dropped, empty as they are: new receipts land in them.
func TestCurrentAndAheadPartitionsStay(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	insert(t, db, olds("old", 3, 400*day)) // lo..lo+2, all removed below
	var ahead []string
	for _, r := range ranges(t, db)["receipt_events"] {
		if !strings.HasPrefix(r, "min-") && r >= fmt.Sprintf("%d-", lo) {
			ahead = append(ahead, r)
		}
	}
	if len(ahead) < 2 {
		t.Fatalf("want the current range and some ahead: %v", ranges(t, db))
	}
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	if got := receiptIDs(t, db, "receipts", "id"); len(got) != 0 {
		t.Fatalf("receipts left %v", got)
	}
	for _, r := range ahead {
		if !slices.Contains(ranges(t, db)["receipt_events"], r) {
			t.Errorf("range %s (current or ahead) dropped", r)
		}
	}
}

// The drop function re-checks everything itself, whatever the caller
// passes: a range that is no partition of each table, the current one,
// one still holding a receipt, one whose receipts left inside the history
// policy, or counts that differ from the partitions' refuse (RL020), and
// nothing is dropped.
func TestDropPartitionRefuses(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	var fixture []receipt
	for _, rs := range [][]receipt{olds("old", width, 400*day), olds("recent", width, 100*day),
		olds("kept", width, 400*day), olds("next", 1, 400*day)} {
		fixture = append(fixture, rs...)
	}
	ids := insert(t, db, fixture)
	// The receipts of the first two ranges leave, the third's stay; the
	// fourth's only one leaves, but the sequence is still inside it.
	var gone []int64
	for k, id := range ids {
		if !strings.HasPrefix(k, "kept") {
			gone = append(gone, id)
		}
	}
	slices.Sort(gone)
	none := `{"receipts": %d, "late_outcomes": 0, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}`
	for _, batch := range [][]int64{gone[:width], gone[width : 2*width], gone[2*width:]} {
		mustExec(t, db, `SELECT reconciler.retention_remove_receipts($1, 'x', repeat('0', 64),
			clock_timestamp() - interval '90 days', interval '1 hour', $2)`, batch, fmt.Sprintf(none, len(batch)))
	}
	before := snapshot(t, db)
	parts := ranges(t, db)
	counts := func(events, checks int) string {
		return fmt.Sprintf(`{"receipt_events": %d, "readback_checks": %d, "verdict_audits": 0}`, events, checks)
	}
	full := counts(3*width, width)
	year := time.Now().Add(-365 * day)
	for _, c := range []struct {
		name     string
		lo, hi   any
		before   time.Time
		expected string
	}{
		{"no such range", lo + 1, lo + width + 1, year, full},
		{"two ranges at once", lo, lo + 2*width, year, counts(6*width, 2*width)},
		{"the default partition", nil, nil, year, full},
		{"receipts in the ledger", lo + 2*width, lo + 3*width, year, full},
		{"the current range", lo + 3*width, lo + 4*width, year, counts(3, 1)},
		{"left inside the history policy", lo + width, lo + 2*width, year, full},
		{"counts differ", lo, lo + width, year, counts(3*width, width-1)},
		{"a table missing from the counts", lo, lo + width, year,
			fmt.Sprintf(`{"receipt_events": %d, "readback_checks": %d}`, 3*width, width)},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := db.Exec(ctx, `SELECT reconciler.retention_drop_history_partition($1, $2, $3, 'x', repeat('0', 64), $4)`,
				c.lo, c.hi, c.before, c.expected)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "RL020" {
				t.Fatalf("err %v, want RL020", err)
			}
			t.Log(pe.Message)
		})
	}
	if !mapsEqual(parts, ranges(t, db)) {
		t.Errorf("partitions changed: %v, were %v", ranges(t, db), parts)
	}
	if after := snapshot(t, db); !mapsEqual(before, after) {
		t.Error("rows changed after refused drops")
	}
	// The same call with the right range and counts goes through.
	if _, err := db.Exec(ctx, `SELECT reconciler.retention_drop_history_partition($1, $2, $3, 'x', repeat('0', 64), $4)`,
		lo, lo+width, year, full); err != nil {
		t.Fatal(err)
	}
	if hasRange(t, db, lo) {
		t.Error("the range was not dropped")
	}
}

// A drop does not wait behind a reader of the history for longer than its
// lock timeout (the writers of the history would queue behind it): the
// pass fails (55P03), nothing removed, and the next one, the reader gone,
// drops the range.
func TestDropGivesWayToAReader(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionBy(t, db)
	insert(t, db, append(olds("old", width, 100*day), receipt{key: "next", state: "succeeded", settled: day}))
	p := retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	reader, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM reconciler.receipt_events`); err != nil {
		t.Fatal(err)
	}
	p.History = 90 * day
	_, err = retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "55P03" {
		t.Fatalf("drop behind a reader: %v, want 55P03 (lock_not_available)", err)
	}
	if !hasRange(t, db, lo) {
		t.Fatal("the range was dropped")
	}
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0); err != nil || rep.HistoryPartitions == 0 || hasRange(t, db, lo) {
		t.Errorf("next pass: %+v, %v; want the range dropped", rep, err)
	}
}
