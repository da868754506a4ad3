package ledger

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/receiptledger/reconciler/internal/contentcoding"
	"github.com/receiptledger/reconciler/internal/sanitize"
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
			"every retry of the receipt: no retry will be sent, a human must look. The dependency's declared send deadline, "+
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

// The send guard of one request: who got there first, the send deadline's
// timer or the request.
const (
	guardWaiting int32 = iota // no connection yet: the timer cancels, nothing was written
	guardWriting              // a write began on a connection without a write deadline (HTTP/2): the timer cuts it
	guardHeld                 // an HTTP/1 connection bounded by a write deadline, or the request fully written
	guardExpired              // the timer fired first and canceled the request
)

var (
	// errTransportResend is the cause of a request the transport tried to
	// send again on another connection after a write had begun.
	errTransportResend = errors.New("the transport tried to send the request again on a new connection after writing it on another; refused, nothing was written on the new one")
	// errCutMidWrite is the cause of a request the send deadline cut
	// after its writing began and before it was whole.
	errCutMidWrite = errors.New("the send deadline passed while the request was being written (its headers were sent, the rest was not): canceled, nothing more was written")
)

// sendStats is what the trace saw, kept as evidence.
type sendStats struct {
	conns   atomic.Int32 // GotConn events: more than one means the transport retried
	blocked atomic.Int32 // HTTP/1 connections on which Do let nothing be written (write deadline in the past)
	h1Given atomic.Bool  // the request was handed to an HTTP/1 connection Do did not block
	reused  atomic.Bool
	wrote   atomic.Bool // a write hook fired
	http2   atomic.Bool // a connection was (or may be) HTTP/2
	guard   atomic.Int32
	// deadline is set when the send deadline canceled the request or
	// blocked its writes; midWrite when it cut a request being written.
	deadline atomic.Bool
	midWrite atomic.Bool
	// resent is set when the transport tried to send the request again
	// after a write had begun, and Do refused it.
	resent atomic.Bool
	// h1 is the HTTP/1 connection whose write deadline Do set, to clear.
	h1 atomic.Pointer[net.Conn]
}

// sent reports whether any byte may have been written. From GotConn on it
// may, except on an HTTP/1 connection whose write deadline had already
// passed when the request got it: every write on it fails before the
// system call, and the write hooks then report bytes that only reached the
// transport's buffer.
func (s *sendStats) sent() bool {
	if n := s.conns.Load(); n > 0 {
		return n > s.blocked.Load()
	}
	return s.wrote.Load()
}

// pastDeadline is a write deadline that has passed: every write on a
// connection carrying it fails before the system call.
var pastDeadline = time.Unix(1, 0)

