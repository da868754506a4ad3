package ledger

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/receiptledger/reconciler/internal/redact"
	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/statemachine"
)

// Errors returned by the client. Each refusal wraps one of them; test with
// errors.Is, and use errors.As for the typed forms that carry details.
var (
	// ErrNotFound means no receipt has the given id.
	ErrNotFound = errors.New("receipt not found")
	// ErrDuplicateIntent means the same intent is unresolved in an earlier
	// receipt of the same dependency; see DuplicateError.
	ErrDuplicateIntent = errors.New("duplicate intent while an earlier outcome is unresolved")
	// ErrKeyConflict means an idempotency key already names a receipt with
	// another intent.
	ErrKeyConflict = errors.New("idempotency key reused for another intent")
	// ErrStateConflict means another writer moved the receipt first; see
	// ConflictError.
	ErrStateConflict = errors.New("receipt moved by another writer")
	// ErrOutcomeUnknown means the request was sent and its answer was lost:
	// do not retry; the reconciler will settle the receipt.
	ErrOutcomeUnknown = errors.New("outcome unknown")
	// ErrNotSent means the call failed before any byte was written; the
	// receipt is rejected with retryable set, and a retry is safe.
	ErrNotSent = errors.New("request not sent")
	// ErrInvalidIntent means the intent is missing a field, its payload
	// was refused by the fingerprint, its MaxSendDelay is out of range, or
	// a retry's payload differs from the attempt it retries.
	ErrInvalidIntent = errors.New("invalid intent")
	// ErrInvalidKey means the database cannot take the idempotency key: a
	// first attempt's key ends in "#<digits>" (the suffix that numbers
	// retries, see LogicalKey) or is longer than MaxKeyBytes, or a retry's
	// key is not "<logical key>#<attempt>" (SQLSTATE RL007).
	ErrInvalidKey = errors.New("invalid idempotency key")
	// ErrSendDeadline means the transport had no connection for the
	// request by its send deadline (Receipt.SendDeadline, measured locally
	// from before the submit): the request was canceled before any byte
	// was written, and the receipt is rejected as not_sent, retryable.
	// An OutcomeError carrying it also matches ErrNotSent.
	ErrSendDeadline = errors.New("send deadline passed before the request could be written")
	// ErrRetryRefused means the database refuses a retry of a receipt
	// (reconciler.retry_error): it is not retryable, or its agent received
	// a late answer after it was settled (a success, or an answer that
	// leaves the effect unknown) that shows the effect exists or may
	// exist. Returned by Retry (planning the next attempt; it then also
	// matches ErrStateConflict) and by Submit (so by Caller.Do) when the
	// late answer was recorded between the retry's plan and its submit:
	// the retry stays planned and nothing is sent.
	ErrRetryRefused = errors.New("retry refused")
	// ErrKeyRetentionPassed means the database refuses a retry of a
	// receipt settled safe_to_retry on the API's native idempotency key
	// (evidence guarantee native_idempotency_key) because the retry's
	// request could be written after reuse_idempotency_key_before: the API
	// would no longer deduplicate the reused key against a straggler of
	// the original, and the absence was not read after the full window
	// (SPEC §5a, "a native key protects only within its retention";
	// SQLSTATE RL009). Nothing is sent; the error also matches
	// ErrRetryRefused. A retry needs a fresh proof first: a settlement of
	// the receipt read after its full absence window.
	ErrKeyRetentionPassed = errors.New("native idempotency key past its retention")
	// ErrKnownKey is returned by PlanAndSubmit, with the key's receipt as
	// it is, when the idempotency key already names a receipt: nothing was
	// submitted, and the caller carries on from that receipt's state
	// (Submit a planned one, replay one past planned, Retry one that may
	// be retried). SQLSTATE RL008.
	ErrKnownKey = errors.New("idempotency key already planned: nothing submitted")
	// ErrKeyRemoved is returned by Plan and PlanAndSubmit when the key
	// named a receipt that retention has since removed from the ledger
	// (reconciler.removed_receipts, its archive in
	// reconciler.retention_batches): a key names one receipt for good, so
	// it is never planned again and nothing is sent.
	ErrKeyRemoved = errors.New("idempotency key names a receipt removed by retention: nothing planned")
)

