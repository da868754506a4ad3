// Package testkit holds what tests in several packages need alike and
// cannot share through a _test.go file: logs captured from a component's
// logger, a counter or gauge read from a Prometheus registry, an injected
// clock, and a bounded wait on a condition.
package testkit

import (
	"bufio"
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// LogBuffer collects a logger's output; safe for the concurrent writes of
// the goroutines a component logs from.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// LogLine returns the first JSON log line (slog's JSONHandler) in logs
// with message msg about receipt id (its receipt_id attribute), failing
// the test if there is none.
func LogLine(tb testing.TB, logs, msg string, id int64) map[string]any {
	tb.Helper()
	sc := bufio.NewScanner(strings.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) != nil {
			continue
		}
		if m["msg"] == msg && m["receipt_id"] == float64(id) {
			return m
		}
	}
	tb.Fatalf("no log line %q for receipt %d in:\n%s", msg, id, logs)
	return nil
}

// Metric returns the value of the first series of the counter or gauge
// name in reg whose labels include labels, 0 if there is none.
func Metric(tb testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	tb.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if v, ok := labels[l.GetName()]; ok && v != l.GetValue() {
					continue series
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// Clock is an injected clock a test advances. Start it at the real time
// where the database stamps times it is compared with.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a clock reading start.
func NewClock(start time.Time) *Clock { return &Clock{now: start} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// WaitFor polls cond every 10 ms until it holds, failing the test if it
// does not within 30 s.
func WaitFor(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
