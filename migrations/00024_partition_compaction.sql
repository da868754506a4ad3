-- Issue 25: a pinned history range still leaves. A range [lo, hi) of
-- receipt ids leaves whole (00022) only once none of its receipts is in
-- the ledger; the few a guarantee keeps (manual_review, open retry chains,
-- alarms) pin nearly every range. Compaction removes the rest of such a
-- range at once: it copies the kept receipts' history into a new table,
-- swaps it in for the range's partition and drops the old one.
--
-- 1. reconciler.retention_partition_compact_reason(lo, hi, history_before):
--    00022's rule without "no receipt of the range is in the ledger": NULL
--    when the history of every receipt of the range that left may go. The
--    archiver chooses with it and the compaction re-checks it.
-- 2. reconciler.retention_compact_history_partition: SECURITY DEFINER,
--    EXECUTE for reconciler_retention only, as the drop.
-- 3. retention_batches.kept: for a compaction (kind 'partition'), the rows
--    kept per table; NULL for a whole drop. A range drops once, but may be
--    compacted any number of times (each time kept receipts left).
-- 4. The drop marks a receipts batch's history done only for the receipts
--    removed before a partition batch of their range: a receipt that left
--    after its range was compacted still has its history there.

-- +goose Up
ALTER TABLE reconciler.retention_batches
    ADD COLUMN kept jsonb,
    ADD CONSTRAINT retention_batches_kept_check CHECK (kept IS NULL OR kind = 'partition');
DROP INDEX reconciler.retention_batches_partition;
-- A range leaves whole once; compacted, as often as kept receipts leave.
CREATE UNIQUE INDEX retention_batches_partition ON reconciler.retention_batches (range_hi)
    WHERE kind = 'partition' AND kept IS NULL;

