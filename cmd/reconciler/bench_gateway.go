package main

import (
	"fmt"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/cmd/reconciler/internal/benchgw"
)

func benchGatewayCommand() *cli.Command {
	return &cli.Command{
		Name: "gateway",
		Usage: "latency the receipt gateway adds per call (p50, p99) and calls per second, against " +
			"calling a local upstream directly and through the Go ledger client, in the same run",
		Description: "For each concurrency, sends -n POSTs (each with a key of its own, so each is " +
			"planned, submitted, sent and settled) to a local upstream answering 201: directly, after one " +
			"durable commit of a one-row INSERT (the floor: a ledger's record must be flushed before the " +
			"bytes leave), through ledger.Caller.Do, and through a gateway in front of it, in one scratch " +
			"database, after a warm-up. The four paths take turns in rounds (about n/20 calls each, in a " +
			"rotating order), so a change in the machine's load falls on all of them alike. Prints one " +
			"line per concurrency: added_* is the gateway over the direct call, floor_* the commit path " +
			"over it, over_do_* the gateway over Caller.Do.",
		Flags: []cli.Flag{
			benchServerFlag(),
			&cli.StringFlag{Name: "concurrency", Value: "1,8", Usage: "concurrent agents, comma-separated"},
			&cli.IntFlag{Name: "n", Value: 2000, Usage: "calls per path"},
		},
		Action: benchGateway,
	}
}

func benchGateway(c *cli.Context) error {
	n := c.Int("n")
	if n < 1 {
		return cli.Exit("bench gateway: -n must be at least 1", 2)
	}
	agents, err := parseList("concurrency", c.String("concurrency"), positiveInt)
	if err != nil {
		return cli.Exit("bench gateway: "+err.Error(), 2)
	}
	ctx := c.Context
	log := c.App.ErrWriter
	bdb, err := openBenchDB(ctx, log, c.String("database-url"), false)
	if err != nil {
		return cli.Exit("bench gateway: "+err.Error(), 1)
	}
	defer bdb.Close()
	maxAgents := 0
	for _, a := range agents {
		maxAgents = max(maxAgents, a)
	}
	// Agents through Caller.Do and the gateway's own handlers each hold a
	// connection per call in flight.
	db, err := bdb.pool(ctx, 2*maxAgents+2)
	if err != nil {
		return cli.Exit("bench gateway: "+err.Error(), 1)
	}
	defer db.Close()
	bench, err := benchgw.New(db)
	if err != nil {
		return cli.Exit("bench gateway: "+err.Error(), 1)
	}
	defer bench.Close()
	if err := bench.Warm(ctx, max(n/20, 10)); err != nil {
		return cli.Exit("bench gateway: "+err.Error(), 1)
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	for _, a := range agents {
		fmt.Fprintf(log, "bench gateway: %d agents, %d calls on each path ...\n", a, n)
		r, err := bench.Run(ctx, a, n)
		if err != nil {
			return cli.Exit("bench gateway: "+err.Error(), 1)
		}
		d, floor, do, gw := r[benchgw.Direct], r[benchgw.Commit], r[benchgw.Do], r[benchgw.Gateway]
		fmt.Fprintf(c.App.Writer, "bench=gateway concurrency=%d n=%d added_p50_ms=%.3f added_p99_ms=%.3f "+
			"floor_p50_ms=%.3f floor_p99_ms=%.3f over_do_p50_ms=%.3f over_do_p99_ms=%.3f "+
			"gateway_calls_per_s=%.0f do_calls_per_s=%.0f direct_calls_per_s=%.0f "+
			"gateway_p50_ms=%.3f gateway_p99_ms=%.3f direct_p50_ms=%.3f direct_p99_ms=%.3f\n",
			a, n, ms(gw.P50-d.P50), ms(gw.P99-d.P99), ms(floor.P50-d.P50), ms(floor.P99-d.P99),
			ms(gw.P50-do.P50), ms(gw.P99-do.P99), gw.Rate, do.Rate, d.Rate, ms(gw.P50), ms(gw.P99), ms(d.P50), ms(d.P99))
	}
	return nil
}
