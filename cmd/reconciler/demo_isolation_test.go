package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// TestDemoLeavesTheLedgerAlone: with RECONCILER_DATABASE_URL exported at a
// ledger that holds a receipt, as operators do, `demo` uses a throwaway
// cluster, and `demo --database-url` on that very server works in a
// database of its own, dropped at the end; it can run twice. The ledger is
// untouched.
func TestDemoLeavesTheLedgerAlone(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	pool := pgtest.Pool(t, url)
	agent, err := ledger.New(pool, "agent:t")
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: "real-1", Operation: "articles.create",
		Dependency: "blog", Method: "POST", Target: "/api/articles", Payload: []byte(`{"title":"real"}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.Succeed(ctx, r, "art_real", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	before := ledgerSnapshot(t, pool)
	if !strings.Contains(before, "real-1") {
		t.Fatalf("snapshot lacks the receipt: %s", before)
	}

	t.Setenv("RECONCILER_DATABASE_URL", url)
	runs := [][]string{
		{"demo", "--tasks", "6"},
		{"demo", "--tasks", "6", "--database-url", url},
		{"--database-url", url, "demo", "--tasks", "6"}, // twice on the same server
	}
	for _, args := range runs {
		code, out, errOut := runCLI(t, "", args...)
		if code != 0 || !strings.Contains(out, "duplicates=0, missing=0") {
			t.Fatalf("%v: exit %d\n%s\n%s", args, code, out, errOut)
		}
		explicit := len(args) > 3
		if got := strings.Contains(out, "working in database reconciler_demo_"); got != explicit {
			t.Errorf("%v: says it works in a database of its own: %v, want %v\n%s", args, got, explicit, out)
		}
		if after := ledgerSnapshot(t, pool); after != before {
			t.Fatalf("%v changed the ledger:\nbefore %s\nafter  %s", args, before, after)
		}
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_database WHERE datname LIKE 'reconciler\_demo\_%'`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d demo databases left behind", left)
	}
}

func ledgerSnapshot(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := pool.QueryRow(context.Background(), `SELECT count(*) || ':' || coalesce(string_agg(
		id || '/' || idempotency_key || '/' || state, ',' ORDER BY id), '') FROM reconciler.receipts`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	var h int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipt_events`).Scan(&h); err == nil {
		s += " history=" + strings.Repeat("|", h)
	}
	return s
}
