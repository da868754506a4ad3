// Package ledger is the agent-side client of the receipt ledger: it records
// every side-effecting call in Postgres before the bytes leave, moves the
// receipt through the state machine as the call plays out, and refuses a
// retry or a re-planned duplicate while an earlier outcome is unknown.
//
// Every move is one statement in one transaction (projection and history
// together), guarded by the state the caller last saw, so of two concurrent
// writers on one receipt exactly one wins and the other gets ErrStateConflict.
//
// Every time a receipt carries (CreatedAt, SubmittedAt, SendDeadline,
// UpdatedAt, event times) is the database's clock_timestamp(); the client
// never stores a time of its own clock. The only local clock reading is
// Caller.Do's monotonic send deadline, which starts before the submit
// statement and so never ends later than the database's.
package ledger

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/statemachine"
)

// Limits of an intent, as the database enforces them.
const (
	// DefaultMaxSendDelay is the send deadline of an intent that declares
	// none: the request must be written within 5 s of its submit.
	DefaultMaxSendDelay = 5 * time.Second
	// MaxSendDelayLimit is the longest send deadline an intent may declare.
	MaxSendDelayLimit = 10 * time.Minute
	// MaxKeyBytes is the longest idempotency key a first attempt may have,
	// in bytes (a retry's key adds "#<attempt>" to it).
	MaxKeyBytes = 255
	// MaxNameBytes is the longest operation, dependency or method an intent
	// may have, in bytes (reconciler.plan refuses longer ones too).
	MaxNameBytes = 200
	// MaxTargetBytes is the longest target an intent may have, in bytes.
	MaxTargetBytes = 2048
	// MaxExternalIDBytes is the longest external id stored. A longer one,
	// or one that is not valid UTF-8 or holds a control character, is not
	// stored: see Move.ExternalID.
	MaxExternalIDBytes = 255
	// maxDetailString and maxDetailBytes bound each string of a move's
	// detail and the whole detail document.
	maxDetailString = 2048
	maxDetailBytes  = 64 << 10
)

// Client records receipts for one actor. It is safe for concurrent use.
type Client struct {
	pool  *pgxpool.Pool
	actor statemachine.Actor
	// secretKey keys the fingerprint of secret fields (WithSecretKey).
	secretKey fingerprint.Option
	// settled wakes Await; shared by every client made from one New.
	settled *settlements
	// durableOutcomes makes the outcome of a call (a move out of
	// submitted) wait for its WAL flush like every other move
	// (WithDurableOutcomes).
	durableOutcomes bool
	// log receives the failures of the LISTEN connection this client's
	// Await and NotifySettled open (WithLogger); nil discards them.
	log *slog.Logger
	// durability is what a commit on the server means, as last read;
	// shared by every client made from one New.
	durability *durabilityCache
	// requireSync, when positive, refuses to record receipts while the
	// server cannot confirm commits on a synchronous standby, trusting a
	// read of the durability for that long (RequireSynchronousStandby).
	requireSync time.Duration
}

// New returns a client that writes as actor ("agent:<id>").
func New(pool *pgxpool.Pool, actor string) (*Client, error) {
	a, err := statemachine.ParseActor(actor)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	return &Client{pool: pool, actor: a, settled: newSettlements(pool),
		durability: &durabilityCache{pool: pool, now: time.Now}}, nil
}

// As returns a client on the same pool that writes as actor. The reconciler
// and review tools use it; the actor is checked on every move.
func (c *Client) As(actor statemachine.Actor) *Client {
	d := *c
	d.actor = actor
	return &d
}

// WithLogger returns a client like c whose Await and NotifySettled log to l
// each failure of the LISTEN connection they open (it reconnects after a
// pause; meanwhile settlements wake no one, and in-flight receipts are
// still re-read on their timer). A connection already open keeps the
// logger of the client that opened it.
func (c *Client) WithLogger(l *slog.Logger) *Client {
	d := *c
	d.log = l
	return &d
}

// WithDurableOutcomes returns a client on the same pool, actor and key whose
// outcomes (Succeed, Reject and MarkUnknown of a submitted receipt) wait
// for the WAL flush before they return, as every other move does.
//
// By default they do not (synchronous_commit off for the move's own
// transaction). The record that must be durable before the request's
// bytes leave is submitted, and it always is. An outcome is visible to
// everyone once it returns and survives the death of the agent's process;
// only a crash of the database server within about 600 ms (three
// wal_writer_delay) can lose it, and then the receipt is back in
// submitted: the orphan sweep moves it to outcome_unknown, and the
// reconciler reads the effect back, as for any call whose answer was
// lost. A later synchronous commit (any submission, any settlement)
// flushes it too, since the WAL is written in order: nothing that saw the
// outcome and then committed durably can outlive it. Use this client when
// a dependency has no readback adapter, where a lost outcome would wait
// for a human instead.
func (c *Client) WithDurableOutcomes() *Client {
	d := *c
	d.durableOutcomes = true
	return &d
}

// Pool returns the pool the client writes through.
func (c *Client) Pool() *pgxpool.Pool { return c.pool }

// Actor returns the actor the client writes as.
func (c *Client) Actor() statemachine.Actor { return c.actor }

