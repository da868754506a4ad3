// Package review is the human side of the receipt ledger (SPEC §6): it lists
// the receipts held in manual_review, shows any receipt's whole timeline,
// and records a person's decision on a held receipt — resolve it to
// succeeded, safe_to_retry or rejected, or requeue it to outcome_unknown so
// the reconciler checks it again.
//
// A decision is a guarded move made as "human:<operator>" with a mandatory
// reason (ledger.Client.Transition from manual_review): of two people
// deciding on one receipt at once exactly one wins, and the other gets a
// *NotHeldError that also matches ledger's *ConflictError, with nothing
// overwritten.
package review

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// DefaultLimit is the number of receipts List returns when Filter.Limit is
// not set.
const DefaultLimit = 50

// Via is recorded in the detail of every move this package makes, as
// extra.resolved_via (unless Resolution.Via names another tool, such as
// `reconciler ui`), so history tells a review decision from a hand-written
// SQL statement.
const Via = "reconciler review"

// Errors returned by this package. Test with errors.Is; the typed forms carry
// details for errors.As.
var (
	// ErrNotFound means no receipt has the given id. It is matched by
	// *NotFoundError, which also matches ledger.ErrNotFound.
	ErrNotFound = errors.New("receipt not found")
	// ErrNotHeld means the receipt is not in manual_review. It is matched by
	// *NotHeldError.
	ErrNotHeld = errors.New("receipt not in manual_review")
	// ErrReasonRequired means a decision was made without a reason.
	ErrReasonRequired = errors.New("a reason is required")
	// ErrInvalidOperator means the operator name cannot form a
	// "human:<name>" actor (empty, or with leading or trailing space).
	ErrInvalidOperator = errors.New("invalid operator")
	// ErrInvalidResolution means Resolution.To is not succeeded,
	// safe_to_retry or rejected.
	ErrInvalidResolution = errors.New("a resolution must be succeeded, safe_to_retry or rejected")
)

// NotFoundError names a receipt id that does not exist. It matches
// ErrNotFound and ledger.ErrNotFound.
type NotFoundError struct {
	ID int64
}

// Error describes the NotFoundError in one line.
func (e *NotFoundError) Error() string { return fmt.Sprintf("receipt %d not found", e.ID) }

// Is makes errors.Is true for ErrNotFound and ledger.ErrNotFound.
func (e *NotFoundError) Is(target error) bool {
	return target == ErrNotFound || target == ledger.ErrNotFound
}

// NotHeldError says that a decision found its receipt in another state than
// manual_review: it was never held, or someone else decided first. Nothing
// was changed. It matches ErrNotHeld and, through Unwrap, ledger's
// *ConflictError and ledger.ErrStateConflict.
type NotHeldError struct {
	ID int64
	// State is the state the receipt was found in.
	State statemachine.State
	// By and At name the latest move's actor and time, when known.
	By statemachine.Actor
	At time.Time
	// Conflict is the guarded move's refusal.
	Conflict *ledger.ConflictError
}

// Error describes the NotHeldError in one line.
func (e *NotHeldError) Error() string {
	msg := fmt.Sprintf("receipt %d is %s, not manual_review", e.ID, e.State)
	if e.By != "" {
		msg += fmt.Sprintf(" (moved there by %s at %s); nothing was changed", e.By, e.At.UTC().Format(time.RFC3339))
	}
	return msg
}

// Is makes errors.Is(err, ErrNotHeld) true.
func (e *NotHeldError) Is(target error) bool { return target == ErrNotHeld }

// Unwrap returns the ledger's *ConflictError, if any.
func (e *NotHeldError) Unwrap() error {
	if e.Conflict == nil {
		return nil
	}
	return e.Conflict
}

// Filter selects held receipts for List. Zero fields select everything.
type Filter struct {
	// Operation and Dependency match exactly when set.
	Operation  string
	Dependency string
	// Reason matches exactly, when set, the reason recorded with the move
	// that held the receipt (e.g. blind, bound_reached).
	Reason string
	// OlderThan keeps receipts held for at least this long.
	OlderThan time.Duration
	// Limit caps the number returned; DefaultLimit when zero or negative.
	Limit int
}

