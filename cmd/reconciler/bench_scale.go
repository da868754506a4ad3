package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/retention"
)

func benchScaleCommand() *cli.Command {
	return &cli.Command{
		Name: "scale",
		Usage: "fill N receipts spread over a year with their history, print claim, plan, sweep and review list " +
			"latencies and table and index sizes per million receipts, then the same after a retention pass",
		Description: "Creates a scratch database (see bench settle), fills it with the triggers off (history " +
			"events, readback checks, verdict audits and keys written alongside, as the triggers would; on a " +
			"partitioned schema, the history partitions created first), VACUUM ANALYZEs it, measures, runs one " +
			"retention pass (archive written to a temporary directory), VACUUM FULLs the tables, and measures " +
			"again. Output is one name=value per line.",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.IntFlag{Name: "receipts", Value: 1_000_000, Usage: "receipts to fill"},
			&cli.StringFlag{Name: "settled", Value: "90d", Usage: "retention pass: settled receipts kept this long"},
			&cli.StringFlag{Name: "history", Value: "180d", Usage: "retention pass: their history kept this long"},
			&cli.IntFlag{Name: "samples", Value: 100, Usage: "claims, plans and review lists measured per phase"},
			&cli.BoolFlag{Name: "retention", Value: true, Usage: "run the retention pass and measure after it " +
				"(false: measure the filled ledger only; a pass over 10 million receipts takes hours on a small machine)"},
			&cli.IntFlag{Name: "retention-batches", Usage: "bound the retention pass to this many receipts batches " +
				"(0: a whole pass); a bounded pass measures the removal's rate on the oldest receipts only: no VACUUM FULL, " +
				"no after phase"},
			&cli.IntFlag{Name: "in-flight", Usage: "receipts in flight, the newest ones (0: 2% of --receipts); " +
				"the work in flight depends on the rate of calls, not on the ledger's age, so to see what the size of the " +
				"history alone costs, compare sizes with the same in-flight count"},
			&cli.IntFlag{Name: "compare", Usage: "also fill a second database of this many receipts on the same server " +
				"(with the same in-flight count) and measure the two interleaved, sample by sample, so that the " +
				"machine's load weighs on both alike; prints each size's figures and their ratios (no retention pass)"},
			&cli.BoolFlag{Name: "keep", Usage: "keep the benchmark database (its name is printed; not with a throwaway cluster)"},
		},
		Action: benchScale,
	}
}

