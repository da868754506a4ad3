package rolestest

import (
	"context"
	"fmt"
	"sort"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/ledger"
)

// historyInserts writes one row of each history table by hand, into the
// table or partition named by the first %s, for receipt %d: partitions
// have no identity, so the id is given.
var historyInserts = map[string]string{
	"receipt_events": `INSERT INTO reconciler.%s (receipt_id, seq, to_state, at, actor)
		VALUES (%d, 99, 'succeeded', now(), 'human:forger')`,
	"readback_checks": `INSERT INTO reconciler.%s (id, receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us)
		OVERRIDING SYSTEM VALUE VALUES (999999, %d, 99, now(), 'x', 'x', 'x', 'present', 0)`,
	"verdict_audits": `INSERT INTO reconciler.%s (id, receipt_id, dependency, operation, adapter, settled_state, settled_at,
		at, instance, verdict) OVERRIDING SYSTEM VALUE VALUES (999999, %d, 'x', 'x', 'x', 'succeeded', now(), now(), 'x', 'confirmed')`,
}

// Issue 25: the append-only rules hold on every partition of the history
// tables (migration 00021): the one the old table became, the ranges the
// migration created, the default, and ranges ensure_history_partitions
// creates later (here with a width of 10). Every partition carries the
// refuse_rewrite triggers; no runtime role may read, write, truncate,
// detach or drop a partition; and the owner's UPDATE, DELETE and TRUNCATE
// are refused on each, directly and through the parent, with the removal's
// setting too.
func TestAppendOnlyOnEveryPartition(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	ro := loginPool(t, e.owner, e.url, "reconciler_readonly")
	ret := loginPool(t, e.owner, e.url, "reconciler_retention")
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}

	// Narrow ranges from now on; the worker creates them, past 5,000,000.
	if _, err := e.owner.Exec(ctx, `UPDATE reconciler.history_partitioning SET width = 10`); err != nil {
		t.Fatal(err)
	}
	var created int
	if err := e.worker.QueryRow(ctx, `SELECT reconciler.ensure_history_partitions(5000000)`).Scan(&created); err != nil {
		t.Fatalf("worker: ensure_history_partitions: %v", err)
	}
	if created != 15 {
		t.Fatalf("ensure_history_partitions(5000000) with width 10 created %d partitions, want 5 per table", created)
	}

	// One receipt whose history lands in each kind of partition: the old
	// table's range, a range of the migration, a range made later, and
	// past every range (the default). Each gets events (the agent's
	// moves), a readback check and a verdict audit (the owner's inserts,
	// as the worker's would be).
	ids := map[string]int64{}
	for i, start := range []int64{0, 1000000, 5000000, 9000000} {
		if start > 0 {
			if _, err := e.owner.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), $1, false)`, start); err != nil {
				t.Fatal(err)
			}
		}
		r := unknown(t, agent, fmt.Sprintf("part:%d", i), "blog-api")
		for table, q := range historyInserts {
			if table == "receipt_events" {
				continue
			}
			if _, err := e.owner.Exec(ctx, fmt.Sprintf(q, table, r.ID)); err != nil {
				t.Fatalf("owner: %s of receipt %d: %v", table, r.ID, err)
			}
		}
		ids[fmt.Sprint(start)] = r.ID
	}

	// Where each receipt's rows are, by partition.
	holds := map[string]int64{}
	parts := map[string]string{} // partition -> parent
	rows, err := e.owner.Query(ctx, `SELECT c.relname::text, p.relname::text
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
		WHERE p.oid IN ('reconciler.receipt_events'::regclass, 'reconciler.readback_checks'::regclass,
		                'reconciler.verdict_audits'::regclass) AND c.relkind = 'r'`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var part, parent string
		if err := rows.Scan(&part, &parent); err != nil {
			t.Fatal(err)
		}
		parts[part] = parent
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for table := range historyInserts {
		rows, err := e.owner.Query(ctx, `SELECT DISTINCT c.relname::text, x.receipt_id
			FROM reconciler.`+table+` x JOIN pg_class c ON c.oid = x.tableoid`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var part string
			var id int64
			if err := rows.Scan(&part, &id); err != nil {
				t.Fatal(err)
			}
			holds[part] = id
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []string{"_legacy", "_p0000000000001000000", "_p0000000000005000000", "_default"} {
		for table := range historyInserts {
			if _, ok := holds[table+want]; !ok {
				t.Errorf("no history row in %s%s (rows are in %v)", table, want, holds)
			}
		}
	}

	// Every partition, empty or not, carries the parent's row trigger and
	// a TRUNCATE trigger of its own, both refuse_rewrite.
	var bare []string
	rows, err = e.owner.Query(ctx, `SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent IN ('reconciler.receipt_events'::regclass, 'reconciler.readback_checks'::regclass,
		                      'reconciler.verdict_audits'::regclass) AND c.relkind = 'r'
		  AND (NOT EXISTS (SELECT FROM pg_trigger g WHERE g.tgrelid = c.oid AND g.tgparentid <> 0
		                   AND g.tgfoid = 'reconciler.refuse_rewrite'::regproc
		                   AND g.tgtype & (2 | 8 | 16) = (2 | 8 | 16))  -- BEFORE, DELETE, UPDATE
		    OR NOT EXISTS (SELECT FROM pg_trigger g WHERE g.tgrelid = c.oid
		                   AND g.tgfoid = 'reconciler.refuse_rewrite'::regproc
		                   AND g.tgtype & (2 | 32) = (2 | 32)))        -- BEFORE, TRUNCATE
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	if bare, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(bare) != 0 {
		t.Errorf("partitions without the append-only triggers: %v", bare)
	}

	names := make([]string, 0, len(parts))
	for p := range parts {
		names = append(names, p)
	}
	sort.Strings(names)
	if len(names) != 3*(1+4+5+1) {
		t.Errorf("%d partitions %v, want 11 per table (legacy, 4 ahead, 5 made later, default)", len(names), names)
	}
	for name, pool := range map[string]*pgxpool.Pool{"agent": e.agent, "worker": e.worker, "reviewer": e.reviewer,
		"readonly": ro, "retention": ret} {
		var stmts []stmt
		for _, part := range names {
			id, ok := holds[part]
			if !ok {
				id = 1 // an empty partition: the privilege is refused before any row is
			}
			parent := parts[part]
			stmts = append(stmts,
				stmt{name + ": insert " + part, fmt.Sprintf(historyInserts[parent], part, id), nil},
				stmt{name + ": update " + part, `UPDATE reconciler.` + part + ` SET receipt_id = receipt_id`, nil},
				stmt{name + ": delete " + part, `DELETE FROM reconciler.` + part, nil},
				stmt{name + ": truncate " + part, `TRUNCATE reconciler.` + part, nil},
				stmt{name + ": detach " + part, `ALTER TABLE reconciler.` + parent + ` DETACH PARTITION reconciler.` + part, nil},
				stmt{name + ": drop " + part, `DROP TABLE reconciler.` + part, nil},
			)
		}
		refuse(t, pool, denied, stmts)
	}

	var owner []stmt
	for _, part := range names {
		parent := parts[part]
		owner = append(owner, stmt{"owner: truncate " + part, `TRUNCATE reconciler.` + part, nil})
		id, ok := holds[part]
		if !ok {
			continue
		}
		owner = append(owner,
			stmt{"owner: update " + part, fmt.Sprintf(`UPDATE reconciler.%s SET receipt_id = receipt_id WHERE receipt_id = %d`, part, id), nil},
			stmt{"owner: delete " + part, fmt.Sprintf(`DELETE FROM reconciler.%s WHERE receipt_id = %d`, part, id), nil},
			stmt{"owner: update " + parent + " of " + part, fmt.Sprintf(`UPDATE reconciler.%s SET receipt_id = receipt_id WHERE receipt_id = %d`, parent, id), nil},
			stmt{"owner: delete " + parent + " of " + part, fmt.Sprintf(`DELETE FROM reconciler.%s WHERE receipt_id = %d`, parent, id), nil},
			stmt{"owner: delete " + part + " with the removal's setting", fmt.Sprintf(
				`SELECT set_config('reconciler.retention_batch', '1', true); DELETE FROM reconciler.%s WHERE receipt_id = %d`, part, id), nil},
		)
	}
	refuse(t, e.owner, rewrite, owner)
	for _, id := range ids {
		if got := history(t, e.owner, id); len(got) != 3 {
			t.Errorf("receipt %d: %d events left, want its 3", id, len(got))
		}
	}
}
