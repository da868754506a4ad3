-- Issue 25: a history partition leaves whole. Once nothing in a range
-- [lo, hi) of receipt ids is needed any more, retention exports the range's
-- partitions of receipt_events, readback_checks and verdict_audits
-- (migration 00021) to one file and drops them, instead of deleting their
-- rows one by one (retention_remove_history).
--
-- The ranges are those reconciler.history_partitions() (00021) lists, from
-- the catalog: from_id NULL for the first partition (from MINVALUE, the
-- rows written before 00021); the default partitions (no range) are never
-- dropped.
--
-- 1. reconciler.retention_partition_keep_reason(lo, hi, history_before):
--    NULL when the range may go, else why not. One rule, used by the
--    archiver to choose and by the drop to refuse.
-- 2. reconciler.retention_drop_history_partition: the only way a history
--    partition leaves. SECURITY DEFINER (the tables' owner: only the owner
--    may detach or drop a partition), EXECUTE for reconciler_retention
--    only. It locks the partitions, re-checks the rule, refuses unless the
--    rows it would drop are exactly the rows the caller exported, records
--    the removal, then detaches and drops them.
-- 3. retention_batches gains the kind 'partition' (range_lo, range_hi), and
--    by_batch: a 'history' row a partition drop writes for each receipts
--    batch whose history it took whole, so the row-by-row path does not
--    try that batch again.

-- +goose Up
ALTER TABLE reconciler.retention_batches
    -- kind 'partition': the range [range_lo, range_hi) of receipt ids whose
    -- history partitions were dropped (range_lo NULL: from MINVALUE).
    ADD COLUMN range_lo bigint,
    ADD COLUMN range_hi bigint,
    -- A 'history' row written by a partition drop: the partition batch that
    -- removed (and archived) the receipts batch's history.
    ADD COLUMN by_batch bigint REFERENCES reconciler.retention_batches (id),
    DROP CONSTRAINT retention_batches_kind_check,
    ADD CONSTRAINT retention_batches_kind_check CHECK (kind IN ('receipts', 'history', 'partition')),
    ADD CONSTRAINT retention_batches_range_check CHECK ((kind = 'partition') = (range_hi IS NOT NULL)
                                                      AND (range_lo IS NULL OR range_hi IS NOT NULL)),
    ADD CONSTRAINT retention_batches_by_batch_check CHECK (by_batch IS NULL OR kind = 'history');
-- A range leaves once.
CREATE UNIQUE INDEX retention_batches_partition ON reconciler.retention_batches (range_hi)
    WHERE kind = 'partition';

-- A range [lo, hi) may go when:
--   * the receipts sequence has passed hi: no receipt drawn from now on
--     lands in it (a receipt whose id was drawn before but that commits
--     after the drop writes its history to the default partition, which is
--     never dropped);
--   * no receipt of the range is in the ledger: every one was removed by
--     retention (which kept each one a guarantee needs) or never existed;
--   * every receipt of the range that retention removed was removed in a
--     receipts batch settled before history_before: the history policy,
--     the rule retention_remove_history's caller applies to a batch.
-- The first partition (lo NULL) is the range below hi.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_partition_keep_reason(lo bigint, hi bigint, history_before timestamptz)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN hi IS NULL OR history_before IS NULL THEN 'no range or no history policy'
        WHEN coalesce(pg_sequence_last_value(pg_get_serial_sequence('reconciler.receipts', 'id')::regclass), 0) < hi
            THEN 'the receipts sequence has not passed it: new receipts land in it'
        WHEN EXISTS (SELECT FROM reconciler.receipts x
                     WHERE x.id >= coalesce(lo, -9223372036854775808) AND x.id < hi)
            THEN format('receipt %s is in the ledger', (SELECT min(x.id) FROM reconciler.receipts x
                                                        WHERE x.id >= coalesce(lo, -9223372036854775808) AND x.id < hi))
        WHEN EXISTS (SELECT FROM reconciler.removed_receipts t JOIN reconciler.retention_batches b ON b.id = t.batch_id
                     WHERE t.receipt_id >= coalesce(lo, -9223372036854775808) AND t.receipt_id < hi
                       AND (b.settled_before < history_before) IS NOT TRUE)
            THEN 'a receipt of the range left inside the history policy'
    END
$$;
-- +goose StatementEnd

-- Drops the partitions [lo, hi) of receipt_events, readback_checks and
-- verdict_audits (lo NULL: the first partition) after the caller exported
-- them to archive (whose SHA-256 it gives); expected counts the rows
-- exported per table. Refused (RL020, nothing removed) unless each table
-- has a partition of exactly that range, the range may go
-- (retention_partition_keep_reason, checked under the locks) and the rows
-- of each partition are exactly expected's. Returns the partition batch.
--
-- The partitions are locked ACCESS EXCLUSIVE (what DETACH takes) before the
-- check: a writer still inside one finishes first and its rows are counted;
-- none can write after. The row counts are a sequential scan of each
-- partition under that lock; only the range's partitions are blocked while
-- it runs, the parents only for the detach and drop. A lock request waiting
-- queues every later request of the table behind it (the agents' history
-- writes, for a parent), so no lock is waited for longer than lock_timeout:
-- behind a long reader the drop fails (55P03, nothing removed) and the next
-- pass tries again, rather than stalling the ledger's writes.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_drop_history_partition(
    lo bigint, hi bigint, history_before timestamptz, archive text, sha256 text, expected jsonb
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET lock_timeout = '2s' AS $$
DECLARE
    p record;
    parts integer := 0;
    why text;
    n bigint;
    counted jsonb := '{}';
    batch bigint;