// Held is one receipt waiting in manual_review.
type Held struct {
	ID             int64  `json:"id"`
	IdempotencyKey string `json:"idempotency_key"`
	Operation      string `json:"operation"`
	Dependency     string `json:"dependency"`
	Attempt        int    `json:"attempt"`
	// HeldSince is when the receipt entered manual_review.
	HeldSince time.Time `json:"held_since"`
	// Age is how long it has been held, by the database's clock; AgeSeconds
	// is the same in seconds, for JSON.
	Age        time.Duration `json:"-"`
	AgeSeconds float64       `json:"age_s"`
	// HeldBy is the actor that moved it to manual_review.
	HeldBy statemachine.Actor `json:"held_by"`
	// Reason is the reason recorded with that move (e.g. blind,
	// bound_reached), and ErrorCode the code of its error, if any.
	Reason    string `json:"reason"`
	ErrorCode string `json:"error_code,omitempty"`
}

// List returns the receipts held in manual_review that match f, the longest
// held first.
func List(ctx context.Context, pool *pgxpool.Pool, f Filter) ([]Held, error) {
	if f.Limit <= 0 {
		f.Limit = DefaultLimit
	}
	q, args := listQuery(f)
	rows, err := pool.Query(ctx, q, args)
	if err != nil {
		return nil, fmt.Errorf("review: list: %w", err)
	}
	held, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Held, error) {
		var h Held
		var actor string
		err := row.Scan(&h.ID, &h.IdempotencyKey, &h.Operation, &h.Dependency, &h.Attempt, &h.HeldSince,
			&h.AgeSeconds, &actor, &h.Reason, &h.ErrorCode)
		h.HeldBy = statemachine.Actor(actor)
		h.Age = time.Duration(h.AgeSeconds * float64(time.Second))
		return h, err
	})
	if err != nil {
		return nil, fmt.Errorf("review: list: %w", err)
	}
	return held, nil
}

// Count returns how many receipts held in manual_review match f (whatever
// f.Limit says), counting at most max of them: when more match, it returns
// max and more = true. The bound keeps the count's cost that of reading max
// index entries however many receipts are held; max <= 0 counts them all.
func Count(ctx context.Context, pool *pgxpool.Pool, f Filter, max int64) (n int64, more bool, err error) {
	q, args := where(sqlCountHead, f)
	if max > 0 {
		q += sqlCountTail
		args["max"] = max + 1
	}
	if err := pool.QueryRow(ctx, sqlCountOuterHead+q+sqlCountOuterTail, args).Scan(&n); err != nil {
		return 0, false, fmt.Errorf("review: count: %w", err)
	}
	if max > 0 && n > max {
		return max, true, nil
	}
	return n, false, nil
}

// listQuery is sqlList with only the conditions f sets, and its arguments.
func listQuery(f Filter) (string, pgx.NamedArgs) {
	q, args := where(sqlListHead, f)
	args["limit"] = f.Limit
	return q + sqlListTail, args
}

// where appends to head the conditions f sets, and returns their arguments.
func where(head string, f Filter) (string, pgx.NamedArgs) {
	var q strings.Builder
	q.WriteString(head)
	args := pgx.NamedArgs{}
	cond := func(sql, name string, v any) {
		q.WriteString("\n  AND ")
		q.WriteString(sql)
		args[name] = v
	}
	if f.Operation != "" {
		cond(sqlListOperation, "operation", f.Operation)
	}
	if f.Dependency != "" {
		cond(sqlListDependency, "dependency", f.Dependency)
	}
	if f.Reason != "" {
		cond(sqlListReason, "reason", f.Reason)
	}
	if f.OlderThan > 0 {
		cond(sqlListMinAge, "min_age_s", f.OlderThan.Seconds())
	}
	return q.String(), args
}

