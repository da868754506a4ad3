package retention

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// The archiver's per-batch statements read receipts and history through
// indexes at 200,000 receipts and 600,000 events (ANALYZEd): the choice
// walks the primary key's range and each chain through receipts_retry_of,
// the exports probe the primary keys; neither big table is scanned. (The
// other tables are empty here, and scanned as such.) A history partition's
// export reads the whole of the range's partitions, and nothing else.
func TestRetentionPlans(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for _, q := range []string{
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		     state, state_actor, created_at, submitted_at, updated_at, version)
		 SELECT 'k' || g, 'things.create', 'dep-' || (g % 20), 'POST', '/things', 'sha256:' || md5(g::text) || md5(g::text),
		     CASE WHEN g % 100 = 0 THEN 'outcome_unknown' ELSE 'succeeded' END, 'agent:a',
		     now() - (200000 - g) * interval '1 minute', now() - (200000 - g) * interval '1 minute',
		     now() - (200000 - g) * interval '1 minute' + interval '1 second', 3
		 FROM generate_series(1, 200000) g`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor)
		 SELECT id, s, state, updated_at, 'agent:a' FROM reconciler.receipts, generate_series(1, 3) s`,
		`INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed)
		 VALUES ('receipts', 'x', repeat('0', 64), '{}')`,
		`INSERT INTO reconciler.removed_receipts (receipt_id, batch_id, state, settled_at)
		 SELECT g, (SELECT min(id) FROM reconciler.retention_batches), 'succeeded', now()
		 FROM generate_series(1, 5000) g`,
		`RESET session_replication_role`,
		`ANALYZE`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// History is partitioned (migration 00021): a scan names the
	// partition and its index; the test names the root's.
	roots := pgtest.PartitionRoots(t, db)
	root := func(name string) string {
		if r, ok := roots[name]; ok {
			return r
		}
		return name
	}
	ids := make([]int64, 5000)
	for i := range ids {
		ids[i] = int64(100001 + i)
	}
	for _, c := range []struct {
		name, sql string
		args      []any
		want      []string
	}{
		{"choose", sqlChains, []any{pgx.NamedArgs{"after": 100000, "bound": 200000,
			"settled_before": time.Now(), "horizon_us": int64(0), "limit": 5000}},
			[]string{"receipts_pkey", "receipts_retry_of"}},
		{"export receipts", sqlExportReceipts, []any{ids},
			[]string{"receipts_pkey"}},
		{"export history", sqlExportHistory, []any{int64(1)},
			[]string{"receipt_events_pkey"}},
		// A range's export reads its partitions only (sequentially: all of
		// them), here the first ones.
		{"export partition", sqlExportPartition, []any{nil, int64(1000000)}, nil},
	} {
		var raw []byte
		if err := db.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+c.sql, c.args...).Scan(&raw); err != nil {
			t.Fatalf("%s: explain: %v", c.name, err)
		}
		var out []struct{ Plan pgtest.PlanNode }
		if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
			t.Fatalf("%s: %s: %v", c.name, raw, err)
		}
		var scans []string
		used := map[string]bool{}
		out[0].Plan.Walk(func(n pgtest.PlanNode) {
			if n.Relation != "" {
				scans = append(scans, fmt.Sprintf("%s %s %s", n.NodeType, n.Relation, n.IndexName))
			}
			used[root(n.IndexName)] = true
			if n.NodeType == "Seq Scan" && c.want != nil && (n.Relation == "receipts" || root(n.Relation) == "receipt_events") {
				t.Errorf("%s: sequential scan of %s", c.name, n.Relation)
			}
			if c.want == nil && n.Relation != "" && !strings.HasSuffix(n.Relation, "_legacy") {
				t.Errorf("%s: reads %s, outside the range's partitions", c.name, n.Relation)
			}
		})
		for _, idx := range c.want {
			if !used[idx] {
				t.Errorf("%s: %s not used; scans: %s", c.name, idx, strings.Join(scans, "; "))
			}
		}
		t.Logf("%s: %s", c.name, strings.Join(scans, "; "))
	}

	// A compaction's export reads the range's partitions and receipts
	// only. (Here the first range holds every receipt, so a sequential read
	// of receipts may be the planner's choice: the bound on the receipts
	// is what keeps a later range's anti-join to its own.)
	var raw []byte
	if err := db.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+sqlExportCompaction, nil, int64(1000000)).Scan(&raw); err != nil {
		t.Fatalf("export compaction: explain: %v", err)
	}
	var out []struct{ Plan pgtest.PlanNode }
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
		t.Fatalf("export compaction: %s: %v", raw, err)
	}
	var scans []string
	out[0].Plan.Walk(func(n pgtest.PlanNode) {
		if n.Relation == "" {
			return
		}
		scans = append(scans, fmt.Sprintf("%s %s %s", n.NodeType, n.Relation, n.IndexName))
		if n.Relation != "receipts" && !strings.HasSuffix(n.Relation, "_legacy") {
			t.Errorf("export compaction: reads %s, outside the range's partitions", n.Relation)
		}
	})
	t.Logf("export compaction: %s", strings.Join(scans, "; "))
}
