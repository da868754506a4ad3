package integration

import (
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestIdleDaemonHasEveryAlertedSeries starts the real daemon on an empty
// ledger, with adapters of every kind that reads, and checks that its
// /metrics already has every metric and label value the alert rules select
// (issue 23: an idle daemon lacked adapter_control_ok, breaker_state,
// check_failures_total and writes_refused_total, so the rules on them had
// nothing to evaluate until something went wrong). An idle daemon must
// also fire none of the rules that read a value: no breaker open, no
// control failing, history partitions ahead and none holding rows past
// them.
func TestIdleDaemonHasEveryAlertedSeries(t *testing.T) {
	bin := buildBinary(t)
	dbURL := pgtest.NewDatabase(t)
	adapters := writeFile(t, "adapters.yaml", `
version: 1
adapters:
  - {name: articles, type: static, kind: create, dependency: blog-api, operations: [articles.create], static: {verdict: present}}
  - {name: unpublish, type: static, kind: delete, dependency: blog-api, operations: [articles.delete], static: {verdict: absent, authoritative: true}}
  - {name: mailer, type: blind, dependency: mailer}
`)
	addr := freeAddr(t)
	d := startDaemon(t, bin, dbURL, "--adapters", adapters, "--metrics-addr", addr, "--log-level", "warn")

	var selectors []promSelector
	var where []string
	for _, rule := range ruleExprs(t) {
		sels, err := promSelectors(rule[1])
		if err != nil {
			t.Fatalf("monitoring/alerts.yaml %s: %v", rule[0], err)
		}
		for _, s := range sels {
			selectors, where = append(selectors, s), append(where, rule[0])
		}
	}
	var body string
	waitFor(t, time.Minute, "the daemon's /metrics", func() (bool, string) {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		// The backlog gauges are set by the first refresh, at start, and
		// the history partitions' by the keeper's first round.
		return resp.StatusCode == http.StatusOK && strings.Contains(body, "reconciler_backlog{") &&
				strings.Contains(body, "\nreconciler_history_partitions_ahead ") &&
				!strings.Contains(body, "\nreconciler_history_partitions_ahead -1"),
			fmt.Sprintf("GET /metrics: %d; daemon stderr:\n%s", resp.StatusCode, d.stderr.String())
	})
	exp, err := parseExposition(body)
	if err != nil {
		t.Fatalf("/metrics: %v", err)
	}
	for i, s := range selectors {
		if m := exp.missing(s); m != "" {
			t.Errorf("alert %s reads %s, which an idle daemon does not export", where[i], m)
		}
	}
	// Every metric alerts.yaml names, in a rule's expression or in the
	// text that tells the operator where to look.
	for _, name := range regexp.MustCompile(`\breconciler_[a-z_]+`).FindAllString(readString(t, filepath.Join(repoRoot, "monitoring/alerts.yaml")), -1) {
		if _, ok := exp.series[name]; !ok {
			t.Errorf("monitoring/alerts.yaml names %s, which an idle daemon does not export", name)
		}
	}
	for _, line := range strings.Split(body, "\n") {
		switch {
		case strings.HasPrefix(line, `reconciler_breaker_state{dependency="blog-api",state="closed"}`) && !strings.HasSuffix(line, " 1"),
			strings.HasPrefix(line, `reconciler_breaker_state{`) && strings.Contains(line, `state="open"`) && !strings.HasSuffix(line, " 0"),
			strings.HasPrefix(line, `reconciler_adapter_control_ok{`) && !strings.HasSuffix(line, " NaN"),
			strings.Contains(line, `dependency="mailer"`),
			// The migration left 4 ranges ahead, and no row past them.
			strings.HasPrefix(line, "reconciler_history_partitions_ahead ") && line != "reconciler_history_partitions_ahead 4",
			strings.HasPrefix(line, "reconciler_history_default_rows ") && line != "reconciler_history_default_rows 0":
			t.Errorf("idle daemon exports %q", line)
		}
	}
	if err, _ := d.stop(t, 30*time.Second); err != nil {
		t.Fatalf("daemon exited with %v; stderr:\n%s", err, d.stderr.String())
	}
}
