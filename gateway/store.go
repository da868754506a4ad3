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
// (reconciler.gateway_responses, migration 00009). Every time is the
// database's.
const (
	sqlRecord = `INSERT INTO reconciler.gateway_responses
		(receipt_id, agent, status, headers, body, body_bytes, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7::interval)
		ON CONFLICT (receipt_id) DO NOTHING`
	sqlLookup = `SELECT agent, status, headers, body, body_bytes FROM reconciler.gateway_responses
		WHERE receipt_id = $1 AND expires_at > clock_timestamp()`
	sqlExpire = `DELETE FROM reconciler.gateway_responses WHERE receipt_id IN (
		SELECT receipt_id FROM reconciler.gateway_responses
		WHERE expires_at <= clock_timestamp() ORDER BY expires_at LIMIT $1)`
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

// expire deletes at most limit expired responses and returns how many.
func (s store) expire(ctx context.Context, limit int) (int64, error) {
	tag, err := s.db.Exec(ctx, sqlExpire, limit)
	if err != nil {
		return 0, fmt.Errorf("gateway: expire responses: %w", err)
	}
	return tag.RowsAffected(), nil
}