-- A pinned range [lo, hi) may be compacted when the receipts sequence has
-- passed hi and every receipt of the range that retention removed was
-- removed in a batch settled before history_before (00022's rule); the
-- receipts still in the ledger are what is kept.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_partition_compact_reason(lo bigint, hi bigint, history_before timestamptz)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN hi IS NULL OR history_before IS NULL THEN 'no range or no history policy'
        WHEN coalesce(pg_sequence_last_value(pg_get_serial_sequence('reconciler.receipts', 'id')::regclass), 0) < hi
            THEN 'the receipts sequence has not passed it: new receipts land in it'
        WHEN EXISTS (SELECT FROM reconciler.removed_receipts t JOIN reconciler.retention_batches b ON b.id = t.batch_id
                     WHERE t.receipt_id >= coalesce(lo, -9223372036854775808) AND t.receipt_id < hi
                       AND (b.settled_before < history_before) IS NOT TRUE)
            THEN 'a receipt of the range left inside the history policy'
    END
$$;
-- +goose StatementEnd

-- Removes from the partitions [lo, hi) of receipt_events, readback_checks
-- and verdict_audits (lo NULL: the first partition) every row of a receipt
-- no longer in the ledger, after the caller exported them to archive (whose
-- SHA-256 it gives); expected counts the rows exported per table. Refused
-- (RL020, nothing removed) unless each table has a partition of exactly
-- that range, the range may be compacted
-- (retention_partition_compact_reason, under the locks) and the rows that
-- leave are exactly expected's. Returns the partition batch.
--
-- Each partition is replaced by a new table holding the kept rows, copied
-- whole (to_jsonb identical: the same columns, ids and times), attached
-- for the same range (the parent's indexes are built on it, its row
-- triggers cloned), given the partition's BEFORE TRUNCATE trigger and its
-- name; the old partition is detached and dropped.
--
-- Locks: the parents first, SHARE ROW EXCLUSIVE (a history writer routes
-- through the parent: it waits there, before choosing a partition, and
-- lands in the new one after the commit; readers go on), then the
-- partitions ACCESS EXCLUSIVE, then the range's receipts FOR KEY SHARE (a
-- kept receipt cannot leave during the copy). DETACH raises the parent's
-- lock to ACCESS EXCLUSIVE: it waits for the readers still inside. No lock
-- is waited for longer than lock_timeout: the compaction fails (55P03,
-- nothing removed) and the next pass tries again.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retention_compact_history_partition(
    lo bigint, hi bigint, history_before timestamptz, archive text, sha256 text, expected jsonb
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp SET lock_timeout = '2s' AS $$
DECLARE
    p record;
    parts integer := 0;
    why text;
    n bigint;
    total bigint;
    copied bigint;
    cols text;
    fresh text;
    counted jsonb := '{}';
    kept jsonb := '{}';
    batch bigint;
    low constant bigint := coalesce(lo, -9223372036854775808);
BEGIN
    LOCK TABLE reconciler.receipt_events, reconciler.readback_checks, reconciler.verdict_audits
        IN SHARE ROW EXCLUSIVE MODE;
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
    why := reconciler.retention_partition_compact_reason(lo, hi, history_before);
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'retention: partition [%, %) may not be compacted: %', coalesce(lo::text, 'MINVALUE'), hi, why
            USING ERRCODE = 'RL020';
    END IF;
    PERFORM FROM reconciler.receipts x WHERE x.id >= low AND x.id < hi FOR KEY SHARE;
    -- (The receipts are bounded by the range below as well: the joins read
    -- the range's receipts by the primary key, never the whole ledger.)
    FOR p IN SELECT r.parent, r.partition FROM reconciler.history_partitions() r
             WHERE r.from_id IS NOT DISTINCT FROM lo AND r.to_id = hi LOOP
        EXECUTE format('SELECT count(*) FROM reconciler.%I h
                        WHERE NOT EXISTS (SELECT FROM reconciler.receipts x WHERE x.id = h.receipt_id
                                          AND x.id >= $1 AND x.id < $2)', p.partition)
        INTO n USING low, hi;
        counted := counted || jsonb_build_object(p.parent, n);
    END LOOP;
    IF counted IS DISTINCT FROM expected THEN
        RAISE EXCEPTION 'retention: the rows of receipts gone from partition [%, %) % are not the rows exported %',
            coalesce(lo::text, 'MINVALUE'), hi, counted, expected USING ERRCODE = 'RL020';
    END IF;

    FOR p IN SELECT r.parent, r.partition FROM reconciler.history_partitions() r
             WHERE r.from_id IS NOT DISTINCT FROM lo AND r.to_id = hi LOOP
        -- (Named by the parent's columns: a partition attached from an
        -- older table may hold them in another order.)
        SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO cols
        FROM pg_attribute a
        WHERE a.attrelid = format('reconciler.%I', p.parent)::regclass AND a.attnum > 0 AND NOT a.attisdropped;
        fresh := left(p.partition, 50) || '_compact';
        EXECUTE format('CREATE TABLE reconciler.%I (LIKE reconciler.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                       fresh, p.parent);
        EXECUTE format('INSERT INTO reconciler.%1$I (%2$s) SELECT %2$s FROM reconciler.%3$I h
                        WHERE EXISTS (SELECT FROM reconciler.receipts x WHERE x.id = h.receipt_id
                                      AND x.id >= $1 AND x.id < $2)',
                       fresh, cols, p.partition) USING low, hi;
        GET DIAGNOSTICS copied = ROW_COUNT;
        EXECUTE format('SELECT count(*) FROM reconciler.%I', p.partition) INTO total;
        IF copied + (counted ->> p.parent)::bigint <> total THEN
            RAISE EXCEPTION 'retention: partition % holds % rows, % kept and % exported', p.partition, total, copied,
                counted ->> p.parent USING ERRCODE = 'RL020';
        END IF;
        kept := kept || jsonb_build_object(p.parent, copied);
        EXECUTE format('ALTER TABLE reconciler.%I DETACH PARTITION reconciler.%I', p.parent, p.partition);
        EXECUTE format('ALTER TABLE reconciler.%I ATTACH PARTITION reconciler.%I FOR VALUES FROM (%s) TO (%s)',
                       p.parent, fresh, coalesce(lo::text, 'MINVALUE'), hi);
        EXECUTE format('DROP TABLE reconciler.%I', p.partition);
        EXECUTE format('ALTER TABLE reconciler.%I RENAME TO %I', fresh, p.partition);
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON reconciler.%I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite()',
                       left(p.partition, 50) || '_no_truncate', p.partition);
    END LOOP;

    INSERT INTO reconciler.retention_batches (kind, archive, sha256, removed, kept, range_lo, range_hi)
    VALUES ('partition', retention_compact_history_partition.archive, retention_compact_history_partition.sha256,
            counted, kept, lo, hi)
    RETURNING id INTO batch;
    -- The receipts batches whose history is now wholly gone: each of their
    -- receipts removed before a partition batch of its range (a drop, or a
    -- compaction, which took the history of every receipt gone by then).
    INSERT INTO reconciler.retention_batches (kind, of_batch, archive, sha256, removed, by_batch)
    SELECT 'history', b.id, retention_compact_history_partition.archive, retention_compact_history_partition.sha256,
           '{}', batch
    FROM reconciler.retention_batches b
    WHERE b.kind = 'receipts'
      AND b.id IN (SELECT t.batch_id FROM reconciler.removed_receipts t
                   WHERE t.receipt_id >= low AND t.receipt_id < hi)
      AND NOT EXISTS (SELECT FROM reconciler.retention_batches h WHERE h.kind = 'history' AND h.of_batch = b.id)
      AND NOT EXISTS (SELECT FROM reconciler.removed_receipts t
                      WHERE t.batch_id = b.id
                        AND NOT EXISTS (SELECT FROM reconciler.retention_batches d
                                        WHERE d.kind = 'partition' AND d.id > t.batch_id
                                          AND t.receipt_id >= coalesce(d.range_lo, -9223372036854775808)
                                          AND t.receipt_id < d.range_hi));
    RETURN batch;
END
$$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION reconciler.retention_compact_history_partition(bigint, bigint, timestamptz, text, text, jsonb)
    FROM PUBLIC;

-- The drop's record of the receipts batches it finishes, with the rule
-- above: a receipt removed after its range was compacted is not done.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.retention_drop_history_partition(
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
                                        WHERE d.kind = 'partition' AND d.id > t.batch_id
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

-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_retention') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION
            reconciler.retention_compact_history_partition(bigint, bigint, timestamptz, text, text, jsonb),
            reconciler.retention_partition_compact_reason(bigint, bigint, timestamptz)
            TO reconciler_retention;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- A compaction's removed rows are traced only by its batch row, which
-- 00022's schema cannot tell from a whole drop.
-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM reconciler.retention_batches WHERE kept IS NOT NULL) THEN
        RAISE EXCEPTION 'migrate down: reconciler.retention_batches records compacted history partitions; '
            'going below 00024 would lose which rows of a range left and where their archive is'
            USING ERRCODE = 'RL020';
    END IF;
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.retention_drop_history_partition(
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
DROP FUNCTION reconciler.retention_compact_history_partition(bigint, bigint, timestamptz, text, text, jsonb);
DROP FUNCTION reconciler.retention_partition_compact_reason(bigint, bigint, timestamptz);
DROP INDEX reconciler.retention_batches_partition;
CREATE UNIQUE INDEX retention_batches_partition ON reconciler.retention_batches (range_hi)
    WHERE kind = 'partition';
ALTER TABLE reconciler.retention_batches
    DROP CONSTRAINT retention_batches_kept_check,
    DROP COLUMN kept;
