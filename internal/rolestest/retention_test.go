package rolestest

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/retention"
)

// Issue 25: reconciler_retention archives and removes a settled receipt
// through the removal functions only; it cannot delete, update or insert
// on its own, even with the removal's setting, and no other role may call
// the removal functions.
func TestRetentionRole(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	ret := loginPool(t, e.owner, e.url, "reconciler_retention")
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, intent("ret:1", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	// Rejected before it was sent: no send deadline to wait for.
	if r, err = agent.Reject(ctx, r, ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	kept := unknown(t, agent, "ret:2", "blog-api")

	remove := `SELECT reconciler.retention_remove_receipts($1, 'x', repeat('0', 64), clock_timestamp(), interval '0',
		'{"receipts": 1, "late_outcomes": 0, "verdict_audits": 0, "webhook_receipts": 0, "webhook_deliveries": 0, "gateway_responses": 0}')`
	for _, p := range []struct {
		name string
		exec func() error
	}{
		{"agent", func() error { _, err := e.agent.Exec(ctx, remove, []int64{r.ID}); return err }},
		{"worker", func() error { _, err := e.worker.Exec(ctx, remove, []int64{r.ID}); return err }},
		{"reviewer", func() error { _, err := e.reviewer.Exec(ctx, remove, []int64{r.ID}); return err }},
	} {
		wantCode(t, p.name+": retention_remove_receipts", p.exec(), denied)
	}
	// Nor a history partition's drop (migration 00022).
	drop := `SELECT reconciler.retention_drop_history_partition(NULL, 1, clock_timestamp(), 'x', repeat('0', 64), '{}')`
	for name, pool := range map[string]interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}{"agent": e.agent, "worker": e.worker, "reviewer": e.reviewer} {
		_, err := pool.Exec(ctx, drop)
		wantCode(t, name+": retention_drop_history_partition", err, denied)
	}
	// Nor a history partition's compaction (migration 00024).
	compact := `SELECT reconciler.retention_compact_history_partition(NULL, 1, clock_timestamp(), 'x', repeat('0', 64), '{}')`
	for name, pool := range map[string]interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}{"agent": e.agent, "worker": e.worker, "reviewer": e.reviewer} {
		_, err := pool.Exec(ctx, compact)
		wantCode(t, name+": retention_compact_history_partition", err, denied)
	}
	refuse(t, ret, denied, append(forgeries(r.ID),
		stmt{"delete receipts", `DELETE FROM reconciler.receipts WHERE id = $1`, []any{r.ID}},
		stmt{"delete receipts with the removal's setting", `SELECT set_config('reconciler.retention_batch', '1', true);
			DELETE FROM reconciler.receipts WHERE id = 1`, nil},
		stmt{"update receipts", `UPDATE reconciler.receipts SET state = 'succeeded' WHERE id = $1`, []any{kept.ID}},
		stmt{"insert retention_batches", `INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed)
			VALUES ('receipts', 'x', repeat('0', 64), '{}')`, nil},
		stmt{"detach a history partition", `ALTER TABLE reconciler.receipt_events DETACH PARTITION reconciler.receipt_events_legacy`, nil},
		stmt{"drop a history partition", `DROP TABLE reconciler.readback_checks_legacy`, nil},
	))

	// The receipt settled a moment ago, never sent; a policy of a
	// microsecond and no request horizon lets it go; the one in flight
	// stays.
	rep, err := retention.New(ret, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: time.Microsecond, History: time.Microsecond}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Rows["receipts"] != 1 || rep.Rows["receipt_events"] != 2 || rep.HistoryBatches != 1 {
		t.Errorf("retention role: removed %v, want the settled receipt and its 2 events", rep.Rows)
	}
	var left []int64
	rows, err := e.owner.Query(ctx, `SELECT id FROM reconciler.receipts ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		_ = rows.Scan(&id)
		left = append(left, id)
	}
	if len(left) != 1 || left[0] != kept.ID {
		t.Errorf("receipts left %v, want only %d (outcome_unknown)", left, kept.ID)
	}

	// A history partition range leaves whole through the role too
	// (migration 00022): the owner makes ranges of 10 ids, a receipt of the
	// first is settled and the sequence passes the range.
	var lo int64
	if err := e.owner.QueryRow(ctx, `SELECT max(to_id) FROM reconciler.history_partitions()`).Scan(&lo); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), ` + strconv.FormatInt(lo-1, 10) + `)`,
		`UPDATE reconciler.history_partitioning SET width = 10`,
		`SELECT reconciler.ensure_history_partitions()`,
	} {
		if _, err := e.owner.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if r, err = agent.Plan(ctx, intent("ret:3", "blog-api")); err != nil {
		t.Fatal(err)
	} else if r.ID != lo {
		t.Fatalf("receipt %d, want %d", r.ID, lo)
	}
	if _, err = agent.Reject(ctx, r, ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.owner.Exec(ctx, `SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), `+strconv.FormatInt(lo+10, 10)+`)`); err != nil {
		t.Fatal(err)
	}
	rep, err = retention.New(ret, retention.Dir(t.TempDir()), nil).Run(ctx,
		retention.Policy{Settled: time.Microsecond, History: time.Microsecond}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.HistoryPartitions == 0 || rep.Rows["receipt_events"] != 2 {
		t.Errorf("retention role: %+v, want the range of the rejected receipt dropped with its 2 events", rep)
	}
}
