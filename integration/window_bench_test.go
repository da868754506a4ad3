package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// BenchmarkSettleWindowCheck measures what the window check of migration
// 00014 (the trigger receipts_check_window: a probe of late_outcomes per
// settled row, and a refusal or an alarm where a late answer voids the
// window) costs a batch settlement of 512 receipts, with the trigger and
// without it (disabled for the run). One receipt in 64 has a late outcome
// inside its window. It reports p50 and p99 per batch in milliseconds:
//
//	go test ./integration -run '^$' -bench SettleWindowCheck -benchtime 20x
func BenchmarkSettleWindowCheck(b *testing.B) {
	const batch = 512
	ctx := context.Background()
	db := pgtest.Pool(b, pgtest.NewDatabase(b))
	for _, trigger := range []bool{true, false} {
		b.Run(fmt.Sprintf("trigger=%v", trigger), func(b *testing.B) {
			state := "ENABLE"
			if !trigger {
				state = "DISABLE"
			}
			if _, err := db.Exec(ctx, `ALTER TABLE reconciler.receipts `+state+` TRIGGER receipts_check_window`); err != nil {
				b.Fatal(err)
			}
			lat := make([]time.Duration, 0, b.N)
			for b.Loop() {
				b.StopTimer()
				ids := seed(b, db, batch, "things.create", "bench-api", "outcome_unknown")
				if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'reconciling', state_actor = 'reconciler:bench'
					WHERE id = ANY($1)`, ids); err != nil {
					b.Fatal(err)
				}
				if _, err := db.Exec(ctx, `INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome, http_status)
					SELECT id, 'agent:test', 'outcome_unknown', 504 FROM unnest($1::bigint[]) WITH ORDINALITY u(id, n)
					WHERE n % 64 = 0`, ids); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				start := time.Now()
				if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'safe_to_retry', state_actor = 'reconciler:bench',
					state_detail = '{"reason": "absent_after_window", "evidence": {"max_request_lifetime_s": 60, "consistency_window_s": 30}}'
					WHERE id = ANY($1)`, ids); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			slices.Sort(lat)
			q := func(p float64) float64 {
				return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
			}
			b.ReportMetric(q(0.50), "p50_ms")
			b.ReportMetric(q(0.99), "p99_ms")
		})
	}
}
