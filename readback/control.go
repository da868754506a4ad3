package readback

import (
	"errors"
	"fmt"
)

// Control is a positive control (SPEC §5a): an effect known to exist that a
// correctly configured adapter must find. Until an adapter has passed a
// control recently, none of its absences is authoritative, because a wrong
// path, filter or marker reads exactly like "absent".
//
// A control is either declared in the adapters file (a known resource, for
// a new deployment that has no succeeded receipts yet) or drawn from the
// ledger (a receipt of the same operation that settled succeeded from the
// API's own 2xx response).
type Control struct {
	// Receipt describes the known effect as the adapter sees a receipt:
	// idempotency key (its logical key is the marker), target, intent,
	// external id and the time it was made.
	Receipt Receipt
	// Source says where the control came from: "declared" or "receipt:<id>".
	Source string
}

// ErrControlFailed means an adapter did not find the effect of a control.
var ErrControlFailed = errors.New("positive control failed")

// EvaluateControl says whether the answer res (or the failure err) of b's
// adapter to a control passes it: the known effect must be found. For
// create and update a present answer passes; for delete, whose control is a
// resource that exists, a present answer passes too (an adapter that reads
// "absent" for a resource that exists would settle deletes that never
// happened). Anything else fails with an error matching ErrControlFailed
// that says what the adapter answered.
func EvaluateControl(b *Binding, res Result, err error) error {
	if err != nil {
		return fmt.Errorf("%w: adapter %s: the check failed: %w", ErrControlFailed, b.Name, err)
	}
	if res.Verdict != VerdictPresent {
		return fmt.Errorf("%w: adapter %s answered %s (query %s) for an effect known to exist",
			ErrControlFailed, b.Name, res.Verdict, res.Query)
	}
	return nil
}
