package main

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

// verdictFlags are the flags of stats' verdict report (docs/verdict-audits.md).
func verdictFlags() []cli.Flag {
	return []cli.Flag{
		&cli.DurationFlag{Name: "period", Value: 24 * time.Hour, Usage: "report the verdicts, audits and lag of this last period"},
		&cli.StringFlag{Name: "adapters",
			Usage: "adapters file: report every adapter's declared and effective window (default: only the widened ones)"},
	}
}

// declaredWindows returns the windows of the adapters file at path (none
// without one), as they stand given the widenings in ds.
func declaredWindows(path string, ds []reconcile.DependencyVerdicts) ([]reconcile.Window, error) {
	if path == "" {
		return nil, nil
	}
	reg, err := httpadapter.LoadFile(path, nil)
	if err != nil {
		return nil, err
	}
	var ws reconcile.Windows
	for _, d := range ds {
		ws.Know(d.Windows)
	}
	var out []reconcile.Window
	for _, b := range reg.Bindings() {
		if b.Kind != readback.Blind {
			out = append(out, ws.For(&b))
		}
	}
	return out, nil
}

// mergeWindows puts the file's windows (declared, effective as they stand)
// in place of the widened ones of the same adapters: a widening of an
// earlier declaration no longer applies.
func mergeWindows(ds []reconcile.DependencyVerdicts, file []reconcile.Window) []reconcile.DependencyVerdicts {
	if file == nil {
		return ds
	}
	idx := map[string]int{}
	for i, d := range ds {
		idx[d.Dependency] = i
		ds[i].Windows = nil
	}
	for _, w := range file {
		i, ok := idx[w.Dependency]
		if !ok {
			ds = append(ds, reconcile.DependencyVerdicts{Dependency: w.Dependency, Verdicts: map[string]int{}})
			i = len(ds) - 1
			idx[w.Dependency] = i
		}
		ds[i].Windows = append(ds[i].Windows, w)
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i].Dependency < ds[j].Dependency })
	return ds
}

// printVerdicts prints the verdict report as name=value lines, one group
// per dependency (nothing when no dependency has any).
func printVerdicts(scr *screen, ds []reconcile.DependencyVerdicts, period time.Duration) {
	if len(ds) == 0 {
		return
	}
	for _, d := range ds {
		p := "dependency." + d.Dependency + "."
		kinds := make([]string, 0, len(d.Verdicts))
		for k := range d.Verdicts {
			kinds = append(kinds, k)
		}
		sort.Strings(kinds)
		for _, k := range kinds {
			scr.Printf("%sverdicts.%s=%d\n", p, strings.ReplaceAll(k, "/", "."), d.Verdicts[k])
		}
		scr.Printf("%saudited=%d\n%sconfirmed=%d\n%scontradicted=%d\n%sinconclusive=%d\n%sawaiting_audit=%d\n%swindow_alarms=%d\n",
			p, d.Audited, p, d.Confirmed, p, d.Contradicted, p, d.Inconclusive, p, d.AwaitingAudit, p, d.Alarms)
		for _, l := range d.Lag {
			q := p + "observed_lag." + l.Operation + "."
			scr.Printf("%ssamples=%d\n%sp50_s=%.3f\n%sp99_s=%.3f\n%smax_s=%.3f\n", q, l.Samples, q, l.P50, q, l.P99, q, l.Max)
		}
		for _, w := range d.Windows {
			q := p + "window." + w.Adapter + "."
			scr.Printf("%sdeclared_s=%.3f\n%seffective_s=%.3f\n", q, w.Declared.Seconds(), q, w.Effective.Seconds())
			if w.Widened() {
				scr.Printf("%swidened=%s\n", q, fmt.Sprintf("%s on receipt %d at %s (observed %.3fs)",
					w.Kind, w.Receipt, w.At.UTC().Format(time.RFC3339), w.Observed.Seconds()))
			}
		}
	}
	scr.Printf("verdicts_period_s=%d\n", int64(period.Seconds()))
}
