-- Issue 12, the agent's hot path: the settlement signals of 00009 (NOTIFY
-- reconciler_settled) and 00010 (queue the route's webhook) no longer run on
-- the moves an agent makes itself.
--
-- Both were row triggers on every move into a settled state, so every call
-- an agent recorded (submitted -> succeeded, the commonest move there is)
-- paid for two more trigger calls, and its commit took the server-wide lock
-- that serializes the commits of every transaction that notified (Postgres
-- queues notifications under one lock held through the commit's WAL flush):
-- with eight agents the ledger ran at 0.55x bare SQL, and at 0.8x without
-- them.
--
-- Nobody needs a signal for those moves. The agent that records the outcome
-- of its own call has it already, and so does the gateway, which registers a
-- receipt's webhook only after the call returns (gateway.register). What
-- waiters and webhooks wait for is the settlement of an unknown outcome: a
-- move out of outcome_unknown, reconciling or manual_review, made by the
-- reconciler or a reviewer. Those moves now signal from the statement
-- trigger that already writes their history (one statement per UPDATE, not
-- two trigger calls per row), and in the same transaction as before: the
-- webhook is queued durably with the settlement, and the NOTIFY is delivered
-- at its commit. ledger.Client.Await re-reads a receipt still in flight
-- (planned or submitted) on a short timer instead.
--
-- And reconciler.transition compares the expected state under the "C"
-- collation, as the ledger client's own move does: planned for its
-- arguments, "state = 'submitted'" proves receipts_stale's predicate, and
-- the move scanned every receipt in flight (and the dead index entries of
-- those that had moved on) instead of probing the primary key.

-- +goose Up
DROP TRIGGER receipts_notify_settled ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_notify_settled();
DROP TRIGGER receipts_queue_webhook ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_queue_webhook();

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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.transition(
    receipt_id bigint,
    to_state text,
    actor text,
    detail jsonb DEFAULT '{}',
    external_id text DEFAULT NULL,
    expected_state text DEFAULT NULL
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
BEGIN
    -- The expected state under the "C" collation: the same comparison,
    -- but no index predicate is proved by it (ledger's sqlMove says why).
    UPDATE reconciler.receipts x
    SET state = transition.to_state,
        state_actor = transition.actor,
        state_detail = coalesce(transition.detail, '{}'),
        external_id = coalesce(transition.external_id, x.external_id)
    WHERE x.id = transition.receipt_id
      AND (transition.expected_state IS NULL OR x.state = transition.expected_state COLLATE "C")
      AND x.state <> transition.to_state
    RETURNING * INTO r;
    IF FOUND THEN
        RETURN r;
    END IF;
    SELECT * INTO r FROM reconciler.receipts x WHERE x.id = transition.receipt_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'receipt % does not exist', transition.receipt_id USING ERRCODE = 'RL003';
    END IF;
    IF r.state = transition.to_state
       AND (transition.expected_state IS NULL OR transition.expected_state = r.state) THEN
        RAISE EXCEPTION 'illegal transition % -> % by %: the receipt is already %',
            r.state, r.state, transition.actor, r.state USING ERRCODE = 'RL001';
    END IF;
    RAISE EXCEPTION 'receipt % is %, expected %: another writer moved it first',
        r.id, r.state, transition.expected_state USING ERRCODE = 'RL002', DETAIL = r.state;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.transition(
    receipt_id bigint,
    to_state text,
    actor text,
    detail jsonb DEFAULT '{}',
    external_id text DEFAULT NULL,
    expected_state text DEFAULT NULL
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
BEGIN
    UPDATE reconciler.receipts x
    SET state = transition.to_state,
        state_actor = transition.actor,
        state_detail = coalesce(transition.detail, '{}'),
        external_id = coalesce(transition.external_id, x.external_id)
    WHERE x.id = transition.receipt_id
      AND (transition.expected_state IS NULL OR x.state = transition.expected_state)
      AND x.state <> transition.to_state
    RETURNING * INTO r;
    IF FOUND THEN
        RETURN r;
    END IF;
    SELECT * INTO r FROM reconciler.receipts x WHERE x.id = transition.receipt_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'receipt % does not exist', transition.receipt_id USING ERRCODE = 'RL003';
    END IF;
    IF r.state = transition.to_state
       AND (transition.expected_state IS NULL OR transition.expected_state = r.state) THEN
        RAISE EXCEPTION 'illegal transition % -> % by %: the receipt is already %',
            r.state, r.state, transition.actor, r.state USING ERRCODE = 'RL001';
    END IF;
    RAISE EXCEPTION 'receipt % is %, expected %: another writer moved it first',
        r.id, r.state, transition.expected_state USING ERRCODE = 'RL002', DETAIL = r.state;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_record_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
BEGIN
    INSERT INTO reconciler.receipt_events
        (receipt_id, seq, from_state, to_state, at, actor, error, evidence, detail, external_id)
    SELECT n.id, n.version, n.moved_from, n.state, n.updated_at, n.state_actor,
           n.state_detail -> 'error', n.state_detail -> 'evidence', n.state_detail, n.external_id
    FROM new_rows n
    WHERE n.moved_from IS NOT NULL;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

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
CREATE TRIGGER receipts_queue_webhook
    AFTER UPDATE OF state ON reconciler.receipts
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review'))
    EXECUTE FUNCTION reconciler.receipts_queue_webhook();
