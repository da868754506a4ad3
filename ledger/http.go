package ledger

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/receiptledger/reconciler/internal/contentcoding"
	"github.com/receiptledger/reconciler/statemachine"
)

// ErrRejected means the API refused the request deterministically (a 4xx,
// or whatever a Caller's Classify calls a rejection): the receipt is
// rejected and the effect did not happen. OutcomeError.Cause.Retryable says
// whether sending it again later may succeed (429, 425).
var ErrRejected = errors.New("request rejected")

// ErrResponseTooLarge is the Exchange.Err of a response whose body exceeded
// Caller.MaxResponseBytes; Exchange.Body then holds the first bytes only.
var ErrResponseTooLarge = errors.New("response body too large")

// ErrUndecodableBody is matched by the Exchange.Err of a response whose
// body is in a content coding Caller.DecodeContent cannot decode (one it
// does not know, or content that does not decode); Exchange.Body then
// holds none of it, or the part decoded before the failure.
var ErrUndecodableBody = contentcoding.ErrUndecodable

// Defaults of a Caller's zero fields.
const (
	// DefaultMaxResponseBytes bounds the response body Do reads: 10 MiB.
	DefaultMaxResponseBytes = 10 << 20
	// DefaultSettleTimeout bounds each ledger write Do makes after planning
	// (submit and settle), which run even when the call's context is done.
	DefaultSettleTimeout = 5 * time.Second
)

// Error codes recorded in CallError.Code by the default classification,
// besides "http_<status>" for a response that settles the receipt as
// rejected or outcome_unknown.
//
// A request canceled at its send deadline before the transport had a
// connection is recorded as not_sent too (SPEC §5a: "a request not written
// by then is not sent at all and the receipt is rejected as not_sent"),
// with a message that says the send deadline passed and "send_deadline":
// true in the detail's extra; the Go error matches ErrSendDeadline.
const (
	CodeNotSent          = "not_sent"          // nothing was written: DNS, dial, TLS, local errors, send deadline
	CodeRateLimited      = "rate_limited"      // 429
	CodeTimeout          = "timeout"           // sent, then a deadline passed
	CodeCanceled         = "canceled"          // sent, then the context was canceled
	CodeConnectionReset  = "connection_reset"  // sent, then ECONNRESET
	CodeConnectionClosed = "connection_closed" // sent, then EOF before a response
	CodeTransportError   = "transport_error"   // sent, then any other failure
	CodeTruncatedBody    = "truncated_body"    // 2xx whose body could not be read whole
	CodeMalformedBody    = "malformed_body"    // 2xx whose body is not the JSON it claims, or cannot be decoded
	CodeBodyTooLarge     = "body_too_large"    // 2xx whose body exceeds MaxResponseBytes
	CodeInvalidVerdict   = "invalid_verdict"   // Classify returned an Outcome out of range
	CodeClassifyPanic    = "classify_panic"    // Classify or ExternalID panicked: outcome unknown
	// Sent, then the send deadline passed before the request was written
	// whole (HTTP/2): it was canceled, nothing more was written.
	CodeSendDeadlineMidWrite = "send_deadline_mid_write"
	// Sent, then the transport tried to send it again on another
	// connection: refused, nothing was written there.
	CodeTransportResend = "transport_resend"
)

// Outcome is how a call settles its receipt: one of the three states a
// submitted receipt may move to.
type Outcome string

// The outcomes of a call.
const (
	// OutcomeSucceeded: the effect happened (a 2xx with a parseable body).
	OutcomeSucceeded = Outcome(statemachine.Succeeded)
	// OutcomeRejected: the effect did not happen (a 4xx, or nothing sent).
	OutcomeRejected = Outcome(statemachine.Rejected)
	// OutcomeUnknown: the request was sent and whether it took effect is
	// unknown; the reconciler will find out.
	OutcomeUnknown = Outcome(statemachine.OutcomeUnknown)
)

