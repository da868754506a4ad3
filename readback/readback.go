// Package readback is the contract between the reconciler and the external
// systems it reads back: an Adapter answers one question for one receipt
// ("is the effect of this call visible?"), and a Registry says which adapter
// answers for which operation or dependency, with the timing guarantees of
// that dependency (consistency window, longest request lifetime, native
// idempotency keys) that decide when an absent answer becomes proof.
//
// The package holds no policy about states: package reconcile turns answers
// into settlements. It does hold the adapters file format (see LoadFile),
// whose per-adapter `type` discriminator lets new adapter kinds (the
// declarative HTTP adapter) plug in without changing the format.
package readback

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/receiptledger/reconciler/internal/redact"
)

// Kind is the kind of operation a receipt performed. It decides how an
// answer is read (SPEC §5).
type Kind string

// The operation kinds.
const (
	// Create: present if a resource created in the window matches the
	// fingerprint or carries the receipt's marker; more than one match is a
	// detected duplicate.
	Create Kind = "create"
	// Update: present if the resource holds the intended fields; absent if
	// it still holds the pre-image recorded at plan time; anything else
	// (VerdictDiverged) goes to manual review.
	Update Kind = "update"
	// Delete: the target state is absence. Absent proves the delete; present
	// after the window proves it did not happen.
	Delete Kind = "delete"
	// Blind: the endpoint cannot be read back; the receipt goes to manual
	// review at once, with that reason.
	Blind Kind = "blind"
)

// Valid reports whether k is one of the four kinds.
func (k Kind) Valid() bool {
	switch k {
	case Create, Update, Delete, Blind:
		return true
	}
	return false
}

// Verdict is an adapter's answer about the resource an operation targets.
type Verdict string

// The verdicts.
const (
	// VerdictPresent: the resource is visible. For create and update the
	// effect happened; for delete the resource is still there.
	VerdictPresent Verdict = "present"
	// VerdictAbsent: no such resource (create, delete) or the resource still
	// holds its pre-image (update). Conclusive only when Authoritative and
	// after the dependency's window.
	VerdictAbsent Verdict = "absent"
	// VerdictInconclusive: the answer cannot tell; check again later.
	VerdictInconclusive Verdict = "inconclusive"
	// VerdictDiverged: an update's target holds neither the intended fields
	// nor the pre-image: a program cannot decide, a human must.
	VerdictDiverged Verdict = "diverged"
)

// Valid reports whether v is one of the verdicts.
func (v Verdict) Valid() bool {
	switch v {
	case VerdictPresent, VerdictAbsent, VerdictInconclusive, VerdictDiverged:
		return true
	}
	return false
}

// Result is one adapter answer.
type Result struct {
	Verdict Verdict
	// ExternalIDs are the ids of the matching resources. Present answers
	// carry at least one; more than one on a create is a duplicate.
	ExternalIDs []string
	// Authoritative marks an answer read from the system of record (not a
	// cache, a lagging replica or a truncated search): only an authoritative
	// absence can prove that nothing happened.
	Authoritative bool
	// Query says what was asked, for the settlement's evidence (a URL, a
	// search expression). Never credentials.
	Query string
	// Evidence is anything else worth keeping (marshalled to JSON).
	Evidence any
}

// Receipt is what an adapter is told about the receipt it checks.
type Receipt struct {
	ID             int64
	IdempotencyKey string
	Operation      string
	Dependency     string
	Method         string
	Target         string
	// Fingerprint is "sha256:<hex>" over the canonical intent.
	Fingerprint string
	// Intent is the normalized payload with secret fields redacted.
	Intent json.RawMessage
	// PreImage is the target's state before an update (nil otherwise).
	PreImage json.RawMessage
	// ExternalID is the id recorded so far, if any.
	ExternalID  string
	Attempt     int
	CreatedAt   time.Time
	SubmittedAt time.Time
	// SendDeadline is the latest moment the original request could have
	// been written (submitted_at + the receipt's max_send_delay, SPEC §5a):
	// the agent sends nothing after it. Zero means SubmittedAt.
	SendDeadline time.Time
	// UnknownSince is when the receipt last became outcome_unknown (first
	// time, or after a requeue): the check bounds run from it.
	UnknownSince time.Time
	// Checks is the number of checks already made since UnknownSince.
	Checks int
}

