package integration

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// Issue 19, item 5: going below 00004 drops reconciler.late_outcomes and
// every receipt's send deadline (max_send_delay), guard flag, submitted_by
// and unknown_since; after down and up again a late success is forgotten
// (its receipt may be retried) and every deadline falls back to 5 s. So the
// Down of 00004 is refused (RL010, nothing rolled back) while any receipt
// is unsettled or any late outcome of a receipt not settled succeeded is
// kept, with an error that says how many and what would be lost; it goes
// through once the ledger holds nothing it would lose, or when the session
// accepts the loss (`migrate down --accept-data-loss`).
func TestDownBelowSoundnessKeepsItsData(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	p := provider(t, db)
	unknown := seed(t, db, 2, "things.create", "down-api", "outcome_unknown")
	settled := seed(t, db, 1, "things.create", "down-api", "submitted")
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'agent:test'
		WHERE id = $1`, settled[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT reconciler.record_late_outcome($1, 'agent:test', 'succeeded', 201, 'thing-late')`,
		unknown[0]); err != nil {
		t.Fatal(err)
	}
	for {
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v <= 4 {
			break
		}
		if _, err := p.Down(ctx); err != nil {
			t.Fatalf("down from %05d with receipts in flight: %v", v, err)
		}
	}
	_, err := p.Down(ctx)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "RL010" {
		t.Fatalf("down below 00004 with 2 receipts unsettled: %v, want RL010", err)
	}
	for _, says := range []string{"2 receipts are unsettled", "1 late outcomes of 1 receipts"} {
		if !strings.Contains(pe.Message, says) {
			t.Errorf("the refusal %q does not say %q", pe.Message, says)
		}
	}
	for _, what := range []string{"late_outcomes", "max_send_delay", "guarded", "submitted_by", "unknown_since"} {
		if !strings.Contains(pe.Detail, what) {
			t.Errorf("the refusal's detail %q does not name %s", pe.Detail, what)
		}
	}
	if v, err := p.GetDBVersion(ctx); err != nil || v != 4 {
		t.Fatalf("after the refused down: version %d (%v), want 4", v, err)
	}
	var late int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.late_outcomes`).Scan(&late); err != nil || late != 1 {
		t.Fatalf("after the refused down: %d late outcomes (%v), want the one kept", late, err)
	}

	// Settled (the late success settles it), nothing to lose: the step goes.
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'reconciling', state_actor = 'reconciler:test'
		WHERE id = ANY($1)`, unknown); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'reconciler:test'
		WHERE id = ANY($1)`, unknown); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Down(ctx); err != nil {
		t.Fatalf("down below 00004 with every receipt settled succeeded: %v", err)
	}
	if _, err := p.UpByOne(ctx); err != nil {
		t.Fatal(err)
	}

	// Unsettled again, but the session accepts the loss.
	seed(t, db, 1, "things.create", "down-api", "outcome_unknown")
	if _, err := p.Down(ctx); err == nil {
		t.Fatal("down below 00004 with a receipt unsettled went through")
	}
	accepting := pgtest.Pool(t, withParam(url, "reconciler.accept_down_data_loss=on"))
	if _, err := provider(t, accepting).Down(ctx); err != nil {
		t.Fatalf("down below 00004 accepting the loss: %v", err)
	}
	if v, err := p.GetDBVersion(ctx); err != nil || v != 3 {
		t.Fatalf("after the accepted down: version %d (%v), want 3", v, err)
	}
}
