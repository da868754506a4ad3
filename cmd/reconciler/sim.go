package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/sim"
)

// simCommand runs the fault-injection experiment of the article in
// shared/seeds/000: every strategy, the article's and ours, against the
// same injected faults, scored on strict success (sim package).
func simCommand() *cli.Command {
	return &cli.Command{
		Name:  "sim",
		Usage: "run the fault-injection experiment: the article's resilience patterns and the ledger, side by side",
		Flags: []cli.Flag{
			// No EnvVars: RECONCILER_DATABASE_URL points at the real
			// ledger, and the experiment never writes there.
			&cli.StringFlag{Name: "database-url",
				Usage: "Postgres server to use: each ledger strategy creates a database of its own there (reconciler_sim_<random>, needs CREATEDB) and drops it at the end; RECONCILER_DATABASE_URL is ignored (default: a throwaway cluster from the local server binaries)"},
			&cli.IntFlag{Name: "tasks", Value: 48, Usage: "tasks per strategy"},
			&cli.StringFlag{Name: "profile", Value: "medium", Usage: "fault profile: none, low, medium or high"},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "seed of the fault streams: the same seed injects the same faults at any concurrency"},
			&cli.StringFlag{Name: "strategies", Usage: "comma-separated strategies to run (default all): " + strings.Join(sim.Strategies, ",")},
			&cli.IntFlag{Name: "concurrency", Value: 16, Usage: "tasks running at once"},
			&cli.IntFlag{Name: "attempts", Value: 6, Usage: "attempts per call for every strategy that retries"},
			&cli.BoolFlag{Name: "json", Usage: "print the report as JSON"},
			&cli.BoolFlag{Name: "csv", Usage: "print the report as CSV"},
			&cli.StringFlag{Name: "svg", Usage: "also write a bar chart of strict success and duplicates per strategy to `FILE` (a new file: see --overwrite)"},
			&cli.BoolFlag{Name: "overwrite", Usage: "let --svg replace an existing file (such as the charts under docs/)"},
		},
		Action: func(c *cli.Context) error {
			if c.Bool("json") && c.Bool("csv") {
				return cli.Exit("sim: --json and --csv are exclusive", 2)
			}
			profile, err := sim.ProfileNamed(c.String("profile"))
			if err != nil {
				return cli.Exit("sim: "+err.Error(), 2)
			}
			var strategies []string
			for s := range strings.SplitSeq(c.String("strategies"), ",") {
				if s = strings.TrimSpace(s); s != "" {
					if !slices.Contains(sim.Strategies, s) {
						return cli.Exit(fmt.Sprintf("sim: unknown strategy %q (one of %s)", s, strings.Join(sim.Strategies, ", ")), 2)
					}
					strategies = append(strategies, s)
				}
			}
			o := sim.Options{Tasks: c.Int("tasks"), Profile: profile, Seed: c.Uint64("seed"), Strategies: strategies,
				Concurrency: c.Int("concurrency"), Attempts: c.Int("attempts")}
			if o.Tasks < 1 || o.Concurrency < 1 || o.Attempts < 1 {
				return cli.Exit("sim: --tasks, --concurrency and --attempts must be at least 1", 2)
			}
			// A run's chart replaces a file only when asked: the charts the
			// docs show are tracked files, and a run with another seed or
			// on another machine would silently change them. Checked
			// before the run, not after 20 s of it.
			if svg := c.String("svg"); svg != "" && !c.Bool("overwrite") {
				if _, err := os.Lstat(svg); err == nil {
					return cli.Exit(fmt.Sprintf("sim: %s exists: pass --overwrite to replace it, or write the chart elsewhere", svg), 1)
				}
			}
			if err := runSim(c.Context, c.App.Writer, c.App.ErrWriter, c.String("database-url"), o,
				c.Bool("json"), c.Bool("csv"), c.String("svg")); err != nil {
				return cli.Exit("sim: "+err.Error(), 1)
			}
			return nil
		},
	}
}

func runSim(ctx context.Context, out, progress io.Writer, dbURL string, o sim.Options, asJSON, asCSV bool, svgPath string) error {
	needsDB := len(o.Strategies) == 0 || slices.Contains(o.Strategies, sim.Ledger) || slices.Contains(o.Strategies, sim.LedgerReconciler)
	if needsDB {
		serverURL, stop, err := serverOrThrowaway(progress, dbURL)
		if err != nil {
			return err
		}
		if stop != nil {
			defer stop()
		}
		o.Database = sim.ServerDatabases(serverURL)
	}
	o.Progress = progressPrinter(progress)
	start := time.Now()
	rep, err := sim.Run(ctx, o)
	if err != nil {
		return err
	}
	fmt.Fprintf(progress, "sim: every strategy ran in %.1f s\n", time.Since(start).Seconds())
	if svgPath != "" {
		var b bytes.Buffer
		if err := rep.WriteSVG(&b); err != nil {
			return err
		}
		if err := os.WriteFile(svgPath, b.Bytes(), 0o644); err != nil {
			return fmt.Errorf("write the chart: %w", err)
		}
	}
	switch {
	case asJSON:
		var b bytes.Buffer
		if err := rep.WriteJSON(&b); err != nil {
			return err
		}
		_, err = out.Write(jsonText(b.Bytes()))
	case asCSV:
		err = rep.WriteCSV(guard{w: out})
	default:
		err = rep.WriteTable(guard{w: out})
	}
	return err
}

// progressPrinter reports each strategy's tasks as they end: on a terminal
// one line rewritten in place, elsewhere (a log, a pipe) one line per
// strategy when it is done.
func progressPrinter(w io.Writer) func(strategy string, done, total int) {
	tty := false
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil {
			tty = st.Mode()&os.ModeCharDevice != 0
		}
	}
	var mu sync.Mutex
	return func(strategy string, done, total int) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case tty && done < total:
			fmt.Fprintf(w, "\rsim: %-20s %3d/%d tasks", strategy, done, total)
		case tty:
			fmt.Fprintf(w, "\rsim: %-20s %3d/%d tasks\n", strategy, done, total)
		case done == total:
			fmt.Fprintf(w, "sim: %s: %d tasks done\n", strategy, total)
		}
	}
}