// Receipt is a receipt's current-state projection as Show reports it.
type Receipt struct {
	ID             int64           `json:"id"`
	IdempotencyKey string          `json:"idempotency_key"`
	Operation      string          `json:"operation"`
	Dependency     string          `json:"dependency"`
	Method         string          `json:"method"`
	Target         string          `json:"target"`
	Fingerprint    string          `json:"fingerprint"`
	Intent         json.RawMessage `json:"intent"`
	// PreImage is the target's state recorded at plan time (updates only).
	PreImage    json.RawMessage    `json:"pre_image,omitempty"`
	State       statemachine.State `json:"state"`
	ExternalID  string             `json:"external_id,omitempty"`
	Attempt     int                `json:"attempt"`
	RetryOf     int64              `json:"retry_of,omitempty"`
	CreatedAt   time.Time          `json:"created_at"`
	SubmittedAt *time.Time         `json:"submitted_at,omitempty"`
	UpdatedAt   time.Time          `json:"updated_at"`
	Version     int                `json:"version"`
	// Checks is the number of readback checks made so far.
	Checks int `json:"checks"`
	// NextCheckAt is when the reconciler may next claim it, if scheduled.
	NextCheckAt *time.Time `json:"next_check_at,omitempty"`
}

// Event is one move in a receipt's timeline.
type Event struct {
	Seq   int                `json:"seq"`
	From  statemachine.State `json:"from,omitempty"` // "" for the first event
	To    statemachine.State `json:"to"`
	At    time.Time          `json:"at"`
	Actor statemachine.Actor `json:"actor"`
	// Error and Evidence are the move's error and evidence, if any.
	Error    json.RawMessage `json:"error,omitempty"`
	Evidence json.RawMessage `json:"evidence,omitempty"`
	// Reason and Extra are taken from Detail, which is kept whole.
	Reason     string          `json:"reason,omitempty"`
	Extra      json.RawMessage `json:"extra,omitempty"`
	Detail     json.RawMessage `json:"detail"`
	ExternalID string          `json:"external_id,omitempty"`
}

// Timeline is a receipt with its whole history.
type Timeline struct {
	Receipt Receipt `json:"receipt"`
	Events  []Event `json:"events"`
	// Audits are the reconciler's audit reads of its settled absence
	// (docs/verdict-audits.md), if any.
	Audits []Audit `json:"audits,omitempty"`
}

// Show returns the receipt with id and its whole timeline, read in one
// snapshot so the two agree. A missing id is a *NotFoundError.
func Show(ctx context.Context, pool *pgxpool.Pool, id int64) (*Timeline, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fmt.Errorf("review: show receipt %d: %w", id, err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var t Timeline
	r := &t.Receipt
	var state string
	err = tx.QueryRow(ctx, sqlReceipt, id).Scan(&r.ID, &r.IdempotencyKey, &r.Operation, &r.Dependency,
		&r.Method, &r.Target, &r.Fingerprint, &r.Intent, &r.PreImage, &state, &r.ExternalID, &r.Attempt,
		&r.RetryOf, &r.CreatedAt, &r.SubmittedAt, &r.UpdatedAt, &r.Version, &r.Checks, &r.NextCheckAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, &NotFoundError{ID: id}
	}
	if err != nil {
		return nil, fmt.Errorf("review: show receipt %d: %w", id, err)
	}
	r.State = statemachine.State(state)
	rows, err := tx.Query(ctx, sqlEvents, id)
	if err != nil {
		return nil, fmt.Errorf("review: timeline of receipt %d: %w", id, err)
	}
	t.Events, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Event, error) {
		var e Event
		var from, to, actor string
		err := row.Scan(&e.Seq, &from, &to, &e.At, &actor, &e.Error, &e.Evidence, &e.Detail,
			&e.Reason, &e.Extra, &e.ExternalID)
		e.From, e.To, e.Actor = statemachine.State(from), statemachine.State(to), statemachine.Actor(actor)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("review: timeline of receipt %d: %w", id, err)
	}
	if t.Audits, err = audits(ctx, tx, id); err != nil {
		return nil, err
	}
	return &t, nil
}

// Resolution is a person's verdict on a held receipt.
type Resolution struct {
	ID int64
	// To is succeeded, safe_to_retry or rejected.
	To statemachine.State
	// Operator is the person deciding; the move is made as "human:<Operator>".
	Operator string
	// Reason says why; it is mandatory and recorded in the event's detail.
	Reason string
	// ExternalID, when set, is recorded with the move (e.g. the resource a
	// person found for a succeeded create).
	ExternalID string
	// Via names the tool the person decided with, recorded as
	// extra.resolved_via; the package's Via (the CLI) when empty.
	Via string
}

