package retention_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/retention"
)

// wide is the receipt ids per history partition in the compaction tests:
// room for a kept receipt of each kind among ten times as many that leave.
const wide = 60

// hasWideRange says whether every history table still has the partition
// [lo, lo+wide).
func hasWideRange(t *testing.T, db *pgxpool.Pool, lo int64) bool {
	t.Helper()
	rng := fmt.Sprintf("%d-%d", lo, lo+wide)
	n := 0
	rs := ranges(t, db)
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

// pinnedRange writes a range [lo, lo+wide) of receipts that left long ago
// but for one kept receipt of each kind a guarantee keeps, and a recent
// receipt past it (the sequence has passed the range). It returns lo, the
// ids and the kept receipts' keys.
func pinnedRange(t *testing.T, db *pgxpool.Pool) (int64, map[string]int64, []string) {
	t.Helper()
	lo := partitionByWidth(t, db, wide)
	kept := []receipt{
		{key: "held", state: "manual_review", settled: 400 * day},
		{key: "open-chain", state: "safe_to_retry", settled: 400 * day},
		{key: "native-key", state: "safe_to_retry", settled: 400 * day,
			detail: `{"evidence": {"reuse_idempotency_key_before": "` + future(day) + `"}}`},
		{key: "unsettled", state: "outcome_unknown", settled: 400 * day},
		{key: "duplicate", state: "succeeded", settled: 400 * day, alarm: true, audit: "inconclusive"},
	}
	gone := olds("gone", wide-len(kept), 100*day)
	var fixture []receipt
	var keys []string
	for i, k := range kept {
		// Spread among the rest, so the kept rows are not one block.
		fixture = append(fixture, gone[i*len(gone)/len(kept):(i+1)*len(gone)/len(kept)]...)
		fixture = append(fixture, k)
		keys = append(keys, k.key)
	}
	fixture = append(fixture, receipt{key: "next", state: "succeeded", settled: day})
	ids := insert(t, db, fixture)
	if ids["next"] != lo+wide {
		t.Fatalf("ids %v: want the range [%d, %d) full and next at %d", ids, lo, lo+wide, lo+wide)
	}
	return lo, ids, keys
}

// partitionOf is the name of the partition of tbl holding receipt id.
func partitionOf(t *testing.T, db *pgxpool.Pool, tbl string, id int64) string {
	t.Helper()
	var name string
	if err := db.QueryRow(context.Background(), `SELECT r.partition FROM reconciler.history_partitions() r
		WHERE r.parent = $1 AND coalesce(r.from_id, -9223372036854775808) <= $2 AND r.to_id > $2`, tbl, id).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// Issue 25: a range a few kept receipts pin is compacted. The history of
// its receipts that left goes at once, to one file holding exactly those
// rows; each kept receipt's history stays identical (events, checks,
// audits); the partitions are still there, append-only, and take the
// kept receipts' new history; the row-by-row path has nothing left of
// them.
func TestPinnedRangeIsCompacted(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, ids, kept := pinnedRange(t, db)
	before := rowsOf(t, db, lo, lo+wide)
	keptBefore := map[string]map[string][]string{}
	for _, k := range kept {
		keptBefore[k] = rowsOf(t, db, ids[k], ids[k]+1)
	}
	if len(keptBefore["duplicate"]["verdict_audits"]) != 1 || len(before["verdict_audits"]) != 1 {
		t.Fatalf("fixture: audits %v", before["verdict_audits"])
	}
	names := map[string]string{}
	for _, tbl := range partitionTablesForTest() {
		names[tbl] = partitionOf(t, db, tbl, lo)
	}

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.HistoryPartitionsCompacted != 1 || rep.HistoryBatches != 0 {
		t.Errorf("report %+v: want the range compacted and no history left for the row path", rep)
	}
	if !hasWideRange(t, db, lo) {
		t.Fatalf("range [%d, %d) holding kept receipts is gone: %v", lo, lo+wide, ranges(t, db))
	}
	for _, k := range kept {
		if got := rowsOf(t, db, ids[k], ids[k]+1); !mapsEqual(got, keptBefore[k]) {
			t.Errorf("%s: history after the compaction\n%v\nwant, identical\n%v", k, got, keptBefore[k])
		}
	}
	after := rowsOf(t, db, lo, lo+wide)
	var want map[string][]string
	for _, k := range kept {
		want = mergeRows(want, keptBefore[k])
	}
	if !mapsEqual(after, want) {
		t.Errorf("history of the range after the compaction:\n%v\nwant only the kept receipts'\n%v", after, want)
	}
	file := filepath.Join(dir, fmt.Sprintf("history-p%019d-%019d-c1.jsonl.gz", lo, lo+wide))
	if !slices.Contains(rep.Files, file) {
		t.Fatalf("files %v, want %s", rep.Files, file)
	}
	gone := map[string][]string{}
	for tbl, rows := range before {
		for _, r := range rows {
			if !slices.Contains(after[tbl], r) {
				gone[tbl] = append(gone[tbl], r)
			}
		}
	}
	if got := archivedRows(t, file); !mapsEqual(got, gone) {
		t.Errorf("archive:\n%v\nwant the rows removed\n%v", got, gone)
	}
	var removed, keptCounts string
	if err := db.QueryRow(ctx, `SELECT removed::text, kept::text FROM reconciler.retention_batches
		WHERE kind = 'partition' AND range_lo = $1 AND range_hi = $2 AND archive = $3`, lo, lo+wide, file).Scan(&removed, &keptCounts); err != nil {
		t.Fatal(err)
	}
	n := wide - len(kept)
	// (A receipt's audits leave with it, in its receipts batch.)
	if w := fmt.Sprintf(`{"receipt_events": %d, "verdict_audits": 0, "readback_checks": %d}`, 3*n, n); removed != w {
		t.Errorf("removed %s, want %s", removed, w)
	}
	if w := fmt.Sprintf(`{"receipt_events": %d, "verdict_audits": 1, "readback_checks": %d}`, 3*len(kept), len(kept)); keptCounts != w {
		t.Errorf("kept %s, want %s", keptCounts, w)
	}

	// The same partitions' names, each still append-only.
	for tbl, name := range names {
		if got := partitionOf(t, db, tbl, lo); got != name {
			t.Errorf("%s: partition %s, was %s", tbl, got, name)
		}
		for _, q := range []string{
			`UPDATE reconciler.` + name + ` SET receipt_id = receipt_id`,
			`DELETE FROM reconciler.` + name,
			`DELETE FROM reconciler.` + tbl + ` WHERE receipt_id = ` + fmt.Sprint(ids["duplicate"]),
			`TRUNCATE reconciler.` + name,
		} {
			_, err := db.Exec(ctx, q)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "RL006" {
				t.Errorf("%s: %v, want RL006 (append-only)", q, err)
			}
		}
	}

	// New history of a kept receipt lands in the range's partition.
	mustExec(t, db, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
		VALUES ($1, 2, clock_timestamp(), 'later', 'test', 'api', 'present', 1)`, ids["unsettled"])
	var landed int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.`+names["readback_checks"]+` WHERE receipt_id = $1`,
		ids["unsettled"]).Scan(&landed); err != nil || landed != 2 {
		t.Errorf("checks of the unsettled receipt in its partition: %d, %v; want 2", landed, err)
	}

	// Nothing left to compact until a kept receipt leaves.
	rep, err = retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil || rep.HistoryPartitionsCompacted != 0 || rep.HistoryBatches != 0 {
		t.Errorf("second pass: %+v, %v; want nothing", rep, err)
	}

	// Going below 00024 would lose which rows of the range left.
	p, err := migrations.NewProvider(ctx, migrations.OpenDB(db))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.DownTo(ctx, 23); err == nil || !strings.Contains(err.Error(), "records compacted history partitions") {
		t.Errorf("down past 00024 with a compaction: %v", err)
	}
}

func partitionTablesForTest() []string {
	return []string{"receipt_events", "readback_checks", "verdict_audits"}
}

func mergeRows(a, b map[string][]string) map[string][]string {
	out := map[string][]string{}
	for tbl, rows := range a {
		out[tbl] = append(out[tbl], rows...)
	}
	for tbl, rows := range b {
		out[tbl] = append(out[tbl], rows...)
	}
	for tbl, rows := range out {
		slices.Sort(rows)
		out[tbl] = rows
	}
	return out
}

// A row of a receipt that left, written into the range between the
// export and the compaction, refuses it (RL020): nothing removed, nothing
// recorded. The next pass exports it with the rest and compacts.
func TestRowWrittenAfterCompactionExportRefuses(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, ids, _ := pinnedRange(t, db)
	p := retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}
	// Receipts removed, their history kept (a year's policy).
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	before := rowsOf(t, db, lo, lo+wide)
	raced := false
	sink := partitionRace{Dir: retention.Dir(t.TempDir()), race: func() {
		if raced {
			return
		}
		raced = true
		mustExec(t, db, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 2, clock_timestamp(), 'late', 'test', 'api', 'present', 1)`, ids["gone-1"])
	}}
	_, err := retention.New(db, sink, nil).Run(ctx, p, 0)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "RL020" {
		t.Fatalf("pass with a row written after the export: %v, want RL020", err)
	}
	t.Log(err)
	after := rowsOf(t, db, lo, lo+wide)
	if len(after["readback_checks"]) != len(before["readback_checks"])+1 || !slices.Equal(after["receipt_events"], before["receipt_events"]) ||
		!slices.Equal(after["verdict_audits"], before["verdict_audits"]) {
		t.Errorf("rows of the range changed beyond the late check")
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches WHERE kind = 'partition' AND range_hi = $1`, lo+wide).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d partition batches recorded for the range, %v", n, err)
	}

	dir := t.TempDir()
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx, p, 0)
	if err != nil || rep.HistoryPartitionsCompacted != 1 {
		t.Fatalf("next pass: %+v, %v; want the range compacted", rep, err)
	}
	archived := archivedRows(t, filepath.Join(dir, fmt.Sprintf("history-p%019d-%019d-c1.jsonl.gz", lo, lo+wide)))
	if got := len(archived["readback_checks"]); got != wide-5+1 {
		t.Errorf("next pass archived %d checks, want %d (the late one with the rest)", got, wide-5+1)
	}
}

