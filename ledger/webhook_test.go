package ledger_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// registeredRoute returns the route a receipt's webhook is registered
// for, "" when none.
func registeredRoute(t *testing.T, c *ledger.Client, id int64) string {
	t.Helper()
	var route string
	err := c.Pool().QueryRow(context.Background(),
		`SELECT route FROM reconciler.webhook_receipts WHERE receipt_id = $1`, id).Scan(&route)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return route
}

// queued returns the states whose webhook events are queued for a receipt.
func queued(t *testing.T, c *ledger.Client, id int64) []string {
	t.Helper()
	rows, err := c.Pool().Query(context.Background(),
		`SELECT state || ' ' || route FROM reconciler.webhook_deliveries WHERE receipt_id = $1 ORDER BY settled_at`, id)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Issue 13's leftover: the webhook registration is written by the statement
// that records the receipt, before anything is sent, so a gateway that dies
// after the upstream answered (and before any statement of its own) leaves
// a registered receipt; its settlement, whoever makes it, queues the event
// in the settling transaction.
func TestWebhookRegisteredWithTheReceipt(t *testing.T) {
	ctx := context.Background()
	c := newClient(t)

	in := article("hook:1:articles.create")
	in.Webhook = "/blog"
	r, err := c.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	// Nothing else was written: the registration is the receipt's own.
	if got := registeredRoute(t, c, r.ID); got != "/blog" {
		t.Fatalf("registered route right after PlanAndSubmit = %q, want /blog", got)
	}
	if got := queued(t, c, r.ID); len(got) != 0 {
		t.Fatalf("events queued before any settlement: %v", got)
	}
	// The agent's own outcome (no gateway statement after it) queues the event.
	if _, err := c.Succeed(ctx, r, "art-1", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	if got := queued(t, c, r.ID); len(got) != 1 || got[0] != "succeeded /blog" {
		t.Fatalf("events queued after the agent's success = %v, want [succeeded /blog]", got)
	}

	// An unknown outcome: the reconciler's settlement queues it.
	in = article("hook:2:articles.create")
	in.Webhook = "/blog"
	r = unknownReceiptOf(t, c, in)
	settleAs(t, c, r, "art-2")
	if got := queued(t, c, r.ID); len(got) != 1 || got[0] != "succeeded /blog" {
		t.Fatalf("events queued after the reconciler's settlement = %v, want [succeeded /blog]", got)
	}

	// A retry (attempt 2, through reconciler.plan) is registered as it is
	// recorded, too; a receipt without Webhook is not.
	in = article("hook:3:articles.create")
	in.Webhook = "/blog"
	first, err := c.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	first, err = c.Reject(ctx, first, ledger.Detail{Error: &ledger.CallError{Code: "not_sent", Retryable: true}})
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.Retry(ctx, first, in)
	if err != nil {
		t.Fatal(err)
	}
	if second.Attempt != 2 || registeredRoute(t, c, second.ID) != "/blog" {
		t.Fatalf("retry: attempt %d registered for %q, want attempt 2 registered for /blog",
			second.Attempt, registeredRoute(t, c, second.ID))
	}
	plain, err := c.PlanAndSubmit(ctx, article("hook:4:articles.create"))
	if err != nil {
		t.Fatal(err)
	}
	if got := registeredRoute(t, c, plain.ID); got != "" {
		t.Fatalf("a receipt without Webhook is registered for %q", got)
	}
	if plain.State != statemachine.Submitted {
		t.Fatalf("plain receipt is %s, want submitted", plain.State)
	}
}

// unknownReceiptOf plans, submits and marks in's receipt outcome_unknown.
func unknownReceiptOf(t *testing.T, c *ledger.Client, in ledger.Intent) *ledger.Receipt {
	t.Helper()
	ctx := context.Background()
	r, err := c.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = c.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	return r
}
