package benchgw_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/cmd/reconciler/internal/benchgw"
	"github.com/receiptledger/reconciler/internal/pgtest"
)

// BenchmarkGateway measures what the gateway adds to a call against a
// local upstream, compared in the same run with calling the upstream
// directly and with the Go ledger client (Caller.Do in process, which
// writes the same receipts): per-call latency (p50, p99) and calls per
// second, with 1 and 8 agents calling at once. added_* is the gateway over
// the direct call; floor_* is one durable commit before the direct call
// over the direct call, the least any ledger adds (its record must be
// flushed before the bytes leave); over_do_* is the gateway over
// Caller.Do, the cost of the proxy itself beyond the ledger's writes. `reconciler bench gateway`
// prints the same figures.
//
//	go test ./cmd/reconciler/internal/benchgw -run '^$' -bench Gateway -benchtime 2000x
func BenchmarkGateway(b *testing.B) {
	for _, agents := range []int{1, 8} {
		b.Run("agents="+strconv.Itoa(agents), func(b *testing.B) {
			ctx := context.Background()
			bench, err := benchgw.New(pgtest.NewPool(b))
			if err != nil {
				b.Fatal(err)
			}
			defer bench.Close()
			if err := bench.Warm(ctx, 20); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			r, err := bench.Run(ctx, agents, b.N)
			b.StopTimer()
			if err != nil {
				b.Fatal(err)
			}
			d, floor, do, gw := r[benchgw.Direct], r[benchgw.Commit], r[benchgw.Do], r[benchgw.Gateway]
			ms := func(x time.Duration) float64 { return float64(x) / 1e6 }
			b.ReportMetric(ms(gw.P50-d.P50), "added_p50_ms")
			b.ReportMetric(ms(gw.P99-d.P99), "added_p99_ms")
			b.ReportMetric(ms(floor.P50-d.P50), "floor_p50_ms")
			b.ReportMetric(ms(floor.P99-d.P99), "floor_p99_ms")
			b.ReportMetric(ms(gw.P50-do.P50), "over_do_p50_ms")
			b.ReportMetric(ms(gw.P99-do.P99), "over_do_p99_ms")
			b.ReportMetric(gw.Rate, "gateway_calls/s")
			b.ReportMetric(do.Rate, "do_calls/s")
			b.ReportMetric(d.Rate, "direct_calls/s")
		})
	}
}
