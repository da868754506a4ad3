package ledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/receiptledger/reconciler/statemachine"
)

// Unrecorded is the outcome of a call that was made and whose recording
// failed (Result.Unrecorded): the receipt, still submitted when the write
// failed, and what the exchange showed.
type Unrecorded struct {
	// Receipt is the receipt as submitted.
	Receipt *Receipt
	// Verdict is how the exchange was classified.
	Verdict Verdict
	// HTTPStatus is the response's status, 0 when none arrived.
	HTTPStatus int
	// Detail is what the move would have recorded.
	Detail Detail
}

// RecordUnrecorded writes an outcome whose recording failed: the move out
// of submitted Do would have made, or, when someone moved the receipt on
// meanwhile (the orphan sweep, then the reconciler), the observed outcome
// as a late outcome, which the reconciler settles from. It returns the
// receipt as it stands after the move (nil when kept as a late outcome or
// settled by someone else already) and an error while the database still
// cannot take the write: call it again later.
func (c *Caller) RecordUnrecorded(ctx context.Context, u *Unrecorded) (*Receipt, error) {
	r, err := c.Ledger.Transition(ctx, Move{ID: u.Receipt.ID, From: statemachine.Submitted, To: u.Verdict.Outcome.State(),
		ExternalID: u.Verdict.ExternalID, Detail: u.Detail})
	var ce *ConflictError
	switch {
	case err == nil:
		return r, nil
	case !errors.As(err, &ce):
		return nil, err
	case movedOnBySweep(ce.Actual) || ce.Actual == statemachine.SafeToRetry:
		if err := c.Ledger.RecordLateOutcome(ctx, u.Receipt.ID, u.Verdict.Outcome, u.HTTPStatus, u.Verdict.ExternalID, u.Detail); err != nil {
			if errors.Is(err, ErrStateConflict) {
				return nil, nil // settled meanwhile: nothing left to keep
			}
			return nil, fmt.Errorf("ledger: receipt %d: the outcome as a late outcome: %w", u.Receipt.ID, err)
		}
		return nil, nil
	}
	return nil, nil // settled by someone else: nothing left to keep
}