// send writes req under ctx with a trace and reads the whole response body.
//
// "Sent" is decided conservatively: from GotConn on, the request may have
// been handed to the connection's writer, and once a write has started,
// bytes may be on the wire even if the write then fails (WroteRequest
// reports an error for a partial write just as for none; a successful
// write says nothing about delivery either). Only a failure before the
// transport had a connection (DNS, dial, TLS handshake, proxy, a wrapping
// RoundTripper's own error such as missing credentials) proves that no
// byte left. Mistaking "not sent" for "sent" costs a readback; the reverse
// would allow a duplicate.
//
// The send deadline (see Do) is enforced here: a timer cancels the request
// at deadline unless the transport got an HTTP/1 connection first (whose
// write deadline then bounds every write) or the request was written
// whole. On a connection without a write deadline (HTTP/2) a request
// whose writing began but did not end by the deadline is canceled then
// (outcome_unknown: its headers left), and its body reads fail from then
// on, so nothing more of it is written.
//
// The transport never sends the request twice (see noReplay); should it
// try, a second connection obtained after a write began is refused: on
// HTTP/1 its write deadline is set in the past, so nothing is written on
// it, and the request is canceled.
func (c *Caller) send(ctx context.Context, req *http.Request, deadline time.Time, delay time.Duration) (Exchange, *sendStats) {
	st := &sendStats{}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	wrote := func() {
		st.wrote.Store(true)
		st.guard.CompareAndSwap(guardWaiting, guardWriting)
	}
	trace := &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			earlier := st.conns.Add(1) > 1
			if info.Reused {
				st.reused.Store(true)
			}
			h2 := info.Conn == nil || c.mayBeHTTP2(info.Conn)
			if h2 {
				st.http2.Store(true)
			}
			if earlier && (st.wrote.Load() || st.h1Given.Load()) {
				// The transport is retrying on another connection a
				// request it may have written on the first: refuse.
				st.resent.Store(true)
				if !h2 && info.Conn.SetWriteDeadline(pastDeadline) == nil {
					conn := info.Conn
					st.h1.Store(&conn)
					st.blocked.Add(1)
				}
				cancel(errTransportResend)
				return
			}
			if h2 {
				// A shared connection: leave it alone; the timer stays
				// armed until the request is written whole.
				return
			}
			// HTTP/1: the connection is this request's alone until it
			// is written, and GotConn runs before the request is handed
			// to the connection's writer.
			expired := !time.Now().Before(deadline)
			if info.Conn.SetWriteDeadline(deadline) != nil {
				// Unbounded writes: the timer stays armed as on HTTP/2.
				st.h1Given.Store(true)
				return
			}
			conn := info.Conn
			st.h1.Store(&conn)
			if expired {
				// Every write on it fails without a system call: nothing
				// of this request can leave on it.
				st.blocked.Add(1)
				st.deadline.Store(true)
				cancel(ErrSendDeadline)
				return
			}
			st.h1Given.Store(true)
			st.guard.CompareAndSwap(guardWaiting, guardHeld)
		},
		WroteHeaderField: func(string, []string) { wrote() },
		WroteHeaders:     wrote,
		Wait100Continue:  wrote,
		WroteRequest: func(httptrace.WroteRequestInfo) {
			wrote()
			// Written whole (or failed): the timer must not cut it now.
			st.guard.CompareAndSwap(guardWriting, guardHeld)
			if conn := st.h1.Load(); conn != nil {
				// The pooled connection must not keep this request's
				// deadline.
				_ = (*conn).SetWriteDeadline(time.Time{})
			}
		},
	}
	out := req.Clone(httptrace.WithClientTrace(sctx, trace))
	c.noReplay(out, st)
	if !time.Now().Before(deadline) {
		// The submit itself took the whole delay: send nothing.
		st.deadline.Store(true)
		closeBody(out)
		return Exchange{Request: out, Err: fmt.Errorf("%w (%v after submit): the submit took it all", ErrSendDeadline, delay)}, st
	}
	timer := time.AfterFunc(time.Until(deadline), func() {
		switch {
		case st.guard.CompareAndSwap(guardWaiting, guardExpired):
			st.deadline.Store(true)
			cancel(ErrSendDeadline)
		case st.guard.CompareAndSwap(guardWriting, guardExpired):
			st.deadline.Store(true)
			st.midWrite.Store(true)
			cancel(errCutMidWrite)
		}
	})
	// Answered or failed: from then on the deadline no longer concerns a
	// request written whole (it must not cut short the reading of a
	// response, whatever the transport reported). One still being
	// written (an HTTP/2 server may answer before the body ends) stays
	// under the timer until its body read is done.
	disarm := func() {
		timer.Stop()
		st.guard.CompareAndSwap(guardWaiting, guardHeld)
		st.guard.CompareAndSwap(guardWriting, guardHeld)
	}
	resp, err := c.client().Do(out)
	if err != nil || st.guard.Load() != guardWriting {
		disarm()
	}
	switch {
	case err != nil && st.resent.Load():
		err = fmt.Errorf("%w: %w", errTransportResend, err)
	case err != nil && st.midWrite.Load():
		err = fmt.Errorf("%w (%v after submit): %w", errCutMidWrite, delay, err)
	case err != nil && st.deadline.Load():
		if st.sent() {
			err = fmt.Errorf("canceled at the send deadline (%v after submit) after the transport had a connection: %w", delay, err)
		} else {
			err = fmt.Errorf("%w (%v after submit): no connection by then, nothing written: %w", ErrSendDeadline, delay, err)
		}
	}
	ex := Exchange{Request: out, Response: resp, Err: err}
	if resp != nil && err == nil {
		if c.DecodeContent {
			ex.Err = contentcoding.Decode(resp)
		}
		if ex.Err == nil {
			ex.Body, ex.Err = readBody(resp.Body, c.maxBody())
		}
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(ex.Body))
		disarm()
		if ex.Err != nil && st.midWrite.Load() {
			ex.Err = fmt.Errorf("%w (%v after submit): %w", errCutMidWrite, delay, ex.Err)
		}
	}
	ex.Sent = resp != nil || st.sent()
	return ex, st
}

