package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/statemachine"
)

// notReplicated answers for a receipt whose submit committed with a
// warning (ErrNotReplicated): nothing is sent, since a failover could lose
// the record, and the receipt is rejected as not_sent, retryable, so the
// step may be sent again (as its next attempt) once the standby confirms
// commits. Should that move fail too, the receipt stays submitted, and
// the orphan sweep and a readback settle it (nothing was sent).
func (c *Caller) notReplicated(ctx context.Context, nr *NotReplicatedError, err error) (*Result, error) {
	cause := &CallError{Code: CodeNotSent, Retryable: true,
		Message: "the submit committed with a warning (" + nr.Warning + "): a standby may not have it, so nothing was sent"}
	wctx, cancel := c.writeContext(ctx)
	defer cancel()
	rc := nr.Receipt
	rej, rerr := c.Ledger.Reject(wctx, rc, Detail{Error: cause, Reason: "commit_not_replicated"})
	if rerr != nil {
		return &Result{Receipt: rc}, &OutcomeError{Receipt: rc, Err: errors.Join(err, rerr),
			note: "nothing sent; recording it as not sent failed too: " + rerr.Error()}
	}
	return &Result{Receipt: rej}, &OutcomeError{Receipt: rej, Cause: cause, Err: err}
}

// movedOnBySweep reports whether a submitted receipt found in state s was
// moved on by the reconciler (the orphan sweep) rather than settled.
func movedOnBySweep(s statemachine.State) bool {
	return s == statemachine.OutcomeUnknown || s == statemachine.Reconciling || s == statemachine.ManualReview
}

// recordLate keeps the outcome observed for a receipt the sweep moved on
// (or the reconciler settled safe_to_retry) before the response arrived,
// and returns the note Do's error carries.
func (c *Caller) recordLate(ctx context.Context, sub *Receipt, now statemachine.State, ex Exchange, v Verdict, d Detail) string {
	wctx, cancel := c.writeContext(ctx)
	defer cancel()
	observed := string(v.Outcome)
	if v.ExternalID != "" {
		observed += " with external id " + strconv.Quote(v.ExternalID)
	}
	if err := c.Ledger.RecordLateOutcome(wctx, sub.ID, v.Outcome, ex.Status(), v.ExternalID, d); err != nil {
		return fmt.Sprintf("the receipt was moved to %s before the response arrived, and recording the observed outcome (%s) as a late outcome failed: %v",
			now, observed, err)
	}
	if now == statemachine.SafeToRetry {
		what := "a success"
		if v.Outcome == OutcomeUnknown {
			what = "an answer that leaves its effect unknown"
		}
		if v.Outcome == OutcomeRejected {
			return fmt.Sprintf("the reconciler had settled the receipt safe_to_retry when the original request's answer arrived: "+
				"a rejection (%s), recorded as a late outcome; it proves no effect, so a retry stays allowed", observed)
		}
		return fmt.Sprintf("the reconciler had settled the receipt safe_to_retry (absence proven), yet the original request was still alive "+
			"and received %s (%s): its effect exists or may exist. Recorded as a late outcome, it makes the database refuse "+
			"every retry of the receipt: no retry will be sent. Where it voids the settlement (a success, or an answer after "+
			"the declared window) and no retry went out, the receipt is back with the reconciler (outcome_unknown) to be "+
			"settled anew; otherwise a human must look. The dependency's declared send deadline, "+
			"request lifetime or consistency window is too short", what, observed)
	}
	return fmt.Sprintf("the receipt was moved to %s before the response arrived; the observed outcome (%s) is recorded as a late outcome and the reconciler will settle the receipt from it",
		now, observed)
}

func (c *Caller) check(in *Intent, req *http.Request) error {
	if c.Ledger == nil {
		return errors.New("ledger: Caller.Ledger is nil")
	}
	if req == nil || req.URL == nil {
		return fmt.Errorf("ledger: do: %w: nil request or URL", ErrInvalidIntent)
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	if in.Method == "" {
		in.Method = method
	} else if !strings.EqualFold(in.Method, method) {
		return fmt.Errorf("ledger: do %s: %w: intent method %s differs from the request's %s",
			in.IdempotencyKey, ErrInvalidIntent, in.Method, method)
	}
	if in.Target == "" {
		in.Target = req.URL.EscapedPath()
		if in.Target == "" {
			in.Target = "/"
		}
	}
	return nil
}

func (c *Caller) writeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d := c.SettleTimeout
	if d <= 0 {
		d = DefaultSettleTimeout
	}
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}