// Intent is what a call means to do.
type Intent struct {
	// IdempotencyKey is owned by the harness, stable across transport
	// retries of one logical step; see Key.
	IdempotencyKey string
	// Operation names the call, e.g. "articles.create".
	Operation string
	// Dependency names the backend that fails independently, e.g. "blog-api".
	Dependency string
	// Method and Target are the HTTP method and path (or the RPC's name).
	Method string
	Target string
	// Payload is the semantic JSON body.
	Payload json.RawMessage
	// Drop names volatile payload fields (timestamps, nonces, request ids)
	// left out of the fingerprint, as RFC 6901 JSON pointers.
	Drop []string
	// Secret names payload fields, as JSON pointers, whose values are
	// stored and fingerprinted only as "hmac-sha256:<key id>:<hex>" under
	// the client's secret key (see Client.WithSecretKey, required for an
	// intent with secret fields). A pointer that matches nothing is refused
	// (ErrInvalidIntent wrapping fingerprint.ErrSecretNotFound).
	Secret []string
	// AllowDuplicate opts out of the duplicate guard: plan even when the
	// same intent is unresolved in another receipt.
	AllowDuplicate bool
	// PreImage is the target's state before an update, recorded at plan
	// time: the reconciler proves an update absent only if the resource
	// still holds it. Leave nil for creates and deletes.
	PreImage json.RawMessage
	// MaxSendDelay is the send deadline (SPEC §5a): the request's bytes
	// must be written within this long after the submit, or not at all
	// (Caller.Do cancels a request that has no connection by then, and
	// the receipt is rejected as not_sent). The reconciler counts it in the
	// absence window, so a shorter deadline settles sooner. 0 means
	// DefaultMaxSendDelay; otherwise it must be positive and at most
	// MaxSendDelayLimit (ErrInvalidIntent). Recorded at plan time, it never
	// changes: a known key keeps the deadline it was planned with.
	MaxSendDelay time.Duration
	// Webhook, when not empty, names the receipt gateway's route whose
	// webhook is sent this receipt's settlements. The registration
	// (reconciler.webhook_receipts) is written by the statement that
	// records the receipt, in its commit, before any byte is sent, so no
	// crash after the call can leave the receipt unregistered; the
	// database then queues each settlement in the settling transaction.
	// The gateway sets it; other agents leave it empty.
	Webhook string
}

// Receipt is one attempt at one side effect: the current-state projection.
type Receipt struct {
	ID             int64
	IdempotencyKey string
	Operation      string
	Dependency     string
	Method         string
	Target         string
	Fingerprint    string
	// Intent is the normalized intent with each secret field's value
	// replaced by its keyed string (see Intent.Secret).
	Intent     json.RawMessage
	State      statemachine.State
	ExternalID string
	Attempt    int
	RetryOf    int64 // 0 when this is a first attempt
	// CreatedAt, SubmittedAt and UpdatedAt are the database's
	// clock_timestamp() at the moves that stamped them.
	CreatedAt   time.Time
	SubmittedAt time.Time // zero until submitted
	UpdatedAt   time.Time
	Version     int
	// MaxSendDelay is the send deadline the receipt was planned with.
	MaxSendDelay time.Duration
	// SendDeadline is SubmittedAt + MaxSendDelay, the database's bound on
	// when the request's bytes may leave; zero until submitted.
	SendDeadline time.Time
	// Retryable is set on a rejected receipt whose call may be sent again:
	// nothing was sent, or the API asked to come back later (429). Retry
	// accepts it like a safe_to_retry receipt.
	Retryable bool
}

// Event is one transition in a receipt's history.
type Event struct {
	Seq        int
	From       statemachine.State // "" for the first event
	To         statemachine.State
	At         time.Time
	Actor      statemachine.Actor
	Error      json.RawMessage
	Evidence   json.RawMessage
	Detail     json.RawMessage
	ExternalID string
}

// CallError describes why a call did not succeed, as recorded in history.
type CallError struct {
	// Code is a short machine-readable cause: not_sent, rate_limited,
	// timeout, http_500, truncated_body, ...
	Code string `json:"code"`
	// Message is the underlying error text.
	Message string `json:"message,omitempty"`
	// HTTPStatus is the response status, when there was one.
	HTTPStatus int `json:"http_status,omitempty"`
	// Retryable is set when no effect can have happened and a retry is safe.
	Retryable bool `json:"retryable,omitempty"`
}

// Detail is what a move records besides its states: the error that caused
// it, the evidence behind it, and anything else worth keeping.
type Detail struct {
	Error    *CallError     `json:"error,omitempty"`
	Evidence any            `json:"evidence,omitempty"`
	Reason   string         `json:"reason,omitempty"`
	Extra    map[string]any `json:"extra,omitempty"`
}

// Move is one requested transition.
type Move struct {
	ID int64
	// From is the state the caller last saw; the move happens only if the
	// receipt is still in it.
	From statemachine.State
	To   statemachine.State
	// Actor defaults to the client's actor.
	Actor  statemachine.Actor
	Detail Detail
	// ExternalID is stored only if it is valid UTF-8 without control
	// characters and at most MaxExternalIDBytes: otherwise it is not stored
	// (an altered id would name nothing the API knows), and the detail's
	// extra records "untrusted_external_id" (an excerpt, the SHA-256 of its
	// bytes, its length) and "sanitized": true.
	ExternalID string
}

var keyEscaper = strings.NewReplacer("%", "%25", ":", "%3A", "#", "%23")

