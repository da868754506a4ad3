-- Issue 13, the gateway's webhooks on settlement. A route of the gateway may
-- name a webhook: when a receipt created through that route settles
-- (succeeded, safe_to_retry, rejected, manual_review), the gateway POSTs a
-- signed event to it, retried until delivered, and records each delivery.
--
-- 1. reconciler.webhook_receipts: the receipts created through a route with
--    a webhook, written by the gateway right after the call.
-- 2. reconciler.webhook_deliveries: one row per receipt and settled state,
--    written in the settling transaction itself by a trigger (or by the
--    gateway's registration when the receipt had already settled), so a
--    settlement is never lost, even while no gateway runs; a receipt moved
--    from manual_review to succeeded by a human gets a second event. The
--    gateways claim due rows (FOR UPDATE SKIP LOCKED, leased through
--    next_attempt_at) and record each attempt's outcome; delivered_at is set
--    once, by the claim's holder only (attempts is the fencing token).
--
-- The trigger runs as whoever settles (worker, reviewer, agent), none of
-- whom may write these tables: its function is SECURITY DEFINER, owned by
-- the migrating role, with a fixed search_path.

-- +goose Up
CREATE TABLE reconciler.webhook_receipts (
    receipt_id    bigint PRIMARY KEY REFERENCES reconciler.receipts (id),
    route         text NOT NULL CHECK (route <> ''),
    registered_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE reconciler.webhook_deliveries (
    receipt_id      bigint NOT NULL REFERENCES reconciler.receipts (id),
    state           text NOT NULL CHECK (state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review')),
    route           text NOT NULL,
    settled_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts        integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- The last attempt's HTTP status (NULL: no answer) and error, sanitized
    -- and bounded; neither ever holds the secret or the request body.
    last_status     integer,
    last_error      text CHECK (length(last_error) <= 1000),
    last_attempt_at timestamptz,
    -- When the row may be claimed next: a retry's time, or the end of the
    -- lease of the gateway delivering it.
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at    timestamptz,
    -- Set when the attempts or the age ran out: the event is not sent again.
    gave_up_at      timestamptz,
    PRIMARY KEY (receipt_id, state)
);
-- The gateways' claim: pending rows in due order.
CREATE INDEX webhook_deliveries_due ON reconciler.webhook_deliveries (next_attempt_at)
    WHERE delivered_at IS NULL AND gave_up_at IS NULL;

-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_queue_webhook() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO reconciler.webhook_deliveries (receipt_id, state, route)
    SELECT w.receipt_id, NEW.state, w.route FROM reconciler.webhook_receipts w
    WHERE w.receipt_id = NEW.id
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION reconciler.receipts_queue_webhook() FROM PUBLIC;

CREATE TRIGGER receipts_queue_webhook
    AFTER UPDATE OF state ON reconciler.receipts
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review'))
    EXECUTE FUNCTION reconciler.receipts_queue_webhook();

-- Where the roles of docs/roles.sql are in use, the gateway runs as an agent:
-- it registers its receipts, claims and records deliveries.
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_agent') IS NOT NULL THEN
        GRANT SELECT, INSERT ON reconciler.webhook_receipts TO reconciler_agent;
        GRANT SELECT, INSERT ON reconciler.webhook_deliveries TO reconciler_agent;
        GRANT UPDATE (attempts, last_status, last_error, last_attempt_at, next_attempt_at, delivered_at, gave_up_at)
            ON reconciler.webhook_deliveries TO reconciler_agent;
    END IF;
    IF to_regrole('reconciler_readonly') IS NOT NULL THEN
        GRANT SELECT ON reconciler.webhook_receipts, reconciler.webhook_deliveries TO reconciler_readonly;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER receipts_queue_webhook ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_queue_webhook();
DROP TABLE reconciler.webhook_deliveries;
DROP TABLE reconciler.webhook_receipts;