BEGIN
    -- (The partitions of a range cannot change once locked: attaching or
    -- detaching one locks it too.)
    FOR p IN SELECT r.partition FROM reconciler.history_partitions() r
             WHERE r.from_id IS NOT DISTINCT FROM lo AND r.to_id = hi
             ORDER BY r.parent LOOP
        EXECUTE format('LOCK TABLE reconciler.%I IN ACCESS EXCLUSIVE MODE', p.partition);
        parts := parts + 1;
    END LOOP;
    IF parts <> 3 THEN
        RAISE EXCEPTION 'retention: [%, %) is no partition of each history table', coalesce(lo::text, 'MINVALUE'), hi
            USING ERRCODE = 'RL020';
    END IF;
    why := reconciler.retention_partition_keep_reason(lo, hi, history_before);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'retention: partition [%, %) is kept: %', coalesce(lo::text, 'MINVALUE'), hi, why
            USING ERRCODE = 'RL020';
    END IF;
    FOR p IN SELECT r.parent, r.partition FROM reconciler.history_partitions() r
             WHERE r.from_id IS NOT DISTINCT FROM lo AND r.to_id = hi LOOP
        EXECUTE format('SELECT count(*) FROM reconciler.%I', p.partition) INTO n;
        counted := counted || jsonb_build_object(p.parent, n);
    END LOOP;
    IF counted IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'retention: the rows of partition [%, %) % are not the rows exported %',
            coalesce(lo::text, 'MINVALUE'), hi, counted, expected USING ERRCODE = 'RL020';
    END IF;

    INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed, range_lo, range_hi)
    VALUES ('partition', retention_drop_history_partition.archive, retention_drop_history_partition.sha256, counted, lo, hi)
    RETURNING id INTO batch;
    -- The receipts batches whose history is now wholly gone (each of their
    -- receipts in this range or one dropped before) are done: the row path
    -- would find nothing of theirs. A batch with receipts in a range still
    -- pinned keeps its turn there, for the rest.
    INSERT INTO reconciler.retention_batches (kind, of_batch, archive, sha256, removed, by_batch)
    SELECT 'history', b.id, retention_drop_history_partition.archive, retention_drop_history_partition.sha256, '{}', batch
    FROM reconciler.retention_batches b
    WHERE b.kind = 'receipts'
      AND b.id IN (SELECT t.batch_id FROM reconciler.removed_receipts t
                   WHERE t.receipt_id >= coalesce(lo, -9223372036854775808) AND t.receipt_id < hi)
      AND NOT EXISTS (SELECT FROM reconciler.retention_batches h WHERE h.kind = 'history' AND h.of_batch = b.id)
      AND NOT EXISTS (SELECT FROM reconciler.removed_receipts t
                      WHERE t.batch_id = b.id
                        AND NOT EXISTS (SELECT FROM reconciler.retention_batches d
                                        WHERE d.kind = 'partition'
                                          AND t.receipt_id >= coalesce(d.range_lo, -9223372036854775808)
                                          AND t.receipt_id < d.range_hi));
    FOR p IN SELECT r.parent, r.partition FROM reconciler.history_partitions() r
             WHERE r.from_id IS NOT DISTINCT FROM lo AND r.to_id = hi LOOP
        EXECUTE format('ALTER TABLE reconciler.%I DETACH PARTITION reconciler.%I', p.parent, p.partition);
        EXECUTE format('DROP TABLE reconciler.%I', p.partition);
    END LOOP;
    RETURN batch;
END
$$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION reconciler.retention_drop_history_partition(bigint, bigint, timestamptz, text, text, jsonb)
    FROM PUBLIC;

-- Where the roles of docs/roles.sql are in use, the archiver chooses with
-- the rule (which reads the receipts sequence) and drops through the
-- function only.
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_retention') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION
            reconciler.retention_drop_history_partition(bigint, bigint, timestamptz, text, text, jsonb),
            reconciler.retention_partition_keep_reason(bigint, bigint, timestamptz)
            TO reconciler_retention;
        EXECUTE format('GRANT SELECT ON SEQUENCE %s TO reconciler_retention',
                       pg_get_serial_sequence('reconciler.receipts', 'id'));
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- A dropped partition's only trace in the database is its batch row:
-- going down past it would lose where its archive is.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM reconciler.retention_batches WHERE kind = 'partition') THEN
        RAISE EXCEPTION 'migrate down: reconciler.retention_batches records dropped history partitions; '
            'going below 00022 would lose which ranges left and where their archive is'
            USING ERRCODE = 'RL020';
    END IF;
END
$$;
-- +goose StatementEnd
DROP FUNCTION reconciler.retention_drop_history_partition(bigint, bigint, timestamptz, text, text, jsonb);
DROP FUNCTION reconciler.retention_partition_keep_reason(bigint, bigint, timestamptz);
DROP INDEX reconciler.retention_batches_partition;
ALTER TABLE reconciler.retention_batches
    DROP CONSTRAINT retention_batches_by_batch_check,
    DROP CONSTRAINT retention_batches_range_check,
    DROP CONSTRAINT retention_batches_kind_check,
    ADD CONSTRAINT retention_batches_kind_check CHECK (kind IN ('receipts', 'history')),
    DROP COLUMN by_batch,
    DROP COLUMN range_hi,
    DROP COLUMN range_lo;
