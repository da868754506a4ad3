package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/reconcile"
)

func statsCommand() *cli.Command {
	return &cli.Command{
		Name:  "stats",
		Usage: "print the reconciler's backlog (receipts per non-terminal state, stale planned, orphans, oldest unknown, duplicates, late answers after the absence window) and, per dependency, its verdicts, their audits and the lag observed against the windows",
		Flags: append([]cli.Flag{
			databaseURLFlag(),
			&cli.DurationFlag{Name: "stale-planned-after", Value: time.Hour, EnvVars: []string{"RECONCILER_STALE_PLANNED_AFTER"},
				Usage: "planned receipts older than this count as stale"},
			&cli.DurationFlag{Name: "orphan-timeout", Value: 5 * time.Minute, EnvVars: []string{"RECONCILER_ORPHAN_TIMEOUT"},
				Usage: "submitted receipts older than this count as orphans"},
			&cli.BoolFlag{Name: "json", Usage: "print JSON instead of name=value lines"},
		}, verdictFlags()...),
		Action: func(c *cli.Context) error {
			db, err := openDatabase(c.Context, "stats", c.String("database-url"))
			if err != nil {
				return err
			}
			defer db.Close()
			store, err := reconcile.NewStore(db, "stats")
			if err != nil {
				return cli.Exit(fmt.Sprintf("stats: %v", err), 1)
			}
			if err := checkLedger(c.Context, "stats", db, readBacklog); err != nil {
				return err
			}
			b, err := store.Backlog(c.Context, time.Now(), c.Duration("stale-planned-after"), c.Duration("orphan-timeout"))
			if err != nil {
				return dbFailure("stats", db, err, readBacklog)
			}
			alarms, err := store.LifetimeAlarms(c.Context)
			if err != nil {
				return dbFailure("stats", db, err, readBacklog)
			}
			if alarms == nil {
				alarms = []reconcile.LifetimeAlarms{}
			}
			var exceeded int64
			deps := make([]string, 0, len(alarms))
			for _, a := range alarms {
				exceeded += a.Count
				deps = append(deps, a.Dependency)
			}
			verdicts, err := store.VerdictStats(c.Context, c.Duration("period"))
			if err != nil {
				return dbFailure("stats", db, err, readBacklog)
			}
			file, err := declaredWindows(c.String("adapters"), verdicts)
			if err != nil {
				return cli.Exit(fmt.Sprintf("stats: %v", err), 1)
			}
			verdicts = mergeWindows(verdicts, file)
			fields := []struct {
				name  string
				value any
			}{
				{"planned", b.Planned}, {"stale_planned", b.StalePlanned},
				{"submitted", b.Submitted}, {"orphans", b.StaleOrphans},
				{"outcome_unknown", b.OutcomeUnknown}, {"reconciling", b.Reconciling},
				{"manual_review", b.ManualReview}, {"due_now", b.DueNow},
				{"oldest_outcome_unknown_age_s", int64(b.OldestUnknownAge.Seconds())},
				{"oldest_unsettled_age_s", int64(b.OldestUnsettledAge.Seconds())},
				{"duplicates_detected", b.Duplicates},
				// Late answers recorded after their receipt's absence
				// window (SPEC §5a): an alarm on each dependency named.
				{"lifetime_exceeded", exceeded},
			}
			// Whether the history partitions are ahead of the receipts
			// (docs/retention.md, "Partitioned history").
			parts, err := reconcile.NewPartitionKeeper(db, reconcile.PartitionConfig{}).Status(c.Context)
			if err != nil {
				return dbFailure("stats", db, err, readBacklog)
			}
			fields = append(fields, []struct {
				name  string
				value any
			}{{"history_partitions_ahead", parts.Ahead}, {"history_default_rows", parts.DefaultRows}}...)
			// What a commit on this server means (docs/failover.md).
			d, err := ledger.ReadDurability(c.Context, db)
			if err != nil {
				return dbFailure("stats", db, err, readBacklog)
			}
			fields = append(fields, []struct {
				name  string
				value any
			}{{"durability", d.Mode}, {"synchronous_standbys", d.Synchronous}, {"asynchronous_standbys", d.Asynchronous}}...)
			if c.Bool("json") {
				m := make(map[string]any, len(fields)+1)
				for _, f := range fields {
					m[f.name] = f.value
				}
				m["lifetime_exceeded_by_dependency"] = alarms
				m["verdicts_period_s"] = int64(c.Duration("period").Seconds())
				m["dependencies"] = verdicts
				return writeJSON(c.App.Writer, m)
			}
			scr := newScreen(c.App.Writer)
			for _, f := range fields {
				scr.Printf("%s=%v\n", f.name, f.value)
			}
			if exceeded > 0 {
				scr.Printf("lifetime_exceeded_dependencies=%s\n", strings.Join(deps, ","))
			}
			printVerdicts(scr, verdicts, c.Duration("period"))
			return nil
		},
	}
}