// Once the receipts a compaction kept leave too, the range leaves whole:
// the drop's file holds exactly their history, and no receipts batch's
// history is left for the row path.
func TestCompactedRangeLeavesWholeLater(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionByWidth(t, db, wide)
	fixture := olds("gone", wide-2, 400*day)
	fixture = append(fixture, receipt{key: "recent-1", state: "succeeded", settled: 30 * day},
		receipt{key: "recent-2", state: "succeeded", settled: 30 * day},
		receipt{key: "next", state: "succeeded", settled: day})
	ids := insert(t, db, fixture)
	keptRows := mergeRows(rowsOf(t, db, ids["recent-1"], ids["recent-1"]+1), rowsOf(t, db, ids["recent-2"], ids["recent-2"]+1))
	rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil || rep.HistoryPartitionsCompacted != 1 {
		t.Fatalf("first pass: %+v, %v; want the range compacted", rep, err)
	}
	if got := rowsOf(t, db, lo, lo+wide); !mapsEqual(got, keptRows) {
		t.Fatalf("after the compaction %v, want the recent receipts' history %v", got, keptRows)
	}

	// A month later by the policy: the recent receipts leave.
	dir := t.TempDir()
	rep, err = retention.New(db, retention.Dir(dir), nil).Run(ctx,
		retention.Policy{Settled: 20 * day, History: 20 * day, Horizon: time.Hour}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.HistoryPartitions != 1 || rep.HistoryPartitionsCompacted != 0 || rep.HistoryBatches != 0 {
		t.Errorf("second pass %+v: want the range dropped whole, nothing row by row", rep)
	}
	if hasWideRange(t, db, lo) {
		t.Error("the range is still there")
	}
	file := filepath.Join(dir, fmt.Sprintf("history-p%019d-%019d.jsonl.gz", lo, lo+wide))
	if got := archivedRows(t, file); !mapsEqual(got, map[string][]string{
		"receipt_events": keptRows["receipt_events"], "readback_checks": keptRows["readback_checks"]}) {
		t.Errorf("drop archived %v, want %v", got, keptRows)
	}
	var undone int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.retention_batches b WHERE b.kind = 'receipts'
		AND NOT EXISTS (SELECT FROM reconciler.retention_batches h WHERE h.kind = 'history' AND h.of_batch = b.id)`).Scan(&undone); err != nil || undone != 0 {
		t.Errorf("%d receipts batches with history not marked done, %v", undone, err)
	}
}

// The compaction re-checks everything itself, whatever the caller passes:
// a range that is no partition of each table, the current one, one whose
// receipts left inside the history policy, or counts that differ from the
// rows of the receipts gone refuse (RL020), and nothing changes.
func TestCompactPartitionRefuses(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, _, _ := pinnedRange(t, db)
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, db)
	parts := ranges(t, db)
	n := wide - 5
	counts := func(events, checks, audits int) string {
		return fmt.Sprintf(`{"receipt_events": %d, "readback_checks": %d, "verdict_audits": %d}`, events, checks, audits)
	}
	right := counts(3*n, n, 0)
	month := time.Now().Add(-30 * day)
	year := time.Now().Add(-365 * day)
	for _, c := range []struct {
		name     string
		lo, hi   any
		before   time.Time
		expected string
	}{
		{"no such range", lo + 1, lo + wide + 1, month, right},
		{"the default partition", nil, nil, month, right},
		{"the current range", lo + wide, lo + 2*wide, month, counts(3, 1, 0)},
		{"left inside the history policy", lo, lo + wide, year, right},
		{"counts differ", lo, lo + wide, month, counts(3*n, n-1, 0)},
		{"all the rows", lo, lo + wide, month, counts(3*wide, wide, 1)},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := db.Exec(ctx, `SELECT reconciler.retention_compact_history_partition($1, $2, $3, 'x', repeat('0', 64), $4)`,
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
		t.Error("rows changed after refused compactions")
	}
	if _, err := db.Exec(ctx, `SELECT reconciler.retention_compact_history_partition($1, $2, $3, 'x', repeat('0', 64), $4)`,
		lo, lo+wide, month, right); err != nil {
		t.Fatal(err)
	}
}

// History a kept receipt writes while a compaction of its range is under
// way waits on the parents' lock, taken first, and lands in the new
// partition once the compaction commits: no row lost, none refused.
func TestHistoryWrittenDuringCompactionLands(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, ids, _ := pinnedRange(t, db)
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	n := wide - 5
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT reconciler.retention_compact_history_partition($1, $2, $3, 'x', repeat('0', 64), $4)`,
		lo, lo+wide, time.Now().Add(-30*day),
		fmt.Sprintf(`{"receipt_events": %d, "readback_checks": %d, "verdict_audits": 0}`, 3*n, n)); err != nil {
		t.Fatal(err)
	}
	writer, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Release()
	var pid uint32
	if err := writer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() {
		_, err := writer.Exec(ctx, `INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
			VALUES ($1, 2, clock_timestamp(), 'during', 'test', 'api', 'present', 1)`, ids["unsettled"])
		wrote <- err
	}()
	// Wait (on the condition, not the clock) until the write queues.
	for waiting := false; !waiting; {
		if err := db.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`,
			pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-wrote:
			t.Fatalf("the write went through during the compaction: %v", err)
		default:
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("write queued behind the compaction: %v", err)
	}
	var landed int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.`+partitionOf(t, db, "readback_checks", lo)+`
		WHERE receipt_id = $1`, ids["unsettled"]).Scan(&landed); err != nil || landed != 2 {
		t.Errorf("checks of the kept receipt in its compacted partition: %d, %v; want 2", landed, err)
	}
}

