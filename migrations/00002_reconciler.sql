-- +goose Up
ALTER TABLE reconciler.receipts SET (fillfactor = 50);
-- The reconciler's own records: the pre-image an update needs to prove
-- absence, every readback check (append-only), every detected duplicate
-- (append-only), and the NOTIFY that wakes idle reconcilers.

-- An update is "absent" only if the resource still holds the state it had
-- before the call, so that state is recorded at plan time.
ALTER TABLE reconciler.receipts ADD COLUMN pre_image jsonb;

-- Receipts held for a human: counted by the reconciler's metrics and listed
-- by review. Partial, so the hot path (rows that never need review) never
-- touches it.
-- Whether the latest check failed transiently: the next check is then a
-- retry, which the dependency's retry budget limits (internal/protect).
ALTER TABLE reconciler.receipts ADD COLUMN last_check_transient boolean NOT NULL DEFAULT false;

CREATE INDEX receipts_held ON reconciler.receipts (updated_at) WHERE state = 'manual_review';

-- One row per readback check, written in the same statement that settles or
-- reschedules the receipt. No foreign key: receipts are never deleted
-- (refuse_rewrite), and a per-row RI trigger would cost the batch settle a
-- third of its throughput for a guarantee the schema already gives.
CREATE TABLE reconciler.readback_checks (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    receipt_id    bigint NOT NULL,
    -- The receipt's check_count after this check: 1 for the first.
    check_no      integer NOT NULL,
    at            timestamptz NOT NULL,
    instance      text NOT NULL,
    adapter       text NOT NULL,
    dependency    text NOT NULL,
    verdict       text NOT NULL CHECK (verdict IN ('present', 'absent', 'inconclusive', 'diverged', 'error')),
    authoritative boolean NOT NULL DEFAULT false,
    matches       integer NOT NULL DEFAULT 0,
    latency_us    bigint NOT NULL CHECK (latency_us >= 0),
    error_class   text CHECK (error_class IN ('transient', 'permanent')),
    error         text,
    evidence      jsonb
);
CREATE INDEX readback_checks_receipt ON reconciler.readback_checks (receipt_id);

-- A create that matched more than one external resource: the receipt is
-- settled succeeded (the effect exists) and the extra copies are an alarm
-- for a human. Kept as rows so `stats` and dashboards can count them.
CREATE TABLE reconciler.duplicate_alarms (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    receipt_id   bigint NOT NULL,
    detected_at  timestamptz NOT NULL,
    instance     text NOT NULL,
    adapter      text NOT NULL,
    dependency   text NOT NULL,
    external_ids text[] NOT NULL
);
CREATE INDEX duplicate_alarms_receipt ON reconciler.duplicate_alarms (receipt_id);

CREATE TRIGGER readback_checks_append_only BEFORE UPDATE OR DELETE ON reconciler.readback_checks
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER readback_checks_no_truncate BEFORE TRUNCATE ON reconciler.readback_checks
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER duplicate_alarms_append_only BEFORE UPDATE OR DELETE ON reconciler.duplicate_alarms
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER duplicate_alarms_no_truncate BEFORE TRUNCATE ON reconciler.duplicate_alarms
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- Wake idle reconcilers once per statement that made any row
-- outcome_unknown. Rows only enter outcome_unknown by UPDATE (a receipt is
-- inserted planned), and the claim moves them out of it, so "some new row is
-- outcome_unknown" is the cheap test; a spurious wake-up costs one claim.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_notify_due() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE state = 'outcome_unknown') THEN
        PERFORM pg_notify('reconciler_due', '');
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER receipts_notify_due AFTER UPDATE ON reconciler.receipts
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.receipts_notify_due();

-- The history trigger joins the statement's old and new transition tables.
-- PL/pgSQL caches that plan per session from the first call's row counts:
-- planned for a one-row move, it stays a nested loop, and a 1,000-row batch
-- then costs a million comparisons (160 ms instead of 5 ms, measured).
-- Without nested loops the join is a hash or merge join whatever the cached
-- estimate, linear in the batch.
ALTER FUNCTION reconciler.receipts_record_update() SET enable_nestloop = off;

-- reconciler.plan gains pre_image (the resource's state before an update).
-- The signature changes, so the function is replaced, not altered.
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint);

