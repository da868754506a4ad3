-- Verdicts that check themselves (issue 20, SPEC §5a "Verdicts are checked
-- afterwards"): after the reconciler settles an absence (safe_to_retry of a
-- create or update, succeeded of a delete) it reads the receipt back once
-- more, later, and records what that audit found; an effect found where the
-- verdict said there was none is an alarm and widens the dependency's
-- window.

-- +goose Up

-- The absences waiting for their audit: one row per settled absence,
-- queued by the trigger below (whoever settles), claimed by a reconciler
-- with a lease, and deleted in the transaction that records its audit. A
-- queue, not history: the history is verdict_audits.
CREATE TABLE reconciler.audit_queue (
    receipt_id       bigint PRIMARY KEY,
    dependency       text COLLATE "C" NOT NULL,
    settled_state    text NOT NULL CHECK (settled_state IN ('safe_to_retry', 'succeeded')),
    settled_at       timestamptz NOT NULL,
    -- A claim: the audit read is made by lease_owner until lease_expires_at.
    lease_owner      text,
    lease_expires_at timestamptz,
    -- Reads that failed transiently so far; an audit is given up
    -- (recorded inconclusive) after a few.
    attempts         integer NOT NULL DEFAULT 0,
    -- A deferred or failed audit is not claimed again before this.
    not_before       timestamptz
);
-- The claim: per dependency, the oldest settled first, up to its cut-off.
CREATE INDEX audit_queue_due ON reconciler.audit_queue (dependency, settled_at);

