package main

import (
	"fmt"
	"slices"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/cmd/reconciler/internal/benchlife"
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
			"and submitted in one commit; then Succeed, committed without waiting for its WAL flush), then " +
			"-n through a client WithDurableOutcomes (Succeed waits for the flush too), in one scratch " +
			"database, after a warm-up of each; --rounds times, alternating. Prints one line per " +
			"concurrency, each figure the median over the rounds: lifecycles_per_s, bare_sql_per_s, " +
			"their ratio, the latency each ledger call adds over the bare statement at p50 and p99, and " +
			"durable_per_s with its ratio to bare SQL.",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.StringFlag{Name: "concurrency", Value: "1,8,32", Usage: "concurrent agents, comma-separated"},
			&cli.IntFlag{Name: "n", Value: 3000, Usage: "lifecycles per run"},
			&cli.IntFlag{Name: "rounds", Value: 3, Usage: "runs of each, alternated; figures are their medians"},
		},
		Action: benchLedger,
	}
}

func benchLedger(c *cli.Context) error {
	n := c.Int("n")
	if n < 1 {
		return cli.Exit("bench ledger: -n must be at least 1", 2)
	}
	rounds := c.Int("rounds")
	if rounds < 1 {
		return cli.Exit("bench ledger: --rounds must be at least 1", 2)
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
	durable := benchlife.Ledger(client.WithDurableOutcomes())
	// Every lifecycle has its own number, hence its own key, across runs.
	var next int64
	run := func(a, count int, f benchlife.Lifecycle) (benchlife.Stats, error) {
		st, err := benchlife.Run(ctx, a, count, next, f)
		next += int64(count)
		return st, err
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	kinds := []struct {
		name string
		f    benchlife.Lifecycle
	}{{"bare SQL", bare}, {"ledger", lc}, {"ledger, durable outcomes", durable}}
	for _, a := range agents {
		fmt.Fprintf(log, "bench ledger: %d agents, %d rounds of %d lifecycles each way ...\n", a, rounds, n)
		// A warm-up of each fills the connection pool and the plan caches,
		// which the first of the measured runs would otherwise pay for.
		warm := max(n/10, a)
		for _, k := range kinds {
			if _, err := run(a, warm, k.f); err != nil {
				return cli.Exit(fmt.Sprintf("bench ledger: warm-up: %v", err), 1)
			}
		}
		// Round by round, alternated, so a noisy neighbour's slow spell
		// falls on all three kinds rather than on one.
		stats := make([][]benchlife.Stats, len(kinds))
		for range rounds {
			for i, k := range kinds {
				st, err := run(a, n, k.f)
				if err != nil {
					return cli.Exit(fmt.Sprintf("bench ledger: %s: %v", k.name, err), 1)
				}
				stats[i] = append(stats[i], st)
			}
		}
		b, l, d := stats[0], stats[1], stats[2]
		rate := func(s []benchlife.Stats) float64 { return median(s, func(x benchlife.Stats) float64 { return x.Rate }) }
		p50 := func(s []benchlife.Stats) float64 {
			return median(s, func(x benchlife.Stats) float64 { return ms(x.P50) })
		}
		p99 := func(s []benchlife.Stats) float64 {
			return median(s, func(x benchlife.Stats) float64 { return ms(x.P99) })
		}
		ratio := func(s []benchlife.Stats) float64 {
			r := make([]float64, rounds)
			for i := range r {
				r[i] = s[i].Rate / b[i].Rate
			}
			slices.Sort(r)
			return r[rounds/2]
		}
		fmt.Fprintf(c.App.Writer, "bench=ledger concurrency=%d n=%d rounds=%d lifecycles_per_s=%.0f bare_sql_per_s=%.0f "+
			"ratio=%.2f p50_added_ms=%.3f p99_added_ms=%.3f p50_ms=%.3f p99_ms=%.3f bare_p50_ms=%.3f bare_p99_ms=%.3f "+
			"durable_per_s=%.0f durable_ratio=%.2f durable_p99_added_ms=%.3f\n",
			a, n, rounds, rate(l), rate(b), ratio(l), p50(l)-p50(b), p99(l)-p99(b),
			p50(l), p99(l), p50(b), p99(b), rate(d), ratio(d), p99(d)-p99(b))
	}
	return nil
}

// median returns the median of f over s (the upper one of an even count).
func median[T any](s []T, f func(T) float64) float64 {
	v := make([]float64, len(s))
	for i, x := range s {
		v[i] = f(x)
	}
	slices.Sort(v)
	return v[len(v)/2]
}
