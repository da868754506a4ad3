-- +goose Up
-- The receipt ledger. `receipts` is the current-state projection, one row per
-- attempt at a side effect; `receipt_events` is its append-only history. The
-- database enforces the state machine itself so that a client in any
-- language, or a hand-written UPDATE, cannot skip or rewrite a step.

CREATE SCHEMA IF NOT EXISTS reconciler;

CREATE TABLE reconciler.receipts (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The columns that describe the intent never change after insert, so
    -- they are validated by the insert trigger, not by CHECK constraints,
    -- which Postgres re-reads and re-evaluates on every UPDATE of the row.
    -- Unique through reconciler.receipt_keys, not an index here: see there.
    idempotency_key  text NOT NULL,
    operation        text NOT NULL,
    -- Machine identifiers: byte order ("C") keeps index comparisons cheap.
    dependency       text COLLATE "C" NOT NULL,
    method           text NOT NULL,
    target           text NOT NULL,
    fingerprint      text COLLATE "C" NOT NULL,
    -- The normalized intent with secret fields redacted; never credentials.
    intent           jsonb NOT NULL DEFAULT '{}',
    -- An update is "absent" only if the resource still holds the state it
    -- had before the call, so that state is recorded at plan time.
    pre_image        jsonb,
    state            text NOT NULL DEFAULT 'planned' CHECK (state IN (
                         'planned', 'submitted', 'outcome_unknown', 'reconciling',
                         'succeeded', 'safe_to_retry', 'rejected', 'manual_review')),
    external_id      text,
    attempt          integer NOT NULL DEFAULT 1,
    -- A retry is a new receipt linked to the safe_to_retry one it replaces
    -- (unique: see receipts_retry_of).
    retry_of         bigint REFERENCES reconciler.receipts (id),
    -- Who made the latest move and with what error/evidence. The trigger
    -- copies them into the history row; they are the input of a move.
    -- Checked by the triggers whenever it drives a move.
    state_actor      text NOT NULL,
    state_detail     jsonb NOT NULL DEFAULT '{}',
    -- Trigger bookkeeping: the state this row version moved from, NULL when
    -- the UPDATE that wrote it was no move. The history trigger reads it
    -- instead of joining the statement's old and new rows.
    moved_from       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    submitted_at     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    version          integer NOT NULL DEFAULT 1,
    -- Reconciler bookkeeping: a claimed row carries a lease; a waiting row
    -- carries the time of its next check, so the wait survives restarts.
    lease_owner      text,
    lease_expires_at timestamptz,
    next_check_at    timestamptz,
    check_count      integer NOT NULL DEFAULT 0
);

-- Idempotency keys, insert-only. A unique index on receipts itself would be
-- rechecked against the heap on every move (a move is a non-HOT update: the
-- state is in index predicates), visiting each earlier version of the row;
-- keys never change, so their uniqueness lives in a table nothing updates.
-- The insert trigger below fills it for every receipt, however inserted.
CREATE TABLE reconciler.receipt_keys (
    idempotency_key text COLLATE "C" PRIMARY KEY,
    receipt_id      bigint NOT NULL
);

-- One settled attempt is retried at most once. Partial, because most
-- receipts are first attempts and every non-HOT update of a receipt inserts
-- into each index whose predicate its new version matches.
CREATE UNIQUE INDEX receipts_retry_of ON reconciler.receipts (retry_of) WHERE retry_of IS NOT NULL;
-- Duplicate guard of Plan: an unresolved receipt with the same intent.
CREATE INDEX receipts_unresolved_fingerprint ON reconciler.receipts (dependency, fingerprint)
    WHERE state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review');
-- The reconciler's claim: due rows only, ordered by due time.
CREATE INDEX receipts_due ON reconciler.receipts (next_check_at)
    WHERE state IN ('outcome_unknown', 'reconciling');