// noReplay makes out a request net/http never sends twice on its own.
// net/http's Transport resends a request on a new connection, within one
// RoundTrip, when a reused HTTP/1 connection fails after the request was
// written and the request is "replayable" (its body is nil, NoBody or has
// GetBody, and its method is GET, HEAD, OPTIONS or TRACE or it carries an
// Idempotency-Key or X-Idempotency-Key header); its HTTP/2 transport
// resends a request whose body is nil, NoBody or has GetBody after some
// stream errors (a PROTOCOL_ERROR reset by the server among them, which
// does not prove the server ignored the request). So:
//
//   - GetBody is cleared: a body cannot be rewound, so it is never sent
//     again (and a 307/308 redirect could not be replayed: Do follows
//     none);
//   - a body-less request gets an empty, non-nil body without GetBody
//     (neither transport resends it). On the wire: for GET, HEAD, DELETE,
//     OPTIONS (methods net/http probes) nothing changes, no body and no
//     Content-Length; over HTTP/2 the headers are followed by an empty
//     DATA frame ending the stream; over HTTP/1 a POST, PUT, PATCH (or
//     another method) is sent with "Transfer-Encoding: chunked" and an
//     empty chunked body instead of "Content-Length: 0";
//   - except that when the request can only go over HTTP/1 (an http URL,
//     sent by net/http's own Transport without unencrypted HTTP/2) and its
//     method is not one net/http replays by itself, the body stays nil so
//     that "Content-Length: 0" is kept, and the Idempotency-Key and
//     X-Idempotency-Key headers are stored under their lower-case names,
//     which net/http does not look for (header names are case-insensitive
//     on the wire, and HTTP/2 lower-cases them anyway).
//
// A body that may go over HTTP/2 is read through sendBody, which fails
// once the send deadline cut the request.
func (c *Caller) noReplay(out *http.Request, st *sendStats) {
	out.GetBody = nil
	h1 := c.onlyHTTP1(out.URL)
	if out.Body != nil && out.Body != http.NoBody {
		if !h1 {
			out.Body = &sendBody{ReadCloser: out.Body, st: st}
		}
		return
	}
	if h1 && !replayableMethod(out.Method) {
		out.Body, out.ContentLength = nil, 0
		for _, k := range [...]string{"Idempotency-Key", "X-Idempotency-Key"} {
			if v, ok := out.Header[k]; ok {
				delete(out.Header, k)
				lk := strings.ToLower(k)
				out.Header[lk] = append(out.Header[lk], v...)
			}
		}
		return
	}
	out.Body, out.ContentLength = emptyBody{}, 0
}

// replayableMethod reports whether net/http takes a body-less request of
// method as idempotent whatever its headers.
func replayableMethod(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// emptyBody is the body of a body-less request: empty, but neither nil
// nor http.NoBody, so net/http never takes the request for replayable.
type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

// sendBody is a request body whose reads fail once the send deadline cut
// the request being written (on HTTP/2; on HTTP/1 the connection's write
// deadline does): no byte of it is produced after the deadline.
type sendBody struct {
	io.ReadCloser
	st *sendStats
}

func (b *sendBody) Read(p []byte) (int, error) {
	if b.st.guard.Load() == guardExpired {
		return 0, errCutMidWrite
	}
	return b.ReadCloser.Read(p)
}

// client returns the HTTP client Do sends with: c.HTTP (or the default)
// with redirects turned off.
func (c *Caller) client() *http.Client {
	hc := http.DefaultClient
	if c.HTTP != nil {
		hc = c.HTTP
	}
	cp := *hc
	cp.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &cp
}

// mayBeHTTP2 reports whether conn may carry HTTP/2, whose connection is
// shared by concurrent requests: a TLS connection that negotiated "h2", or
// a plain one when the transport is configured for unencrypted HTTP/2.
func (c *Caller) mayBeHTTP2(conn net.Conn) bool {
	if tc, ok := conn.(*tls.Conn); ok {
		return tc.ConnectionState().NegotiatedProtocol == "h2"
	}
	tr, ok := c.transport()
	return ok && tr.Protocols != nil && tr.Protocols.UnencryptedHTTP2()
}

// onlyHTTP1 reports whether a request to u can only be sent over HTTP/1:
// an http URL sent by net/http's own Transport without unencrypted HTTP/2.
// Any other RoundTripper may speak HTTP/2.
func (c *Caller) onlyHTTP1(u *url.URL) bool {
	tr, ok := c.transport()
	return ok && u != nil && strings.EqualFold(u.Scheme, "http") &&
		(tr.Protocols == nil || !tr.Protocols.UnencryptedHTTP2())
}

// transport returns the RoundTripper Do sends with as an *http.Transport,
// when it is one.
func (c *Caller) transport() (*http.Transport, bool) {
	var rt http.RoundTripper
	if c.HTTP != nil {
		rt = c.HTTP.Transport
	}
	if rt == nil {
		rt = http.DefaultTransport
	}
	tr, ok := rt.(*http.Transport)
	return tr, ok
}

func (c *Caller) maxBody() int64 {
	if c.MaxResponseBytes > 0 {
		return c.MaxResponseBytes
	}
	return DefaultMaxResponseBytes
}

func readBody(r io.Reader, limit int64) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return body, err
	}
	if int64(len(body)) > limit {
		return body[:limit], fmt.Errorf("%w: more than %d bytes", ErrResponseTooLarge, limit)
	}
	return body, nil
}

