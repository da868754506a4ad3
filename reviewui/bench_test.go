package reviewui

import (
	"context"

	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// benchHeld is how many receipts BenchmarkQueuePage holds in manual_review.
const benchHeld = 100_000

// benchSettled is how many settled receipts lie beside them: a ledger holds
// far more settled receipts than held ones, and the planner weighs an index
// against the whole table.
const benchSettled = 2 * benchHeld

// fillHeld writes n receipts held in manual_review, each with the event
// that held it, and settled receipts beside them, straight into the tables
// (as the integration tests' scale fill does: the triggers' checks are not
// what is measured). The held ones are spread over 20 dependencies, 10
// operations and 3 reasons, held from a minute to n minutes ago. Then
// VACUUM ANALYZE, as autovacuum would.
func fillHeld(tb testing.TB, db *pgxpool.Pool, n, settled int) {
	tb.Helper()
	ctx := context.Background()
	conn, err := db.Acquire(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Release()
	for _, q := range []string{
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint, intent,
		                                  state, state_actor, state_detail, created_at, submitted_at, updated_at, guarded, version)
		SELECT 'bench:' || g, 'op-' || (g % 10), 'dep-' || (g % 20), 'POST', '/things/' || g, 'sha256:' || md5(g::text),
		       jsonb_build_object('method', 'POST', 'target', '/things/' || g, 'payload', jsonb_build_object('n', g)),
		       'manual_review', 'reconciler:bench',
		       jsonb_build_object('reason', (ARRAY['blind', 'bound_reached', 'diverged'])[1 + g % 3]),
		       now() - make_interval(mins => g + 1), now() - make_interval(mins => g + 1),
		       now() - make_interval(mins => g), false, 4
		FROM generate_series(1, $1::int) g`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint, intent,
		                                  state, state_actor, state_detail, created_at, submitted_at, updated_at, guarded, version)
		SELECT 'settled:' || g, 'op-' || (g % 10), 'dep-' || (g % 20), 'POST', '/things/' || g, 'sha256:' || md5(g::text),
		       '{}', 'succeeded', 'agent:bench', jsonb_build_object('reason', 'response'),
		       now() - make_interval(mins => g + 1), now() - make_interval(mins => g + 1),
		       now() - make_interval(mins => g), false, 3
		FROM generate_series(1, $1::int) g`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, from_state, to_state, at, actor, detail)
		SELECT id, version, 'outcome_unknown', 'manual_review', updated_at, state_actor, state_detail
		FROM reconciler.receipts WHERE state = 'manual_review'`,
		`RESET session_replication_role`,
		`VACUUM ANALYZE reconciler.receipts`,
		`VACUUM ANALYZE reconciler.receipt_events`,
	} {
		var args []any
		switch {
		case strings.Contains(q, "'settled:'"):
			args = append(args, settled)
		case strings.Contains(q, "$1"):
			args = append(args, n)
		}
		if _, err := conn.Exec(ctx, q, args...); err != nil {
			tb.Fatalf("fill: %v", err)
		}
	}
}

// BenchmarkQueuePage measures the queue page, answered whole over HTTP
// (queue, counts, filter choices, summary bar), with 100,000 receipts held
// in manual_review beside 200,000 settled: unfiltered, and with each
// filter. It reports the
// median and the 99th percentile of the page's latency.
func BenchmarkQueuePage(b *testing.B) {
	e := newLedger(b)
	start := time.Now()
	fillHeld(b, e.owner, benchHeld, benchSettled)
	b.Logf("held %d receipts (and %d settled) in %s", benchHeld, benchSettled, time.Since(start).Round(time.Millisecond))
	ts := serve(b, e.login(b, "reconciler_reviewer"))
	// The pass over every held receipt that the summary bar and the
	// filters' counts take, read in the background at most every
	// CountsEvery: what the first page after a start waits for.
	srv, err := New(Config{Pool: e.owner, Identifier: &TrustedHeader{}})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("counts_read", func(b *testing.B) {
		var lat []time.Duration
		for b.Loop() {
			t0 := time.Now()
			if _, err := srv.readCounts(context.Background()); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		reportPercentiles(b, lat)
	})
	for _, c := range []struct{ name, query string }{
		{"all", ""},
		{"dependency", "?dependency=dep-7"},
		{"operation", "?operation=op-3"},
		{"reason", "?reason=diverged"},
		{"age", "?age=1000h"},
		{"all_filters", "?dependency=dep-7&operation=op-7&reason=bound_reached&age=24h"},
		{"no_match", "?dependency=dep-none"},
	} {
		b.Run(c.name, func(b *testing.B) {
			var lat []time.Duration
			for b.Loop() {
				t0 := time.Now()
				get(b, ts.URL+"/"+c.query, "alice")
				lat = append(lat, time.Since(t0))
			}
			reportPercentiles(b, lat)
		})
	}
}

// reportPercentiles reports the median and the 99th percentile of lat in
// milliseconds, instead of the mean.
func reportPercentiles(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	p := func(q float64) float64 {
		return float64(lat[int(q*float64(len(lat)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(p(0.5), "p50_ms")
	b.ReportMetric(p(0.99), "p99_ms")
	b.ReportMetric(0, "ns/op")
}

// get fetches url as reviewer and fails unless the answer is 200.
func get(tb testing.TB, url, reviewer string) []byte {
	tb.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		tb.Fatal(err)
	}
	req.Header.Set("X-Forwarded-User", reviewer)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	if err != nil {
		tb.Fatal(err)
	}
	if res.StatusCode != http.StatusOK {
		tb.Fatalf("GET %s: %s\n%s", url, res.Status, body)
	}
	return body
}