// State returns the receipt state the outcome settles to.
func (o Outcome) State() statemachine.State { return statemachine.State(o) }

// Valid reports whether o is one of the three outcomes.
func (o Outcome) Valid() bool {
	return o == OutcomeSucceeded || o == OutcomeRejected || o == OutcomeUnknown
}

// Verdict is the classification of one exchange.
type Verdict struct {
	Outcome Outcome
	// ExternalID is the id of the created or changed resource. For a
	// succeeded verdict left empty, Do extracts it from the body with the
	// Caller's ExternalID.
	ExternalID string
	// Code, Message and Retryable describe a rejected or unknown outcome in
	// the receipt's history (CallError). Left empty by a Classify override,
	// Code and Message default to those of the default classification, or
	// to "http_<status>".
	Code      string
	Message   string
	Retryable bool
}

// Exchange is what happened on the wire, as given to a classifier.
type Exchange struct {
	// Request is the request as sent. It may carry credentials: a
	// classifier must not copy it into a verdict.
	Request *http.Request
	// Response is nil when no response arrived.
	Response *http.Response
	// Body is the response body as read (possibly partial when Err is set).
	Body []byte
	// Err is the transport error when Response is nil, else the error that
	// cut reading the body short (ErrResponseTooLarge for an oversized one).
	Err error
	// Sent reports whether any byte of the request may have been written.
	// It is conservative: true from the moment the transport had a
	// connection for the request. False means no byte can have left, and a
	// retry is safe.
	Sent bool
}

// Status returns the response's status code, or 0 without a response.
func (ex Exchange) Status() int {
	if ex.Response == nil {
		return 0
	}
	return ex.Response.StatusCode
}

// Caller makes side-effecting HTTP calls through the ledger: it plans and
// submits the receipt before any byte is sent, sends the request, and
// settles the receipt from what happened on the wire (SPEC §4). Configure
// one Caller per API, since classification and external ids are per API.
// A Caller is safe for concurrent use once configured.
type Caller struct {
	// Ledger records the receipts. Required.
	Ledger *Client
	// HTTP sends the requests; nil means http.DefaultClient. Its transport
	// must report net/http/httptrace events for the request's context, as
	// net/http's Transport (HTTP/1 and HTTP/2) and wrappers around it do:
	// a failure the transport reports without any trace event is taken as
	// "nothing was sent". Its CheckRedirect is not used: Do never follows
	// a redirect (SPEC §5a), the 3xx is the answer.
	HTTP *http.Client
	// Classify, when set, is consulted first; returning false falls back
	// to DefaultClassify. Use it for per-API meanings, for example "409
	// means it already exists: succeeded", or "this API's 503 comes from
	// the load shedder in front of it: rejected, retryable".
	Classify func(Exchange) (Verdict, bool)
	// ExternalID extracts the external id from a succeeded response's
	// body; nil means the top-level "id" (string or number) of a JSON
	// object, see ExternalIDAt for another place. It returns "" when the
	// body carries no id; an error means the body is not what the API
	// promises, and the receipt settles as outcome_unknown.
	ExternalID func(body []byte) (string, error)
	// MaxResponseBytes bounds the response body read into memory;
	// 0 means DefaultMaxResponseBytes.
	MaxResponseBytes int64
	// DecodeContent decodes every content coding of the response body
	// (gzip, x-gzip, deflate, br, stacked) before it is read, bounded
	// (MaxResponseBytes bounds the decoded body) and classified, and
	// removes Content-Encoding from the response: an API may compress its
	// answer whatever it was asked. A body that cannot be decoded is not
	// read (its error matches ErrUndecodableBody): a 2xx is then
	// outcome_unknown (malformed_body). Off, net/http decodes only the gzip
	// its Transport asked for itself.
	DecodeContent bool
	// SettleTimeout bounds each ledger write after planning; 0 means
	// DefaultSettleTimeout.
	SettleTimeout time.Duration
	// Known, when set, is called with the receipt an idempotency key
	// already names, before Do replays it, submits it or sends its next
	// attempt; an error it returns is Do's, and nothing is sent. A new
	// key's call never calls it. The gateway uses it to keep each agent's
	// keys its own: another agent's reuse of a key must neither learn of
	// that call nor send its next attempt.
	Known func(ctx context.Context, r *Receipt) error
	// Answered, when set, is called once a response to the request Do
	// sent has arrived and been classified, with the submitted receipt,
	// before the outcome is recorded: whatever it writes is there before
	// the receipt settles, so a reader that sees the receipt settled sees
	// it too. The gateway keeps the response for replays so. Its context
	// is bounded by SettleTimeout; it cannot change the outcome.
	Answered func(ctx context.Context, r *Receipt, ex Exchange, v Verdict)
}

