package main

import (
	"fmt"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// auditFlags are run's flags of the verdict audits (docs/verdict-audits.md).
func auditFlags() []cli.Flag {
	return []cli.Flag{
		&cli.BoolFlag{Name: "no-audits", EnvVars: []string{"RECONCILER_NO_AUDITS"},
			Usage: "do not read settled absences back (window alarms from settling reads still apply)"},
		&cli.DurationFlag{Name: "audit-delay", EnvVars: []string{"RECONCILER_AUDIT_DELAY"},
			Usage: "audit a settled absence this long after it settled (default: --audit-windows × its dependency's absence window)"},
		&cli.Float64Flag{Name: "audit-windows", Value: reconcile.DefaultAuditMultiple, EnvVars: []string{"RECONCILER_AUDIT_WINDOWS"},
			Usage: "without --audit-delay, the audit delay in absence windows (5s send delay + the effective window)"},
		&cli.Float64Flag{Name: "audit-sample", Value: 1, EnvVars: []string{"RECONCILER_AUDIT_SAMPLE"},
			Usage: "share of settled absences audited, in (0, 1]"},
		&cli.Float64Flag{Name: "window-margin", Value: reconcile.DefaultWindowMargin, EnvVars: []string{"RECONCILER_WINDOW_MARGIN"},
			Usage: "a window alarm widens the window to (1 + margin) × the lag it observed"},
	}
}

// auditConfig is the AuditConfig run's flags ask for.
func auditConfig(c *cli.Context) reconcile.AuditConfig {
	return reconcile.AuditConfig{Off: c.Bool("no-audits"), Delay: c.Duration("audit-delay"),
		Multiple: c.Float64("audit-windows"), SampleRate: c.Float64("audit-sample"), Margin: c.Float64("window-margin")}
}

// printContradicted lists, after the held receipts, the settled absences
// an audit contradicted (docs/verdict-audits.md).
func printContradicted(scr *screen, cs []review.Contradiction) {
	if len(cs) == 0 {
		return
	}
	scr.Printf("\nverdicts an audit contradicted (false_absence): the effect exists; they stay %s, "+
		"look for the duplicate a retry made (`reconciler receipts show ID`)\n", "terminal")
	tw := scr.Table()
	tw.Printf("ID\tAUDITED\tOPERATION\tDEPENDENCY\tSTATE\tMATCHES\tRETRIES\tRETRIED BY\n")
	for _, x := range cs {
		by := "-"
		if x.Retried != 0 {
			by = fmt.Sprint(x.Retried)
		}
		tw.Printf("%d\t%s\t%s\t%s\t%s\t%d\t%d\t%s\n", x.ID, x.AuditedAt.UTC().Format(time.RFC3339), x.Operation,
			x.Dependency, x.State, x.Matches, x.Retries, by)
	}
	_ = tw.Flush()
}

// printAudits prints a receipt's audits after its timeline: what the audit
// read found, and why it was judged so.
func printAudits(w *screen, as []review.Audit) {
	if len(as) == 0 {
		return
	}
	w.Printf("audits\n")
	for _, a := range as {
		w.Printf("  %s  %s  of %s settled %s, by %s\n", a.At.UTC().Format("2006-01-02T15:04:05.000Z07:00"),
			a.Verdict, a.Settled, a.SettledAt.UTC().Format("2006-01-02T15:04:05.000Z07:00"), a.Adapter)
		if a.Verdict == "contradicted" {
			w.Printf("        %-11s %s\n", "alarm:", "false_absence: the effect the verdict said absent exists")
		}
		w.Printf("        %-11s %d (retries account for %d)\n", "matches:", a.Matches, a.Retries)
		if a.ObservedLagSeconds != nil {
			w.Printf("        %-11s %.3fs since submission\n", "lag:", *a.ObservedLagSeconds)
		}
		w.Printf("        %-11s %s\n", "evidence:", compact(a.Evidence))
	}
}
