package benchlife_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/cmd/reconciler/internal/benchlife"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// BenchmarkLifecycle measures a full agent lifecycle (plan, submit,
// succeed) with 1, 8 and 32 concurrent agents, through the ledger client
// and, in the same run and database server, through bare SQL doing the same
// durable work in three commits (this package, as `reconciler bench
// ledger` does). "ledger" is the path Caller.Do takes: PlanAndSubmit
// (planned and submitted, both events, one commit) then Succeed.
// "ledger-moves" makes the three moves one by one (Plan, Submit, Succeed:
// three commits, like bare SQL). Each reports lifecycles/s and the latency
// of each call (p50, p99); the ledger runs also report the latency they add
// over bare SQL at the same percentile, and their rate as a ratio of bare
// SQL's, when the bare-SQL run of the same agent count ran just before (the
// default).
//
//	go test ./cmd/reconciler/internal/benchlife -run '^$' -bench Lifecycle -benchtime 3000x
func BenchmarkLifecycle(b *testing.B) {
	bare := map[int]benchlife.Stats{}
	for _, agents := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("bare-sql/agents=%d", agents), func(b *testing.B) {
			pool := pgtest.NewPool(b)
			if err := benchlife.CreateBare(context.Background(), pool); err != nil {
				b.Fatal(err)
			}
			bare[agents] = runAgents(b, agents, benchlife.Bare(pool))
		})
		for name, lifecycle := range map[string]func(*ledger.Client) benchlife.Lifecycle{
			"ledger": benchlife.Ledger, "ledger-moves": benchlife.LedgerMoves} {
			b.Run(fmt.Sprintf("%s/agents=%d", name, agents), func(b *testing.B) {
				c, err := ledger.New(pgtest.NewPool(b), "agent:bench")
				if err != nil {
					b.Fatal(err)
				}
				st := runAgents(b, agents, lifecycle(c))
				if base, ok := bare[agents]; ok {
					b.ReportMetric(micros(st.P50-base.P50), "added-p50-µs")
					b.ReportMetric(micros(st.P99-base.P99), "added-p99-µs")
					b.ReportMetric(st.Rate/base.Rate, "x-bare-rate")
				}
			})
		}
	}
}

func micros(d time.Duration) float64 { return float64(d.Microseconds()) }

// runAgents runs b.N lifecycles spread over agents goroutines, reports
// lifecycles/s and per-call latency percentiles, and returns them.
func runAgents(b *testing.B, agents int, lifecycle benchlife.Lifecycle) benchlife.Stats {
	b.Helper()
	b.ResetTimer()
	st, err := benchlife.Run(context.Background(), agents, b.N, 0, lifecycle)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(st.Rate, "lifecycles/s")
	b.ReportMetric(micros(st.P50), "call-p50-µs")
	b.ReportMetric(micros(st.P99), "call-p99-µs")
	b.ReportMetric(0, "ns/op")
	return st
}
