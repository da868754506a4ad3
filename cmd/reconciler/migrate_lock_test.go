package main

import (
	"context"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
)

// A transaction that read receipts and stays open holds a lock the next
// migration (00011 replaces the triggers of receipts) must wait for, and
// every agent's move would queue behind that waiting migration: `migrate
// up` gives up after --lock-timeout with one line that says why and what
// to do, applies nothing, and succeeds once the transaction has ended.
func TestMigrateGivesWayToALongTransaction(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewEmptyDatabase(t)
	pool := pgtest.Pool(t, url)
	db := migrations.OpenDB(pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 10); err != nil {
		t.Fatal(err)
	}
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM reconciler.receipts`); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := runCLI(t, "", "migrate", "up", "--lock-timeout", "200ms", "--database-url", url)
	wantOneLine(t, "migrate up behind a long transaction", code, out, errOut, 1,
		"00011_settled_signals.sql waited longer than --lock-timeout 200ms", "rolled back", "run it again")
	if v, err := p.GetDBVersion(ctx); err != nil || v != 10 {
		t.Fatalf("after the refused migration the schema is at %d (%v), want 10: nothing half-applied", v, err)
	}

	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = runCLI(t, "", "migrate", "up", "--database-url", url)
	if code != 0 || !strings.Contains(out, "applied 00011_settled_signals.sql") {
		t.Fatalf("migrate up once the transaction ended: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