// safeClassify is classify turning a panic of a Classify override or an
// ExternalID extractor into an outcome_unknown verdict that carries the
// panic (sanitized): the request was sent, so its effect is unknown, and the
// receipt must not stay submitted.
func (c *Caller) safeClassify(ex Exchange) (v Verdict, overridden bool) {
	defer func() {
		if p := recover(); p != nil {
			msg, _ := sanitize.Text(fmt.Sprintf("Classify panicked: %v", p), maxMessageBytes)
			v, overridden = Verdict{Outcome: OutcomeUnknown, Code: CodeClassifyPanic, Message: msg}, true
		}
	}()
	return c.classify(ex)
}

// classify applies the override, then the default, and completes the
// verdict: codes and messages default, and a succeeded verdict gets its
// external id from the body.
func (c *Caller) classify(ex Exchange) (v Verdict, overridden bool) {
	def := DefaultClassify(ex)
	v = def
	if c.Classify != nil {
		if ov, ok := c.Classify(ex); ok {
			v, overridden = ov, true
			if !v.Outcome.Valid() {
				v = Verdict{Outcome: OutcomeUnknown, Code: CodeInvalidVerdict,
					Message: fmt.Sprintf("Classify returned outcome %q", ov.Outcome)}
			}
			if v.Outcome != OutcomeSucceeded {
				if v.Code == "" {
					v.Code = def.Code
				}
				if v.Code == "" {
					v.Code = statusCode(ex)
				}
				if v.Message == "" {
					v.Message = def.Message
				}
				if v.Message == "" {
					v.Message = statusMessage(ex)
				}
			}
		}
	}
	if v.Outcome == OutcomeSucceeded && v.ExternalID == "" {
		extract := c.ExternalID
		if extract == nil {
			extract = defaultExternalID
		}
		id, err := extract(ex.Body)
		if err != nil {
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: "external id: " + err.Error()}, overridden
		}
		v.ExternalID = id
	}
	return v, overridden
}