// DuplicateError is returned by Plan when the intent's fingerprint is
// unresolved in an earlier receipt, and by Submit (so by Caller.Do) when
// another receipt of the same intent was submitted between this one's plan
// and its submit: the database re-checks the guard on planned→submitted, so
// of two agents that planned one intent under two keys only one sends. The
// refused receipt stays planned and nothing was sent. It matches
// ErrDuplicateIntent.
type DuplicateError struct {
	// Existing is the earlier receipt whose outcome is still unresolved.
	Existing *Receipt
}

// Error describes the DuplicateError in one line.
func (e *DuplicateError) Error() string {
	return fmt.Sprintf("%v: receipt %d (%s) holds the same intent %s", ErrDuplicateIntent,
		e.Existing.ID, e.Existing.State, e.Existing.Fingerprint)
}

// Unwrap returns ErrDuplicateIntent.
func (e *DuplicateError) Unwrap() error { return ErrDuplicateIntent }

// ConflictError is returned when a move's expected current state no longer
// holds. It matches ErrStateConflict.
type ConflictError struct {
	// ID is the receipt's id.
	ID int64
	// Expected is the state the move required; Actual the one it found.
	Expected statemachine.State
	Actual   statemachine.State
}

// Error describes the ConflictError in one line.
func (e *ConflictError) Error() string {
	return fmt.Sprintf("receipt %d is %s, expected %s: %v", e.ID, e.Actual, e.Expected, ErrStateConflict)
}

// Unwrap returns ErrStateConflict.
func (e *ConflictError) Unwrap() error { return ErrStateConflict }

// SQLSTATEs raised by the schema's triggers and functions (package migrations).
const (
	codeIllegal    = "RL001"
	codeConflict   = "RL002"
	codeNotFound   = "RL003"
	codeKeyReused  = "RL004"
	codeDuplicate  = "RL005"
	codeInvalidKey = "RL007"
	codeKnownKey   = "RL008"
	codeRetention  = "RL009"
	// codeUniqueKey is PostgreSQL's unique_violation.
	codeUniqueKey = "23505"
)

// pgCode returns the SQLSTATE of err, or "".
func pgCode(err error) (string, *pgconn.PgError) {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code, pe
	}
	return "", nil
}

// safeErrorText renders err, from sending req, for the database and logs
// (Caller.Do records it in receipt_events.error and the OutcomeError shows
// it): a *url.Error's URL is cut to its origin (scheme and host: no user
// info, path, query or fragment; the receipt's target column already says
// which path, and a path may be the secret, a webhook's), and every form of
// every credential req carries is removed (see redactRequestText). The text
// is bounded after redaction, so a cut never leaves part of a credential.
func safeErrorText(err error, req *http.Request) string {
	if err == nil {
		return ""
	}
	msg := err.Error()
	var ue *url.Error
	if errors.As(err, &ue) {
		msg = ue.Op + " " + strconv.Quote(urlOrigin(ue.URL)) + ": " + ue.Err.Error()
	}
	return redactRequestText(msg, req)
}

// redactRequestText removes from msg every form (raw, Basic, base64, URL-
// and percent-encoded, JSON-escaped) of the credentials req carries: the
// values of its credential headers (Authorization, Proxy-Authorization,
// Cookie, and any header named like a key, token, secret, password,
// signature, session or auth), its URL's user info, query and query values,
// and its path and path segments (always: Caller.Do cannot tell a secret
// path from another, and the path is recorded in the target column
// anyway), and bounds the result. Use it on any text recorded from a call:
// a Classify override's Verdict.Message, an ExternalID error, an error
// excerpt of a response body.
func redactRequestText(msg string, req *http.Request) string {
	if req != nil {
		msg = redact.ForRequest(req, true).String(msg)
		if req.URL != nil {
			// Any copy of the full URL left (its path was redacted
			// already when long enough to be a credential) loses
			// everything past its origin.
			if full := req.URL.String(); len(full) > 0 {
				msg = strings.ReplaceAll(msg, full, urlOrigin(full))
			}
		}
	}
	msg, _ = sanitize.Text(msg, maxMessageBytes)
	return msg
}

// urlOrigin returns the scheme and host of raw, "[unparseable URL]" when it
// does not parse.
func urlOrigin(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "[unparseable URL]"
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host}).String()
}