// A receipt that leaves after its range was compacted still has its
// history there: the drop of another range its batch shares does not count
// that batch's history as gone, and the row path removes it.
func TestReceiptLeavingACompactedRangeLosesItsHistoryLater(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo := partitionByWidth(t, db, wide)
	fixture := olds("gone", wide-2, 100*day)
	fixture = append(fixture, receipt{key: "held", state: "manual_review", settled: 400 * day},
		receipt{key: "recent", state: "succeeded", settled: 30 * day})
	fixture = append(fixture, olds("next-range", wide, 30*day)...)
	fixture = append(fixture, receipt{key: "next", state: "succeeded", settled: day})
	ids := insert(t, db, fixture)
	if ids["next"] != lo+2*wide {
		t.Fatalf("ids %v", ids)
	}
	held := rowsOf(t, db, ids["held"], ids["held"]+1)
	rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
	if err != nil || rep.HistoryPartitionsCompacted != 1 {
		t.Fatalf("first pass: %+v, %v; want the range compacted", rep, err)
	}

	// "recent" leaves in one batch with the next range's receipts; that
	// range drops whole, "recent"'s range stays (held).
	rep, err = retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 20 * day, History: 20 * day, Horizon: time.Hour}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.ReceiptBatches != 1 || rep.HistoryPartitions != 1 || rep.HistoryBatches != 1 {
		t.Errorf("second pass %+v: want one receipts batch, the next range dropped and the rest of the batch row by row", rep)
	}
	if got := rowsOf(t, db, ids["recent"], ids["recent"]+1); len(got["receipt_events"])+len(got["readback_checks"]) != 0 {
		t.Errorf("history of the receipt that left after the compaction still there: %v", got)
	}
	if got := rowsOf(t, db, lo, lo+wide); !mapsEqual(got, held) {
		t.Errorf("range after the second pass %v, want the held receipt's history %v", got, held)
	}
}

