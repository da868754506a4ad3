package main

import (
	"fmt"
	"log/slog"
	"os"
	"sort"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/retention"
)

// removeSettled: `archive run`.
var removeSettled = access{"archive and remove settled receipts",
	"reconciler_retention",
	`has_function_privilege('reconciler.retention_remove_receipts(bigint[], text, text, timestamptz, interval, jsonb)', 'EXECUTE')
	 AND has_table_privilege('reconciler.receipt_events', 'SELECT')`}

func archiveCommand() *cli.Command {
	return &cli.Command{
		Name:  "archive",
		Usage: "export settled receipts no guarantee needs any more, and later their history, then remove them (docs/retention.md)",
		Subcommands: []*cli.Command{{
			Name: "run",
			Usage: "one retention pass: each batch of receipts (then each history partition range, then the history " +
				"left) is written to --dir as gzip JSON Lines with a .sha256 file, and removed only once written",
			Description: "The policy comes from the adapters file's retention mapping ({settled: 90d, history: 1y}) or " +
				"the flags, which override it. A receipt stays while any guarantee needs it (unsettled, manual_review, " +
				"native-key retention, absence window, the adapters' request horizon, an open retry chain, a " +
				"duplicate alarm, a pending webhook, a replayable gateway response): the database re-checks each " +
				"batch. A history partition range whose receipts all left before the history policy, and that the " +
				"receipts sequence has passed, is dropped whole (history-p<lo>-<hi>.jsonl.gz). " +
				"Prints what was removed, one name=value per line.",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.StringFlag{Name: "dir", Required: true, Usage: "directory the archive files are written to"},
				&cli.StringFlag{Name: "adapters", EnvVars: []string{"RECONCILER_ADAPTERS"},
					Usage: "adapters file: its retention policy, and its adapters' request horizon"},
				&cli.StringFlag{Name: "settled", Usage: "keep settled receipts at least this long (90d, 1y, 36h)"},
				&cli.StringFlag{Name: "history", Usage: "keep their history at least this long after settlement (at least --settled)"},
				&cli.DurationFlag{Name: "horizon", Usage: "without --adapters: the longest request lifetime plus " +
					"consistency window (or native key retention) of any dependency"},
				&cli.IntFlag{Name: "batch", Value: retention.DefaultBatch, Usage: "receipts per batch"},
				&cli.BoolFlag{Name: "no-compact", Usage: "leave history ranges pinned by a few kept receipts to the " +
					"row-by-row path: a compaction holds the history's writers for its duration (docs/retention.md)"},
				&cli.IntFlag{Name: "max-batches", Usage: "stop after this many receipts batches (0: no bound)"},
			},
			Action: archiveRun,
		}, {
			Name:      "verify",
			Usage:     "check archive files against their .sha256 files and count their rows per table",
			ArgsUsage: "FILE...",
			Action:    archiveVerify,
		}},
	}
}

// archivePolicy is the policy of the flags over the adapters file's.
func archivePolicy(c *cli.Context) (retention.Policy, error) {
	p := retention.Policy{Batch: c.Int("batch"), NoCompaction: c.Bool("no-compact")}
	switch {
	case c.String("adapters") != "":
		reg, err := httpadapter.LoadFile(c.String("adapters"), nil)
		if err != nil {
			return p, cli.Exit(fmt.Sprintf("archive run: %v", err), 1)
		}
		if c.IsSet("horizon") {
			return p, cli.Exit("archive run: --horizon and --adapters: the horizon is the adapters'; drop --horizon", 2)
		}
		p.Horizon = reg.RequestHorizon()
		if r, ok := reg.Retention(); ok {
			p.Settled, p.History = r.Settled, r.History
		}
	case c.IsSet("horizon"):
		p.Horizon = c.Duration("horizon")
	default:
		return p, cli.Exit("archive run: pass --adapters (its adapters' request horizon keeps every receipt whose call "+
			"could still answer) or --horizon", 2)
	}
	for _, f := range []struct {
		name string
		dst  *time.Duration
	}{{"settled", &p.Settled}, {"history", &p.History}} {
		if v := c.String(f.name); v != "" {
			d, err := readback.ParseAge(v)
			if err != nil {
				return p, cli.Exit(fmt.Sprintf("archive run: --%s: %v", f.name, err), 2)
			}
			*f.dst = d
		}
	}
	if p.Settled == 0 {
		return p, cli.Exit("archive run: no policy: pass --settled (and --history), or an adapters file with retention: {settled: 90d, history: 1y}", 2)
	}
	if p.History == 0 {
		p.History = p.Settled
	}
	if err := p.Validate(); err != nil {
		return p, cli.Exit(fmt.Sprintf("archive run: %v", err), 2)
	}
	return p, nil
}

func archiveRun(c *cli.Context) error {
	p, err := archivePolicy(c)
	if err != nil {
		return err
	}
	dir := c.String("dir")
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return cli.Exit(fmt.Sprintf("archive run: --dir %s is no directory (%v)", dir, err), 1)
	}
	pool, err := openPool(c, "archive run", removeSettled)
	if err != nil {
		return err
	}
	defer pool.Close()
	log := slog.New(slog.NewJSONHandler(jsonLines{c.App.ErrWriter}, nil))
	rep, err := retention.New(pool, retention.Dir(dir), log).Run(c.Context, p, c.Int("max-batches"))
	printArchiveReport(newScreen(c.App.Writer), rep)
	if err != nil {
		return dbFailure("archive run", pool, err, removeSettled)
	}
	return nil
}

func printArchiveReport(w *screen, rep retention.Report) {
	w.Printf("receipt_batches=%d\nhistory_partitions=%d\nhistory_partitions_compacted=%d\nhistory_batches=%d\n",
		rep.ReceiptBatches, rep.HistoryPartitions, rep.HistoryPartitionsCompacted, rep.HistoryBatches)
	tables := make([]string, 0, len(rep.Rows))
	for t := range rep.Rows {
		tables = append(tables, t)
	}
	sort.Strings(tables)
	for _, t := range tables {
		w.Printf("removed_%s=%d\n", t, rep.Rows[t])
	}
	for _, f := range rep.Files {
		w.Printf("file=%s\n", f)
	}
}

func archiveVerify(c *cli.Context) error {
	if !c.Args().Present() {
		return cli.Exit("archive verify: name at least one archive file", 2)
	}
	w := newScreen(c.App.Writer)
	for _, f := range c.Args().Slice() {
		lines, err := retention.ReadFile(f)
		if err != nil {
			return cli.Exit(fmt.Sprintf("archive verify: %v", err), 1)
		}
		counts := map[string]int{}
		for _, l := range lines {
			counts[l.Table]++
		}
		tables := make([]string, 0, len(counts))
		for t := range counts {
			tables = append(tables, t)
		}
		sort.Strings(tables)
		w.Printf("%s: ok", f)
		for _, t := range tables {
			w.Printf(" %s=%d", t, counts[t])
		}
		w.Printf("\n")
	}
	return nil
}