-- +goose StatementBegin
CREATE FUNCTION reconciler.plan(
    idempotency_key text,
    operation text,
    dependency text,
    method text,
    target text,
    fingerprint text,
    intent jsonb,
    actor text,
    allow_duplicate boolean DEFAULT false,
    retry_of bigint DEFAULT NULL,
    pre_image jsonb DEFAULT NULL
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
    prev reconciler.receipts;
    earlier reconciler.receipts;
BEGIN
    SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
    IF FOUND THEN
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
        RETURN r;
    END IF;
    IF plan.retry_of IS NOT NULL THEN
        SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = plan.retry_of FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'receipt % does not exist', plan.retry_of USING ERRCODE = 'RL003';
        END IF;
        IF prev.state <> 'safe_to_retry' THEN
            RAISE EXCEPTION 'receipt % is %, not safe_to_retry: it cannot be retried', prev.id, prev.state
                USING ERRCODE = 'RL002';
        END IF;
    END IF;
    IF NOT plan.allow_duplicate THEN
        -- Serialize plans of one intent so two agents cannot both pass the
        -- guard. (Opted-out plans need no guard and take no lock.)
        PERFORM pg_advisory_xact_lock(hashtextextended(plan.dependency || ' ' || plan.fingerprint, 0));
        -- A plan of the same key may have committed while we waited: it is
        -- this very intent, so return it rather than call it a duplicate.
        SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
        IF FOUND AND r.fingerprint = plan.fingerprint AND r.dependency = plan.dependency THEN
            RETURN r;
        END IF;
        SELECT * INTO earlier FROM reconciler.receipts x
        WHERE x.dependency = plan.dependency AND x.fingerprint = plan.fingerprint
          AND x.state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review')
        ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'intent % is unresolved in receipt % (%): a re-planned duplicate is blocked',
                plan.fingerprint, earlier.id, earlier.state
                USING ERRCODE = 'RL005', DETAIL = earlier.id::text;
        END IF;
    END IF;
    INSERT INTO reconciler.receipts AS x
        (idempotency_key, operation, dependency, method, target, fingerprint, intent,
         state_actor, attempt, retry_of, pre_image)
    VALUES (plan.idempotency_key, plan.operation, plan.dependency, upper(plan.method), plan.target,
            plan.fingerprint, coalesce(plan.intent, '{}'), plan.actor,
            CASE WHEN plan.retry_of IS NULL THEN 1 ELSE prev.attempt + 1 END, plan.retry_of,
            plan.pre_image)
    ON CONFLICT ON CONSTRAINT receipts_idempotency_key_key DO NOTHING
    RETURNING * INTO r;
    IF NOT FOUND THEN
        -- A concurrent plan of the same key won the insert; return its row.
        SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
    END IF;
    RETURN r;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb);

-- The 00001 definition, restored verbatim.
-- +goose StatementBegin
CREATE FUNCTION reconciler.plan(
    idempotency_key text,
    operation text,
    dependency text,
    method text,
    target text,
    fingerprint text,
    intent jsonb,
    actor text,
    allow_duplicate boolean DEFAULT false,
    retry_of bigint DEFAULT NULL
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
    prev reconciler.receipts;
    earlier reconciler.receipts;
BEGIN
    SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
    IF FOUND THEN
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
        RETURN r;
    END IF;
    IF plan.retry_of IS NOT NULL THEN
        SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = plan.retry_of FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'receipt % does not exist', plan.retry_of USING ERRCODE = 'RL003';
        END IF;
        IF prev.state <> 'safe_to_retry' THEN
            RAISE EXCEPTION 'receipt % is %, not safe_to_retry: it cannot be retried', prev.id, prev.state
                USING ERRCODE = 'RL002';
        END IF;
    END IF;
    IF NOT plan.allow_duplicate THEN
        -- Serialize plans of one intent so two agents cannot both pass the
        -- guard. (Opted-out plans need no guard and take no lock.)
        PERFORM pg_advisory_xact_lock(hashtextextended(plan.dependency || ' ' || plan.fingerprint, 0));
        -- A plan of the same key may have committed while we waited: it is
        -- this very intent, so return it rather than call it a duplicate.
        SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
        IF FOUND AND r.fingerprint = plan.fingerprint AND r.dependency = plan.dependency THEN
            RETURN r;
        END IF;
        SELECT * INTO earlier FROM reconciler.receipts x
        WHERE x.dependency = plan.dependency AND x.fingerprint = plan.fingerprint
          AND x.state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review')
        ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'intent % is unresolved in receipt % (%): a re-planned duplicate is blocked',
                plan.fingerprint, earlier.id, earlier.state
                USING ERRCODE = 'RL005', DETAIL = earlier.id::text;
        END IF;
    END IF;
    INSERT INTO reconciler.receipts AS x
        (idempotency_key, operation, dependency, method, target, fingerprint, intent,
         state_actor, attempt, retry_of)
    VALUES (plan.idempotency_key, plan.operation, plan.dependency, upper(plan.method), plan.target,
            plan.fingerprint, coalesce(plan.intent, '{}'), plan.actor,
            CASE WHEN plan.retry_of IS NULL THEN 1 ELSE prev.attempt + 1 END, plan.retry_of)
    ON CONFLICT ON CONSTRAINT receipts_idempotency_key_key DO NOTHING
    RETURNING * INTO r;
    IF NOT FOUND THEN
        -- A concurrent plan of the same key won the insert; return its row.
        SELECT * INTO r FROM reconciler.receipts x WHERE x.idempotency_key = plan.idempotency_key;
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
    END IF;
    RETURN r;
END
$$;
-- +goose StatementEnd

ALTER FUNCTION reconciler.receipts_record_update() RESET enable_nestloop;
DROP TRIGGER receipts_notify_due ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_notify_due();
DROP TABLE reconciler.duplicate_alarms;
DROP TABLE reconciler.readback_checks;
DROP INDEX reconciler.receipts_held;
ALTER TABLE reconciler.receipts DROP COLUMN last_check_transient;
ALTER TABLE reconciler.receipts DROP COLUMN pre_image;