// A compaction does not wait behind a reader of the history for longer
// than its lock timeout: the pass fails (55P03), nothing removed, and the
// next one, the reader gone, compacts the range.
func TestCompactionGivesWayToAReader(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, _, _ := pinnedRange(t, db)
	p := retention.Policy{Settled: 90 * day, History: 365 * day, Horizon: time.Hour}
	if _, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	before := rowsOf(t, db, lo, lo+wide)
	reader, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM reconciler.readback_checks`); err != nil {
		t.Fatal(err)
	}
	p.History = 90 * day
	_, err = retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "55P03" {
		t.Fatalf("compaction behind a reader: %v, want 55P03 (lock_not_available)", err)
	}
	if got := rowsOf(t, db, lo, lo+wide); !mapsEqual(got, before) {
		t.Fatal("rows of the range changed")
	}
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx, p, 0); err != nil || rep.HistoryPartitionsCompacted != 1 {
		t.Errorf("next pass: %+v, %v; want the range compacted", rep, err)
	}
}

// archive run --no-compact (Policy.NoCompaction) leaves a pinned range to
// the row-by-row path: its removable history goes row by row, the kept
// receipts' history stays, and the partition is the one it was.
func TestNoCompactionLeavesAPinnedRangeToTheRows(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	lo, ids, kept := pinnedRange(t, db)
	keptBefore := map[string]map[string][]string{}
	for _, k := range kept {
		keptBefore[k] = rowsOf(t, db, ids[k], ids[k]+1)
	}
	names := map[string]string{}
	for _, tbl := range partitionTablesForTest() {
		names[tbl] = partitionOf(t, db, tbl, lo)
	}
	rep, err := retention.New(db, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour, NoCompaction: true}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.HistoryPartitionsCompacted != 0 || rep.HistoryBatches == 0 {
		t.Errorf("report %+v: want nothing compacted and the history removed row by row", rep)
	}
	for _, k := range kept {
		if got := rowsOf(t, db, ids[k], ids[k]+1); !mapsEqual(got, keptBefore[k]) {
			t.Errorf("%s: history after the pass\n%v\nwant, identical\n%v", k, got, keptBefore[k])
		}
	}
	for _, tbl := range partitionTablesForTest() {
		if got := partitionOf(t, db, tbl, lo); got != names[tbl] {
			t.Errorf("%s: partition %s after the pass, want %s untouched", tbl, got, names[tbl])
		}
	}
}