// known runs the Known hook, if any, on the receipt a known key names.
func (c *Caller) known(ctx context.Context, r *Receipt) error {
	if c.Known == nil {
		return nil
	}
	if err := c.Known(ctx, r); err != nil {
		return fmt.Errorf("ledger: key %s names receipt %d: nothing sent: %w", r.IdempotencyKey, r.ID, err)
	}
	return nil
}

// replay answers for a receipt that is already past planned, sending nothing.
func (c *Caller) replay(ctx context.Context, r *Receipt) (*Result, error) {
	res := &Result{Receipt: r, Replayed: true}
	if r.State == statemachine.Succeeded {
		return res, nil
	}
	oe := &OutcomeError{Receipt: r}
	oe.Cause, oe.Err = c.lastError(ctx, r.ID)
	if oe.Err != nil {
		oe.note = oe.Err.Error()
	}
	return res, oe
}

// lastError returns the error recorded by the receipt's latest event that has one.
func (c *Caller) lastError(ctx context.Context, id int64) (*CallError, error) {
	events, err := c.Ledger.History(ctx, id)
	if err != nil {
		return nil, err
	}
	for i := len(events) - 1; i >= 0; i-- {
		raw := events[i].Error
		if len(raw) == 0 || string(raw) == "null" {
			continue
		}
		var ce CallError
		if err := json.Unmarshal(raw, &ce); err != nil {
			return nil, fmt.Errorf("ledger: receipt %d: recorded error: %w", id, err)
		}
		return &ce, nil
	}
	return nil, nil
}

// settle moves the submitted receipt per the verdict, with a context that
// outlives ctx. It returns the error it recorded, if any, and the detail.
func (c *Caller) settle(ctx context.Context, r *Receipt, ex Exchange, v Verdict, overridden bool, st *sendStats) (*Receipt, *CallError, Detail, error) {
	extra := map[string]any{"sent": ex.Sent}
	if st.deadline.Load() {
		extra["send_deadline"] = true
	}
	if st.midWrite.Load() {
		extra["send_deadline_mid_write"] = true
	}
	if n := st.conns.Load(); n > 1 {
		// The transport got another connection for the request (a
		// retry before any write, or a resend Do refused).
		extra["transport_attempts"] = n
	}
	if st.resent.Load() {
		extra["transport_resend_refused"] = true
	}
	if st.reused.Load() {
		extra["connection_reused"] = true
	}
	if overridden {
		extra["classified_by"] = "override"
	}
	if ex.Response != nil {
		if ra := ex.Response.Header.Get("Retry-After"); ra != "" && len(ra) <= 64 {
			extra["retry_after"], _ = sanitize.Text(ra, 64)
		}
		if s := ex.Response.StatusCode; s >= 300 && s <= 399 {
			if loc := redirectLocation(ex); loc != "" {
				extra["location"], _ = sanitize.Text(loc, 2048)
			}
		}
	}
	if v.Code == CodeClassifyPanic {
		extra["classify_panic"] = v.Message
	}
	d := Detail{Extra: extra}
	var cause *CallError
	if v.Outcome == OutcomeSucceeded {
		ev := map[string]any{"source": "http_response"}
		if s := ex.Status(); s != 0 {
			ev["http_status"] = s
		}
		// An id that is not storable as is (invalid UTF-8, a NUL or other
		// control character, over MaxExternalIDBytes) is not trusted: the
		// receipt settles succeeded (the 2xx proves the effect) without an
		// external id, and the evidence keeps its hash and an excerpt.
		if id, untrusted := storableID(v.ExternalID); untrusted != nil {
			v.ExternalID = id
			ev["untrusted_external_id"] = untrusted
			ev["sanitized"] = true
		}
		d.Evidence = ev
	} else {
		code, ch1 := sanitize.Text(v.Code, 64)
		// A Classify override's message or an ExternalID error may quote
		// the request or the response: every form of the call's
		// credentials goes before it is stored.
		msg, ch2 := sanitize.Text(redactRequestText(v.Message, ex.Request), maxMessageBytes)
		cause = &CallError{Code: code, Message: msg, HTTPStatus: ex.Status(), Retryable: v.Retryable}
		d.Error = cause
		if ch1 || ch2 {
			extra["sanitized"] = true
		}
	}
	wctx, cancel := c.writeContext(ctx)
	defer cancel()
	var settled *Receipt
	var err error
	switch v.Outcome {
	case OutcomeSucceeded:
		settled, err = c.Ledger.Succeed(wctx, r, v.ExternalID, d)
	case OutcomeRejected:
		settled, err = c.Ledger.Reject(wctx, r, d)
	default:
		settled, err = c.Ledger.MarkUnknown(wctx, r, d)
	}
	return settled, cause, d, err
}
