package main

import (
	"strconv"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// parseScaleLines parses bench scale's output, name=value per line where a
// value may be followed by a note in parentheses, into the first word of
// each value.
func parseScaleLines(t *testing.T, out string) map[string]string {
	t.Helper()
	kv := map[string]string{}
	for line := range strings.Lines(strings.TrimSpace(out)) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok || k == "" || v == "" {
			t.Fatalf("line %q is not name=value", line)
		}
		kv[k], _, _ = strings.Cut(v, " ")
	}
	return kv
}

// bench scale measures a ledger with all its history: the verdict audits
// are filled and sized with the rest and leave with their receipts; on a
// partitioned schema a table's size is its partitions' and no row is left
// in a default partition; without a retention pass no "after" is printed.
func TestBenchScale(t *testing.T) {
	for _, tc := range []struct {
		name      string
		retention bool
	}{{"with a retention pass", true}, {"without", false}} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCLI(t, "", "bench", "scale", "--receipts", "30000", "--samples", "2",
				"--retention="+strconv.FormatBool(tc.retention), "--database-url", pgtest.AdminURL(t))
			if code != 0 {
				t.Fatalf("exit %d: %s", code, errOut)
			}
			kv := parseScaleLines(t, out)
			positive := func(k string) {
				t.Helper()
				f, err := strconv.ParseFloat(kv[k], 64)
				if err != nil || f <= 0 {
					t.Errorf("%s=%q, want a positive number in:\n%s", k, kv[k], out)
				}
			}
			phases := []string{"before"}
			if tc.retention {
				phases = append(phases, "after")
				positive("retention_receipts_removed")
				positive("retention_audits_removed")
				if _, ok := kv["retention_history_partitions_dropped"]; !ok {
					t.Errorf("no retention_history_partitions_dropped in:\n%s", out)
				}
			} else {
				if kv["retention"] != "skipped" {
					t.Errorf("retention=%q, want skipped, in:\n%s", kv["retention"], out)
				}
				for k := range kv {
					if strings.HasPrefix(k, "after_") || strings.HasPrefix(k, "retention_") {
						t.Errorf("%s printed without a retention pass", k)
					}
				}
			}
			for _, p := range phases {
				for _, table := range []string{"receipts", "receipt_events", "readback_checks", "verdict_audits"} {
					positive(p + "_" + table + "_table_mb_per_million")
					positive(p + "_" + table + "_indexes_mb_per_million")
				}
				for _, k := range []string{"claim32_p99_ms", "plan_p99_ms", "review_list50_p99_ms", "sweep512_ms"} {
					if _, err := strconv.ParseFloat(kv[p+"_"+k], 64); err != nil {
						t.Errorf("%s_%s=%q, want a number", p, k, kv[p+"_"+k])
					}
				}
				if rows, ok := kv[p+"_default_partition_rows"]; ok && rows != "0" {
					t.Errorf("%s: %s rows in default partitions, want 0", p, rows)
				}
			}
		})
	}
}

// bench scale --compare fills two sizes with the same receipts in flight
// and prints each one's figures and their ratios, with no retention pass.
func TestBenchScaleCompare(t *testing.T) {
	code, out, errOut := runCLI(t, "", "bench", "scale", "--receipts", "40000", "--compare", "60000",
		"--in-flight", "4000", "--samples", "3", "--database-url", pgtest.AdminURL(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	kv := parseScaleLines(t, out)
	for _, n := range []string{"n40000", "n60000"} {
		if kv[n+"_receipts_live"] != strings.TrimPrefix(n, "n") {
			t.Errorf("%s_receipts_live=%q in:\n%s", n, kv[n+"_receipts_live"], out)
		}
		if rows, ok := kv[n+"_default_partition_rows"]; ok && rows != "0" {
			t.Errorf("%s: %s rows in default partitions, want 0", n, rows)
		}
	}
	// Each size has its sweep figure.
	if a, b := kv["n40000_sweep512_ms"], kv["n60000_sweep512_ms"]; a == "" || b == "" {
		t.Errorf("no sweep figures in:\n%s", out)
	}
	for _, m := range []string{"claim32", "plan", "review_list50"} {
		for _, q := range []string{"p50", "p99"} {
			k := "ratio_" + m + "_n60000_over_n40000_" + q
			if f, err := strconv.ParseFloat(kv[k], 64); err != nil || f <= 0 {
				t.Errorf("%s=%q, want a positive ratio, in:\n%s", k, kv[k], out)
			}
		}
	}
	for k := range kv {
		if strings.HasPrefix(k, "retention_") || strings.HasPrefix(k, "after_") {
			t.Errorf("%s printed by --compare", k)
		}
	}
}