-- Orphan sweep (stale submitted) and stale-planned counts.
CREATE INDEX receipts_stale ON reconciler.receipts (state, updated_at)
    WHERE state IN ('planned', 'submitted');

-- History rows are written only by the receipts triggers, from rows that
-- exist, and receipts can never be deleted; so there is no foreign key,
-- whose per-row check would cost the reconciler's batch settle a good share
-- of its throughput for a guarantee the schema already gives.
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
);

-- reconciler.transition_error returns NULL when actor may move a receipt from
-- from_state to to_state, else the reason it may not. This is the transition
-- table of SPEC §3 (package statemachine holds the same one). A FROM-less SQL
-- function, so the trigger's call is inlined rather than run as a query.
-- +goose StatementBegin
CREATE FUNCTION reconciler.transition_error(from_state text, to_state text, actor text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN ($1, $2) NOT IN (
                ('planned', 'submitted'), ('planned', 'rejected'),
                ('submitted', 'succeeded'), ('submitted', 'rejected'), ('submitted', 'outcome_unknown'),
                ('outcome_unknown', 'reconciling'), ('outcome_unknown', 'manual_review'),
                ('reconciling', 'succeeded'), ('reconciling', 'safe_to_retry'), ('reconciling', 'manual_review'),
                ('manual_review', 'succeeded'), ('manual_review', 'safe_to_retry'),
                ('manual_review', 'rejected'), ('manual_review', 'outcome_unknown'))
            THEN CASE WHEN $1 IN ('succeeded', 'safe_to_retry', 'rejected')
                      THEN $1 || ' is terminal' ELSE 'not in the transition table' END
        WHEN $1 = 'manual_review' AND $3 NOT LIKE 'human:%'
            THEN 'only a human may leave manual_review'
    END
$$;
-- +goose StatementEnd

-- A row starts in planned. Its first history event is written with it.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_before_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state <> 'planned' THEN
        RAISE EXCEPTION 'illegal transition (new) -> %: a receipt starts in planned', NEW.state
            USING ERRCODE = 'RL001';
    END IF;
    IF NEW.idempotency_key = '' OR NEW.operation = '' OR NEW.dependency = '' OR NEW.method = ''
       OR NEW.method <> upper(NEW.method) OR NEW.attempt < 1
       OR NEW.fingerprint !~ '^sha256:[0-9a-f]{64}$'
       OR NEW.state_actor !~ '^(agent|reconciler|human):.' THEN
        RAISE EXCEPTION 'invalid receipt: key, operation, dependency and method must be non-empty, '
            'the method upper case, the attempt >= 1, the fingerprint sha256:<64 hex> and the actor '
            '<agent|reconciler|human>:<id> (got key %, method %, fingerprint %, actor %)',
            quote_literal(NEW.idempotency_key), quote_literal(NEW.method),
            quote_literal(NEW.fingerprint), quote_literal(NEW.state_actor)
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.version := 1;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- Every state change is checked against the table and the actor rule, bumps
-- the version, and is recorded in history by the statement trigger below.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
BEGIN
    IF NEW.id <> OLD.id OR NEW.idempotency_key <> OLD.idempotency_key
       OR NEW.fingerprint <> OLD.fingerprint OR NEW.created_at <> OLD.created_at
       OR NEW.version <> OLD.version THEN
        RAISE EXCEPTION 'receipt %: id, idempotency_key, fingerprint, created_at and version cannot be changed', OLD.id
            USING ERRCODE = 'RL006';
    END IF;
    -- An UPDATE that leaves the state as it is (leases, schedules) is not a
    -- move and records nothing.
    IF NEW.state = OLD.state THEN
        NEW.moved_from := NULL;
        RETURN NEW;
    END IF;
    -- PL/pgSQL rebuilds its simple expressions in every transaction, and
    -- every move is its own transaction: one array test is cheap to rebuild,
    -- the full table with its reasons is worked out only for a refusal.
    IF NOT (OLD.state || '>' || NEW.state) = ANY ('{planned>submitted,planned>rejected,
            submitted>succeeded,submitted>rejected,submitted>outcome_unknown,
            outcome_unknown>reconciling,outcome_unknown>manual_review,
            reconciling>succeeded,reconciling>safe_to_retry,reconciling>manual_review,
            manual_review>succeeded,manual_review>safe_to_retry,manual_review>rejected,
            manual_review>outcome_unknown}'::text[])
       OR OLD.state = 'manual_review' AND NEW.state_actor NOT LIKE 'human:_%'
       OR NEW.state_actor !~ '^(agent|reconciler|human):.' THEN
        why := coalesce(reconciler.transition_error(OLD.state, NEW.state, NEW.state_actor),
                        'the actor must be <agent|reconciler|human>:<id>');
        RAISE EXCEPTION 'illegal transition % -> % by %: %', OLD.state, NEW.state, NEW.state_actor, why
            USING ERRCODE = 'RL001';
    END IF;
    -- Where the roles of docs/roles.sql are in use, "human" is a database
    -- role too: an agent's or the daemon's login cannot leave manual_review by
    -- writing a human actor. (Only moves out of manual_review pay for this.)
    IF OLD.state = 'manual_review'
       AND (coalesce(pg_has_role(current_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
            OR coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false))
       AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
        RAISE EXCEPTION 'illegal transition % -> % by %: only a member of reconciler_reviewer may leave manual_review',
            OLD.state, NEW.state, NEW.state_actor USING ERRCODE = 'RL001';
    END IF;
    -- A move that did not set its own detail must not inherit the previous one's.
    IF NEW.state_detail = OLD.state_detail THEN
        NEW.state_detail := '{}';
    END IF;
    NEW.moved_from := OLD.state;
    NEW.version := OLD.version + 1;
    NEW.updated_at := now();
    IF NEW.state = 'submitted' THEN
        NEW.submitted_at := now();
    END IF;
    IF NEW.state = 'outcome_unknown' THEN
        NEW.next_check_at := now();
        NEW.lease_owner := NULL;
        NEW.lease_expires_at := NULL;
        -- Wake idle reconcilers (delivered at commit; Postgres folds
        -- identical notifications of one transaction into one).
        PERFORM pg_notify('reconciler_due', '');
    END IF;
    IF NEW.state IN ('succeeded', 'safe_to_retry', 'rejected', 'manual_review') THEN
        NEW.next_check_at := NULL;
        NEW.lease_owner := NULL;
        NEW.lease_expires_at := NULL;
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- History rows are written per statement from the transition tables, so a
-- batch of N moves costs one INSERT, not N.
--
-- Both history functions are SECURITY DEFINER: they run with the rights of
-- their owner, whoever ran the migrations (the owner of the schema and its
-- tables), so the roles of docs/roles.sql move receipts without holding
-- INSERT on receipt_events or receipt_keys, and no client can write a
-- history row of its own. As every SECURITY DEFINER function should, they
-- pin search_path (pg_temp last, so no temporary object can shadow a name;
-- every name inside is schema-qualified anyway, and new_rows is the
-- trigger's transition table, resolved before any schema). The GUC save and
-- restore that the SET clause costs is paid once per statement, not per
-- row, and measured below the noise of a single-row move (~40 us).
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_record_insert() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
BEGIN
    INSERT INTO reconciler.receipt_keys (idempotency_key, receipt_id)
    SELECT n.idempotency_key, n.id FROM new_rows n;
    INSERT INTO reconciler.receipt_events
        (receipt_id, seq, from_state, to_state, at, actor, error, evidence, detail, external_id)
    SELECT n.id, n.version, NULL, n.state, n.updated_at, n.state_actor,
           n.state_detail -> 'error', n.state_detail -> 'evidence', n.state_detail, n.external_id
    FROM new_rows n;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_record_update() RETURNS trigger LANGUAGE plpgsql
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

CREATE TRIGGER receipts_before_insert BEFORE INSERT ON reconciler.receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.receipts_before_insert();
CREATE TRIGGER receipts_before_update BEFORE UPDATE ON reconciler.receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.receipts_before_update();
CREATE TRIGGER receipts_record_insert AFTER INSERT ON reconciler.receipts
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.receipts_record_insert();
CREATE TRIGGER receipts_record_update AFTER UPDATE ON reconciler.receipts
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.receipts_record_update();

-- History and receipts are never rewritten or removed.
-- +goose StatementBegin
CREATE FUNCTION reconciler.refuse_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%.% is append-only: % refused', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'RL006';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER receipt_events_append_only BEFORE UPDATE OR DELETE ON reconciler.receipt_events
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipt_events_no_truncate BEFORE TRUNCATE ON reconciler.receipt_events
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipt_keys_append_only BEFORE UPDATE OR DELETE ON reconciler.receipt_keys
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipt_keys_no_truncate BEFORE TRUNCATE ON reconciler.receipt_keys
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipts_no_delete BEFORE DELETE ON reconciler.receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER receipts_no_truncate BEFORE TRUNCATE ON reconciler.receipts
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- reconciler.plan records a planned receipt (with the pre-image of an update,
-- if given), or returns the existing one for
-- a known idempotency key. It refuses a key reused for another intent
-- (RL004) and, unless allow_duplicate, an intent whose fingerprint is still
-- unresolved for the same dependency under another key (RL005).
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
    -- Plans of one key take turns, so exactly one inserts it.
    PERFORM pg_advisory_xact_lock(hashtextextended(plan.idempotency_key, 1));
    SELECT x.* INTO r FROM reconciler.receipt_keys k JOIN reconciler.receipts x ON x.id = k.receipt_id
    WHERE k.idempotency_key = plan.idempotency_key;
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
        -- Retry what was proven absent, or what was refused before any
        -- effect could happen and may be sent again (nothing was sent, or
        -- the API said come back later): the error the rejection recorded
        -- says which.
        IF NOT (prev.state = 'safe_to_retry'
                OR prev.state = 'rejected' AND (prev.state_detail #>> '{error,retryable}') = 'true') THEN
            RAISE EXCEPTION 'receipt % is %, neither safe_to_retry nor a retryable rejection: it cannot be retried',
                prev.id, prev.state USING ERRCODE = 'RL002';
        END IF;
    END IF;
    IF NOT plan.allow_duplicate THEN
        -- Serialize plans of one intent so two agents cannot both pass the
        -- guard. (Opted-out plans need no guard and take no lock.)
        PERFORM pg_advisory_xact_lock(hashtextextended(plan.dependency || ' ' || plan.fingerprint, 0));
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
    RETURNING * INTO r;
    RETURN r;
END
$$;
-- +goose StatementEnd

-- reconciler.transition moves a receipt to to_state; a move to the state it
-- is already in is refused like any illegal move. With expected_state it
-- moves only from that state (RL002 otherwise), so of two concurrent writers
-- exactly one wins. Illegal moves raise RL001, unknown receipts RL003.
-- +goose StatementBegin
CREATE FUNCTION reconciler.transition(
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

-- +goose Down
DROP FUNCTION reconciler.transition(bigint, text, text, jsonb, text, text);
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb);
DROP TABLE reconciler.receipt_events;
DROP TABLE reconciler.receipt_keys;
DROP TABLE reconciler.receipts;
DROP FUNCTION reconciler.refuse_rewrite();
DROP FUNCTION reconciler.receipts_record_update();
DROP FUNCTION reconciler.receipts_record_insert();
DROP FUNCTION reconciler.receipts_before_update();
DROP FUNCTION reconciler.receipts_before_insert();
DROP FUNCTION reconciler.transition_error(text, text, text);