// Resolve moves a held receipt to r.To as "human:<r.Operator>", recording
// the reason. It returns the receipt after the move, or: ErrInvalidResolution,
// ErrReasonRequired or ErrInvalidOperator for bad input (nothing is read);
// a *NotFoundError for an unknown id; a *NotHeldError (matching ledger's
// *ConflictError) when the receipt is not in manual_review, including when
// another person resolved it first.
func Resolve(ctx context.Context, pool *pgxpool.Pool, r Resolution) (*ledger.Receipt, error) {
	switch r.To {
	case statemachine.Succeeded, statemachine.SafeToRetry, statemachine.Rejected:
	default:
		return nil, fmt.Errorf("review: receipt %d: %w (got %q)", r.ID, ErrInvalidResolution, r.To)
	}
	return leave(ctx, pool, r, "resolve")
}

// Decide makes the decision r: a resolution as Resolve makes it, or, with
// r.To = outcome_unknown, a requeue as Requeue makes it (r.ExternalID is
// then refused: a requeue finds nothing). Errors are those of Resolve.
func Decide(ctx context.Context, pool *pgxpool.Pool, r Resolution) (*ledger.Receipt, error) {
	if r.To != statemachine.OutcomeUnknown {
		return Resolve(ctx, pool, r)
	}
	if strings.TrimSpace(r.ExternalID) != "" {
		return nil, fmt.Errorf("review: receipt %d: %w: a requeue records no external id", r.ID, ErrInvalidResolution)
	}
	return leave(ctx, pool, r, "requeue")
}

// Requeue moves a held receipt back to outcome_unknown as
// "human:<operator>", recording the reason; the database schedules it due
// at once, so the reconciler claims and checks it again. Errors are those of
// Resolve.
func Requeue(ctx context.Context, pool *pgxpool.Pool, id int64, operator, reason string) (*ledger.Receipt, error) {
	return leave(ctx, pool, Resolution{ID: id, To: statemachine.OutcomeUnknown, Operator: operator, Reason: reason}, "requeue")
}

// leave makes the guarded move manual_review → r.To for a human.
func leave(ctx context.Context, pool *pgxpool.Pool, r Resolution, action string) (*ledger.Receipt, error) {
	id, operator, via := r.ID, r.Operator, r.Via
	if via == "" {
		via = Via
	}
	reason := strings.TrimSpace(r.Reason)
	if reason == "" {
		return nil, fmt.Errorf("review: receipt %d: %w", id, ErrReasonRequired)
	}
	actor, err := statemachine.ParseActor(string(statemachine.Human) + ":" + operator)
	if err != nil {
		return nil, fmt.Errorf("review: receipt %d: %w %q: %w", id, ErrInvalidOperator, operator, err)
	}
	client, err := ledger.New(pool, string(actor))
	if err != nil {
		return nil, fmt.Errorf("review: receipt %d: %w", id, err)
	}
	rec, err := client.Transition(ctx, ledger.Move{
		ID: id, From: statemachine.ManualReview, To: r.To,
		Detail: ledger.Detail{Reason: reason, Extra: map[string]any{
			"resolved_via": via, "action": action, "operator": operator}},
		ExternalID: strings.TrimSpace(r.ExternalID),
	})
	if err == nil {
		return rec, nil
	}
	var conflict *ledger.ConflictError
	switch {
	case errors.As(err, &conflict):
		nh := &NotHeldError{ID: id, State: conflict.Actual, Conflict: conflict}
		var by string
		// Best effort: name who moved it. The refusal stands without it.
		if pool.QueryRow(ctx, sqlLatestEvent, id).Scan(&by, &nh.At) == nil {
			nh.By = statemachine.Actor(by)
		}
		return nil, nh
	case errors.Is(err, ledger.ErrNotFound):
		return nil, &NotFoundError{ID: id}
	}
	return nil, fmt.Errorf("review: %w", err)
}

// FormatAge prints d the way a person scans a queue: two units at most.
// The review page and the review CLI both show a held receipt's age with it.
func FormatAge(d time.Duration) string {
	d = d.Round(time.Second)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}
