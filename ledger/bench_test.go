package ledger_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// BenchmarkLifecycle measures a full agent lifecycle (plan, submit,
// succeed) with 1, 8 and 32 concurrent agents, through the ledger client
// and, in the same run and database server, through bare SQL doing the same
// durable work (an insert or update of the receipt plus an insert of the
// event, three commits per lifecycle, no triggers). "ledger" is the path
// Caller.Do takes: PlanAndSubmit (planned and submitted, both events, one
// commit) then Succeed. "ledger-moves" makes the three moves one by one
// (Plan, Submit, Succeed: three commits, like bare SQL). Each reports
// lifecycles/s and the latency of each call (p50, p99); the ledger runs
// also report the latency they add over bare SQL at the same percentile,
// and their rate as a ratio of bare SQL's, when the bare-SQL run of the same
// agent count ran just before (the default).
//
//	go test ./ledger -run '^$' -bench Lifecycle -benchtime 3000x
func BenchmarkLifecycle(b *testing.B) {
	for _, agents := range []int{1, 8, 32} {
		var bare lifecycleStats
		b.Run(fmt.Sprintf("bare-sql/agents=%d", agents), func(b *testing.B) {
			pool := benchPool(b)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `
				CREATE TABLE bare_receipts (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
					idempotency_key text UNIQUE NOT NULL, fingerprint text NOT NULL, intent jsonb NOT NULL,
					state text NOT NULL, external_id text, version int NOT NULL, updated_at timestamptz NOT NULL);
				CREATE TABLE bare_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
					receipt_id bigint NOT NULL REFERENCES bare_receipts (id), seq int NOT NULL,
					from_state text, to_state text NOT NULL, at timestamptz NOT NULL, actor text NOT NULL,
					detail jsonb NOT NULL, external_id text)`); err != nil {
				b.Fatal(err)
			}
			var seq atomic.Int64
			bare = runAgents(b, agents, func(lat *[]time.Duration) error {
				key := fmt.Sprintf("k-%d", seq.Add(1))
				var id int64
				err := timed(lat, func() error {
					return pool.QueryRow(ctx, `WITH r AS (
						INSERT INTO bare_receipts (idempotency_key, fingerprint, intent, state, version, updated_at)
						VALUES ($1, $2, $3, 'planned', 1, now()) RETURNING id)
						INSERT INTO bare_events (receipt_id, seq, to_state, at, actor, detail)
						SELECT id, 1, 'planned', now(), 'agent:bench', '{}' FROM r RETURNING receipt_id`,
						key, "sha256:x", `{"title":"t"}`).Scan(&id)
				})
				if err != nil {
					return err
				}
				for i, to := range []string{"submitted", "succeeded"} {
					err := timed(lat, func() error {
						_, err := pool.Exec(ctx, `WITH r AS (
							UPDATE bare_receipts SET state = $2, version = version + 1, updated_at = now()
							WHERE id = $1 AND state = $3 RETURNING id, version)
							INSERT INTO bare_events (receipt_id, seq, from_state, to_state, at, actor, detail)
							SELECT id, version, $3, $2, now(), 'agent:bench', '{}' FROM r`,
							id, to, []string{"planned", "submitted"}[i])
						return err
					})
					if err != nil {
						return err
					}
				}
				return nil
			})
		})
		for _, moves := range []bool{false, true} {
			name := "ledger"
			if moves {
				name = "ledger-moves"
			}
			b.Run(fmt.Sprintf("%s/agents=%d", name, agents), func(b *testing.B) {
				c, err := ledger.New(benchPool(b), "agent:bench")
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				var seq atomic.Int64
				st := runAgents(b, agents, func(lat *[]time.Duration) error {
					// Distinct intents with the duplicate guard on, as agents
					// doing different work would plan them.
					n := seq.Add(1)
					payload := json.RawMessage(fmt.Sprintf(
						`{"title":"Outcome unknown %d","body":"An agent calls an external API.","tags":["a","b"]}`, n))
					in := ledger.Intent{IdempotencyKey: fmt.Sprintf("k-%d", n), Operation: "articles.create",
						Dependency: "blog-api", Method: "POST", Target: "/api/articles", Payload: payload}
					var r *ledger.Receipt
					steps := []func() error{
						func() (err error) { r, err = c.PlanAndSubmit(ctx, in); return err },
						func() (err error) { r, err = c.Succeed(ctx, r, "ext-1", ledger.Detail{}); return err },
					}
					if moves {
						steps = []func() error{
							func() (err error) { r, err = c.Plan(ctx, in); return err },
							func() (err error) { r, err = c.Submit(ctx, r); return err },
							steps[1],
						}
					}
					for _, step := range steps {
						if err := timed(lat, step); err != nil {
							return err
						}
					}
					return nil
				})
				if bare.rate > 0 {
					b.ReportMetric(st.p50-bare.p50, "added-p50-µs")
					b.ReportMetric(st.p99-bare.p99, "added-p99-µs")
					b.ReportMetric(st.rate/bare.rate, "x-bare-rate")
				}
			})
		}
	}
}

func benchPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	return pgtest.NewPool(b)
}

func timed(lat *[]time.Duration, f func() error) error {
	start := time.Now()
	err := f()
	*lat = append(*lat, time.Since(start))
	return err
}

// lifecycleStats are one run's figures: lifecycles/s and per-call latency
// percentiles in µs.
type lifecycleStats struct{ rate, p50, p99 float64 }

// runAgents runs b.N lifecycles spread over agents goroutines, reports
// lifecycles/s and per-call latency percentiles, and returns them.
func runAgents(b *testing.B, agents int, lifecycle func(lat *[]time.Duration) error) lifecycleStats {
	b.Helper()
	var next atomic.Int64
	lats := make([][]time.Duration, agents)
	errs := make([]error, agents)
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for a := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(b.N) {
				if err := lifecycle(&lats[a]); err != nil {
					errs[a] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	all := slices.Concat(lats...)
	slices.Sort(all)
	pct := func(p float64) float64 { return float64(all[int(p*float64(len(all)-1))].Microseconds()) }
	st := lifecycleStats{rate: float64(b.N) / elapsed.Seconds(), p50: pct(0.50), p99: pct(0.99)}
	b.ReportMetric(st.rate, "lifecycles/s")
	b.ReportMetric(st.p50, "call-p50-µs")
	b.ReportMetric(st.p99, "call-p99-µs")
	b.ReportMetric(0, "ns/op")
	return st
}
