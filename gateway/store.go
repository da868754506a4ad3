package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The gateway's SQL, all of it: the responses it keeps for replays
// (reconciler.gateway_responses, migration 00009) and its webhooks
// (reconciler.webhook_receipts and webhook_deliveries, migration 00010).
// Every time is the database's.
const (
	// sqlRecord commits without waiting for its WAL flush
	// (synchronous_commit off for its own transaction), as the ledger
	// records the outcome it follows (ledger.Client.WithDurableOutcomes
	// says why that is sound). A kept response is a cache of the answer
	// for replays: a crash of the database server that loses it leaves a
	// settled receipt without one, which a replay answers from the receipt
	// (as for one settled by a readback), or loses the outcome before it
	// too (the WAL is written in order), and the reconciler settles the
	// receipt again.
	sqlRecord = `INSERT INTO reconciler.gateway_responses
		(receipt_id, agent, status, headers, body, body_bytes, expires_at)
		SELECT $1::bigint, $2::text, $3::integer, $4::jsonb, $5::bytea, $6::bigint,
		       clock_timestamp() + $7::interval
		FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async
		ON CONFLICT (receipt_id) DO NOTHING`
	sqlLookup = `SELECT agent, status, headers, body, body_bytes FROM reconciler.gateway_responses
		WHERE receipt_id = $1 AND expires_at > clock_timestamp()`
	// sqlOwner is the actor that created a receipt: the actor of its first
	// event (history is append-only, so it never changes).
	sqlOwner = `SELECT actor FROM reconciler.receipt_events WHERE receipt_id = $1 ORDER BY seq LIMIT 1`
	// sqlKeyOwner is the owner of the receipt an idempotency key names.
	sqlKeyOwner = `SELECT e.actor FROM reconciler.receipt_keys k
		JOIN reconciler.receipt_events e ON e.receipt_id = k.receipt_id
		WHERE k.idempotency_key = $1 ORDER BY e.seq LIMIT 1`
	sqlExpire = `DELETE FROM reconciler.gateway_responses WHERE receipt_id IN (
		SELECT receipt_id FROM reconciler.gateway_responses
		WHERE expires_at <= clock_timestamp() ORDER BY expires_at LIMIT $1)`

	// sqlRegisterWebhook records that a receipt was made through a route
	// with a webhook and, when it has settled already, queues its event: a
	// receipt recorded before migration 00011, whose registration was made
	// after the call (a new receipt is registered by the statement that
	// records it: ledger.Intent.Webhook). FOR SHARE orders it with a
	// settlement in flight: that one either committed before (the row is
	// read as settled here) or waits for this statement to commit (and its
	// trigger then sees the registration).
	sqlRegisterWebhook = `WITH r AS (
			SELECT id, state FROM reconciler.receipts WHERE id = $1 FOR SHARE),
		reg AS (
			INSERT INTO reconciler.webhook_receipts (receipt_id, route)
			SELECT id, $2 FROM r ON CONFLICT DO NOTHING RETURNING receipt_id, route)
		INSERT INTO reconciler.webhook_deliveries (receipt_id, state, route)
		SELECT r.id, r.state, reg.route FROM r JOIN reg ON reg.receipt_id = r.id
		WHERE r.state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review')
		ON CONFLICT DO NOTHING`
	// sqlClaimWebhooks leases due deliveries of the routes given: attempts
	// counts the attempt about to be made (and fences its outcome), and
	// next_attempt_at moves past the attempt's end so no other gateway
	// claims the row meanwhile.
	sqlClaimWebhooks = `UPDATE reconciler.webhook_deliveries d
		SET attempts = d.attempts + 1, last_attempt_at = clock_timestamp(),
		    next_attempt_at = clock_timestamp() + $3::interval
		FROM reconciler.receipts r
		WHERE (d.receipt_id, d.state) IN (
			SELECT receipt_id, state FROM reconciler.webhook_deliveries
			WHERE delivered_at IS NULL AND gave_up_at IS NULL AND next_attempt_at <= clock_timestamp()
			  AND route = ANY($1)
			ORDER BY next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED)
		  AND r.id = d.receipt_id
		RETURNING d.receipt_id, d.state, d.route, d.attempts, d.settled_at, r.idempotency_key,
		          r.operation, r.dependency, coalesce(r.external_id, ''), r.attempt`
	sqlWebhookDelivered = `UPDATE reconciler.webhook_deliveries
		SET delivered_at = clock_timestamp(), last_status = $4, last_error = NULL
		WHERE receipt_id = $1 AND state = $2 AND attempts = $3 AND delivered_at IS NULL`
	// sqlWebhookFailed schedules the next attempt, or gives the event up
	// when its attempts or its age ran out.
	sqlWebhookFailed = `UPDATE reconciler.webhook_deliveries
		SET last_status = $4, last_error = $5, next_attempt_at = clock_timestamp() + $6::interval,
		    gave_up_at = CASE WHEN attempts >= $7 OR settled_at + $8::interval <= clock_timestamp()
		                      THEN clock_timestamp() END
		WHERE receipt_id = $1 AND state = $2 AND attempts = $3 AND delivered_at IS NULL
		RETURNING gave_up_at IS NOT NULL`
	// sqlWebhookNextDue is how long until the next pending delivery of the
	// routes given is due, in seconds (NULL: none pending).
	sqlWebhookNextDue = `SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8
		FROM reconciler.webhook_deliveries
		WHERE delivered_at IS NULL AND gave_up_at IS NULL AND route = ANY($1)`
)