// Key derives a harness-owned idempotency key from stable identities,
// "task:step:operation". Colons, percent and hash signs inside a part are
// escaped so distinct triples never share a key, and the key holds no "#"
// at all, so it never ends like a retry's "#<attempt>" suffix (see Retry
// and LogicalKey) and the database never refuses it for its form.
//
// Key does not shorten: a key longer than MaxKeyBytes bytes (long ids, or
// many escaped characters: each escape takes three bytes) is refused by
// Plan and Caller.Do with ErrInvalidKey before anything is recorded. Hash
// long ids before passing them if they can come near the limit.
func Key(taskID, stepID, operation string) string {
	return keyEscaper.Replace(taskID) + ":" + keyEscaper.Replace(stepID) + ":" + keyEscaper.Replace(operation)
}

// attemptSuffix returns the index of the "#" of a final "#<digits>", the
// "#<attempt>" a retry's key ends with, or -1. A first attempt's key cannot
// end this way (the database refuses it with RL007, regex '#[0-9]+$'), so
// removing it is unambiguous.
func attemptSuffix(key string) int {
	i := len(key)
	for i > 0 && key[i-1] >= '0' && key[i-1] <= '9' {
		i--
	}
	if i == len(key) || i == 0 || key[i-1] != '#' {
		return -1
	}
	return i - 1
}

// LogicalKey returns the key of the logical step a receipt's idempotency
// key belongs to: the key with a final "#<digits>" (the attempt suffix
// Retry adds) removed, and nothing else. Every attempt of one step shares
// it, so it is the marker an agent can put in a request it builds before
// knowing which attempt it is. "order#8812:charge" is its own logical key;
// its retry "order#8812:charge#2" has the same one.
func LogicalKey(idempotencyKey string) string {
	if i := attemptSuffix(idempotencyKey); i >= 0 {
		return idempotencyKey[:i]
	}
	return idempotencyKey
}

// checkFirstKey refuses, before the round trip, a first attempt's key the
// database would refuse with RL007.
func checkFirstKey(key string) error {
	if len(key) > MaxKeyBytes {
		return fmt.Errorf("ledger: plan: %w: the key is %d bytes, more than %d", ErrInvalidKey, len(key), MaxKeyBytes)
	}
	if attemptSuffix(key) >= 0 {
		return fmt.Errorf("ledger: plan %s: %w: a first attempt's key must not end in \"#<digits>\", the suffix of retries",
			key, ErrInvalidKey)
	}
	return nil
}

const receiptColumns = `id, idempotency_key, operation, dependency, method, target, fingerprint,
	intent, state, coalesce(external_id, ''), attempt, coalesce(retry_of, 0),
	created_at, coalesce(submitted_at, 'epoch'::timestamptz), updated_at, version,
	state = 'rejected' AND (state_detail #>> '{error,retryable}') IS NOT DISTINCT FROM 'true',
	max_send_delay, coalesce(submitted_at + max_send_delay, 'epoch'::timestamptz)`

// sqlMove is the move reconciler.transition makes, without the function
// layer: this runs on every call an agent makes. The triggers enforce the
// state machine and write history either way.
//
// The expected state is compared under the "C" collation, which means the
// same (equal strings are equal bytes under every deterministic collation)
// but matches no index or index predicate: planned for its values, the
// statement would otherwise read receipts_stale, whose predicate a known
// state proves, scanning every receipt in flight and the dead entries of
// those that moved on, instead of one primary-key probe.
//
// sqlMoveOutcome records the outcome of a call (a move out of submitted)
// without waiting for its WAL flush: see WithDurableOutcomes.
const (
	sqlMoveSet = `UPDATE reconciler.receipts
		SET state = $2, state_actor = $3, state_detail = $4, external_id = coalesce($5, external_id)`
	sqlMoveWhere = `
		WHERE id = $1 AND state = $6 COLLATE "C"
		RETURNING ` + receiptColumns
	sqlMove        = sqlMoveSet + sqlMoveWhere
	sqlMoveOutcome = sqlMoveSet + `
		FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async` + sqlMoveWhere
)

// The statements that record a new receipt: PlanAndSubmit's INSERT (the
// triggers make every check reconciler.plan would) and reconciler.plan
// (Plan, Retry, and PlanAndSubmit's fallback). The forms for an intent
// with a Webhook register the receipt's webhook in the same statement
// (webhook_receipts; a known key's receipt is registered too, as the
// gateway's registration after a replayed call did).
const (
	sqlInsertSubmitted = `INSERT INTO reconciler.receipts
		(idempotency_key, operation, dependency, method, target, fingerprint, intent, state_actor,
		 pre_image, max_send_delay, guarded, state)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'submitted')`
	sqlPlanAndSubmit        = sqlInsertSubmitted + ` RETURNING ` + receiptColumns
	sqlPlanAndSubmitWebhook = `WITH r AS (` + sqlInsertSubmitted + ` RETURNING *),
		hook AS (INSERT INTO reconciler.webhook_receipts (receipt_id, route) SELECT id, $12 FROM r)
		SELECT ` + receiptColumns + ` FROM r`
	sqlPlanCall = `reconciler.plan(
		idempotency_key => $1, operation => $2, dependency => $3, method => $4, target => $5,
		fingerprint => $6, intent => $7, actor => $8, allow_duplicate => $9, retry_of => $10,
		pre_image => $11, max_send_delay => $12, submit => $13)`
	sqlPlan        = `SELECT ` + receiptColumns + ` FROM ` + sqlPlanCall
	sqlPlanWebhook = `WITH r AS (SELECT * FROM ` + sqlPlanCall + `),
		hook AS (INSERT INTO reconciler.webhook_receipts (receipt_id, route) SELECT id, $14 FROM r
		         ON CONFLICT DO NOTHING)
		SELECT ` + receiptColumns + ` FROM r`
)

