package main

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/reconcile"
)

// startPartitionKeeper keeps the history partitions ahead while the daemon
// runs (docs/retention.md, "Partitioned history"): a round at once, then
// one a minute, until ctx ends or the returned func stops it (and waits).
// With once (run --once) it makes the one round and returns.
func startPartitionKeeper(ctx context.Context, db *pgxpool.Pool, reg prometheus.Registerer, logger *slog.Logger, once bool) func() {
	k := reconcile.NewPartitionKeeper(db, reconcile.PartitionConfig{
		Logger: logger, Metrics: reconcile.NewPartitionMetrics(reg)})
	if once {
		if _, err := k.Ensure(ctx); err != nil {
			logger.Warn("history partitions: round failed", "error", err)
		}
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { k.Run(ctx) })
	return func() { cancel(); wg.Wait() }
}

func partitionsCommand() *cli.Command {
	return &cli.Command{
		Name:  "partitions",
		Usage: "inspect the history tables' partitions (receipt_events, readback_checks, verdict_audits)",
		Subcommands: []*cli.Command{{
			Name: "show",
			Usage: "print each partition's receipt id range, the period of creation time it covers, its rows " +
				"(the planner's estimate) and size, how many ranges are ahead of the receipts, and the rows " +
				"the default partitions hold",
			Flags: []cli.Flag{databaseURLFlag(), &cli.BoolFlag{Name: "json", Usage: "print JSON"}},
			Action: func(c *cli.Context) error {
				const cmd = "partitions show"
				pool, err := openPool(c, cmd, readBacklog)
				if err != nil {
					return err
				}
				defer pool.Close()
				st, err := reconcile.NewPartitionKeeper(pool, reconcile.PartitionConfig{}).Describe(c.Context)
				if err != nil {
					return dbFailure(cmd, pool, err, readBacklog)
				}
				if c.Bool("json") {
					return writeJSON(c.App.Writer, st)
				}
				printPartitions(newScreen(c.App.Writer), st)
				return nil
			},
		}},
	}
}

// printPartitions prints a table of the partitions, then the totals.
func printPartitions(w *screen, st reconcile.PartitionStatus) {
	id := func(v *int64, none string) string {
		if v == nil {
			return none
		}
		return strconv.FormatInt(*v, 10)
	}
	at := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format(time.RFC3339)
	}
	tw := w.Table()
	tw.Printf("TABLE\tPARTITION\tIDS FROM\tTO\tFIRST CREATED\tLAST CREATED\tROWS (EST.)\tSIZE\n")
	for _, p := range st.Partitions {
		rows := "-"
		if p.Default {
			rows = strconv.FormatInt(p.DefaultRows, 10)
		} else if p.EstimatedRows >= 0 {
			rows = strconv.FormatInt(p.EstimatedRows, 10)
		}
		from, to := id(p.From, "MIN"), id(p.To, "-")
		if p.Default {
			from = "DEFAULT"
		}
		tw.Printf("%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.Parent, p.Name, from, to,
			at(p.FirstCreated), at(p.LastCreated), rows, fmt.Sprintf("%.2f MB", float64(p.Bytes)/1e6))
	}
	_ = tw.Flush()
	w.Printf("last_receipt_id=%d\n", st.LastID)
	w.Printf("history_partitions_ahead=%d\n", st.Ahead)
	w.Printf("history_default_rows=%d\n", st.DefaultRows)
}
