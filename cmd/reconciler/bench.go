package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

func benchCommand() *cli.Command {
	return &cli.Command{
		Name:  "bench",
		Usage: "measure the ledger and the reconciler on a throwaway database",
		Subcommands: []*cli.Command{benchLedgerCommand(), benchConsistencyCommand(), benchGatewayCommand(), benchBacklogCommand(), benchScaleCommand(), {
			Name: "settle",
			Usage: "fill N due receipts, settle them with one instance and a no-op adapter that " +
				"answers present, print settled_per_s and peak_rss_mb",
			Description: "Creates a database named reconciler_bench_<random> on the server of " +
				"--database-url (the role needs CREATEDB; without it, on a throwaway cluster), migrates " +
				"it, fills it, settles every row through the real claim/check/settle path (history " +
				"events and check records included) and drops it. Output is one name=value per line.",
			Flags: []cli.Flag{
				benchServerFlag(),
				&cli.IntFlag{Name: "n", Value: 20000, Usage: "number of due receipts"},
				&cli.IntFlag{Name: "batch-size", Value: benchBatchSize, Usage: "rows per claim and per settle statement"},
				&cli.IntFlag{Name: "workers", Value: benchWorkers, Usage: "concurrent checks"},
				&cli.BoolFlag{Name: "keep", Usage: "keep the benchmark database (its name is printed; not with a throwaway cluster)"},
			},
			Action: benchSettle,
		}},
	}
}

// The bench's tuning, also the run defaults' reasoning (see docs/benchmarks.md):
// with a no-op adapter the work is all in Postgres, so the batch is large
// enough to amortise a round trip and a statement-level trigger over
// hundreds of rows, and small enough that a claim's locks and the transition
// tables stay cheap; a few workers suffice because a check costs
// microseconds.
const (
	benchBatchSize = 1000
	benchWorkers   = 4
)

func benchSettle(c *cli.Context) error {
	n := c.Int("n")
	if n < 1 {
		return cli.Exit("bench settle: -n must be at least 1", 2)
	}
	ctx := c.Context
	bdb, err := openBenchDB(ctx, c.App.ErrWriter, c.String("database-url"), c.Bool("keep"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: %v", err), 1)
	}
	defer bdb.Close()
	db, err := bdb.pool(ctx, c.Int("workers")+4)
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: %v", err), 1)
	}
	defer db.Close()
	if err := benchFill(ctx, db, n); err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: fill: %v", err), 1)
	}

	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{
		Name: "bench-noop", Type: "static", Kind: readback.Create, Dependency: "bench-api",
		Adapter: readback.Static{Verdict: readback.VerdictPresent, Authoritative: true},
		Policy:  readback.DefaultPolicy(),
	}); err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: %v", err), 1)
	}
	pool, err := reconcile.New(db, reconcile.Config{
		Instance:  "bench",
		Registry:  reg,
		Logger:    slog.New(slog.DiscardHandler),
		Workers:   c.Int("workers"),
		BatchSize: c.Int("batch-size"),
	})
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: %v", err), 2)
	}
	start := time.Now()
	sum, err := pool.Drain(ctx)
	elapsed := time.Since(start)
	if err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: %v", err), 1)
	}
	settled := sum.Settled[statemachine.Succeeded]
	var events, checks int64
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM reconciler.receipt_events),
		(SELECT count(*) FROM reconciler.readback_checks)`).Scan(&events, &checks); err != nil {
		return cli.Exit(fmt.Sprintf("bench settle: verify: %v", err), 1)
	}
	// Every receipt has planned, submitted, outcome_unknown (fill), then
	// reconciling and succeeded (the work measured): five events.
	if settled != n || events != int64(5*n) || checks != int64(n) {
		return cli.Exit(fmt.Sprintf("bench settle: settled %d of %d, %d history events (want %d), %d checks (want %d)",
			settled, n, events, 5*n, checks, n), 1)
	}
	w := c.App.Writer
	fmt.Fprintf(w, "n=%d\n", n)
	fmt.Fprintf(w, "batch_size=%d\n", c.Int("batch-size"))
	fmt.Fprintf(w, "workers=%d\n", c.Int("workers"))
	fmt.Fprintf(w, "elapsed_s=%.3f\n", elapsed.Seconds())
	fmt.Fprintf(w, "settled_per_s=%.0f\n", float64(settled)/elapsed.Seconds())
	fmt.Fprintf(w, "peak_rss_mb=%.1f\n", peakRSSMB())
	if c.Bool("keep") && c.String("database-url") != "" {
		fmt.Fprintf(w, "database=%s\n", bdb.Name)
	}
	return nil
}

// benchFill inserts n receipts of the bench dependency and moves them to
// outcome_unknown through the real triggers (so they carry their history),
// in chunks so the statement-level transition tables stay small, then
// vacuums so the measured run starts from a settled table. The receipts are
// distinct intents inserted unguarded: the duplicate guard has nothing to
// find among them, and its re-check on submission takes one advisory lock
// per row, which a 50,000-row statement would hold all at once (more than
// the server's lock table holds by default).
func benchFill(ctx context.Context, db *pgxpool.Pool, n int) error {
	const chunk = 50000
	for lo := 1; lo <= n; lo += chunk {
		hi := min(lo+chunk-1, n)
		var first, last int64
		err := db.QueryRow(ctx, `
			WITH ins AS (
				INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method,
				                                 target, fingerprint, intent, state_actor, guarded)
				SELECT 'bench:' || g || ':create', 'things.create', 'bench-api', 'POST', '/things',
				       'sha256:' || encode(sha256(('bench:' || g)::bytea), 'hex'), '{}', 'agent:bench', false
				FROM generate_series($1::int, $2::int) g
				RETURNING id
			) SELECT min(id), max(id) FROM ins`, lo, hi).Scan(&first, &last)
		if err != nil {
			return err
		}
		for _, to := range []string{"submitted", "outcome_unknown"} {
			if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $1, state_actor = 'agent:bench'
				WHERE id BETWEEN $2 AND $3`, to, first, last); err != nil {
				return err
			}
		}
	}
	_, err := db.Exec(ctx, `VACUUM ANALYZE reconciler.receipts, reconciler.receipt_events`)
	return err
}

// peakRSSMB returns the process's peak resident set size (VmHWM) in MB, or
// -1 where /proc is unavailable.
func peakRSSMB() float64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return -1
	}
	defer f.Close()
	return parseVmHWM(f)
}

func parseVmHWM(r io.Reader) float64 {
	s := bufio.NewScanner(r)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 64)
			if err != nil {
				return -1
			}
			return kb / 1024
		}
	}
	return -1
}