// DefaultClassify is the classification of SPEC §4:
//
//   - nothing sent (any failure before the transport had a connection,
//     including the send deadline passing first): rejected, retryable,
//     not_sent;
//   - sent, then no response (timeout, reset, EOF, canceled): outcome_unknown;
//   - 2xx whose body was read whole and, when it is or looks like JSON,
//     parses: succeeded; otherwise outcome_unknown (truncated_body,
//     malformed_body, body_too_large);
//   - 3xx: outcome_unknown. Do follows no redirect, so the request was
//     delivered and answered with one; whether it took effect is unknown.
//     A 303 See Other to a POST, PUT, PATCH or DELETE usually means the
//     server did the work and points at the result: the message says the
//     effect likely exists. The Location (without user info, query or
//     fragment) is recorded in the detail's extra as "location";
//   - 408: outcome_unknown (gateways and proxies send it after they
//     forwarded the request, so it may have taken effect): not retryable;
//   - 429: rejected, retryable, rate_limited; 425: rejected, retryable
//     (the server refused to process early data); other 4xx: rejected;
//   - 5xx (500, 502, 503, 504, ...), and any other status: outcome_unknown.
func DefaultClassify(ex Exchange) Verdict {
	if ex.Response == nil {
		if ex.Err == nil {
			return Verdict{Outcome: OutcomeUnknown, Code: CodeTransportError, Message: "no response and no error"}
		}
		msg := safeErrorText(ex.Err, ex.Request)
		if !ex.Sent {
			return Verdict{Outcome: OutcomeRejected, Code: CodeNotSent, Message: msg, Retryable: true}
		}
		return Verdict{Outcome: OutcomeUnknown, Code: transportCode(ex.Err), Message: msg}
	}
	status := ex.Response.StatusCode
	switch {
	case status >= 200 && status <= 299:
		switch {
		case errors.Is(ex.Err, ErrResponseTooLarge):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeBodyTooLarge, Message: ex.Err.Error()}
		case errors.Is(ex.Err, ErrUndecodableBody):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: fmt.Sprintf("%s with a body that cannot be read: %s", statusMessage(ex), safeErrorText(ex.Err, ex.Request))}
		case ex.Err != nil:
			return Verdict{Outcome: OutcomeUnknown, Code: CodeTruncatedBody,
				Message: fmt.Sprintf("%s after %d bytes: %s", statusMessage(ex), len(ex.Body), safeErrorText(ex.Err, ex.Request))}
		case looksJSON(ex.Response.Header.Get("Content-Type"), ex.Body) && !json.Valid(ex.Body):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: fmt.Sprintf("%s with a body of %d bytes that is not valid JSON", statusMessage(ex), len(ex.Body))}
		}
		return Verdict{Outcome: OutcomeSucceeded}
	case status >= 300 && status <= 399:
		msg := statusMessage(ex) + ": redirect not followed; the request was delivered and answered with a redirect, its effect is unknown"
		if status == http.StatusSeeOther && ex.Request != nil && effectMethod(ex.Request.Method) {
			msg = statusMessage(ex) + " to a " + strings.ToUpper(ex.Request.Method) +
				": the effect likely exists (the server usually did the work and points at the result); redirect not followed"
		}
		return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex), Message: msg}
	case status == http.StatusRequestTimeout:
		return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex),
			Message: statusMessage(ex) + ": gateways send it after forwarding the request, so its effect is unknown"}
	case status == http.StatusTooManyRequests:
		return Verdict{Outcome: OutcomeRejected, Code: CodeRateLimited, Message: statusMessage(ex), Retryable: true}
	case status == http.StatusTooEarly:
		return Verdict{Outcome: OutcomeRejected, Code: statusCode(ex), Message: statusMessage(ex), Retryable: true}
	case status >= 400 && status <= 499:
		return Verdict{Outcome: OutcomeRejected, Code: statusCode(ex), Message: statusMessage(ex)}
	}
	return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex), Message: statusMessage(ex)}
}

// effectMethod reports whether a 303 answering method points at the
// result of an effect.
func effectMethod(method string) bool {
	switch strings.ToUpper(method) {
	case http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		return true
	}
	return false
}

// redirectLocation returns a 3xx response's Location resolved against the
// request's URL, without user info, query or fragment, bounded; "" when
// there is none.
func redirectLocation(ex Exchange) string {
	raw := ex.Response.Header.Get("Location")
	if raw == "" {
		return ""
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "[unparseable Location]"
	}
	if ex.Request != nil && ex.Request.URL != nil {
		u = ex.Request.URL.ResolveReference(u)
	}
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	loc, _ := sanitize.Text(u.String(), maxMessageBytes)
	return loc
}

func statusCode(ex Exchange) string {
	if ex.Response == nil {
		return CodeTransportError
	}
	return "http_" + strconv.Itoa(ex.Response.StatusCode)
}

func statusMessage(ex Exchange) string {
	if ex.Response == nil {
		return ""
	}
	s := ex.Response.StatusCode
	return strings.TrimSpace(strconv.Itoa(s) + " " + http.StatusText(s))
}

