package ledger

import (
	"context"
	"fmt"

	"github.com/receiptledger/reconciler/statemachine"
)

// ReasonFreshProof is the reason recorded with a receipt sent back to the
// reconciler by RequestFreshProof.
const ReasonFreshProof = "fresh_proof"

// RequestFreshProof sends a safe_to_retry receipt back to the reconciler
// (safe_to_retry -> outcome_unknown), which reads it again and settles it
// anew. A retry refused with ErrKeyRetentionPassed needs it: the absence was
// proven while the API's native idempotency key was retained, and that
// retention has passed (SPEC §5a, "a native key protects only within its
// retention"); once the receipt settles safe_to_retry again (Await), now
// past its full absence window, Retry goes through. The database refuses
// (ErrStateConflict) once a retry of the receipt is past planned, and,
// where the roles of docs/roles.sql are in use, to an agent's login that did
// not submit the receipt (statemachine.ErrIllegalTransition). why is
// recorded with the move.
func (c *Client) RequestFreshProof(ctx context.Context, r *Receipt, why string) (*Receipt, error) {
	return c.Transition(ctx, Move{ID: r.ID, From: statemachine.SafeToRetry, To: statemachine.OutcomeUnknown,
		Detail: Detail{Reason: ReasonFreshProof, Extra: map[string]any{"why": why}}})
}

// freshProof answers a retry of prev refused with ErrKeyRetentionPassed
// (refused): nothing was sent, and prev goes back to the reconciler for a
// fresh proof. The error wraps refused.
func (c *Caller) freshProof(ctx context.Context, prev *Receipt, refused error) (*Result, error) {
	wctx, cancel := c.writeContext(ctx)
	defer cancel()
	r, err := c.Ledger.RequestFreshProof(wctx, prev, "a retry was refused: the native idempotency key's retention has passed")
	if err != nil {
		return &Result{Receipt: prev}, fmt.Errorf("ledger: retry of receipt %d: nothing sent: %w; requesting a fresh proof failed: %w",
			prev.ID, refused, err)
	}
	return &Result{Receipt: r}, fmt.Errorf("ledger: retry of receipt %d: nothing sent: %w; a fresh proof was requested "+
		"(the receipt is outcome_unknown again): run the step again once the reconciler has settled it", prev.ID, refused)
}