// The bench's mix, per receipt id g of n spread over a year, oldest first
// (ids in creation order, as in a real ledger). The newest @n - @settled
// (--in-flight; by default 2%, the last 7.3 days) are the work in flight: per 100, 50 outcome_unknown (due), 2
// reconciling, 13 submitted (all older than the orphan cut-off but the
// last), 7 planned, the rest succeeded (a backlog far above a healthy
// one's, so that every phase has due receipts to claim). The older ones are settled: per
// 1,000, 2 manual_review, 5 safe_to_retry never retried (open chains), 20
// rejected, the rest succeeded, one in ten of those through the
// reconciler (five events and a readback check, else three events). One
// settled receipt in 100 is a delete (most of them succeeded through the
// reconciler). One receipt in 10,000 has a duplicate alarm.
const sqlScaleFill = `WITH r AS (
	SELECT g, now() - (@n - g) * (interval '365 days' / @n) AS created,
	       CASE WHEN g > @settled THEN
	                CASE WHEN g % 100 < 50 THEN 'outcome_unknown' WHEN g % 100 < 52 THEN 'reconciling'
	                     WHEN g % 100 < 65 THEN 'submitted' WHEN g % 100 < 72 THEN 'planned' ELSE 'succeeded' END
	            ELSE
	                CASE WHEN g % 1000 < 2 THEN 'manual_review' WHEN g % 1000 < 7 THEN 'safe_to_retry'
	                     WHEN g % 1000 < 27 THEN 'rejected' ELSE 'succeeded' END
	       END AS state
	FROM generate_series(@lo::bigint, @hi::bigint) g
)
INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint, intent,
    state, state_actor, state_detail, created_at, submitted_at, updated_at, unknown_since, next_check_at,
    lease_owner, lease_expires_at, version, check_count, guarded)
SELECT 'scale:' || g, CASE WHEN g % 100 = 0 AND g <= @settled THEN 'things.delete' ELSE 'things.create' END,
       'dep-' || (g % 20), CASE WHEN g % 100 = 0 AND g <= @settled THEN 'DELETE' ELSE 'POST' END, '/things', 'sha256:' || md5(g::text) || md5(g::text || 'x'),
       jsonb_build_object('name', 'thing ' || g),
       state, CASE WHEN state IN ('reconciling', 'manual_review', 'safe_to_retry') OR g % 10 = 0 AND state = 'succeeded'
                   THEN 'reconciler:scale' ELSE 'agent:scale' END,
       CASE WHEN state = 'safe_to_retry' OR g % 10 = 0 AND state = 'succeeded' AND g <= @settled
            THEN jsonb_build_object('evidence', jsonb_build_object('absence_safe_at', created + interval '2 minutes'))
            ELSE '{}' END,
       created, CASE WHEN state <> 'planned' THEN created + interval '100 ms' END,
       CASE WHEN state IN ('planned', 'submitted') AND g = @n THEN now()
            WHEN state IN ('planned', 'submitted', 'outcome_unknown', 'reconciling') THEN created + interval '1 s'
            ELSE created + interval '5 minutes' END,
       CASE WHEN state IN ('outcome_unknown', 'reconciling') THEN created + interval '1 s' END,
       CASE state WHEN 'outcome_unknown' THEN created + interval '1 minute' WHEN 'reconciling' THEN now() + interval '1 hour' END,
       CASE WHEN state = 'reconciling' THEN 'other/00000000/1' END,
       CASE WHEN state = 'reconciling' THEN now() + interval '1 hour' END,
       CASE WHEN state = 'planned' THEN 1 WHEN state = 'submitted' THEN 2 WHEN state = 'outcome_unknown' THEN 3
            WHEN state = 'reconciling' THEN 4 WHEN state IN ('manual_review', 'safe_to_retry') OR g % 10 = 0 THEN 5
            ELSE 3 END,
       CASE WHEN state IN ('manual_review', 'safe_to_retry') OR g % 10 = 0 AND state = 'succeeded' THEN 1 ELSE 0 END,
       true
FROM r`

