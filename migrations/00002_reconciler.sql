-- +goose Up
-- The reconciler's own records: every readback check (append-only) and every
-- detected duplicate (append-only). (The NOTIFY that wakes idle reconcilers
-- is sent by the receipts trigger of 00001.)

-- Whether the latest check failed transiently: the next check is then a
-- retry, which the dependency's retry budget limits (internal/protect).
ALTER TABLE reconciler.receipts ADD COLUMN last_check_transient boolean NOT NULL DEFAULT false;

-- Receipts held for a human: counted by the reconciler's metrics and listed
-- by review. Partial, so the hot path (rows that never need review) never
-- touches it.
CREATE INDEX receipts_held ON reconciler.receipts (updated_at) WHERE state = 'manual_review';

-- One row per readback check, written in the same statement that settles or
-- reschedules the receipt. No foreign key: receipts are never deleted
-- (refuse_rewrite), and a per-row RI trigger would cost the batch settle a
-- third of its throughput for a guarantee the schema already gives.
CREATE TABLE reconciler.readback_checks (
    id            bigint GENERATED ALWAYS AS IDENTITY,
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
-- One index serves both identity and the lookup of a receipt's checks in
-- order: a second one would cost every settled row another index insert.
ALTER TABLE reconciler.readback_checks ADD PRIMARY KEY (receipt_id, id);

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


-- +goose Down
DROP TABLE reconciler.duplicate_alarms;
DROP TABLE reconciler.readback_checks;
DROP INDEX reconciler.receipts_held;
ALTER TABLE reconciler.receipts DROP COLUMN last_check_transient;
