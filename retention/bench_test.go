package retention_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/retention"
)

// BenchmarkHistoryRemoval times the removal of the history of receipts
// retention removed a year ago (3 events and a readback check each;
// RETENTION_BENCH_RECEIPTS of them, a million unless set), row by row (one
// partition holds them all and a kept receipt pins it) against whole
// partitions (ranges of a tenth of them, all due), and against compacted
// ones (the same ranges, 1 receipt in 100 still in the ledger in
// manual_review, pinning every range: migration 00024). Run it with
// -bench HistoryRemoval -benchtime 1x; each run fills a fresh database.
func BenchmarkHistoryRemoval(b *testing.B) {
	n := int64(1_000_000)
	if v := os.Getenv("RETENTION_BENCH_RECEIPTS"); v != "" {
		var err error
		if n, err = strconv.ParseInt(v, 10, 64); err != nil || n < 10_000 {
			b.Fatalf("RETENTION_BENCH_RECEIPTS=%q: want a number of at least 10000", v)
		}
	}
	for _, m := range []struct {
		name  string
		width int64
		kept  int64 // every kept-th receipt stays in the ledger (0: none)
	}{{"rows", 10 * n, 0}, {"partitions", n / 10, 0}, {"compacted", n / 10, 100}} {
		b.Run(m.name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				ctx := context.Background()
				db := pgtest.NewPool(b)
				var top int64
				if err := db.QueryRow(ctx, `SELECT max(to_id) FROM reconciler.history_partitions()`).Scan(&top); err != nil {
					b.Fatal(err)
				}
				conn, err := db.Acquire(ctx)
				if err != nil {
					b.Fatal(err)
				}
				// The state retention leaves a year after removing the
				// receipts [top, top+n), in batches of 5000: their history,
				// the batches, removed_receipts; the kept ones in the ledger.
				for _, q := range []string{
					fmt.Sprintf(`SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), %d)`, top-1),
					fmt.Sprintf(`UPDATE reconciler.history_partitioning SET width = %d`, m.width),
					fmt.Sprintf(`SELECT reconciler.ensure_history_partitions(%d)`, top+n),
					`SET session_replication_role = replica`,
					fmt.Sprintf(`INSERT INTO reconciler.receipt_events (receipt_id, seq, from_state, to_state, at, actor)
						SELECT g, s, NULL, CASE s WHEN 3 THEN 'succeeded' ELSE 'planned' END,
						       now() - interval '400 days', 'agent:bench'
						FROM generate_series(%d, %d) g, generate_series(1, 3) s`, top, top+n-1),
					fmt.Sprintf(`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
						SELECT g, 1, now() - interval '400 days', 'bench', 'bench', 'api', 'present', 1000
						FROM generate_series(%d, %d) g`, top, top+n-1),
					fmt.Sprintf(`INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed, settled_before)
						SELECT 'receipts', 'bench', repeat('0', 64), '{}', now() - interval '400 days'
						FROM generate_series(1, %d)`, (n+4999)/5000),
					fmt.Sprintf(`INSERT INTO reconciler.removed_receipts (receipt_id, batch_id, state, settled_at)
						SELECT g, (g - %d) / 5000 + 1, 'succeeded', now() - interval '400 days'
						FROM generate_series(%d, %d) g WHERE %d = 0 OR g %% %d <> 0`, top, top, top+n-1, m.kept, max(m.kept, 1)),
					fmt.Sprintf(`INSERT INTO reconciler.receipts (id, idempotency_key, operation, dependency, method, target,
						fingerprint, state, state_actor, created_at, submitted_at, updated_at, version)
						OVERRIDING SYSTEM VALUE
						SELECT g, 'kept-' || g, 'things.create', 'api', 'POST', '/things', 'sha256:' || repeat('0', 64),
						       'manual_review', 'reconciler:bench', now() - interval '401 days', now() - interval '401 days',
						       now() - interval '400 days', 3
						FROM generate_series(%d, %d) g WHERE %d <> 0 AND g %% %d = 0`, top, top+n-1, m.kept, max(m.kept, 1)),
					`RESET session_replication_role`,
					fmt.Sprintf(`SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), %d)`, top+n-1),
				} {
					if _, err := conn.Exec(ctx, q); err != nil {
						b.Fatalf("%s: %v", q, err)
					}
				}
				conn.Release()
				// A receipt in flight after them: in their partition (rows),
				// or in the next range (partitions).
				insert(b, db, []receipt{{key: "in-flight", state: "outcome_unknown", settled: day}})
				mustExec(b, db, `ANALYZE`)

				sink := &timedSink{Dir: retention.Dir(b.TempDir())}
				b.StartTimer()
				start := time.Now()
				rep, err := retention.New(db, sink, nil).Run(ctx,
					retention.Policy{Settled: 90 * day, History: 90 * day, Horizon: time.Hour}, 0)
				elapsed := time.Since(start)
				b.StopTimer()
				if err != nil {
					b.Fatal(err)
				}
				gone := n
				if m.kept != 0 {
					gone -= (top+n-1)/m.kept - (top-1)/m.kept
				}
				if rep.Rows["receipt_events"] != 3*gone || rep.Rows["readback_checks"] != gone {
					b.Fatalf("removed %v, want %d events and %d checks", rep.Rows, 3*gone, gone)
				}
				var archived int64
				for _, f := range rep.Files {
					if st, err := os.Stat(f); err == nil {
						archived += st.Size()
					}
				}
				fmt.Printf("history_removal mode=%s receipts=%d events=%d checks=%d partitions=%d compacted=%d history_batches=%d "+
					"seconds=%.2f export_s=%.2f remove_s=%.2f rows_per_s=%.0f archive_mb=%.1f\n",
					m.name, n, rep.Rows["receipt_events"], rep.Rows["readback_checks"], rep.HistoryPartitions,
					rep.HistoryPartitionsCompacted, rep.HistoryBatches, elapsed.Seconds(), sink.spent.Seconds(),
					(elapsed - sink.spent).Seconds(), float64(4*gone)/elapsed.Seconds(), float64(archived)/(1<<20))
				b.ReportMetric(elapsed.Seconds(), "s/removal")
				b.ReportMetric((elapsed - sink.spent).Seconds(), "s/removal-without-export")
			}
		})
	}
}

// timedSink adds up the time spent writing archives: the rest of a pass is
// choosing and removing.
type timedSink struct {
	retention.Dir
	spent time.Duration
}

func (s *timedSink) Write(ctx context.Context, name string, write func(io.Writer) error) (string, string, error) {
	start := time.Now()
	defer func() { s.spent += time.Since(start) }()
	return s.Dir.Write(ctx, name, write)
}
