-- Issue 13's leftover: a webhook registration lost to a gateway crash.
--
-- The gateway registered a receipt's webhook (reconciler.webhook_receipts)
-- after the call returned, so a gateway that died between the upstream's
-- answer and that statement left a receipt whose settlement nobody would
-- ever be told of. It now registers in the statement that records the
-- receipt (ledger.Intent.Webhook: the same INSERT, the same commit, before
-- any byte is sent), so a receipt of a route with a webhook is never
-- without its registration.
--
-- A registered receipt's settlement is then queued by the trigger in the
-- settling transaction, whoever settles it, the agent's own outcome
-- included (00011 queued only the reconciler's and reviewers' settlements,
-- and relied on the registration after the call to queue the agent's).
-- An agent's move now pays one probe of webhook_receipts' primary key; the
-- NOTIFY stays for settlements of unknown outcomes only.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_record_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    signalled bigint;
BEGIN
    WITH e AS (
        INSERT INTO reconciler.receipt_events
            (receipt_id, seq, from_state, to_state, at, actor, error, evidence, detail, external_id)
        SELECT n.id, n.version, n.moved_from, n.state, n.updated_at, n.state_actor,
               n.state_detail -> 'error', n.state_detail -> 'evidence', n.state_detail, n.external_id
        FROM new_rows n
        WHERE n.moved_from IS NOT NULL
        RETURNING receipt_id, from_state, to_state
    ), settled AS (
        SELECT e.receipt_id, e.from_state, e.to_state FROM e
        WHERE e.to_state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review')
    ), hooks AS (
        INSERT INTO reconciler.webhook_deliveries (receipt_id, state, route)
        SELECT s.receipt_id, s.to_state, w.route
        FROM settled s JOIN reconciler.webhook_receipts w ON w.receipt_id = s.receipt_id
        ON CONFLICT DO NOTHING
    )
    SELECT count(pg_notify('reconciler_settled', s.receipt_id::text)) INTO signalled FROM settled s
    WHERE s.from_state IN ('outcome_unknown', 'reconciling', 'manual_review');
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_record_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    signalled bigint;
BEGIN
    WITH e AS (
        INSERT INTO reconciler.receipt_events
            (receipt_id, seq, from_state, to_state, at, actor, error, evidence, detail, external_id)
        SELECT n.id, n.version, n.moved_from, n.state, n.updated_at, n.state_actor,
               n.state_detail -> 'error', n.state_detail -> 'evidence', n.state_detail, n.external_id
        FROM new_rows n
        WHERE n.moved_from IS NOT NULL
        RETURNING receipt_id, from_state, to_state
    ), settled AS (
        SELECT e.receipt_id, e.to_state FROM e
        WHERE e.from_state IN ('outcome_unknown', 'reconciling', 'manual_review')
          AND e.to_state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review')
    ), hooks AS (
        INSERT INTO reconciler.webhook_deliveries (receipt_id, state, route)
        SELECT s.receipt_id, s.to_state, w.route
        FROM settled s JOIN reconciler.webhook_receipts w ON w.receipt_id = s.receipt_id
        ON CONFLICT DO NOTHING
    )
    SELECT count(pg_notify('reconciler_settled', s.receipt_id::text)) INTO signalled FROM settled s;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