// Result is what Do returns: the receipt and, when a response arrived, the
// response with its body read whole (Response.Body reads Body again).
type Result struct {
	Receipt *Receipt
	// Response is nil when no response arrived or nothing was sent.
	Response *http.Response
	Body     []byte
	// Verdict is how this call was classified; zero when Replayed.
	Verdict Verdict
	// Sent reports whether this call may have written any request byte.
	Sent bool
	// Replayed is set when the idempotency key named a receipt that was
	// already past planned: nothing was sent, and Receipt is that one.
	Replayed bool
	// Unrecorded is set when the call was made and recording its outcome
	// failed (the database unreachable, read-only mid-failover): the
	// receipt stays submitted, and the observed outcome is here for the
	// caller to keep and write once the database answers
	// (Caller.RecordUnrecorded). Dropped, the reconciler reads the effect
	// back after the orphan timeout instead.
	Unrecorded *Unrecorded
}

// OutcomeError is the error of a Do whose receipt did not succeed. It
// matches ErrOutcomeUnknown (sent and unresolved: do not retry, the
// reconciler settles it), ErrNotSent (nothing was written: rejected,
// retryable) or ErrRejected (the API refused), and the transport error.
type OutcomeError struct {
	// Receipt is the receipt as it stands.
	Receipt *Receipt
	// Cause is the error recorded in the receipt's history; nil when none
	// was (a receipt still submitted).
	Cause *CallError
	// Err is the underlying transport, body or ledger error, if any. Its
	// text may hold the request URL with its query; Error does not print it.
	Err error
	// note is a credential-free account of Err for Error.
	note string
}

func (e *OutcomeError) sentinel() error {
	if e.Receipt != nil && e.Receipt.State == statemachine.Rejected {
		if e.Cause != nil && e.Cause.Code == CodeNotSent {
			return ErrNotSent
		}
		return ErrRejected
	}
	return ErrOutcomeUnknown
}

// Error describes the OutcomeError in one line.
func (e *OutcomeError) Error() string {
	var b strings.Builder
	b.WriteString("ledger: ")
	if r := e.Receipt; r != nil {
		fmt.Fprintf(&b, "receipt %d (%s %s) is %s: ", r.ID, r.Operation, r.IdempotencyKey, r.State)
	}
	b.WriteString(e.sentinel().Error())
	if c := e.Cause; c != nil {
		b.WriteString(": " + c.Code)
		if c.Message != "" {
			b.WriteString(": " + c.Message)
		}
		if c.Retryable {
			b.WriteString(" (retryable)")
		}
	}
	if e.note != "" {
		b.WriteString(": " + e.note)
	}
	return b.String()
}

// Unwrap returns the sentinel for the receipt's state and the underlying error.
func (e *OutcomeError) Unwrap() []error {
	if e.Err == nil {
		return []error{e.sentinel()}
	}
	return []error{e.sentinel(), e.Err}
}

