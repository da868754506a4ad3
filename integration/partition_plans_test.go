package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// analyzed is a node of EXPLAIN (ANALYZE, FORMAT JSON): which relation it
// read, how often, and how many partitions it pruned when it started.
type analyzed struct {
	NodeType string     `json:"Node Type"`
	Relation string     `json:"Relation Name"`
	Index    string     `json:"Index Name"`
	Loops    float64    `json:"Actual Loops"`
	Removed  int        `json:"Subplans Removed"`
	Plans    []analyzed `json:"Plans"`
}

func (n analyzed) walk(f func(analyzed)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

// Issue 25: with the history partitioned by receipt id (here 60,000
// receipts over six ranges of 10,000, ANALYZEd), every per-receipt read
// of history reads the one partition holding that receipt, as the code
// runs it: `receipts show`'s events and audits (pruned when planned, or,
// with a generic plan, when it starts: Subplans Removed), the worker's probe of
// readback_checks before writing a check again, and `review list`'s join
// with each held receipt's latest event (a primary-key probe of the
// partition holding it; the others never run).
func TestHistoryReadsPruneToOnePartition(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	rec := &recorder{}
	db := tracedPool(t, url, rec)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const first, n, width = 5000000, 60000, 10000
	for _, q := range []string{
		fmt.Sprintf(`UPDATE reconciler.history_partitioning SET width = %d`, width),
		fmt.Sprintf(`SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), %d, false)`, first),
		fmt.Sprintf(`SELECT reconciler.ensure_history_partitions(%d)`, first+n),
		`SET session_replication_role = replica`,
		fmt.Sprintf(`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		     state, state_actor, state_detail, created_at, submitted_at, updated_at, version)
		 SELECT 'k' || g, 'things.create', 'dep-' || (g %% 20), 'POST', '/things', 'sha256:' || md5(g::text) || md5(g::text),
		     CASE WHEN g %% 100 = 0 THEN 'manual_review' ELSE 'succeeded' END, 'reconciler:a',
		     CASE WHEN g %% 100 = 0 THEN '{"reason": "blind"}'::jsonb ELSE '{}'::jsonb END,
		     now() - (%[1]d - g) * interval '1 minute', now() - (%[1]d - g) * interval '1 minute',
		     now() - (%[1]d - g) * interval '1 minute' + interval '1 second', 3
		 FROM generate_series(1, %[1]d) g`, n),
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor, detail)
		 SELECT id, s, CASE WHEN s = 3 THEN state ELSE 'submitted' END, updated_at, 'reconciler:a', state_detail
		 FROM reconciler.receipts, generate_series(1, 3) s`,
		`INSERT INTO reconciler.readback_checks (receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
		 SELECT id, 1, updated_at, 'a', 'static', dependency, 'present', 100 FROM reconciler.receipts`,
		`INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter, settled_state, settled_at, at,
		     instance, verdict)
		 SELECT id, dependency, operation, 'static', 'succeeded', updated_at, updated_at, 'a',
		     CASE WHEN id % 1000 = 0 THEN 'contradicted' ELSE 'confirmed' END
		 FROM reconciler.receipts WHERE id % 10 = 0`,
		`RESET session_replication_role`,
		`ANALYZE`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	conn.Release()
	roots := pgtest.PartitionRoots(t, db)

	// The receipt looked at: in the third range.
	const id = first + 2*width + 5000
	home := func(table string) string { return fmt.Sprintf("%s_p%019d", table, first+2*width) }
	if _, err := review.Show(ctx, db, id); err != nil {
		t.Fatal(err)
	}
	store, err := reconcile.NewStore(db, "plans")
	if err != nil {
		t.Fatal(err)
	}
	if err := store.RecordChecksAgain(ctx, []reconcile.ReceiptCheck{
		{ReceiptID: id, Check: &reconcile.CheckRecord{CheckNo: 1, At: time.Now(), Adapter: "static", Dependency: "dep-0", Verdict: "present"}},
		{ReceiptID: id + 1, Check: &reconcile.CheckRecord{CheckNo: 1, At: time.Now(), Adapter: "static", Dependency: "dep-0", Verdict: "present"}},
	}); err != nil {
		t.Fatal(err)
	}
	held, err := review.List(ctx, db, review.Filter{Limit: 50})
	if err != nil || len(held) != 50 {
		t.Fatalf("review list: %d, %v", len(held), err)
	}

	// explainAnalyzed runs EXPLAIN ANALYZE of s (in a transaction rolled
	// back: the probe's statement inserts), with setup first.
	explainAnalyzed := func(s traced, setup string) analyzed {
		t.Helper()
		tx, err := db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if setup != "" {
			if _, err := tx.Exec(ctx, setup); err != nil {
				t.Fatal(err)
			}
		}
		var raw []byte
		if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+s.sql, s.args...).Scan(&raw); err != nil {
			t.Fatalf("explain: %v\n%s", err, s.sql)
		}
		var out []struct{ Plan analyzed }
		if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
			t.Fatalf("explain output %s: %v", raw, err)
		}
		return out[0].Plan
	}
	// reads lists the history partitions a plan read (at least once), and
	// fails on a sequential scan of one.
	reads := func(what string, plan analyzed) (read []string, removed int) {
		t.Helper()
		plan.walk(func(n analyzed) {
			removed += n.Removed
			root := roots[n.Relation]
			if root != "receipt_events" && root != "readback_checks" && root != "verdict_audits" || n.Loops == 0 {
				return
			}
			read = append(read, n.Relation)
			if n.NodeType == "Seq Scan" {
				t.Errorf("%s: sequential scan of %s", what, n.Relation)
			}
		})
		return read, removed
	}

	for _, c := range []struct {
		name, marker, table string
	}{
		{"receipts show: events", "FROM reconciler.receipt_events WHERE receipt_id = $1", "receipt_events"},
		{"receipts show: audits", "FROM reconciler.verdict_audits WHERE receipt_id = $1", "verdict_audits"},
		// (Correlated with the checks written: pruned as it runs, for
		// each check, however it is planned.)
		{"worker's probe before writing a check again", "SELECT 1 FROM reconciler.readback_checks k", "readback_checks"},
	} {
		s := rec.find(t, c.marker)
		read, _ := reads(c.name, explainAnalyzed(s, ""))
		if len(read) != 1 || read[0] != home(c.table) {
			t.Errorf("%s: read %v, want only %s", c.name, read, home(c.table))
		}
		t.Logf("%s: read %v", c.name, read)
		if len(s.args) != 1 {
			continue
		}
		// pgx prepares its statements, and a prepared statement may run
		// a generic plan (no value for $1 when planned): it prunes as it
		// starts.
		// (PREPARE and EXECUTE go as simple queries: $1 is the prepared
		// statement's, not one of the protocol's.)
		var raw []byte
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			for _, q := range []string{"SET LOCAL plan_cache_mode = force_generic_plan", "PREPARE generic AS " + s.sql} {
				if _, err := tx.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
					return err
				}
			}
			if err := tx.QueryRow(ctx, fmt.Sprintf("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE generic(%d)", s.args[0]),
				pgx.QueryExecModeSimpleProtocol).Scan(&raw); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "DEALLOCATE generic", pgx.QueryExecModeSimpleProtocol)
			return err
		})
		if err != nil {
			t.Fatalf("%s (generic plan): %v", c.name, err)
		}
		var out []struct{ Plan analyzed }
		if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
			t.Fatalf("explain output %s: %v", raw, err)
		}
		read, removed := reads(c.name+" (generic plan)", out[0].Plan)
		if len(read) != 1 || read[0] != home(c.table) || removed == 0 {
			t.Errorf("%s (generic plan): read %v, %d subplans removed at start; want only %s", c.name, read, removed, home(c.table))
		}
		t.Logf("%s (generic plan): read %v, Subplans Removed: %d", c.name, read, removed)
	}

	// review list: each held receipt's latest event, by a probe of the
	// partition holding it. The 50 oldest held are in the first range.
	plan := explainAnalyzed(rec.find(t, "WHERE r.state = 'manual_review'"), "")
	read, _ := reads("review list", plan)
	if len(read) != 1 || read[0] != home("receipt_events")[:len("receipt_events_p")]+fmt.Sprintf("%019d", first) {
		t.Errorf("review list: read %v, want only the first range's receipt_events partition", read)
	}
	var probes []string
	plan.walk(func(n analyzed) {
		if roots[n.Relation] == "receipt_events" && n.Loops > 0 {
			probes = append(probes, n.NodeType+" "+n.Index)
		}
	})
	if len(probes) != 1 || !strings.HasPrefix(probes[0], "Index Scan ") || !strings.HasSuffix(probes[0], "_pkey") {
		t.Errorf("review list: reads receipt_events by %v, want a primary-key probe", probes)
	}
	t.Logf("review list: read %v by %v", read, probes)
}