func scanReceipt(row pgx.Row) (*Receipt, error) {
	var r Receipt
	var state string
	err := row.Scan(&r.ID, &r.IdempotencyKey, &r.Operation, &r.Dependency, &r.Method, &r.Target,
		&r.Fingerprint, &r.Intent, &state, &r.ExternalID, &r.Attempt, &r.RetryOf,
		&r.CreatedAt, &r.SubmittedAt, &r.UpdatedAt, &r.Version, &r.Retryable,
		&r.MaxSendDelay, &r.SendDeadline)
	if err != nil {
		return nil, err
	}
	r.State = statemachine.State(state)
	if r.SubmittedAt.Equal(time.Unix(0, 0)) {
		r.SubmittedAt, r.SendDeadline = time.Time{}, time.Time{}
	}
	return &r, nil
}

// Plan records the intent as a planned receipt before anything is sent. A
// known idempotency key returns its existing receipt. An intent whose
// fingerprint is unresolved in another receipt of the same dependency is
// refused with a *DuplicateError unless AllowDuplicate is set. A key the
// database cannot take (see Key and LogicalKey) is refused with
// ErrInvalidKey before the round trip.
func (c *Client) Plan(ctx context.Context, in Intent) (*Receipt, error) {
	fp, err := c.firstAttempt(in)
	if err != nil {
		return nil, err
	}
	return c.plan(ctx, in, fp, 0, false)
}

// firstAttempt checks an intent planned as a first attempt (Plan,
// PlanAndSubmit) before any round trip and returns its fingerprint.
func (c *Client) firstAttempt(in Intent) (fingerprint.Result, error) {
	if err := checkIntent(in); err != nil {
		return fingerprint.Result{}, err
	}
	if err := checkFirstKey(in.IdempotencyKey); err != nil {
		return fingerprint.Result{}, err
	}
	return intentFingerprint(in, c.secretKey)
}

// PlanAndSubmit records a new intent planned and submitted in one
// transaction: both history events, one commit, the same durable record
// before the first byte as Plan then Submit (Caller.Do takes this path).
// Call it just before the request is sent: its bytes must be written by
// the returned receipt's SendDeadline or not at all. It refuses what Plan
// refuses, and what Submit would: a *DuplicateError when the intent is
// unresolved in another receipt, and nothing is recorded. When the key
// already names a receipt, nothing is submitted: it returns that receipt
// as it is with ErrKnownKey, and the caller carries on from its state.
func (c *Client) PlanAndSubmit(ctx context.Context, in Intent) (*Receipt, error) {
	fp, err := c.firstAttempt(in)
	if err != nil {
		return nil, err
	}
	if err := c.checkDurability(ctx); err != nil {
		return nil, fmt.Errorf("ledger: plan %s: nothing recorded, nothing sent: %w", in.IdempotencyKey, err)
	}
	// The common case, a new key, is one INSERT of the receipt already
	// submitted: the triggers make every check reconciler.plan would (the
	// key's form and uniqueness, the duplicate guard under the intent's
	// lock) and write both events, without the function's extra lookups.
	// Any refusal is asked again of reconciler.plan, whose answer tells a
	// known key (ErrKnownKey) from a duplicate or a conflicting reuse. A
	// refusal by the key's own uniqueness says the key is known (its row
	// is committed, and receipt_keys is insert-only), so plan is asked
	// without submit: it returns the key's receipt (or refuses a
	// conflicting reuse) in the one round trip, with no read after it.
	args := []any{in.IdempotencyKey, in.Operation, in.Dependency, strings.ToUpper(in.Method), in.Target,
		fp.Fingerprint, fp.Intent, string(c.actor), preImage(in.PreImage), sendDelay(in), !in.AllowDuplicate}
	sql := sqlPlanAndSubmit
	if in.Webhook != "" {
		sql, args = sqlPlanAndSubmitWebhook, append(args, in.Webhook)
	}
	r, err := c.submitRow(ctx, sql, args...)
	var nr *NotReplicatedError
	if errors.As(err, &nr) {
		return r, fmt.Errorf("ledger: plan %s: %w", in.IdempotencyKey, err)
	}
	if code, pe := pgCode(err); code == codeUniqueKey && pe.ConstraintName == "receipt_keys_pkey" {
		if r, err = c.plan(ctx, in, fp, 0, false); err != nil {
			return nil, err
		}
		return r, fmt.Errorf("ledger: plan %s: %w", in.IdempotencyKey, ErrKnownKey)
	} else if pe != nil {
		return c.plan(ctx, in, fp, 0, true)
	}
	if err != nil {
		return nil, fmt.Errorf("ledger: plan %s: %w", in.IdempotencyKey, err)
	}
	return r, nil
}