// Do makes the call req means, as intent in, through the ledger:
//
//  1. PlanAndSubmit records the intent and that the request is about to
//     leave, in one statement and one commit (both history events); for
//     a key the ledger already knows it records nothing, and Do carries on
//     from that receipt: a planned one (an earlier call stopped before its
//     submit) is submitted on its own, one past planned is replayed, one
//     that may be retried is followed by its next attempt;
//  2. only then is req sent, under ctx (which replaces req's context),
//     within the receipt's send deadline or not at all (below);
//  3. the receipt is settled from the exchange: Classify, then
//     DefaultClassify. Settling uses a context detached from ctx, so a
//     call whose ctx expired is still recorded.
//
// The send deadline (SPEC §5a) is the receipt's MaxSendDelay, counted on
// the local monotonic clock from a moment taken before the submit
// statement is issued; the database stamps submitted_at after that moment,
// so the local deadline never ends later than the receipt's SendDeadline.
// A request for which the transport has no connection by then (pool wait,
// DNS, dial, TLS) is canceled, nothing having been written, and the receipt
// is rejected as not_sent, retryable (the error matches ErrNotSent and
// ErrSendDeadline). On an HTTP/1 connection, Do also sets the connection's
// write deadline to the send deadline when it gets the connection (and
// clears it once the request is written, so the pooled connection stays
// reusable): no byte of the request is written after the deadline, and a
// request cut short by it is outcome_unknown like any failure after the
// connection was had. An HTTP/2 connection is shared by many requests, so
// Do never touches it: there, the timer stays armed until the request is
// written whole. Canceled before its headers were written, it is not_sent
// as above; canceled after (a body still being written at the deadline),
// it is outcome_unknown with code send_deadline_mid_write, and its body
// yields nothing more from the deadline on. A request written whole before
// the deadline is never canceled by it, however late its answer. (Unencrypted
// HTTP/2 is recognized only when HTTP is an *http.Transport whose
// Protocols enable it; a custom RoundTripper that speaks unencrypted HTTP/2
// must not be used here.)
//
// Do never follows a redirect: the request is sent with a shallow copy of
// HTTP whose CheckRedirect returns http.ErrUseLastResponse, and the 3xx is
// classified (see DefaultClassify). Following it would send another
// request, with the call's headers, whose status would then be taken for
// the call's.
//
// in.Method and in.Target default to req's method and URL path (never its
// query or user info); set Target when the path itself holds a secret.
// Only in.Payload (normalized, secret fields redacted) is stored: request
// headers, credentials and the URL's query never reach the database, and
// error messages are recorded with the URL's query and user info removed.
//
// A key whose receipt is already past planned is not sent again: Do
// returns that receipt with Replayed set; nil error if it succeeded, an
// OutcomeError otherwise. A safe_to_retry receipt is followed: Do plans the
// next attempt with Client.Retry and sends that. When the database refuses
// that retry because the receipt's proof rests on the API's native key and
// its retention has passed (ErrKeyRetentionPassed), Do sends nothing,
// requests a fresh proof (Client.RequestFreshProof) and says so: run the
// step again once the reconciler has settled the receipt anew.
//
// The error is nil exactly when the receipt succeeded; an OutcomeError
// when it settled otherwise (Result holds the receipt and any response);
// and otherwise an error from planning or submitting (DuplicateError,
// ErrKeyConflict, ErrInvalidIntent, ErrInvalidKey, ...) with nothing sent.
// A DuplicateError means the intent is unresolved in another receipt:
// nothing was recorded for a new key, and nothing is sent. For a key
// planned earlier it means another receipt of the same intent was
// submitted since: the receipt stays planned (Result.Receipt). Do always
// closes req.Body.
//
// When the response arrives after someone else (the reconciler's orphan
// sweep) moved the submitted receipt on to outcome_unknown, reconciling or
// manual_review, Do cannot settle it, so it records what it observed with
// Client.RecordLateOutcome: the reconciler settles the receipt from it (a
// 2xx with its external id is kept), and the OutcomeError says so. When
// the reconciler already settled it safe_to_retry, Do records the late
// answer whatever it is: a success or an answer leaving the effect
// unknown (a 5xx, a timeout) shows the original request outlived the
// window, and the database then refuses every retry of the receipt; the
// OutcomeError says so. A retry planned before that late answer was
// recorded is refused at its submit (ErrRetryRefused): it stays planned
// and nothing is sent.
//
// The transport never sends the request twice: Do sends it with GetBody
// cleared and a body-less request with an empty body net/http does not
// take for replayable (see noReplay for what that changes on the wire),
// and should the transport still get a second connection for it after a
// write began, Do refuses it (on HTTP/1 nothing is written on it) and the
// receipt is outcome_unknown with code transport_resend.
func (c *Caller) Do(ctx context.Context, in Intent, req *http.Request) (*Result, error) {
	if err := c.check(&in, req); err != nil {
		closeBody(req)
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		closeBody(req)
		return nil, fmt.Errorf("ledger: plan %s: nothing recorded, nothing sent: %w", in.IdempotencyKey, err)
	}
	// A new key's receipt is planned and submitted in one statement, under
	// the write context (its outcome must be known: a submitted receipt is
	// one the caller may send). The send deadline starts before that
	// statement: the database stamps submitted_at later than this, so
	// t0+delay is never later than the receipt's SendDeadline.
	t0 := time.Now()
	wctx, cancel := c.writeContext(ctx)
	r, err := c.Ledger.PlanAndSubmit(wctx, in)
	cancel()
	// fresh: submitted by this call, so this call sends it. A known key's
	// receipt (ErrKnownKey) is carried on from its state below.
	fresh := err == nil
	if errors.Is(err, ErrKnownKey) {
		err = c.known(ctx, r)
	}
	var prev *Receipt
	// The same step run again after a proven absence or a retryable
	// rejection is the next attempt of it.
	for err == nil && !fresh && (r.State == statemachine.SafeToRetry || r.Retryable) {
		prev = r
		t0 = time.Now()
		wctx, cancel = c.writeContext(ctx)
		r, err = c.Ledger.retry(wctx, prev, in, true)
		cancel()
		fresh = err == nil
		if errors.Is(err, ErrKnownKey) {
			err = nil
		}
	}
	if prev != nil && errors.Is(err, ErrKeyRetentionPassed) {
		closeBody(req)
		return c.freshProof(ctx, prev, err)
	}
	var dup *DuplicateError
	if errors.As(err, &dup) && (dup.Existing.IdempotencyKey == in.IdempotencyKey ||
		(prev != nil && dup.Existing.RetryOf == prev.ID)) {
		// A concurrent call planned and submitted this very receipt
		// between the key lookup and the duplicate guard of plan: it is
		// ours, not a duplicate.
		closeBody(req)
		if err := c.known(ctx, dup.Existing); err != nil {
			return nil, err
		}
		return c.replay(ctx, dup.Existing)
	}
	var nr *NotReplicatedError
	if errors.As(err, &nr) {
		closeBody(req)
		return c.notReplicated(ctx, nr, err)
	}
	if err != nil {
		closeBody(req)
		return nil, err
	}
	sub := r
	if !fresh {
		if r.State != statemachine.Planned {
			closeBody(req)
			return c.replay(ctx, r)
		}
		// Planned by an earlier call that stopped before its submit: the
		// move planned -> submitted on its own.
		if err := ctx.Err(); err != nil {
			closeBody(req)
			return &Result{Receipt: r}, fmt.Errorf("ledger: receipt %d not submitted, nothing sent: %w", r.ID, err)
		}
		t0 = time.Now()
		wctx, cancel = c.writeContext(ctx)
		sub, err = c.Ledger.Submit(wctx, r)
		cancel()
		var dupSub *DuplicateError
		if errors.As(err, &dupSub) {
			// Another receipt of this intent went out since ours was planned.
			closeBody(req)
			return &Result{Receipt: r}, fmt.Errorf("ledger: receipt %d not submitted, nothing sent: %w", r.ID, err)
		}
		if errors.Is(err, ErrKeyRetentionPassed) {
			// Planned while the native key was retained, submitted after.
			closeBody(req)
			gctx, cancel := c.writeContext(ctx)
			p, gerr := c.Ledger.Get(gctx, r.RetryOf)
			cancel()
			if gerr != nil {
				return &Result{Receipt: r}, fmt.Errorf("ledger: receipt %d not submitted, nothing sent: %w (and reading receipt %d: %w)",
					r.ID, err, r.RetryOf, gerr)
			}
			return c.freshProof(ctx, p, err)
		}
		if errors.Is(err, ErrRetryRefused) {
			// A late answer to the receipt this one retries was recorded
			// since the retry was planned: its effect exists or may exist.
			closeBody(req)
			return &Result{Receipt: r}, fmt.Errorf("ledger: receipt %d (a retry of receipt %d) not submitted, nothing sent, and no retry will be sent: "+
				"the receipt it retries received a late answer after it was settled: %w", r.ID, r.RetryOf, err)
		}
		if errors.Is(err, ErrStateConflict) {
			// Another call with the same key submitted it first: it is in flight there.
			closeBody(req)
			if cur, gerr := c.Ledger.Get(ctx, r.ID); gerr == nil {
				return c.replay(ctx, cur)
			}
			return &Result{Receipt: r}, err
		}
		if errors.As(err, &nr) {
			closeBody(req)
			return c.notReplicated(ctx, nr, err)
		}
		if err != nil {
			closeBody(req)
			return &Result{Receipt: r}, fmt.Errorf("ledger: receipt %d: submit failed, nothing sent: %w", r.ID, err)
		}
	}

	delay := sub.MaxSendDelay
	if delay <= 0 {
		delay = DefaultMaxSendDelay
	}
	ex, stats := c.send(ctx, req, t0.Add(delay), delay)
	v, overridden := c.safeClassify(ex)
	if c.Answered != nil && ex.Response != nil {
		actx, cancel := c.writeContext(ctx)
		c.Answered(actx, sub, ex, v)
		cancel()
	}
	res := &Result{Receipt: sub, Response: ex.Response, Body: ex.Body, Verdict: v, Sent: ex.Sent}
	settled, cause, detail, err := c.settle(ctx, sub, ex, v, overridden, stats)
	if err != nil {
		// The receipt stays submitted (or was moved by someone else, e.g.
		// the reconciler's orphan sweep): its outcome is unknown to the
		// ledger whatever the response said.
		note := fmt.Sprintf("recording the outcome (%s) failed: %v", v.Outcome, err)
		var ce *ConflictError
		errors.As(err, &ce)
		switch {
		case ce != nil && movedOnBySweep(ce.Actual):
			note = c.recordLate(ctx, sub, ce.Actual, ex, v, detail)
		case ce != nil && ce.Actual == statemachine.SafeToRetry:
			// The reconciler proved an absence, yet the original
			// request was still alive: any answer (a success, or a
			// 502 or timeout that leaves the effect unknown) shows a
			// declared lifetime or window is too short. Recorded, a
			// late succeeded or outcome_unknown makes the database
			// refuse any retry of the receipt (reconciler.retry_error);
			// a late rejection proves no effect.
			note = c.recordLate(ctx, sub, ce.Actual, ex, v, detail)
		}
		if ce == nil {
			res.Unrecorded = &Unrecorded{Receipt: sub, Verdict: v, HTTPStatus: ex.Status(), Detail: detail}
		}
		gctx, cancel := c.writeContext(ctx)
		if cur, gerr := c.Ledger.Get(gctx, sub.ID); gerr == nil {
			res.Receipt = cur
		}
		cancel()
		return res, &OutcomeError{Receipt: res.Receipt, Cause: cause, Err: errors.Join(ex.Err, err), note: note}
	}
	res.Receipt = settled
	if settled.State == statemachine.Succeeded {
		return res, nil
	}
	return res, &OutcomeError{Receipt: settled, Cause: cause, Err: ex.Err}
}
