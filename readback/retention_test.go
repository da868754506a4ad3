package readback_test

import (
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// Issue 25: the adapters file's retention policy is read in days and
// years, refused when it would remove history before its receipt or is
// malformed (naming the line), and the request horizon is the longest of
// the adapters'.
func TestRetentionPolicyInTheAdaptersFile(t *testing.T) {
	const adapters = `adapters:
  - {name: s, type: static, kind: create, dependency: d, static: {verdict: present}, max_request_lifetime: 10m}
  - {name: k, type: static, kind: create, dependency: e, static: {verdict: present}, idempotency: {native: true, retention: 48h}}
`
	for _, c := range []struct {
		name, file string
		want       readback.Retention
		err        string
	}{
		{"days and a year", "version: 1\nretention: {settled: 90d, history: 1y}\n" + adapters,
			readback.Retention{Settled: 90 * 24 * time.Hour, History: 365 * 24 * time.Hour}, ""},
		{"go durations", "version: 1\nretention: {settled: 36h, history: 2w}\n" + adapters,
			readback.Retention{Settled: 36 * time.Hour, History: 14 * 24 * time.Hour}, ""},
		{"history shorter", "version: 1\nretention:\n  settled: 90d\n  history: 30d\n" + adapters,
			readback.Retention{}, "a.yaml:4: retention.history: must be at least retention.settled"},
		{"bad age", "version: 1\nretention:\n  settled: ninety days\n  history: 1y\n" + adapters,
			readback.Retention{}, `a.yaml:3: retention.settled: want an age such as 90d`},
		{"missing history", "version: 1\nretention: {settled: 90d}\n" + adapters,
			readback.Retention{}, "retention.history: is required"},
		{"unknown key", "version: 1\nretention: {settled: 90d, history: 1y, forever: true}\n" + adapters,
			readback.Retention{}, "retention.forever"},
	} {
		t.Run(c.name, func(t *testing.T) {
			reg, err := readback.Load("a.yaml", strings.NewReader(c.file), nil)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err %v, want %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, ok := reg.Retention()
			if !ok || got != c.want {
				t.Errorf("retention %+v (%v), want %+v", got, ok, c.want)
			}
			if h := reg.RequestHorizon(); h != 48*time.Hour {
				t.Errorf("request horizon %s, want the native key retention, 48h", h)
			}
		})
	}
	reg, err := readback.Load("a.yaml", strings.NewReader("version: 1\n"+adapters), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := reg.Retention(); ok {
		t.Error("a file without retention has a policy")
	}
}