// checkIntent refuses an intent with a missing field or a send deadline out
// of range.
func checkIntent(in Intent) error {
	for name, v := range map[string]string{"idempotency key": in.IdempotencyKey,
		"operation": in.Operation, "dependency": in.Dependency, "method": in.Method} {
		if v == "" {
			return fmt.Errorf("ledger: plan: %w: %s is empty", ErrInvalidIntent, name)
		}
	}
	if !printable(in.IdempotencyKey) {
		return fmt.Errorf("ledger: plan %q: %w: the key holds a control character or invalid UTF-8",
			sanitize.Terminal(truncate(in.IdempotencyKey)), ErrInvalidKey)
	}
	for _, f := range []struct {
		name, v string
		max     int
	}{{"operation", in.Operation, MaxNameBytes}, {"dependency", in.Dependency, MaxNameBytes},
		{"method", in.Method, MaxNameBytes}, {"target", in.Target, MaxTargetBytes},
		{"webhook route", in.Webhook, MaxTargetBytes}} {
		if len(f.v) > f.max {
			return fmt.Errorf("ledger: plan %s: %w: the %s is %d bytes, more than %d",
				sanitize.Terminal(truncate(in.IdempotencyKey)), ErrInvalidIntent, f.name, len(f.v), f.max)
		}
		if !printable(f.v) {
			return fmt.Errorf("ledger: plan %s: %w: the %s holds a control character or invalid UTF-8",
				sanitize.Terminal(truncate(in.IdempotencyKey)), ErrInvalidIntent, f.name)
		}
	}
	if d := sendDelay(in); d <= 0 || d > MaxSendDelayLimit {
		return fmt.Errorf("ledger: plan %s: %w: MaxSendDelay %v is not in (0, %v]",
			in.IdempotencyKey, ErrInvalidIntent, in.MaxSendDelay, MaxSendDelayLimit)
	}
	return nil
}

// printable reports whether s is valid UTF-8 without control characters
// (C0, DEL, C1, line and paragraph separators, bidirectional controls): the
// characters reconciler.plan refuses in a key, name or target.
func printable(s string) bool { return sanitize.Terminal(s) == s }

// truncate shortens s for an error message.
func truncate(s string) string {
	out, _ := sanitize.Text(s, 64)
	return out
}

// storableID returns id if it can be stored as an external id unaltered
// (printable and at most MaxExternalIDBytes), else "" and a description of
// it for the move's detail: an altered id names nothing the API knows, and
// readbacks look receipts up by it.
func storableID(id string) (string, map[string]any) {
	if id == "" || (len(id) <= MaxExternalIDBytes && printable(id)) {
		return id, nil
	}
	excerpt, _ := sanitize.Text(id, 64)
	h := sha256.Sum256([]byte(id))
	return "", map[string]any{"excerpt": sanitize.Terminal(excerpt),
		"sha256": "sha256:" + hex.EncodeToString(h[:]), "bytes": len(id)}
}

// detailJSON encodes a move's detail as jsonb accepts it: strings valid
// UTF-8 without NUL and bounded, marked "sanitized" where altered.
func detailJSON(d Detail) ([]byte, error) {
	j, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	j, _ = sanitize.JSON(j, maxDetailString, maxDetailBytes)
	return j, nil
}

// sendDelay is the intent's send deadline with the default applied.
func sendDelay(in Intent) time.Duration {
	if in.MaxSendDelay == 0 {
		return DefaultMaxSendDelay
	}
	return in.MaxSendDelay
}

// intentFingerprint computes the fingerprint plan records; key is the
// client's secret key option (nil without one).
func intentFingerprint(in Intent, key fingerprint.Option) (fingerprint.Result, error) {
	payload := in.Payload
	if len(payload) == 0 {
		payload = json.RawMessage(`{}`)
	}
	fp, err := fingerprint.Compute(in.Method, in.Target, payload,
		fingerprint.WithDrop(in.Drop...), fingerprint.WithSecret(in.Secret...), key)
	if err != nil {
		return fp, fmt.Errorf("ledger: plan %s: %w: %w", in.IdempotencyKey, ErrInvalidIntent, err)
	}
	return fp, nil
}

// plan records a checked intent with its fingerprint fp, submitted too
// when submit is set (see PlanAndSubmit).
func (c *Client) plan(ctx context.Context, in Intent, fp fingerprint.Result, retryOf int64, submit bool) (*Receipt, error) {
	var retry *int64
	if retryOf != 0 {
		retry = &retryOf
	}
	args := []any{in.IdempotencyKey, in.Operation, in.Dependency, strings.ToUpper(in.Method), in.Target,
		fp.Fingerprint, fp.Intent, string(c.actor), in.AllowDuplicate, retry, preImage(in.PreImage),
		sendDelay(in), submit}
	sql := sqlPlan
	if in.Webhook != "" {
		sql, args = sqlPlanWebhook, append(args, in.Webhook)
	}
	if err := c.checkDurability(ctx); err != nil {
		return nil, fmt.Errorf("ledger: plan %s: nothing recorded, nothing sent: %w", in.IdempotencyKey, err)
	}
	ask := func() (*Receipt, error) {
		if submit {
			return c.submitRow(ctx, sql, args...)
		}
		return scanReceipt(c.pool.QueryRow(ctx, sql, args...))
	}
	r, err := ask()
	if code, pe := pgCode(err); code == codeUniqueKey && pe.ConstraintName == "receipt_keys_pkey" {
		// The key is taken, but plan found no receipt under it: either a
		// concurrent insert (PlanAndSubmit's, which does not take plan's
		// lock) committed after plan looked, or retention removed the
		// key's receipt. Asked again, plan returns the former's receipt;
		// the latter is refused again (planError: ErrKeyRemoved).
		r, err = ask()
	}
	var nr *NotReplicatedError
	if errors.As(err, &nr) {
		return r, fmt.Errorf("ledger: plan %s: %w", in.IdempotencyKey, err)
	}
	if code, pe := pgCode(err); code == codeKnownKey {
		// Not a failure: the key's receipt, for the caller to carry on from.
		id, _ := strconv.ParseInt(pe.Detail, 10, 64)
		if r, err = c.Get(ctx, id); err != nil {
			// Not ErrKnownKey: that error comes with the key's receipt,
			// which callers carry on from.
			return nil, fmt.Errorf("ledger: plan %s: the key names receipt %d, and reading it failed: %w", in.IdempotencyKey, id, err)
		}
		return r, fmt.Errorf("ledger: plan %s: %w", in.IdempotencyKey, ErrKnownKey)
	}
	if err != nil {
		return nil, c.planError(ctx, in.IdempotencyKey, err)
	}
	return r, nil
}

