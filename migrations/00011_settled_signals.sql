-- Issue 12, the agent's hot path: the settlement signals of 00009 (NOTIFY
-- reconciler_settled) and 00010 (queue the route's webhook) no longer cost
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
-- Nobody waits on a notification of those moves: the agent that records the
-- outcome of its own call has it already. What waiters wait for is the
-- settlement of an unknown outcome: a move out of outcome_unknown,
-- reconciling or manual_review, made by the reconciler or a reviewer. Only
-- those moves notify now, and ledger.Client.Await re-reads a receipt still
-- in flight (planned or submitted) on a short timer instead. Both signals
-- come from the statement trigger that already writes history (one
-- statement per UPDATE, not two trigger calls per row), in the settling
-- transaction as before: the NOTIFY is delivered at its commit.
--
-- Issue 13's leftover, a webhook registration lost to a gateway crash: the
-- gateway registered a receipt's webhook (reconciler.webhook_receipts) after
-- the call returned, so a gateway that died between the upstream's answer
-- and that statement left a receipt whose settlement nobody would be told
-- of. It now registers in the statement that records the receipt
-- (ledger.Intent.Webhook: the same commit, before any byte is sent), and the
-- trigger queues the event of every settlement of a registered receipt,
-- whoever makes it, the agent's own outcome included: an agent's move pays
-- one probe of webhook_receipts' primary key.
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