// storedResponse is a settled call's response as kept for replays.
type storedResponse struct {
	Agent   string
	Status  int
	Headers http.Header
	// Body is nil when the body was larger than the replay bound.
	Body      []byte
	BodyBytes int64
}

type store struct{ db *pgxpool.Pool }

// record keeps a settled call's response for retention. A receipt keeps
// the first response recorded for it.
func (s store) record(ctx context.Context, receiptID int64, resp storedResponse, retention time.Duration) error {
	if resp.Headers == nil {
		resp.Headers = http.Header{}
	}
	_, err := s.db.Exec(ctx, sqlRecord, receiptID, resp.Agent, resp.Status, resp.Headers, resp.Body,
		resp.BodyBytes, retention)
	if err != nil {
		return fmt.Errorf("gateway: record the response of receipt %d: %w", receiptID, err)
	}
	return nil
}

// lookup returns the response kept for a receipt, or nil when none is
// (never recorded, or expired).
func (s store) lookup(ctx context.Context, receiptID int64) (*storedResponse, error) {
	var r storedResponse
	err := s.db.QueryRow(ctx, sqlLookup, receiptID).Scan(&r.Agent, &r.Status, &r.Headers, &r.Body, &r.BodyBytes)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("gateway: read the response of receipt %d: %w", receiptID, err)
	}
	return &r, nil
}

// owner returns the actor that created receipt id, "" when there is no
// such receipt.
func (s store) owner(ctx context.Context, id int64) (string, error) {
	var actor string
	err := s.db.QueryRow(ctx, sqlOwner, id).Scan(&actor)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("gateway: read the owner of receipt %d: %w", id, err)
	}
	return actor, nil
}

// keyOwner returns the actor that created the receipt key names, "" when
// the key names none.
func (s store) keyOwner(ctx context.Context, key string) (string, error) {
	var actor string
	err := s.db.QueryRow(ctx, sqlKeyOwner, key).Scan(&actor)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("gateway: read the owner of a key: %w", err)
	}
	return actor, nil
}

// expire deletes at most limit expired responses and returns how many.
func (s store) expire(ctx context.Context, limit int) (int64, error) {
	tag, err := s.db.Exec(ctx, sqlExpire, limit)
	if err != nil {
		return 0, fmt.Errorf("gateway: expire responses: %w", err)
	}
	return tag.RowsAffected(), nil
}

// claimedDelivery is a webhook delivery leased for one attempt.
type claimedDelivery struct {
	ReceiptID      int64
	State          string
	Route          string
	Attempts       int
	SettledAt      time.Time
	IdempotencyKey string
	Operation      string
	Dependency     string
	ExternalID     string
	Attempt        int
}

// registerWebhook records that receipt id was made through route, and
// keeps its response for retention when kept is not nil; it reports
// whether an event was queued at once (the receipt had settled).
func (s store) registerWebhook(ctx context.Context, id int64, route string) (bool, error) {
	tag, err := s.db.Exec(ctx, sqlRegisterWebhook, id, route)
	if err != nil {
		return false, fmt.Errorf("gateway: register the webhook of receipt %d: %w", id, err)
	}
	return tag.RowsAffected() > 0, nil
}

// claimWebhooks leases at most limit due deliveries of routes for lease.
func (s store) claimWebhooks(ctx context.Context, routes []string, limit int, lease time.Duration) ([]claimedDelivery, error) {
	rows, err := s.db.Query(ctx, sqlClaimWebhooks, routes, limit, lease)
	if err != nil {
		return nil, fmt.Errorf("gateway: claim webhook deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (claimedDelivery, error) {
		var d claimedDelivery
		err := row.Scan(&d.ReceiptID, &d.State, &d.Route, &d.Attempts, &d.SettledAt, &d.IdempotencyKey,
			&d.Operation, &d.Dependency, &d.ExternalID, &d.Attempt)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("gateway: claim webhook deliveries: %w", err)
	}
	return out, nil
}

// webhookDelivered records a delivery's success; false when the claim was
// lost (another gateway's lease, or delivered already).
func (s store) webhookDelivered(ctx context.Context, d claimedDelivery, status int) (bool, error) {
	tag, err := s.db.Exec(ctx, sqlWebhookDelivered, d.ReceiptID, d.State, d.Attempts, status)
	if err != nil {
		return false, fmt.Errorf("gateway: record the webhook of receipt %d: %w", d.ReceiptID, err)
	}
	return tag.RowsAffected() > 0, nil
}

// webhookFailed records a failed attempt (status 0: no answer) and
// schedules the next one after wait, or gives up; it reports whether it
// gave up.
func (s store) webhookFailed(ctx context.Context, d claimedDelivery, status int, msg string, wait time.Duration, w *Webhook) (bool, error) {
	var st *int
	if status != 0 {
		st = &status
	}
	var gaveUp bool
	err := s.db.QueryRow(ctx, sqlWebhookFailed, d.ReceiptID, d.State, d.Attempts, st, msg, wait, w.MaxAttempts, w.MaxAge).Scan(&gaveUp)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("gateway: record the webhook of receipt %d: %w", d.ReceiptID, err)
	}
	return gaveUp, nil
}

// webhookNextDue returns how long until the next pending delivery of
// routes is due; ok is false when none is pending.
func (s store) webhookNextDue(ctx context.Context, routes []string) (time.Duration, bool, error) {
	var secs *float64
	if err := s.db.QueryRow(ctx, sqlWebhookNextDue, routes).Scan(&secs); err != nil {
		return 0, false, fmt.Errorf("gateway: next webhook delivery: %w", err)
	}
	if secs == nil {
		return 0, false, nil
	}
	return time.Duration(*secs * float64(time.Second)), true, nil
}
