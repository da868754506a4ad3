-- Issue 25: retention. Settled receipts leave the ledger once every guarantee
-- that reads them has run out, and their history later, each only after it
-- was exported (package retention, `reconciler archive`), in audited
-- batches; nothing else may remove a row.
--
-- 1. reconciler.retention_batches: one row per removal, naming the archive
--    file and its SHA-256 and counting the rows removed from each table.
--    reconciler.removed_receipts: one row per removed receipt (its id, the
--    batch, its final state and settlement time). Both append-only. The
--    receipt's idempotency key stays in receipt_keys, forever: a key names
--    one receipt for good, so an agent reusing the key of a removed receipt
--    is refused (the key's uniqueness), never handed a fresh receipt to send
--    again.
-- 2. reconciler.retention_keep_reason(receipt, settled_before, horizon):
--    NULL when a receipt may be removed, else the guarantee that keeps it.
--    One rule, used by the archiver to choose and by the removal to refuse.
-- 3. reconciler.retention_remove_receipts / retention_remove_history: the
--    only way to delete from receipts and the history tables. SECURITY
--    DEFINER (they run as the migrating role, which owns the tables), with
--    EXECUTE for reconciler_retention only (docs/roles.sql). Each re-checks
--    the rule under a row lock, records the batch, deletes, and refuses the
--    whole batch unless the rows deleted are exactly the rows the caller
--    says it exported.
-- 4. refuse_rewrite lets a DELETE through only inside one of those
--    functions: the table's owner running with reconciler.retention_batch
--    set (the functions' SET clause) to a batch that lists the row's
--    receipt. UPDATE and TRUNCATE stay refused to everyone, as before.
-- 5. The audits of 00015: a receipt whose audit is pending (audit_queue),
--    whose audit contradicted its verdict (a false_absence a reviewer must
--    see) or that a window alarm names is kept; the other audits
--    (confirmed, inconclusive) leave with their receipt, exported first.

-- +goose Up
CREATE TABLE reconciler.retention_batches (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- receipts: the receipts (and rows that hang off them) of one batch;
    -- history: the history rows of an earlier receipts batch (of_batch).
    kind           text NOT NULL CHECK (kind IN ('receipts', 'history')),
    of_batch       bigint REFERENCES reconciler.retention_batches (id),
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The login that ran the removal (session_user: the function runs as
    -- its owner).
    removed_by     name NOT NULL DEFAULT session_user,
    archive        text NOT NULL CHECK (archive <> ''),
    sha256         text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    -- Rows removed per table, e.g. {"receipts": 1000, "late_outcomes": 2}.
    removed        jsonb NOT NULL,
    -- The latest settlement among the batch's receipts (receipts batches):
    -- its history may go once that is older than the history policy.
    settled_before timestamptz,
    CHECK ((kind = 'history') = (of_batch IS NOT NULL))
);
-- A receipts batch's history is removed once.
CREATE UNIQUE INDEX retention_batches_history ON reconciler.retention_batches (of_batch)
    WHERE kind = 'history';

CREATE TABLE reconciler.removed_receipts (
    receipt_id bigint PRIMARY KEY,
    batch_id   bigint NOT NULL REFERENCES reconciler.retention_batches (id),
    state      text NOT NULL,
    settled_at timestamptz NOT NULL
);
CREATE INDEX removed_receipts_batch ON reconciler.removed_receipts (batch_id);

CREATE TRIGGER retention_batches_append_only BEFORE UPDATE OR DELETE ON reconciler.retention_batches
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER retention_batches_no_truncate BEFORE TRUNCATE ON reconciler.retention_batches
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER removed_receipts_append_only BEFORE UPDATE OR DELETE ON reconciler.removed_receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER removed_receipts_no_truncate BEFORE TRUNCATE ON reconciler.removed_receipts
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- A DELETE passes only inside a removal: run by a role the table's owner
-- belongs to (the SECURITY DEFINER functions below run as the owner), with
-- reconciler.retention_batch set to the batch that lists the row's receipt
-- in removed_receipts, and only on the tables retention empties. Anyone may
-- set the setting; only the owner passes the role test, and what the owner
-- removes this way is listed in an audit row. The catalog lookup and the
-- probe are paid by deletes only: UPDATE is refused at once, as before.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.refuse_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    batch bigint;
    rid bigint;
BEGIN
    IF TG_OP = 'DELETE' AND TG_TABLE_NAME IN ('receipts', 'receipt_events', 'readback_checks', 'late_outcomes',
                                              'verdict_audits') THEN
        batch := nullif(current_setting('reconciler.retention_batch', true), '')::bigint;
        IF batch IS NOT NULL
           AND pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
            -- (PL/pgSQL resolves OLD's fields when a statement first runs,
            -- so each table only ever runs the branch naming its column.)
            IF TG_TABLE_NAME = 'receipts' THEN
                rid := OLD.id;
            ELSE
                rid := OLD.receipt_id;
            END IF;
            IF EXISTS (SELECT FROM reconciler.removed_receipts t WHERE t.receipt_id = rid AND t.batch_id = batch) THEN
                RETURN OLD;
            END IF;
        END IF;
    END IF;
    RAISE EXCEPTION '%.% is append-only: % refused', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'RL006';
END
$$;
-- +goose StatementEnd

-- The guarantees that keep a receipt (docs/retention.md):
--   * only a settled receipt leaves: succeeded, rejected or safe_to_retry;
--     never one in flight or in manual_review;
--   * settled before settled_before (the policy);
--   * past the horizons its settlement recorded: the native idempotency
--     key's retention (evidence.reuse_idempotency_key_before: a retry must
--     reuse the key before then) and the absence window
--     (evidence.absence_safe_at);
--   * past horizon after its send deadline: the longest request lifetime
--     plus consistency window (and native key retention) of any adapter,
--     which the archiver reads from the adapters file; a late answer of
--     the call cannot arrive after that;
--   * not the open end of a retry chain: a safe_to_retry receipt or a
--     retryable rejection that nobody retried yet may still be retried,
--     and the retry must link to it (the rest of the chain is kept with
--     it: a chain leaves whole);
--   * no duplicate alarm and no lifetime alarm (00014): nothing in the
--     schema records that a human dealt with one, so the receipt stays
--     where `stats` counts it;
--   * no audit pending (00015's audit_queue), no audit that contradicted
--     the verdict (a false_absence: nothing records that a reviewer saw
--     it) and no window alarm naming the receipt (its evidence);
--   * no webhook delivery pending, no gateway response still replayable.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_keep_reason(r reconciler.receipts, settled_before timestamptz, horizon interval)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN r.state = 'manual_review' THEN 'manual_review'
        WHEN r.state NOT IN ('succeeded', 'rejected', 'safe_to_retry') THEN 'unsettled'
        WHEN r.updated_at >= settled_before THEN 'inside the retention policy'
        WHEN (r.state_detail #>> '{evidence,reuse_idempotency_key_before}')::timestamptz >= clock_timestamp()
            THEN 'inside the native idempotency key''s retention'
        WHEN (r.state_detail #>> '{evidence,absence_safe_at}')::timestamptz >= clock_timestamp()
            THEN 'inside the absence window'
        WHEN coalesce(r.submitted_at + r.max_send_delay, r.created_at) + horizon >= clock_timestamp()
            THEN 'inside the request horizon'
        WHEN (r.state = 'safe_to_retry' OR r.state = 'rejected' AND (r.state_detail #>> '{error,retryable}') = 'true')
             AND NOT EXISTS (SELECT FROM reconciler.receipts c WHERE c.retry_of = r.id)
            THEN 'open retry chain'
        WHEN EXISTS (SELECT FROM reconciler.duplicate_alarms a WHERE a.receipt_id = r.id)
            THEN 'duplicate alarm'
        WHEN EXISTS (SELECT FROM reconciler.lifetime_alarms a WHERE a.receipt_id = r.id)
            THEN 'lifetime alarm'
        WHEN EXISTS (SELECT FROM reconciler.audit_queue q WHERE q.receipt_id = r.id)
            THEN 'audit pending'
        WHEN EXISTS (SELECT FROM reconciler.verdict_audits v WHERE v.receipt_id = r.id AND v.verdict = 'contradicted')
            THEN 'verdict contradicted'
        WHEN EXISTS (SELECT FROM reconciler.window_alarms a WHERE a.receipt_id = r.id)
            THEN 'window alarm'
        WHEN EXISTS (SELECT FROM reconciler.webhook_deliveries w
                     WHERE w.receipt_id = r.id AND w.delivered_at IS NULL AND w.gave_up_at IS NULL)
            THEN 'webhook delivery pending'
        WHEN EXISTS (SELECT FROM reconciler.gateway_responses g
                     WHERE g.receipt_id = r.id AND g.expires_at >= clock_timestamp())
            THEN 'gateway response replayable'
    END
$$;
-- +goose StatementEnd

-- Removes the receipts ids (whole retry chains), with their late outcomes,
-- webhook rows, gateway responses and verdict audits, after the caller exported them to
-- archive (whose SHA-256 it gives). expected counts the rows exported per
-- table; the batch is refused (RL020, nothing removed) if a receipt is kept
-- by a guarantee, a chain is cut, or any count differs. Returns the batch.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_remove_receipts(
    ids bigint[], archive text, sha256 text, settled_before timestamptz, horizon interval, expected jsonb
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET reconciler.retention_batch = '' AS $$
DECLARE
    batch bigint;
    found_n bigint;
    why text;
    n bigint;
    removed jsonb := '{}';
    latest timestamptz;
BEGIN
    IF horizon IS NULL OR horizon < interval '0' OR settled_before IS NULL OR cardinality(ids) IS NULL THEN
        RAISE EXCEPTION 'retention: ids, settled_before and a horizon >= 0 are required' USING ERRCODE = 'RL020';
    END IF;
    -- The lock serializes with a retry's plan (FOR UPDATE of the retried
    -- receipt) and with record_late_outcome.
    SELECT count(*), max(x.updated_at) INTO found_n, latest FROM (
        SELECT x.id, x.updated_at FROM reconciler.receipts x WHERE x.id = ANY (ids) ORDER BY x.id FOR UPDATE) x;
    IF found_n <> cardinality(ids) THEN
        RAISE EXCEPTION 'retention: % of % receipts exist', found_n, cardinality(ids) USING ERRCODE = 'RL020';
    END IF;
    SELECT format('receipt %s is kept: %s', x.id, k.why) INTO why
    FROM reconciler.receipts x
    CROSS JOIN LATERAL (SELECT reconciler.retention_keep_reason(x, settled_before, horizon) AS why) k
    WHERE x.id = ANY (ids) AND k.why IS NOT NULL
    ORDER BY x.id LIMIT 1;
    IF why IS NULL THEN
        -- A chain leaves whole: no receipt removed while its retry, or the
        -- receipt it retries, stays.
        SELECT format('receipt %s is kept: its retry chain is not in the batch', x.id) INTO why
        FROM reconciler.receipts x
        WHERE (x.id = ANY (ids) AND x.retry_of IS NOT NULL AND NOT x.retry_of = ANY (ids))
           OR (x.retry_of = ANY (ids) AND NOT x.id = ANY (ids))
        LIMIT 1;
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'retention: %', why USING ERRCODE = 'RL020';
    END IF;

    INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed, settled_before)
    VALUES ('receipts', archive, sha256, expected, latest)
    RETURNING id INTO batch;
    INSERT INTO reconciler.removed_receipts (receipt_id, batch_id, state, settled_at)
    SELECT x.id, batch, x.state, x.updated_at FROM reconciler.receipts x WHERE x.id = ANY (ids);
    PERFORM set_config('reconciler.retention_batch', batch::text, true);

    DELETE FROM reconciler.gateway_responses g WHERE g.receipt_id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('gateway_responses', n);
    DELETE FROM reconciler.webhook_deliveries w WHERE w.receipt_id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('webhook_deliveries', n);
    DELETE FROM reconciler.webhook_receipts w WHERE w.receipt_id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('webhook_receipts', n);
    DELETE FROM reconciler.late_outcomes l WHERE l.receipt_id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('late_outcomes', n);
    DELETE FROM reconciler.verdict_audits v WHERE v.receipt_id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('verdict_audits', n);
    DELETE FROM reconciler.receipts x WHERE x.id = ANY (ids);
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('receipts', n);
    IF removed IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'retention: the rows removed % are not the rows exported %', removed, expected
            USING ERRCODE = 'RL020';
    END IF;
    RETURN batch;
END
$$;
-- +goose StatementEnd

-- Removes the history (receipt_events, readback_checks) of the receipts of
-- receipts batch of_batch, after the caller exported it. Refused (RL020)
-- for a batch that is no receipts batch, whose history already went, or if
-- the counts differ from expected. Returns the history batch.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_remove_history(
    of_batch bigint, archive text, sha256 text, expected jsonb
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET reconciler.retention_batch = '' AS $$
DECLARE
    batch bigint;
    n bigint;
    removed jsonb := '{}';
BEGIN
    PERFORM FROM reconciler.retention_batches b WHERE b.id = retention_remove_history.of_batch AND b.kind = 'receipts' FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'retention: % is no receipts batch', retention_remove_history.of_batch USING ERRCODE = 'RL020';
    END IF;
    INSERT INTO reconciler.retention_batches (kind, of_batch, archive, sha256, removed)
    VALUES ('history', retention_remove_history.of_batch, archive, sha256, expected)
    RETURNING id INTO batch;
    -- The rows are listed under the receipts batch.
    PERFORM set_config('reconciler.retention_batch', retention_remove_history.of_batch::text, true);
    DELETE FROM reconciler.receipt_events e USING reconciler.removed_receipts t
    WHERE t.batch_id = retention_remove_history.of_batch AND e.receipt_id = t.receipt_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('receipt_events', n);
    DELETE FROM reconciler.readback_checks c USING reconciler.removed_receipts t
    WHERE t.batch_id = retention_remove_history.of_batch AND c.receipt_id = t.receipt_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    removed := removed || jsonb_build_object('readback_checks', n);
    IF removed IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'retention: the rows removed % are not the rows exported %', removed, expected
            USING ERRCODE = 'RL020';
    END IF;
    RETURN batch;
END
$$;
-- +goose StatementEnd

-- The keep rule probes window alarms by receipt (audit_queue and
-- verdict_audits are unique on it already).
CREATE INDEX window_alarms_receipt ON reconciler.window_alarms (receipt_id);

REVOKE ALL ON FUNCTION reconciler.retention_remove_receipts(bigint[], text, text, timestamptz, interval, jsonb),
    reconciler.retention_remove_history(bigint, text, text, jsonb) FROM PUBLIC;

-- Where the roles of docs/roles.sql are in use (and reconciler_retention
-- exists: docs/roles.sql creates it), the archiver reads what it exports
-- and removes through the functions only.
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_retention') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION
            reconciler.retention_remove_receipts(bigint[], text, text, timestamptz, interval, jsonb),
            reconciler.retention_remove_history(bigint, text, text, jsonb),
            reconciler.retention_keep_reason(reconciler.receipts, timestamptz, interval)
            TO reconciler_retention;
        GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.readback_checks,
            reconciler.late_outcomes, reconciler.duplicate_alarms, reconciler.lifetime_alarms,
            reconciler.gateway_responses, reconciler.webhook_receipts, reconciler.webhook_deliveries,
            reconciler.audit_queue, reconciler.verdict_audits, reconciler.window_alarms,
            reconciler.retention_batches, reconciler.removed_receipts TO reconciler_retention;
    END IF;
    IF to_regrole('reconciler_readonly') IS NOT NULL THEN
        GRANT SELECT ON reconciler.retention_batches, reconciler.removed_receipts TO reconciler_readonly;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- The record of what retention removed is the only trace of those receipts
-- in the database: going down past it would lose it, so it is refused
-- while there is any.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM reconciler.retention_batches) THEN
        RAISE EXCEPTION 'migrate down: reconciler.retention_batches records removed receipts; '
            'dropping it would lose which receipts left and where their archive is'
            USING ERRCODE = 'RL020';
    END IF;
END
$$;
-- +goose StatementEnd
DROP FUNCTION reconciler.retention_remove_history(bigint, text, text, jsonb);
DROP FUNCTION reconciler.retention_remove_receipts(bigint[], text, text, timestamptz, interval, jsonb);
DROP FUNCTION reconciler.retention_keep_reason(reconciler.receipts, timestamptz, interval);
DROP INDEX reconciler.window_alarms_receipt;
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.refuse_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%.% is append-only: % refused', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'RL006';
END
$$;
-- +goose StatementEnd
DROP TABLE reconciler.removed_receipts;
DROP TABLE reconciler.retention_batches;