// preImage returns p as a value for a nullable jsonb parameter: nil (SQL
// NULL) when absent, so "no pre-image" is not confused with JSON null.
func preImage(p json.RawMessage) any {
	if len(p) == 0 {
		return nil
	}
	return []byte(p)
}

func (c *Client) planError(ctx context.Context, key string, err error) error {
	code, pe := pgCode(err)
	switch code {
	case codeDuplicate:
		return fmt.Errorf("ledger: plan %s: %w", key, c.duplicateError(ctx, pe))
	case codeInvalidKey:
		return fmt.Errorf("ledger: plan %s: %w: %s", key, ErrInvalidKey, pe.Message)
	case codeKeyReused:
		return fmt.Errorf("ledger: plan %s: %w: %s", key, ErrKeyConflict, pe.Message)
	case codeNotFound:
		return fmt.Errorf("ledger: plan %s: %w: %s", key, ErrNotFound, pe.Message)
	case codeConflict:
		return fmt.Errorf("ledger: plan %s: %w: %s", key, ErrStateConflict, pe.Message)
	case codeRetention:
		return fmt.Errorf("ledger: plan %s: %w, nothing sent: %w: %s", key, ErrRetryRefused, ErrKeyRetentionPassed, pe.Message)
	case codeUniqueKey:
		// reconciler.plan found no receipt under the key twice, yet the
		// key is taken: keys outlive the receipts retention removes.
		if pe.ConstraintName == "receipt_keys_pkey" {
			return fmt.Errorf("ledger: plan %s: %w", key, ErrKeyRemoved)
		}
	}
	return fmt.Errorf("ledger: plan %s: %w", key, err)
}

// duplicateError reads the receipt an RL005 refusal names in its DETAIL and
// returns the *DuplicateError carrying it.
func (c *Client) duplicateError(ctx context.Context, pe *pgconn.PgError) error {
	id, _ := strconv.ParseInt(pe.Detail, 10, 64)
	existing, gerr := c.Get(ctx, id)
	if gerr != nil {
		return fmt.Errorf("%w: %s (and reading receipt %d: %w)", ErrDuplicateIntent, pe.Message, id, gerr)
	}
	return &DuplicateError{Existing: existing}
}

// Transition makes one move in one transaction: the receipt's projection
// and its history event together, only if the receipt is still in m.From.
func (c *Client) Transition(ctx context.Context, m Move) (*Receipt, error) {
	if m.Actor == "" {
		m.Actor = c.actor
	}
	if err := statemachine.Check(m.Actor, m.From, m.To); err != nil {
		return nil, fmt.Errorf("ledger: receipt %d: %w", m.ID, err)
	}
	if id, untrusted := storableID(m.ExternalID); untrusted != nil {
		m.ExternalID = id
		m.Detail.Extra = maps.Clone(m.Detail.Extra)
		if m.Detail.Extra == nil {
			m.Detail.Extra = map[string]any{}
		}
		m.Detail.Extra["untrusted_external_id"] = untrusted
		m.Detail.Extra["sanitized"] = true
	}
	detail, err := detailJSON(m.Detail)
	if err != nil {
		return nil, fmt.Errorf("ledger: receipt %d: detail: %w", m.ID, err)
	}
	var ext *string
	if m.ExternalID != "" {
		ext = &m.ExternalID
	}
	sql := sqlMove
	if m.From == statemachine.Submitted && !c.durableOutcomes {
		sql = sqlMoveOutcome
	}
	var r *Receipt
	if m.To == statemachine.Submitted {
		if err := c.checkDurability(ctx); err != nil {
			return nil, fmt.Errorf("ledger: receipt %d: not submitted, nothing sent: %w", m.ID, err)
		}
		r, err = c.submitRow(ctx, sql, m.ID, string(m.To), string(m.Actor), detail, ext, string(m.From))
	} else {
		r, err = scanReceipt(c.pool.QueryRow(ctx, sql, m.ID, string(m.To), string(m.Actor), detail, ext, string(m.From)))
	}
	var nr *NotReplicatedError
	if errors.As(err, &nr) {
		return r, fmt.Errorf("ledger: %w", err)
	}
	if err == nil {
		return r, nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		// Not in the expected state, or no such receipt: tell which.
		cur, gerr := c.Get(ctx, m.ID)
		if gerr != nil {
			return nil, gerr
		}
		return nil, fmt.Errorf("ledger: %w", &ConflictError{ID: m.ID, Expected: m.From, Actual: cur.State})
	}
	switch code, pe := pgCode(err); code {
	case codeIllegal:
		// The trigger's message starts "illegal transition" itself.
		if rest, ok := strings.CutPrefix(pe.Message, statemachine.ErrIllegalTransition.Error()+" "); ok {
			return nil, fmt.Errorf("ledger: receipt %d: %w %s", m.ID, statemachine.ErrIllegalTransition, rest)
		}
		return nil, fmt.Errorf("ledger: receipt %d: %w: %s", m.ID, statemachine.ErrIllegalTransition, pe.Message)
	case codeDuplicate:
		// planned -> submitted re-checks the duplicate guard: another
		// receipt of the same intent went out since this one was planned.
		return nil, fmt.Errorf("ledger: receipt %d: %s -> %s: %w", m.ID, m.From, m.To, c.duplicateError(ctx, pe))
	case codeRetention:
		// planned -> submitted of a retry whose basis is a native key
		// past its retention (reconciler.retry_basis).
		return nil, fmt.Errorf("ledger: receipt %d: %s -> %s: %w: %w: %s", m.ID, m.From, m.To, ErrRetryRefused,
			ErrKeyRetentionPassed, pe.Message)
	case codeConflict:
		if m.From == statemachine.Planned && m.To == statemachine.Submitted {
			// planned -> submitted of a retry re-checks
			// reconciler.retry_error on the receipt it retries.
			return nil, fmt.Errorf("ledger: receipt %d: %s -> %s: %w: %s", m.ID, m.From, m.To, ErrRetryRefused, pe.Message)
		}
		if m.From == statemachine.SafeToRetry {
			// A fresh proof refused: a retry of the receipt went out.
			return nil, fmt.Errorf("ledger: receipt %d: %s -> %s: %w: %w", m.ID, m.From, m.To, ErrStateConflict, err)
		}
	}
	return nil, fmt.Errorf("ledger: receipt %d: %s -> %s: %w", m.ID, m.From, m.To, err)
}

