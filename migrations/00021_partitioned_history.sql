-- Partitioned history (issue 25, docs/retention.md "Partitioned history").
--
-- receipt_events, readback_checks and verdict_audits become native range
-- partitions by receipt_id. Receipt ids are drawn in creation order (the
-- receipts' identity sequence), so an id range is a period of creation
-- time, and all of a receipt's history lives in one partition: the primary
-- keys (receipt_id, seq) and (receipt_id, id) stay as they were (they
-- include the partition key), every per-receipt lookup prunes to one
-- partition, and a partition can go once every receipt of its range has
-- left. (Partitioned by the event's own time, the keys would lose
-- (receipt_id, seq), and a kept receipt's history would pin every period.)
--
-- Each existing table becomes the first partition, <table>_legacy, covering
-- every id below the first multiple of the width above the receipts
-- sequence: ATTACH validates that range by one scan of the table, under the
-- exclusive lock the whole migration holds (docs/retention.md gives the
-- figure at a million receipts). Its indexes become the parent's, so none
-- is rebuilt. Above it, reconciler.ensure_history_partitions creates
-- <table>_p<lower bound, 19 digits> of width ids each, kept `ahead` ranges
-- above the sequence by the reconciler (and by this migration); a row past
-- every range lands in <table>_default rather than being refused.

-- +goose Up

-- The locks the renames below take, taken first and together. Writers
-- lock receipts, readback_checks and verdict_audits in their own orders
-- and receipt_events last (the history trigger): taken one by one here,
-- a settlement holding readback_checks and waiting for receipt_events
-- deadlocked with this migration. No fixed order is safe: a settlement
-- (a WITH inserting readback_checks, then an UPDATE of receipts) locks
-- readback_checks first when parsed (its WITH is analyzed first) and,
-- as planned, receipts first when it runs a cached plan. So: wait for
-- receipts (holding nothing else, and queueing new writers behind), then
-- take the other three only if they are free at once; if not, let go of
-- everything and try again. Writers wait for the commit and then write
-- through the partitioned parents.
-- +goose StatementBegin
DO $$
BEGIN
    LOOP
        BEGIN
            LOCK TABLE reconciler.receipts IN ACCESS EXCLUSIVE MODE;
            LOCK TABLE reconciler.readback_checks, reconciler.verdict_audits, reconciler.receipt_events
                IN ACCESS EXCLUSIVE MODE NOWAIT;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            -- (The block's rollback released the lock on receipts.)
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- How the history is partitioned: one row, changed by the owner only (no
-- runtime role is granted it). width: receipt ids per partition (a million
-- is about ten days at 100,000 receipts a day); ahead: partitions kept
-- above the one the receipts sequence is in. A changed width applies to
-- the ranges not created yet.
CREATE TABLE reconciler.history_partitioning (
    one   boolean PRIMARY KEY DEFAULT true CHECK (one),
    width bigint NOT NULL DEFAULT 1000000 CHECK (width > 0),
    ahead integer NOT NULL DEFAULT 4 CHECK (ahead > 0)
);
INSERT INTO reconciler.history_partitioning DEFAULT VALUES;

-- The old tables step aside: their constraints' and identity sequences'
-- names are the ones the partitioned parents take. Their row triggers go,
-- since the parents' clone onto every partition, this one included, under
-- the same names; their TRUNCATE triggers stay (statement triggers are not
-- cloned). An identity of a partition would never be used (rows enter
-- through the parent, which draws ids from its own sequence), so it goes.
ALTER TABLE reconciler.receipt_events RENAME TO receipt_events_legacy;
ALTER TABLE reconciler.receipt_events_legacy RENAME CONSTRAINT receipt_events_pkey TO receipt_events_legacy_pkey;
DROP TRIGGER receipt_events_append_only ON reconciler.receipt_events_legacy;

ALTER TABLE reconciler.readback_checks RENAME TO readback_checks_legacy;
ALTER TABLE reconciler.readback_checks_legacy RENAME CONSTRAINT readback_checks_pkey TO readback_checks_legacy_pkey;
ALTER SEQUENCE reconciler.readback_checks_id_seq RENAME TO readback_checks_legacy_id_seq;
DROP TRIGGER readback_checks_append_only ON reconciler.readback_checks_legacy;

ALTER TABLE reconciler.verdict_audits RENAME TO verdict_audits_legacy;
-- The primary key must include the partition key: receipt_id alone, which
-- was unique already (at most one audit per settled verdict), so its
-- unique index becomes the parent's primary key's and the id index goes.
ALTER TABLE reconciler.verdict_audits_legacy DROP CONSTRAINT verdict_audits_pkey;
ALTER TABLE reconciler.verdict_audits_legacy RENAME CONSTRAINT verdict_audits_receipt_id_key TO verdict_audits_legacy_pkey;
ALTER INDEX reconciler.verdict_audits_at RENAME TO verdict_audits_legacy_at;
ALTER INDEX reconciler.verdict_audits_contradicted RENAME TO verdict_audits_legacy_contradicted;
ALTER SEQUENCE reconciler.verdict_audits_id_seq RENAME TO verdict_audits_legacy_id_seq;
DROP TRIGGER verdict_audits_append_only ON reconciler.verdict_audits_legacy;

-- The parents: the columns, defaults and CHECKs of 00001, 00002 and 00015,
-- the CHECKs under their old names (ATTACH matches a partition's by name).
CREATE TABLE reconciler.receipt_events (
    receipt_id  bigint NOT NULL,
    -- seq equals the receipt's version after the move: history is gap-free.
    seq         integer NOT NULL,
    from_state  text,
    to_state    text NOT NULL,
    at          timestamptz NOT NULL,
    actor       text NOT NULL,
    error       jsonb,
    evidence    jsonb,
    detail      jsonb NOT NULL DEFAULT '{}',
    external_id text,
    PRIMARY KEY (receipt_id, seq)
) PARTITION BY RANGE (receipt_id);

CREATE TABLE reconciler.readback_checks (
    id            bigint GENERATED ALWAYS AS IDENTITY,
    receipt_id    bigint NOT NULL,
    -- The receipt's check_count after this check: 1 for the first.
    check_no      integer NOT NULL,
    at            timestamptz NOT NULL,
    instance      text NOT NULL,
    adapter       text NOT NULL,
    dependency    text NOT NULL,
    verdict       text NOT NULL CONSTRAINT readback_checks_verdict_check CHECK (verdict IN ('present', 'absent', 'inconclusive', 'diverged', 'error')),
    authoritative boolean NOT NULL DEFAULT false,
    matches       integer NOT NULL DEFAULT 0,
    latency_us    bigint NOT NULL CONSTRAINT readback_checks_latency_us_check CHECK (latency_us >= 0),
    error_class   text CONSTRAINT readback_checks_error_class_check CHECK (error_class IN ('transient', 'permanent')),
    error         text,
    evidence      jsonb,
    PRIMARY KEY (receipt_id, id)
) PARTITION BY RANGE (receipt_id);

CREATE TABLE reconciler.verdict_audits (
    id             bigint GENERATED ALWAYS AS IDENTITY,
    receipt_id     bigint NOT NULL PRIMARY KEY,
    dependency     text COLLATE "C" NOT NULL,
    operation      text NOT NULL,
    adapter        text NOT NULL,
    settled_state  text NOT NULL CONSTRAINT verdict_audits_settled_state_check CHECK (settled_state IN ('safe_to_retry', 'succeeded')),
    settled_at     timestamptz NOT NULL,
    at             timestamptz NOT NULL,
    instance       text NOT NULL,
    verdict        text NOT NULL CONSTRAINT verdict_audits_verdict_check CHECK (verdict IN ('confirmed', 'contradicted', 'inconclusive')),
    matches        integer NOT NULL DEFAULT 0,
    retries        integer NOT NULL DEFAULT 0,
    observed_lag   interval,
    evidence       jsonb NOT NULL DEFAULT '{}'
) PARTITION BY RANGE (receipt_id);
-- stats: audits in a period.
CREATE INDEX verdict_audits_at ON reconciler.verdict_audits (at);
-- review list: the contradicted verdicts (few), newest first.
CREATE INDEX verdict_audits_contradicted ON reconciler.verdict_audits (at) WHERE verdict = 'contradicted';

-- Row triggers on a partitioned table clone onto each partition, present
-- and future; TRUNCATE triggers do not, so every partition gets its own.
CREATE TRIGGER receipt_events_append_only BEFORE UPDATE OR DELETE ON reconciler.receipt_events
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipt_events_no_truncate BEFORE TRUNCATE ON reconciler.receipt_events
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER readback_checks_append_only BEFORE UPDATE OR DELETE ON reconciler.readback_checks
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER readback_checks_no_truncate BEFORE TRUNCATE ON reconciler.readback_checks
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER verdict_audits_append_only BEFORE UPDATE OR DELETE ON reconciler.verdict_audits
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER verdict_audits_no_truncate BEFORE TRUNCATE ON reconciler.verdict_audits
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- Attach the old tables as the first range: every id below the first
-- multiple of the width above both the receipts sequence and every
-- receipt_id the three tables hold. The parents' identities continue past
-- the old ones, whose sequences then go. Each parent takes the old
-- table's grants, and the partition keeps none: rows are read and written
-- through the parent only.
-- +goose StatementBegin
DO $$
DECLARE
    w bigint := (SELECT h.width FROM reconciler.history_partitioning h);
    top bigint;
    last_id bigint;
    t text;
    g record;
BEGIN
    top := greatest(
        coalesce(pg_sequence_last_value(pg_get_serial_sequence('reconciler.receipts', 'id')::regclass), 0),
        (SELECT coalesce(max(e.receipt_id), 0) FROM reconciler.receipt_events_legacy e),
        (SELECT coalesce(max(c.receipt_id), 0) FROM reconciler.readback_checks_legacy c),
        (SELECT coalesce(max(v.receipt_id), 0) FROM reconciler.verdict_audits_legacy v));
    top := (top / w + 1) * w;
    FOREACH t IN ARRAY ARRAY['readback_checks', 'verdict_audits'] LOOP
        -- (greatest ignores NULLs: a sequence never drawn from, an empty table.)
        EXECUTE format('SELECT greatest(pg_sequence_last_value(%L), (SELECT max(x.id) FROM reconciler.%I x))',
                       format('reconciler.%s_legacy_id_seq', t), t || '_legacy') INTO last_id;
        IF last_id IS NOT NULL THEN
            PERFORM pg_catalog.setval(format('reconciler.%s_id_seq', t), last_id);
        END IF;
        EXECUTE format('ALTER TABLE reconciler.%I ALTER COLUMN id DROP IDENTITY', t || '_legacy');
    END LOOP;
    FOREACH t IN ARRAY ARRAY['receipt_events', 'readback_checks', 'verdict_audits'] LOOP
        FOR g IN
            SELECT a.privilege_type, a.is_grantable, NULL::name AS col,
                   CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS grantee
            FROM pg_catalog.pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
            WHERE c.oid = format('reconciler.%I', t || '_legacy')::regclass AND a.grantee <> c.relowner
            UNION ALL
            SELECT a.privilege_type, a.is_grantable, att.attname,
                   CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
            FROM pg_catalog.pg_attribute att CROSS JOIN LATERAL aclexplode(att.attacl) a
            WHERE att.attrelid = format('reconciler.%I', t || '_legacy')::regclass
              AND att.attnum > 0 AND NOT att.attisdropped
        LOOP
            EXECUTE format('GRANT %s %s ON reconciler.%I TO %s %s', g.privilege_type,
                           CASE WHEN g.col IS NOT NULL THEN format('(%I)', g.col) ELSE '' END, t, g.grantee,
                           CASE WHEN g.is_grantable THEN 'WITH GRANT OPTION' ELSE '' END);
            EXECUTE format('REVOKE ALL ON reconciler.%I FROM %s CASCADE', t || '_legacy', g.grantee);
        END LOOP;
        EXECUTE format('ALTER TABLE reconciler.%I ATTACH PARTITION reconciler.%I FOR VALUES FROM (MINVALUE) TO (%s)',
                       t, t || '_legacy', top);
        -- The safety net: a row past every range is kept, never refused.
        EXECUTE format('CREATE TABLE reconciler.%I PARTITION OF reconciler.%I DEFAULT', t || '_default', t);
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON reconciler.%I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite()',
                       t || '_default_no_truncate', t || '_default');
    END LOOP;
END
$$;
-- +goose StatementEnd

-- Creates the history partitions above the highest range, up to `ahead`
-- full ranges above the one holding the receipts sequence's last value (or
-- upto, whichever is higher); returns how many it created. One caller at a
-- time: a call that finds another under way returns 0 at once (that one
-- is the leader of this round) rather than queueing behind its locks.
-- SECURITY DEFINER, so the reconciler's role creates tables it could not
-- create itself, all owned by the owner. The three tables get the same
-- ranges. If a default partition holds rows above the highest range (the
-- reconciler was not running), the next range starts above them (a new
-- range may not cover rows the default holds); those rows stay in the
-- default, which the reconciler's metric reports.
-- +goose StatementBegin
CREATE FUNCTION reconciler.ensure_history_partitions(upto bigint DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    w bigint;
    n_ahead integer;
    top bigint;
    hi bigint;
    held bigint;
    t text;
    part text;
    made integer := 0;
BEGIN
    -- (2025, 21): issue 25, migration 00021. The two-key form is a key
    -- space of its own, apart from the bigint keys plan takes.
    IF NOT pg_try_advisory_xact_lock(2025, 21) THEN
        RETURN 0;
    END IF;
    SELECT h.width, h.ahead INTO w, n_ahead FROM reconciler.history_partitioning h;
    top := greatest(coalesce(pg_sequence_last_value(pg_get_serial_sequence('reconciler.receipts', 'id')::regclass), 0),
                    upto, 0);
    top := (top / w + 1 + n_ahead) * w;
    -- The three tables share their ranges (a range of receipts leaves
    -- whole): the next starts above the highest of any, and above any row
    -- a default partition holds.
    -- (reconciler.history_partitions, below, is the one reader of the
    -- catalog's bounds.)
    SELECT max(r.to_id) INTO hi FROM reconciler.history_partitions() r;
    SELECT greatest((SELECT max(d.receipt_id) FROM reconciler.receipt_events_default d),
                    (SELECT max(d.receipt_id) FROM reconciler.readback_checks_default d),
                    (SELECT max(d.receipt_id) FROM reconciler.verdict_audits_default d))
    INTO held;
    IF held >= hi THEN
        RAISE WARNING 'reconciler: the history default partitions hold receipt ids up to %, above every range (%): '
            'the next range starts above them, and they stay in the default partitions', held, hi;
        hi := (held / w + 1) * w;
    END IF;
    -- At most 32 ranges a call: each partition holds locks until the
    -- commit, and a width far too small for the ids drawn must not exhaust
    -- the lock table in one call; the next rounds go on from there.
    WHILE hi < top AND made < 3 * 32 LOOP
        FOREACH t IN ARRAY ARRAY['receipt_events', 'readback_checks', 'verdict_audits'] LOOP
            part := format('%s_p%s', t, lpad(hi::text, 19, '0'));
            EXECUTE format('CREATE TABLE reconciler.%I PARTITION OF reconciler.%I FOR VALUES FROM (%s) TO (%s)',
                           part, t, hi, hi + w);
            EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON reconciler.%I '
                           'FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite()',
                           part || '_no_truncate', part);
            made := made + 1;
        END LOOP;
        hi := hi + w;
    END LOOP;
    RETURN made;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION reconciler.ensure_history_partitions(bigint) FROM PUBLIC;

-- The partitions of the history tables, for the reconciler's metrics and
-- `reconciler partitions show`: each one's range (from_id NULL: from
-- MINVALUE; both NULL: the default partition) and, for a default
-- partition, the rows it holds (counted: it is empty unless the partitions
-- ahead ran out). SECURITY DEFINER: no runtime role holds a privilege on a
-- partition.
-- +goose StatementBegin
CREATE FUNCTION reconciler.history_partitions()
RETURNS TABLE (parent text, partition text, from_id bigint, to_id bigint, default_rows bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT p.relname::text AS parent, c.relname::text AS part, pg_get_expr(c.relpartbound, c.oid) AS bound
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.oid IN ('reconciler.receipt_events'::regclass, 'reconciler.readback_checks'::regclass,
                        'reconciler.verdict_audits'::regclass)
        ORDER BY 1, 2
    LOOP
        parent := r.parent;
        partition := r.part;
        from_id := (regexp_match(r.bound, 'FROM \(''?(-?[0-9]+)''?\)'))[1]::bigint;
        to_id := (regexp_match(r.bound, 'TO \(''?(-?[0-9]+)''?\)'))[1]::bigint;
        default_rows := NULL;
        IF r.bound = 'DEFAULT' THEN
            EXECUTE format('SELECT count(*) FROM reconciler.%I', r.part) INTO default_rows;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION reconciler.history_partitions() FROM PUBLIC;

-- Partitions ahead from the start: `migrate up` leaves the ledger ready
-- before any reconciler runs.
SELECT reconciler.ensure_history_partitions();

-- refuse_rewrite fires on each partition, under the partition's own name;
-- the removal path (00020) is decided by the name of the partition tree's
-- root. UPDATE and TRUNCATE are refused at once, as before.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.refuse_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    batch bigint;
    rid bigint;
    tbl text := TG_TABLE_NAME;
BEGIN
    IF TG_OP = 'DELETE' THEN
        tbl := coalesce((SELECT c.relname FROM pg_catalog.pg_class c
                         WHERE c.oid = pg_catalog.pg_partition_root(TG_RELID)), TG_TABLE_NAME);
    END IF;
    IF TG_OP = 'DELETE' AND tbl IN ('receipts', 'receipt_events', 'readback_checks', 'late_outcomes',
                                    'verdict_audits') THEN
        batch := nullif(current_setting('reconciler.retention_batch', true), '')::bigint;
        IF batch IS NOT NULL
           AND pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
            -- (PL/pgSQL resolves OLD's fields when a statement first runs,
            -- so each table only ever runs the branch naming its column.)
            IF tbl = 'receipts' THEN
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

-- Where the roles of docs/roles.sql are in use: the reconciler keeps the
-- partitions ahead, and the archiver may too before a removal.
-- +goose StatementBegin
DO $$
DECLARE
    r text;
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION reconciler.ensure_history_partitions(bigint) TO reconciler_worker;
    END IF;
    IF to_regrole('reconciler_retention') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION reconciler.ensure_history_partitions(bigint) TO reconciler_retention;
    END IF;
    IF to_regrole('reconciler_readonly') IS NOT NULL THEN
        GRANT SELECT ON reconciler.history_partitioning TO reconciler_readonly;
    END IF;
    -- Every role that reads history may list its partitions.
    FOREACH r IN ARRAY ARRAY['reconciler_worker', 'reconciler_reviewer', 'reconciler_readonly', 'reconciler_retention'] LOOP
        IF to_regrole(r) IS NOT NULL THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION reconciler.history_partitions() TO %I', r);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Each table back to a plain table holding every row, in key order, with
-- the indexes, triggers, identity and grants it had at 00020.
-- The locks the drops below take, taken first and together (as in Up). Writers
-- lock receipts, readback_checks and verdict_audits in their own orders
-- and receipt_events last (the history trigger): taken one by one here,
-- a settlement holding readback_checks and waiting for receipt_events
-- deadlocked with the migration. So: wait for receipts (holding nothing
-- else, and queueing new writers behind), then take the other three only
-- if they are free at once; if not, let go of everything and try again.
-- +goose StatementBegin
DO $$
BEGIN
    LOOP
        BEGIN
            LOCK TABLE reconciler.receipts IN ACCESS EXCLUSIVE MODE;
            LOCK TABLE reconciler.readback_checks, reconciler.verdict_audits, reconciler.receipt_events
                IN ACCESS EXCLUSIVE MODE NOWAIT;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            -- (The block's rollback released the lock on receipts.)
            PERFORM pg_sleep(0.01);
        END;
    END LOOP;
END
$$;
-- +goose StatementEnd

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
DROP FUNCTION reconciler.history_partitions();
DROP FUNCTION reconciler.ensure_history_partitions(bigint);
DROP TABLE reconciler.history_partitioning;

-- (LIKE copies the columns with their collations, defaults, NOT NULLs and
-- CHECKs under their names; not the identity, restored after the copy.)
CREATE TABLE reconciler.receipt_events_plain (LIKE reconciler.receipt_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
INSERT INTO reconciler.receipt_events_plain SELECT * FROM reconciler.receipt_events ORDER BY receipt_id, seq;
CREATE TABLE reconciler.readback_checks_plain (LIKE reconciler.readback_checks INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
INSERT INTO reconciler.readback_checks_plain SELECT * FROM reconciler.readback_checks ORDER BY receipt_id, id;
CREATE TABLE reconciler.verdict_audits_plain (LIKE reconciler.verdict_audits INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
INSERT INTO reconciler.verdict_audits_plain SELECT * FROM reconciler.verdict_audits ORDER BY id;

-- +goose StatementBegin
DO $$
DECLARE
    t text;
    g record;
    next_id bigint;
BEGIN
    FOREACH t IN ARRAY ARRAY['receipt_events', 'readback_checks', 'verdict_audits'] LOOP
        FOR g IN
            SELECT a.privilege_type, a.is_grantable, NULL::name AS col,
                   CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS grantee
            FROM pg_catalog.pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
            WHERE c.oid = format('reconciler.%I', t)::regclass AND a.grantee <> c.relowner
            UNION ALL
            SELECT a.privilege_type, a.is_grantable, att.attname,
                   CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
            FROM pg_catalog.pg_attribute att CROSS JOIN LATERAL aclexplode(att.attacl) a
            WHERE att.attrelid = format('reconciler.%I', t)::regclass
              AND att.attnum > 0 AND NOT att.attisdropped
        LOOP
            EXECUTE format('GRANT %s %s ON reconciler.%I TO %s %s', g.privilege_type,
                           CASE WHEN g.col IS NOT NULL THEN format('(%I)', g.col) ELSE '' END, t || '_plain', g.grantee,
                           CASE WHEN g.is_grantable THEN 'WITH GRANT OPTION' ELSE '' END);
        END LOOP;
        next_id := NULL;
        IF t <> 'receipt_events' THEN
            EXECUTE format('SELECT greatest(coalesce(pg_sequence_last_value(%L), 0), '
                           '(SELECT coalesce(max(x.id), 0) FROM reconciler.%I x)) + 1',
                           format('reconciler.%s_id_seq', t), t || '_plain') INTO next_id;
        END IF;
        EXECUTE format('DROP TABLE reconciler.%I', t);
        EXECUTE format('ALTER TABLE reconciler.%I RENAME TO %I', t || '_plain', t);
        IF next_id IS NOT NULL THEN
            EXECUTE format('ALTER TABLE reconciler.%I ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH %s)',
                           t, next_id);
        END IF;
        EXECUTE format('CREATE TRIGGER %I BEFORE UPDATE OR DELETE ON reconciler.%I '
                       'FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite()', t || '_append_only', t);
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON reconciler.%I '
                       'FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite()', t || '_no_truncate', t);
    END LOOP;
END
$$;
-- +goose StatementEnd
ALTER TABLE reconciler.receipt_events ADD PRIMARY KEY (receipt_id, seq);
ALTER TABLE reconciler.readback_checks ADD PRIMARY KEY (receipt_id, id);
ALTER TABLE reconciler.verdict_audits ADD PRIMARY KEY (id);
ALTER TABLE reconciler.verdict_audits ADD UNIQUE (receipt_id);
CREATE INDEX verdict_audits_at ON reconciler.verdict_audits (at);
CREATE INDEX verdict_audits_contradicted ON reconciler.verdict_audits (at) WHERE verdict = 'contradicted';