// sqlScaleHistory writes what the triggers would have: the key, one event
// per version, a readback check per check_count, and the alarms.
func sqlScaleHistory() []string {
	return []string{
		`INSERT INTO reconciler.receipt_keys (idempotency_key, receipt_id)
		 SELECT idempotency_key, id FROM reconciler.receipts WHERE id BETWEEN @lo AND @hi`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, from_state, to_state, at, actor, detail)
		 SELECT x.id, s, CASE WHEN s > 1 THEN (ARRAY['planned', 'submitted', 'outcome_unknown', 'reconciling'])[s - 1] END,
		        CASE WHEN s = x.version THEN x.state ELSE (ARRAY['planned', 'submitted', 'outcome_unknown', 'reconciling'])[s] END,
		        least(x.created_at + s * interval '1 s', x.updated_at), x.state_actor,
		        CASE WHEN s = x.version THEN x.state_detail ELSE '{}' END
		 FROM reconciler.receipts x, generate_series(1, x.version) s WHERE x.id BETWEEN @lo AND @hi`,
		`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict,
		     authoritative, latency_us)
		 SELECT id, 1, updated_at, 'scale', 'scale', dependency,
		        CASE WHEN state = 'safe_to_retry' OR state = 'succeeded' AND operation = 'things.delete' THEN 'absent'
		             WHEN state = 'succeeded' THEN 'present' ELSE 'inconclusive' END,
		        true, 1500
		 FROM reconciler.receipts WHERE id BETWEEN @lo AND @hi AND check_count > 0`,
		`INSERT INTO reconciler.duplicate_alarms (receipt_id, detected_at, instance, adapter, dependency, external_ids)
		 SELECT id, updated_at, 'scale', 'scale', dependency, '{a,b}' FROM reconciler.receipts
		 WHERE id BETWEEN @lo AND @hi AND id % 10000 = 5000 AND state = 'succeeded'`,
		// The reconciler audits each absence it settled (migration 00015):
		// the safe_to_retry receipts and the reconciler's succeeded
		// deletes, once each, a day after the verdict.
		`INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter, settled_state, settled_at,
		     at, instance, verdict)
		 SELECT id, dependency, operation, 'scale', state, updated_at, updated_at + interval '1 day', 'scale', 'confirmed'
		 FROM reconciler.receipts WHERE id BETWEEN @lo AND @hi
		   AND (state = 'safe_to_retry' OR state = 'succeeded' AND operation = 'things.delete' AND state_actor = 'reconciler:scale')`,
	}
}

// sqlScaleSizes is the size of each table of the ledger and of its
// indexes, largest first, with its partition count (0: not partitioned).
// A partitioned table stores nothing itself (its size and its indexes' are
// 0): its size is the sum over the leaves of its partition tree
// (pg_partition_tree lists nothing for a plain table: that is its own
// leaf).
const sqlScaleSizes = `SELECT c.relname, sum(pg_table_size(t.relid))::bigint, sum(pg_indexes_size(t.relid))::bigint,
	(SELECT count(*) FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid),
	count(*) FILTER (WHERE t.relid <> c.oid AND t.isleaf)
	FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace,
	     LATERAL (SELECT p.relid, p.isleaf FROM pg_catalog.pg_partition_tree(c.oid) p WHERE c.relkind = 'p'
	              UNION ALL SELECT c.oid, true WHERE c.relkind = 'r') t
	WHERE n.nspname = 'reconciler' AND c.relkind IN ('r', 'p') AND NOT c.relispartition
	  AND c.relname <> 'goose_db_version'
	GROUP BY c.oid, c.relname
	HAVING sum(pg_total_relation_size(t.relid)) > 65536
	ORDER BY sum(pg_total_relation_size(t.relid)) DESC`

// sqlScaleDefaultPartitions names the default partitions of the ledger's
// partitioned tables: rows there are rows the fill (or the reconciler's
// partition maintenance) failed to place in a numbered partition.
const sqlScaleDefaultPartitions = `SELECT p.relname
	FROM pg_catalog.pg_class p JOIN pg_catalog.pg_namespace n ON n.oid = p.relnamespace
	WHERE n.nspname = 'reconciler' AND p.relispartition
	  AND pg_catalog.pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT'
	ORDER BY 1`

// sqlScaleHistoryPartitions counts the numbered (non-default) partitions of
// the history tables, which retention may drop whole.
const sqlScaleHistoryPartitions = `SELECT count(*) FROM pg_catalog.pg_inherits i
	JOIN pg_catalog.pg_class p ON p.oid = i.inhrelid
	WHERE i.inhparent IN (SELECT to_regclass(t) FROM unnest(ARRAY['reconciler.receipt_events',
	          'reconciler.readback_checks', 'reconciler.verdict_audits']) t)
	  AND pg_catalog.pg_get_expr(p.relpartbound, p.oid) <> 'DEFAULT'`

func benchScale(c *cli.Context) error {
	n := c.Int("receipts")
	if n < 10000 {
		return cli.Exit("bench scale: --receipts must be at least 10000", 2)
	}
	var p retention.Policy
	for _, f := range []struct {
		name string
		dst  *time.Duration
	}{{"settled", &p.Settled}, {"history", &p.History}} {
		d, err := readback.ParseAge(c.String(f.name))
		if err != nil {
			return cli.Exit(fmt.Sprintf("bench scale: --%s: %v", f.name, err), 2)
		}
		*f.dst = d
	}
	p.Horizon = readback.DefaultPolicy().MaxRequestLifetime + readback.DefaultPolicy().ConsistencyWindow
	if err := p.Validate(); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 2)
	}
	inflight := c.Int("in-flight")
	if inflight == 0 {
		inflight = n / 50
	}
	if inflight < 1 || inflight > n {
		return cli.Exit("bench scale: --in-flight must be between 1 and --receipts", 2)
	}
	ctx := c.Context
	if m := c.Int("compare"); m != 0 {
		if m < inflight {
			return cli.Exit("bench scale: --compare must be at least the in-flight count", 2)
		}
		return benchScaleCompare(c, []int{n, m}, inflight)
	}
	bdb, err := openBenchDB(ctx, c.App.ErrWriter, c.String("database-url"), c.Bool("keep"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	defer bdb.Close()
	db, err := bdb.pool(ctx, 8)
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	defer db.Close()
	w := c.App.Writer
	fmt.Fprintf(w, "receipts=%d\n", n)
	start := time.Now()
	if err := scaleFill(ctx, db, n, inflight); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: fill: %v", err), 1)
	}
	fmt.Fprintf(w, "fill_s=%.1f\n", time.Since(start).Seconds())
	samples := c.Int("samples")
	if err := scaleMeasure(ctx, w, db, "before", n, samples); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	if !c.Bool("retention") {
		fmt.Fprintln(w, "retention=skipped (--retention=false: no retention pass, no after phase)")
		return nil
	}
	var partsBefore int64
	if err := db.QueryRow(ctx, sqlScaleHistoryPartitions).Scan(&partsBefore); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}

	dir, err := os.MkdirTemp("", "reconciler-bench-archive-")
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	defer os.RemoveAll(dir)
	start = time.Now()
	bound := c.Int("retention-batches")
	rep, err := retention.New(db, retention.Dir(dir), nil).Run(ctx, p, bound)
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: retention: %v", err), 1)
	}
	elapsed := time.Since(start)
	var archived int64
	for _, f := range rep.Files {
		if st, err := os.Stat(f); err == nil {
			archived += st.Size()
		}
	}
	fmt.Fprintf(w, "retention_policy=settled %s, history %s\n", c.String("settled"), c.String("history"))
	fmt.Fprintf(w, "retention_s=%.1f\n", elapsed.Seconds())
	fmt.Fprintf(w, "retention_receipts_removed=%d\n", rep.Rows["receipts"])
	fmt.Fprintf(w, "retention_events_removed=%d\n", rep.Rows["receipt_events"])
	fmt.Fprintf(w, "retention_checks_removed=%d\n", rep.Rows["readback_checks"])
	fmt.Fprintf(w, "retention_audits_removed=%d\n", rep.Rows["verdict_audits"])
	var partsAfter int64
	if err := db.QueryRow(ctx, sqlScaleHistoryPartitions).Scan(&partsAfter); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	fmt.Fprintf(w, "retention_history_partitions_dropped=%d (of %d; %d ranges dropped whole, the rest compacted or removed row by row)\n",
		partsBefore-partsAfter, partsBefore, rep.HistoryPartitions)
	fmt.Fprintf(w, "retention_history_partitions_compacted=%d\n", rep.HistoryPartitionsCompacted)
	fmt.Fprintf(w, "retention_receipts_per_s=%.0f\n", float64(rep.Rows["receipts"])/elapsed.Seconds())
	fmt.Fprintf(w, "retention_archive_mb=%.1f\n", float64(archived)/(1<<20))
	fmt.Fprintf(w, "retention_batches=%d+%d\n", rep.ReceiptBatches, rep.HistoryBatches)
	if bound > 0 {
		fmt.Fprintf(w, "retention=bounded (--retention-batches=%d: the rate of a partial pass, no after phase)\n", bound)
		return nil
	}
	start = time.Now()
	if _, err := db.Exec(ctx, `VACUUM (FULL, ANALYZE) reconciler.receipts, reconciler.receipt_events,
		reconciler.readback_checks, reconciler.verdict_audits, reconciler.receipt_keys, reconciler.late_outcomes`); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: vacuum: %v", err), 1)
	}
	fmt.Fprintf(w, "vacuum_full_s=%.1f\n", time.Since(start).Seconds())
	if err := scaleMeasure(ctx, w, db, "after", n, samples); err != nil {
		return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1)
	}
	if c.Bool("keep") && c.String("database-url") != "" {
		fmt.Fprintf(w, "database=%s\n", bdb.Name)
	}
	return nil
}

// scaleFill fills n receipts in chunks, on one connection with the
// triggers off, then VACUUM ANALYZEs and checkpoints. On a partitioned schema it first has
// the history partitions for ids up to n created, as the reconciler's
// partition maintenance would have, so that no row lands in a default
// partition.
func scaleFill(ctx context.Context, db *pgxpool.Pool, n, inflight int) error {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var partitioned bool
	if err := conn.QueryRow(ctx, `SELECT to_regprocedure('reconciler.ensure_history_partitions(bigint)') IS NOT NULL`).
		Scan(&partitioned); err != nil {
		return err
	}
	if partitioned {
		if _, err := conn.Exec(ctx, `SELECT reconciler.ensure_history_partitions($1)`, n); err != nil {
			return fmt.Errorf("history partitions: %w", err)
		}
	}
	if _, err := conn.Exec(ctx, `SET session_replication_role = replica`); err != nil {
		return fmt.Errorf("%w (the bench's fill needs a superuser)", err)
	}
	defer conn.Exec(context.Background(), `RESET session_replication_role`)
	const chunk = 200_000
	for lo := 1; lo <= n; lo += chunk {
		args := pgx.NamedArgs{"n": n, "settled": n - inflight, "lo": lo, "hi": min(lo+chunk-1, n)}
		if _, err := conn.Exec(ctx, sqlScaleFill, args); err != nil {
			return err
		}
		for _, q := range sqlScaleHistory() {
			if _, err := conn.Exec(ctx, q, args); err != nil {
				return err
			}
		}
	}
	if _, err := conn.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		return err
	}
	// The fill and its vacuum leave gigabytes of dirty pages at 10 million
	// receipts (a tenth of that at 1 million): written back by the
	// checkpointer during the measurements, they would weigh on the larger
	// size only.
	_, err = conn.Exec(ctx, `CHECKPOINT`)
	return err
}

// scaleMeasure prints the sizes and latencies of one phase, each name
// prefixed with it.
func scaleMeasure(ctx context.Context, w io.Writer, db *pgxpool.Pool, phase string, n, samples int) error {
	if err := scaleSizes(ctx, w, db, phase, n); err != nil {
		return err
	}
	pr, err := newScaleProbe(db, phase)
	if err != nil {
		return err
	}
	for range samples {
		if err := pr.claim(ctx); err != nil {
			return err
		}
	}
	for i := range samples {
		if err := pr.plan(ctx, i); err != nil {
			return err
		}
	}
	for range samples {
		if err := pr.list(ctx); err != nil {
			return err
		}
	}
	pr.print(w, phase)
	return pr.sweep(ctx, w, phase)
}

// scaleSizes prints the receipts live and each table's size per million
// receipts written (n), with its indexes and partitions.
func scaleSizes(ctx context.Context, w io.Writer, db *pgxpool.Pool, phase string, n int) error {
	var live int64
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&live); err != nil {
		return err
	}
	fmt.Fprintf(w, "%s_receipts_live=%d\n", phase, live)
	rows, err := db.Query(ctx, sqlScaleSizes)
	if err != nil {
		return err
	}
	var name string
	var table, index, indexes, parts int64
	perMillion := func(b int64) float64 { return float64(b) / (1 << 20) / (float64(n) / 1e6) }
	var total int64
	if _, err := pgx.ForEachRow(rows, []any{&name, &table, &index, &indexes, &parts}, func() error {
		total += table + index
		fmt.Fprintf(w, "%s_%s_table_mb_per_million=%.1f\n", phase, name, perMillion(table))
		fmt.Fprintf(w, "%s_%s_indexes_mb_per_million=%.1f (%d indexes)\n", phase, name, perMillion(index), indexes)
		if parts > 0 {
			fmt.Fprintf(w, "%s_%s_partitions=%d\n", phase, name, parts)
		}
		return nil
	}); err != nil {
		return err
	}
	fmt.Fprintf(w, "%s_total_mb_per_million=%.1f\n", phase, perMillion(total))
	return scaleDefaultRows(ctx, w, db, phase)
}

// scaleDefaultRows prints the rows held in default partitions (nothing
// when the schema has none): the fill places every row in a numbered
// partition, so any number but 0 is a bench or maintenance bug.
func scaleDefaultRows(ctx context.Context, w io.Writer, db *pgxpool.Pool, phase string) error {
	rows, err := db.Query(ctx, sqlScaleDefaultPartitions)
	if err != nil {
		return err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	if len(names) == 0 {
		return nil
	}
	var total int64
	for _, name := range names {
		var c int64
		q := "SELECT count(*) FROM " + pgx.Identifier{"reconciler", name}.Sanitize()
		if err := db.QueryRow(ctx, q).Scan(&c); err != nil {
			return fmt.Errorf("rows in %s: %w", name, err)
		}
		total += c
	}
	fmt.Fprintf(w, "%s_default_partition_rows=%d (%d default partitions)\n", phase, total, len(names))
	return nil
}

func printPercentiles(w io.Writer, name string, ds []time.Duration) {
	fmt.Fprintf(w, "%s_p50_ms=%.2f\n%s_p99_ms=%.2f\n", name, ms(quantile(ds, 0.50)), name, ms(quantile(ds, 0.99)))
}

// quantile returns the q-quantile of ds (sorting ds).
func quantile(ds []time.Duration, q float64) time.Duration {
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(q*float64(len(ds))))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