func transportCode(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errTransportResend):
		return CodeTransportResend
	case errors.Is(err, errCutMidWrite):
		return CodeSendDeadlineMidWrite
	case errors.Is(err, context.Canceled):
		return CodeCanceled
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return CodeTimeout
	case errors.Is(err, syscall.ECONNRESET):
		return CodeConnectionReset
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return CodeConnectionClosed
	}
	return CodeTransportError
}

// looksJSON reports whether a body should parse as JSON: its media type is
// JSON, or it starts like a JSON object or array.
func looksJSON(contentType string, body []byte) bool {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return false
	}
	if mt, _, err := mime.ParseMediaType(contentType); err == nil &&
		(mt == "application/json" || strings.HasSuffix(mt, "+json")) {
		return true
	}
	return trimmed[0] == '{' || trimmed[0] == '['
}

const maxMessageBytes = 512

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

// ExternalIDAt returns an extractor, for Caller.ExternalID, of the string
// or number at pointer (RFC 6901, e.g. "/data/id") in a JSON body. A body
// that is empty or lacks the pointer's target (or holds null there) has no
// id; a body that is not JSON, or a target that is neither a string nor a
// number, is an error.
func ExternalIDAt(pointer string) (func(body []byte) (string, error), error) {
	tokens, err := parsePointer(pointer)
	if err != nil {
		return nil, err
	}
	return func(body []byte) (string, error) {
		if len(bytes.TrimSpace(body)) == 0 {
			return "", nil
		}
		if !json.Valid(body) {
			return "", errors.New("response body is not valid JSON")
		}
		raw, ok := lookup(body, tokens)
		if !ok {
			return "", nil
		}
		id, ok := scalarID(raw)
		if !ok {
			return "", fmt.Errorf("the value at %q is not a string or number", pointer)
		}
		return id, nil
	}, nil
}

// defaultExternalID is the top-level "id" of a JSON object; any other body
// (not JSON, not an object, no scalar "id") has none. Whether a 2xx body
// that looks like JSON parses is the classification's concern.
func defaultExternalID(body []byte) (string, error) {
	if !json.Valid(body) {
		return "", nil
	}
	raw, ok := lookup(body, []string{"id"})
	if !ok {
		return "", nil
	}
	id, _ := scalarID(raw)
	return id, nil
}

func parsePointer(p string) ([]string, error) {
	if p == "" {
		return nil, nil
	}
	if !strings.HasPrefix(p, "/") {
		return nil, fmt.Errorf("ledger: JSON pointer %q does not start with /", p)
	}
	parts := strings.Split(p[1:], "/")
	for i, t := range parts {
		for j := 0; j < len(t); j++ {
			if t[j] == '~' && (j+1 == len(t) || (t[j+1] != '0' && t[j+1] != '1')) {
				return nil, fmt.Errorf("ledger: JSON pointer %q: bad escape in %q", p, t)
			}
		}
		parts[i] = strings.ReplaceAll(strings.ReplaceAll(t, "~1", "/"), "~0", "~")
	}
	return parts, nil
}

// lookup resolves tokens in a valid JSON document.
func lookup(doc []byte, tokens []string) (json.RawMessage, bool) {
	cur := json.RawMessage(doc)
	for _, tok := range tokens {
		trimmed := bytes.TrimSpace(cur)
		if len(trimmed) == 0 {
			return nil, false
		}
		switch trimmed[0] {
		case '{':
			var obj map[string]json.RawMessage
			if json.Unmarshal(trimmed, &obj) != nil {
				return nil, false
			}
			next, ok := obj[tok]
			if !ok {
				return nil, false
			}
			cur = next
		case '[':
			var arr []json.RawMessage
			if json.Unmarshal(trimmed, &arr) != nil {
				return nil, false
			}
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(arr) || (len(tok) > 1 && tok[0] == '0') {
				return nil, false
			}
			cur = arr[i]
		default:
			return nil, false
		}
	}
	cur = bytes.TrimSpace(cur)
	if string(cur) == "null" {
		return nil, false
	}
	return cur, true
}

// scalarID renders a JSON string (unquoted) or number (its literal text).
func scalarID(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 {
		return "", false
	}
	switch c := raw[0]; {
	case c == '"':
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return "", false
		}
		return s, true
	case c == '-' || (c >= '0' && c <= '9'):
		return string(raw), true
	}
	return "", false
}

func closeBody(req *http.Request) {
	if req != nil && req.Body != nil {
		req.Body.Close()
	}
}