// Adapter reads one external system back. Check answers for one receipt;
// it must not change the external system. Errors should be classified with
// Transient or Permanent (see Classify for the default); ctx carries the
// check's deadline.
type Adapter interface {
	Check(ctx context.Context, r Receipt) (Result, error)
}

// Local is implemented by adapters that answer without calling their
// dependency (Static): the reconciler spends none of the dependency's
// protection (breaker, rate limit, concurrency) on them.
type Local interface {
	Local() bool
}

// AdapterFunc lets a function be an Adapter.
type AdapterFunc func(ctx context.Context, r Receipt) (Result, error)

// Check calls f.
func (f AdapterFunc) Check(ctx context.Context, r Receipt) (Result, error) { return f(ctx, r) }

// ErrorClass says whether a failed check may succeed if repeated.
type ErrorClass string

// The error classes.
const (
	// Transient: timeout, 429, 5xx, connection failure. The check is
	// repeated later and counts against the dependency's breaker.
	Transient ErrorClass = "transient"
	// Permanent: authentication, bad configuration, 404 on the search
	// endpoint itself. Repeating cannot help; the receipt goes to manual
	// review with the error.
	Permanent ErrorClass = "permanent"
)

// Error is a classified check failure.
type Error struct {
	Class ErrorClass
	// RetryAfter is the server's requested pause (Retry-After), or zero.
	RetryAfter time.Duration
	Err        error
}

// Error describes the Error in one line.
func (e *Error) Error() string { return fmt.Sprintf("%s readback error: %v", e.Class, e.Err) }

// Unwrap returns the underlying error.
func (e *Error) Unwrap() error { return e.Err }

// TransientError classifies err as transient, with the server's requested
// pause (zero if none).
func TransientError(err error, retryAfter time.Duration) error {
	return &Error{Class: Transient, RetryAfter: retryAfter, Err: err}
}

// PermanentError classifies err as permanent.
func PermanentError(err error) error {
	return &Error{Class: Permanent, Err: err}
}

// Classify returns err's class and requested pause. An *Error in the chain
// decides. Anything unclassified (timeouts, connection errors, a bug in an
// adapter) is transient: an unknown failure must never settle a receipt,
// and the check bound stops it from looping.
func Classify(err error) (ErrorClass, time.Duration) {
	var e *Error
	if errors.As(err, &e) && (e.Class == Transient || e.Class == Permanent) {
		return e.Class, max(e.RetryAfter, 0)
	}
	return Transient, 0
}

// RedactError returns err with every form of the credentials r knows (see
// package internal/redact: raw, Basic, base64, URL- and percent-encoded,
// JSON-escaped) removed from its text. An err whose text holds none is
// returned as is. Otherwise the result's Error is the redacted text and it
// keeps err's classification (Classify sees an *Error with the same class
// and pause, whose own text is redacted too), but nothing else of err's
// chain, so that no caller can reach the unredacted text through Unwrap.
// Adapters call it on every error they return (the reconciler stores
// Error() in readback_checks and history and logs it).
func RedactError(err error, r *redact.Redactor) error {
	if err == nil || r.Empty() {
		return err
	}
	text := err.Error()
	red := r.String(text)
	if red == text {
		return err
	}
	out := &redactedError{text: red}
	var e *Error
	if errors.As(err, &e) {
		inner := ""
		if e.Err != nil {
			inner = r.String(e.Err.Error())
		}
		out.class = &Error{Class: e.Class, RetryAfter: e.RetryAfter, Err: errors.New(inner)}
	}
	return out
}

// redactedError is an error whose text was redacted; class, when set,
// carries the classification of the error it replaces.
type redactedError struct {
	text  string
	class *Error
}

func (e *redactedError) Error() string { return e.text }

// Unwrap returns the redacted classification, or nil.
func (e *redactedError) Unwrap() error {
	if e.class == nil {
		return nil
	}
	return e.class
}
