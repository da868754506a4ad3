package main

import (
	"fmt"
	"slices"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/internal/benchlife"
	"github.com/receiptledger/reconciler/ledger"
)

func benchLedgerCommand() *cli.Command {
	return &cli.Command{
		Name: "ledger",
		Usage: "full agent lifecycles (plan, submit, succeed) per second through the ledger client, " +
			"against bare SQL doing the same durable work, at each concurrency",
		Description: "For each concurrency, runs -n lifecycles of bare SQL (a receipts and an events " +
			"table, three commits each inserting or updating the receipt and inserting an event, no " +
			"triggers), then -n through the ledger client as Caller.Do makes them (PlanAndSubmit: planned " +
			"and submitted in one commit; then Succeed), in one scratch database, after a warm-up of " +
			"each. Prints one line per concurrency: lifecycles_per_s, bare_sql_per_s, their ratio, and " +
			"the latency each ledger call adds over the bare statement at p50 and p99.",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.StringFlag{Name: "concurrency", Value: "1,8,32", Usage: "concurrent agents, comma-separated"},
			&cli.IntFlag{Name: "n", Value: 3000, Usage: "lifecycles per run"},
		},
		Action: benchLedger,
	}
}

func benchLedger(c *cli.Context) error {
	n := c.Int("n")
	if n < 1 {
		return cli.Exit("bench ledger: -n must be at least 1", 2)
	}
	agents, err := parseList("concurrency", c.String("concurrency"), positiveInt)
	if err != nil {
		return cli.Exit("bench ledger: "+err.Error(), 2)
	}
	ctx := c.Context
	log := c.App.ErrWriter
	bdb, err := openBenchDB(ctx, log, c.String("database-url"), false)
	if err != nil {
		return cli.Exit("bench ledger: "+err.Error(), 1)
	}
	defer bdb.Close()
	db, err := bdb.pool(ctx, slices.Max(agents)+2)
	if err != nil {
		return cli.Exit("bench ledger: "+err.Error(), 1)
	}
	defer db.Close()
	if err := benchlife.CreateBare(ctx, db); err != nil {
		return cli.Exit("bench ledger: "+err.Error(), 1)
	}
	client, err := ledger.New(db, "agent:bench")
	if err != nil {
		return cli.Exit("bench ledger: "+err.Error(), 1)
	}
	bare, lc := benchlife.Bare(db), benchlife.Ledger(client)
	// Every lifecycle has its own number, hence its own key, across runs.
	var next int64
	run := func(a, count int, f benchlife.Lifecycle) (benchlife.Stats, error) {
		st, err := benchlife.Run(ctx, a, count, next, f)
		next += int64(count)
		return st, err
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	for _, a := range agents {
		fmt.Fprintf(log, "bench ledger: %d agents, %d lifecycles each way ...\n", a, n)
		// A warm-up of each fills the connection pool and the plan caches,
		// which the first of the two measured runs would otherwise pay for.
		warm := max(n/10, a)
		for _, f := range []benchlife.Lifecycle{bare, lc} {
			if _, err := run(a, warm, f); err != nil {
				return cli.Exit(fmt.Sprintf("bench ledger: warm-up: %v", err), 1)
			}
		}
		b, err := run(a, n, bare)
		if err != nil {
			return cli.Exit(fmt.Sprintf("bench ledger: bare SQL: %v", err), 1)
		}
		l, err := run(a, n, lc)
		if err != nil {
			return cli.Exit(fmt.Sprintf("bench ledger: ledger: %v", err), 1)
		}
		fmt.Fprintf(c.App.Writer, "bench=ledger concurrency=%d n=%d lifecycles_per_s=%.0f bare_sql_per_s=%.0f "+
			"ratio=%.2f p50_added_ms=%.3f p99_added_ms=%.3f p50_ms=%.3f p99_ms=%.3f bare_p50_ms=%.3f bare_p99_ms=%.3f\n",
			a, n, l.Rate, b.Rate, l.Rate/b.Rate, ms(l.P50-b.P50), ms(l.P99-b.P99),
			ms(l.P50), ms(l.P99), ms(b.P50), ms(b.P99))
	}
	return nil
}
