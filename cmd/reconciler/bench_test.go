package main

import (
	"strconv"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// parseBenchLines parses the name=value lines a bench prints, checking that
// each carries every key of want, with a number where want says so.
func parseBenchLines(t *testing.T, out string, want map[string]bool) []map[string]string {
	t.Helper()
	var lines []map[string]string
	for line := range strings.Lines(strings.TrimSpace(out)) {
		kv := map[string]string{}
		for field := range strings.FieldsSeq(line) {
			k, v, ok := strings.Cut(field, "=")
			if !ok || k == "" || v == "" {
				t.Fatalf("field %q of %q is not name=value", field, line)
			}
			kv[k] = v
		}
		for k, numeric := range want {
			v, ok := kv[k]
			if !ok {
				t.Fatalf("line %q has no %s", line, k)
			}
			if _, err := strconv.ParseFloat(v, 64); numeric && err != nil {
				t.Fatalf("line %q: %s=%q is not a number", line, k, v)
			}
		}
		lines = append(lines, kv)
	}
	return lines
}

func TestBenchLedger(t *testing.T) {
	code, out, errOut := runCLI(t, "", "bench", "ledger", "-n", "200", "--concurrency", "1,4", "--rounds", "1",
		"--database-url", pgtest.AdminURL(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := parseBenchLines(t, out, map[string]bool{"bench": false, "concurrency": true, "n": true,
		"rounds": true, "lifecycles_per_s": true, "bare_sql_per_s": true, "ratio": true, "p50_added_ms": true,
		"p99_added_ms": true, "durable_per_s": true, "durable_ratio": true, "durable_p99_added_ms": true})
	if len(lines) != 2 || lines[0]["concurrency"] != "1" || lines[1]["concurrency"] != "4" {
		t.Fatalf("want one line per concurrency (1, 4), got:\n%s", out)
	}
}

// bench gateway prints one line per concurrency with the latency the
// gateway adds over a direct call and over Caller.Do, and each path's rate.
func TestBenchGateway(t *testing.T) {
	code, out, errOut := runCLI(t, "", "bench", "gateway", "-n", "40", "--concurrency", "1,3",
		"--database-url", pgtest.AdminURL(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := parseBenchLines(t, out, map[string]bool{"bench": false, "concurrency": true, "n": true,
		"added_p50_ms": true, "added_p99_ms": true, "over_do_p50_ms": true, "over_do_p99_ms": true,
		"gateway_calls_per_s": true, "do_calls_per_s": true, "direct_calls_per_s": true})
	if len(lines) != 2 || lines[0]["concurrency"] != "1" || lines[1]["concurrency"] != "3" {
		t.Fatalf("want one line per concurrency (1, 3), got:\n%s", out)
	}
}

func TestBenchConsistency(t *testing.T) {
	code, out, errOut := runCLI(t, "", "bench", "consistency", "--lags", "50ms,100ms", "--scale", "0.05",
		"--receipts", "10", "--database-url", pgtest.AdminURL(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := parseBenchLines(t, out, map[string]bool{"bench": false, "schedule": false, "lag_s": true,
		"receipts": true, "median_s": true, "p95_s": true, "median_x": true, "p95_x": true,
		"reads_per_receipt": true, "cold_median_x": true, "cold_p95_x": true, "unsettled": true})
	seen := map[string]bool{}
	for _, l := range lines {
		seen[l["schedule"]+"@"+l["lag_s"]] = true
		// Every receipt's effect exists: each must settle succeeded.
		if l["unsettled"] != "0" {
			t.Errorf("%s at lag %s: %s receipts not settled succeeded", l["schedule"], l["lag_s"], l["unsettled"])
		}
	}
	for _, s := range consistencySchedules {
		for _, lag := range []string{"0.050", "0.100"} {
			if !seen[s+"@"+lag] {
				t.Errorf("no line for schedule %s at lag %s:\n%s", s, lag, out)
			}
		}
	}
}

func TestBenchBacklog(t *testing.T) {
	code, out, errOut := runCLI(t, "", "bench", "backlog", "--unknowns", "30", "--api-rate", "40", "--lag", "200ms",
		"--per-receipt-max", "10", "--database-url", pgtest.AdminURL(t))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := parseBenchLines(t, out, map[string]bool{"strategy": false, "unknowns": true, "api_rate": true,
		"lag_s": true, "absence_window_s": true, "drain_s": true, "reads": true, "reads_per_receipt": true,
		"p50_s": true, "p95_s": true, "p50_x": true, "p95_x": true, "false": true, "manual": true, "throttled": true})
	if len(lines) != 2 || lines[0]["strategy"] != "per_receipt" || lines[1]["strategy"] != "batched" ||
		lines[0]["unknowns"] != "10" || lines[1]["unknowns"] != "30" {
		t.Fatalf("want a per_receipt line (10 unknowns) and a batched one (30), got:\n%s", out)
	}
	for _, l := range lines {
		if l["false"] != "0" || l["manual"] != "0" {
			t.Errorf("%s: %s false verdicts, %s manual reviews", l["strategy"], l["false"], l["manual"])
		}
	}
}

func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "ledger", "--concurrency", "1,x"},
		{"bench", "ledger", "-n", "0"},
		{"bench", "ledger", "--rounds", "0"},
		{"bench", "consistency", "--lags", "-1s"},
		{"bench", "consistency", "--schedules", "nonsense"},
		{"bench", "consistency", "--scale", "0"},
		{"bench", "gateway", "-n", "0"},
		{"bench", "gateway", "--concurrency", "0"},
		{"bench", "backlog", "--unknowns", "1"},
		{"bench", "backlog", "--api-rate", "0"},
		{"bench", "backlog", "--strategies", "nonsense"},
	} {
		if code, _, errOut := runCLI(t, "", args...); code != 2 {
			t.Errorf("%v: exit %d (%s), want 2", args, code, errOut)
		}
	}
}