// Submit records that the request is about to be sent. Call it before the
// first byte leaves: a crash after it leaves an orphan the reconciler finds.
// The request's bytes must then be written by the returned receipt's
// SendDeadline or not at all (Caller.Do enforces it). When another receipt
// of the same intent (same dependency and fingerprint, planned under
// another key) was submitted since this one was planned and is unresolved,
// Submit refuses with the *DuplicateError Plan would have returned: the
// receipt stays planned, and nothing may be sent. Submitting a retry
// re-checks that the receipt it retries may still be retried (its agent
// may have recorded a late answer since the retry was planned); when not,
// Submit refuses with ErrRetryRefused, the retry stays planned, and nothing
// may be sent.
func (c *Client) Submit(ctx context.Context, r *Receipt) (*Receipt, error) {
	return c.Transition(ctx, Move{ID: r.ID, From: r.State, To: statemachine.Submitted})
}

// Succeed records a verified effect with the external id from the response.
// Succeed, Reject and MarkUnknown of a submitted receipt return without
// waiting for the WAL flush, unless the client is WithDurableOutcomes.
func (c *Client) Succeed(ctx context.Context, r *Receipt, externalID string, d Detail) (*Receipt, error) {
	return c.Transition(ctx, Move{ID: r.ID, From: r.State, To: statemachine.Succeeded, ExternalID: externalID, Detail: d})
}

// Reject records a deterministic no-effect: a 4xx, or a failure before any
// byte was sent.
func (c *Client) Reject(ctx context.Context, r *Receipt, d Detail) (*Receipt, error) {
	return c.Transition(ctx, Move{ID: r.ID, From: r.State, To: statemachine.Rejected, Detail: d})
}

// MarkUnknown records that the request was sent and its answer lost.
func (c *Client) MarkUnknown(ctx context.Context, r *Receipt, d Detail) (*Receipt, error) {
	return c.Transition(ctx, Move{ID: r.ID, From: r.State, To: statemachine.OutcomeUnknown, Detail: d})
}

// RecordLateOutcome keeps, as evidence for the reconciler, the outcome this
// client observed for a receipt it submitted that someone else (the
// reconciler's orphan sweep) moved on before the response arrived: the
// receipt is in outcome_unknown, reconciling or manual_review, so the
// agent may no longer settle it, but the 2xx and its external id must not
// be lost. The reconciler settles a receipt with a late succeeded outcome
// as succeeded with that external id. A receipt already settled
// safe_to_retry may get one too: a success, or an unknown answer after the
// window its settlement declared, sends it back to outcome_unknown (unless
// a retry of it went out), so the duplicate guard holds its intent again
// and the reconciler settles it anew (docs/rules-of-time.md). Only the
// actor that submitted the receipt may record one; otherwise, or in any
// other state, the database refuses with ErrStateConflict. Late outcomes
// are append-only.
func (c *Client) RecordLateOutcome(ctx context.Context, id int64, outcome Outcome, httpStatus int, externalID string, d Detail) error {
	if !outcome.Valid() {
		return fmt.Errorf("ledger: late outcome of receipt %d: %w: outcome %q", id, ErrInvalidIntent, outcome)
	}
	if sid, untrusted := storableID(externalID); untrusted != nil {
		externalID = sid
		d.Extra = maps.Clone(d.Extra)
		if d.Extra == nil {
			d.Extra = map[string]any{}
		}
		d.Extra["untrusted_external_id"] = untrusted
		d.Extra["sanitized"] = true
	}
	detail, err := detailJSON(d)
	if err != nil {
		return fmt.Errorf("ledger: late outcome of receipt %d: detail: %w", id, err)
	}
	var status *int
	if httpStatus != 0 {
		status = &httpStatus
	}
	var ext *string
	if externalID != "" {
		ext = &externalID
	}
	_, err = c.pool.Exec(ctx, `SELECT reconciler.record_late_outcome(receipt_id => $1, actor => $2,
		outcome => $3, http_status => $4, external_id => $5, detail => $6)`,
		id, string(c.actor), string(outcome), status, ext, detail)
	switch code, pe := pgCode(err); {
	case err == nil:
		return nil
	case code == codeConflict:
		return fmt.Errorf("ledger: late outcome of receipt %d: %w: %s", id, ErrStateConflict, pe.Message)
	case code == codeNotFound:
		return fmt.Errorf("ledger: late outcome of receipt %d: %w: %s", id, ErrNotFound, pe.Message)
	}
	return fmt.Errorf("ledger: late outcome of receipt %d: %w", id, err)
}

