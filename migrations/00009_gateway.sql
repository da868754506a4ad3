-- Issue 13, the receipt gateway. Two things the gateway (and any client that
-- waits for a settlement) needs from the database:
--
-- 1. A NOTIFY on settlement. `reconciler gateway`'s `GET /receipts/{id}?wait=`
--    and Go's ledger.Client.Await wake on it instead of polling the table:
--    every move into succeeded, safe_to_retry, rejected or manual_review
--    sends `reconciler_settled` with the receipt's id as its payload,
--    delivered at commit. A row trigger with a WHEN clause, so moves into
--    the other states (and updates that move nothing: leases, schedules)
--    queue no trigger event at all.
--
-- 2. The responses the gateway replays. An agent that sends the same
--    Idempotency-Key again after its call settled gets the upstream's
--    answer again (status, the headers that matter, the body up to the
--    route's bound) without a byte sent upstream. They are kept for a
--    retention period and then deleted: they are a cache of the answer, not
--    history (the receipt's events are the history), so unlike history they
--    may be deleted. Credentials are never stored: the gateway injects the
--    upstream's credentials itself and removes every form of them from a
--    body before storing it; request headers are not stored at all.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_notify_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('reconciler_settled', NEW.id::text);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER receipts_notify_settled
    AFTER UPDATE OF state ON reconciler.receipts
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review'))
    EXECUTE FUNCTION reconciler.receipts_notify_settled();

CREATE TABLE reconciler.gateway_responses (
    receipt_id  bigint PRIMARY KEY REFERENCES reconciler.receipts (id),
    -- The agent actor whose call it answered: replayed to that agent only.
    agent       text NOT NULL CHECK (agent ~ '^agent:.'),
    status      integer NOT NULL CHECK (status BETWEEN 100 AND 599),
    -- Only the headers the route keeps (Content-Type, Location, ...).
    headers     jsonb NOT NULL DEFAULT '{}',
    -- NULL when the body was larger than the route keeps.
    body        bytea,
    body_bytes  bigint NOT NULL CHECK (body_bytes >= 0),
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL
);
-- The gateway's periodic cleanup deletes expired rows in expiry order.
CREATE INDEX gateway_responses_expiry ON reconciler.gateway_responses (expires_at);

-- Where the roles of docs/roles.sql are in use, the gateway runs as an agent:
-- it records, replays and expires the responses.
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_agent') IS NOT NULL THEN
        GRANT SELECT, INSERT, DELETE ON reconciler.gateway_responses TO reconciler_agent;
    END IF;
    IF to_regrole('reconciler_readonly') IS NOT NULL THEN
        GRANT SELECT ON reconciler.gateway_responses TO reconciler_readonly;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE reconciler.gateway_responses;
DROP TRIGGER receipts_notify_settled ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_notify_settled();