-- One row per audit read, append-only. At most one audit per settled
-- verdict (the unique receipt_id): an audit adds at most one read to a
-- settled absence, retried reads of a failing API aside.
CREATE TABLE reconciler.verdict_audits (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    receipt_id     bigint NOT NULL UNIQUE,
    dependency     text COLLATE "C" NOT NULL,
    operation      text NOT NULL,
    adapter        text NOT NULL,
    -- The verdict audited and when it was settled.
    settled_state  text NOT NULL CHECK (settled_state IN ('safe_to_retry', 'succeeded')),
    settled_at     timestamptz NOT NULL,
    -- When the audit read began (the database's clock), and by whom.
    at             timestamptz NOT NULL,
    instance       text NOT NULL,
    -- confirmed: the absence still holds; contradicted: the effect (or the
    -- deleted resource) is there: the verdict was wrong (false_absence);
    -- inconclusive: the read could not tell (error, non-authoritative,
    -- inconclusive answer), or the receipt was not sampled.
    verdict        text NOT NULL CHECK (verdict IN ('confirmed', 'contradicted', 'inconclusive')),
    -- What the read found: matches, how many of them later attempts of the
    -- same logical key account for, and (contradicted) the time from
    -- submission to the audit read: an upper bound of the effect's lag.
    matches        integer NOT NULL DEFAULT 0,
    retries        integer NOT NULL DEFAULT 0,
    observed_lag   interval,
    evidence       jsonb NOT NULL DEFAULT '{}'
);
-- stats: audits in a period.
CREATE INDEX verdict_audits_at ON reconciler.verdict_audits (at);
-- review list: the contradicted verdicts (few), newest first.
CREATE INDEX verdict_audits_contradicted ON reconciler.verdict_audits (at) WHERE verdict = 'contradicted';

-- Proof that a dependency's declared window is too short, append-only: an
-- effect found after an authoritative absence that began past the window
-- (present_after_absence: a settling read; false_absence: an audit). Each
-- row widens the window of its adapter's declaration: the effective window
-- of (dependency, adapter) is the largest effective_after of its rows with
-- the declared window still in the file (a changed declaration ends them).
CREATE TABLE reconciler.window_alarms (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at               timestamptz NOT NULL,
    instance         text NOT NULL,
    dependency       text COLLATE "C" NOT NULL,
    adapter          text NOT NULL,
    operation        text NOT NULL,
    receipt_id       bigint NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('present_after_absence', 'false_absence')),
    -- Windows are measured from the send deadline: max_request_lifetime +
    -- consistency_window as declared, and effective before and after.
    declared         interval NOT NULL,
    observed         interval NOT NULL,
    effective_before interval NOT NULL,
    effective_after  interval NOT NULL CHECK (effective_after >= declared),
    evidence         jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX window_alarms_dependency ON reconciler.window_alarms (dependency, adapter);
CREATE INDEX window_alarms_at ON reconciler.window_alarms (at);

CREATE TRIGGER verdict_audits_append_only BEFORE UPDATE OR DELETE ON reconciler.verdict_audits
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER verdict_audits_no_truncate BEFORE TRUNCATE ON reconciler.verdict_audits
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER window_alarms_append_only BEFORE UPDATE OR DELETE ON reconciler.window_alarms
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER window_alarms_no_truncate BEFORE TRUNCATE ON reconciler.window_alarms
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- Queues the audit of every absence the reconciler settles: safe_to_retry,
-- and a delete's succeeded (reason "deleted"), moved from reconciling. A
-- reviewer's verdict is not audited. settled_at is when the read the
-- verdict rests on began (its evidence's read_at, on the reconciler's
-- clock, the database's), else the move's time. SECURITY DEFINER, like the
-- webhook queue's: the worker settles, the queue is the owner's.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_queue_audit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    read_at text := NEW.state_detail -> 'evidence' ->> 'read_at';
    settled timestamptz := NEW.updated_at;
BEGIN
    -- Only the reconciler writes this evidence (Go's RFC 3339). No
    -- EXCEPTION block: it would cost a subtransaction per settled row of a
    -- batch; a read_at of another shape is ignored.
    IF read_at ~ '^\d{4}-[01]\d-[0-3]\dT[0-2]\d:[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]\d\d:\d\d)$' THEN
        settled := read_at::timestamptz;
    END IF;
    INSERT INTO reconciler.audit_queue (receipt_id, dependency, settled_state, settled_at)
    VALUES (NEW.id, NEW.dependency, NEW.state, settled)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER receipts_queue_audit
    AFTER UPDATE OF state ON reconciler.receipts
    FOR EACH ROW
    WHEN (OLD.state = 'reconciling'
          AND (NEW.state = 'safe_to_retry'
               OR (NEW.state = 'succeeded' AND NEW.state_detail ->> 'reason' = 'deleted')))
    EXECUTE FUNCTION reconciler.receipts_queue_audit();

-- Grants where the roles of docs/roles.sql exist (that file holds the same).
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        GRANT SELECT, UPDATE (lease_owner, lease_expires_at, attempts, not_before), DELETE
            ON reconciler.audit_queue TO reconciler_worker;
        GRANT SELECT ON reconciler.verdict_audits, reconciler.window_alarms TO reconciler_worker;
        GRANT INSERT (receipt_id, dependency, operation, adapter, settled_state, settled_at, at, instance,
                      verdict, matches, retries, observed_lag, evidence)
            ON reconciler.verdict_audits TO reconciler_worker;
        GRANT INSERT (at, instance, dependency, adapter, operation, receipt_id, kind, declared, observed,
                      effective_before, effective_after, evidence)
            ON reconciler.window_alarms TO reconciler_worker;
    END IF;
    IF to_regrole('reconciler_reviewer') IS NOT NULL THEN
        GRANT SELECT ON reconciler.verdict_audits, reconciler.window_alarms, reconciler.audit_queue
            TO reconciler_reviewer;
    END IF;
    IF to_regrole('reconciler_readonly') IS NOT NULL THEN
        GRANT SELECT ON reconciler.verdict_audits, reconciler.window_alarms, reconciler.audit_queue
            TO reconciler_readonly;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER receipts_queue_audit ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_queue_audit();
DROP TABLE reconciler.window_alarms;
DROP TABLE reconciler.verdict_audits;
DROP TABLE reconciler.audit_queue;