// Retry plans attempt n+1 of a safe_to_retry receipt, or of a retryable
// rejection (see Receipt.Retryable), linked to it, under the key
// "<logical key>#<attempt>". The intent is the previous one; pass
// the original payload so secret fields (redacted in storage) are covered.
// A payload whose fingerprint differs from the previous attempt's is
// refused with ErrInvalidIntent before anything is recorded, so a wrong
// payload never takes the step's next key: Retry with the right one still
// works. in.MaxSendDelay applies to the new attempt.
func (c *Client) Retry(ctx context.Context, prev *Receipt, in Intent) (*Receipt, error) {
	return c.retry(ctx, prev, in, false)
}

// retry plans attempt n+1 of prev, submitted too when submit is set (see
// PlanAndSubmit: a known retry key returns its receipt with ErrKnownKey).
func (c *Client) retry(ctx context.Context, prev *Receipt, in Intent, submit bool) (*Receipt, error) {
	if prev.State != statemachine.SafeToRetry && !prev.Retryable {
		return nil, fmt.Errorf("ledger: retry receipt %d: %w: it is %s, neither safe_to_retry nor a retryable rejection",
			prev.ID, ErrStateConflict, prev.State)
	}
	in.IdempotencyKey = LogicalKey(prev.IdempotencyKey) + "#" + strconv.Itoa(prev.Attempt+1)
	in.Operation, in.Dependency, in.Method, in.Target = prev.Operation, prev.Dependency, prev.Method, prev.Target
	if err := checkIntent(in); err != nil {
		return nil, err
	}
	fp, err := intentFingerprint(in, c.secretKey)
	if err != nil {
		return nil, err
	}
	if fp.Fingerprint != prev.Fingerprint {
		return nil, fmt.Errorf("ledger: retry receipt %d: %w: the payload's fingerprint %s differs from %s",
			prev.ID, ErrInvalidIntent, fp.Fingerprint, prev.Fingerprint)
	}
	r, err := c.plan(ctx, in, fp, prev.ID, submit)
	if errors.Is(err, ErrStateConflict) {
		// reconciler.retry_error refused it (RL002).
		return nil, fmt.Errorf("ledger: retry receipt %d: %w, nothing sent: %w", prev.ID, ErrRetryRefused, err)
	}
	return r, err
}

// Get returns the receipt with id.
func (c *Client) Get(ctx context.Context, id int64) (*Receipt, error) {
	r, err := scanReceipt(c.pool.QueryRow(ctx,
		`SELECT `+receiptColumns+` FROM reconciler.receipts WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("ledger: receipt %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("ledger: get receipt %d: %w", id, err)
	}
	return r, nil
}

// History returns the receipt's events in order.
func (c *Client) History(ctx context.Context, id int64) ([]Event, error) {
	rows, err := c.pool.Query(ctx, `
		SELECT seq, coalesce(from_state, ''), to_state, at, actor, error, evidence, detail,
		       coalesce(external_id, '')
		FROM reconciler.receipt_events WHERE receipt_id = $1 ORDER BY seq`, id)
	if err != nil {
		return nil, fmt.Errorf("ledger: history of receipt %d: %w", id, err)
	}
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Event, error) {
		var e Event
		var from, to, actor string
		err := row.Scan(&e.Seq, &from, &to, &e.At, &actor, &e.Error, &e.Evidence, &e.Detail, &e.ExternalID)
		e.From, e.To, e.Actor = statemachine.State(from), statemachine.State(to), statemachine.Actor(actor)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: history of receipt %d: %w", id, err)
	}
	if len(events) == 0 {
		if _, err := c.Get(ctx, id); err != nil {
			return nil, err
		}
	}
	return events, nil
}

// WithSecretKey returns a client like c whose fingerprints key the values
// of secret fields (Intent.Secret) with HMAC-SHA256 under key, recorded
// with keyID in every keyed value (see fingerprint.WithSecretKey); the
// deployment's key is read by SecretKeyFromEnv. Without a key, Plan and
// Caller.Do refuse an intent with secret fields (ErrInvalidIntent wrapping
// fingerprint.ErrSecretKeyRequired). Rotating the key changes the
// fingerprint of intents with secret fields: the duplicate guard does not
// match a receipt planned under the previous key, and Retry refuses a
// retry of one (ErrInvalidIntent); rotate when no receipt with secret
// fields is unresolved.
func (c *Client) WithSecretKey(keyID string, key []byte) (*Client, error) {
	opt := fingerprint.WithSecretKey(keyID, key)
	if _, err := fingerprint.Compute("GET", "/", []byte(`{}`), opt); err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	d := *c
	d.secretKey = opt
	return &d, nil
}

// SecretKeyFromEnv returns c with the deployment's secret key
// (RECONCILER_SECRET_KEY, hex or base64, at least 32 bytes, and
// RECONCILER_SECRET_KEY_ID; see fingerprint.SecretKeyFromEnv) when it is
// set, and c itself when it is not; a malformed key is an error.
func (c *Client) SecretKeyFromEnv(getenv func(string) string) (*Client, error) {
	id, key, ok, err := fingerprint.SecretKeyFromEnv(getenv)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	if !ok {
		return c, nil
	}
	return c.WithSecretKey(id, key)
}
