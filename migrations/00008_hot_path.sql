-- Issue 12 (hot paths): an agent's receipts cost no more than hand-written
-- journaling. The guarantees are those of 00004; what changes is how much
-- work the common path does.
--
--   * Planned and submitted in one step. A receipt may be inserted already
--     submitted: the insert trigger then makes exactly the checks of the
--     move planned -> submitted (the duplicate guard under the intent's
--     lock, RL005; a retry's re-check under a share lock of the receipt it
--     retries, RL002), stamps submitted_at and submitted_by, and the
--     history trigger writes both events (planned, seq 1; submitted, seq 2)
--     in the same statement. One commit instead of two, one row version
--     instead of two, and the same durable record before the first byte.
--     Any other first state is still refused (RL001). reconciler.plan(...,
--     submit => true) does this for a new key; for a key it already knows
--     it submits nothing and raises RL008 (DETAIL: the receipt's id).
--   * One insert trigger instead of two: the input limits of 00005 are
--     checked in receipts_before_insert (the same checks and errors), and
--     every rule of an accepted row is one PL/pgSQL expression (one scan of
--     the names for control characters), the refusals worked out rule by
--     rule only for a row that breaks one.
--
-- The move trigger (receipts_before_update) and the history trigger of
-- updates are those of 00004 and 00001, unchanged.

-- +goose Up

-- A row starts in planned, or in submitted when it is planned and submitted
-- in one step; stamped by the database's clock either way. Keys (path 7) as
-- in 00004; input limits as in 00005 (RL007 for the key; check_violation
-- for the rest).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_before_insert() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad text;
    prev reconciler.receipts;
    why text;
    other bigint;
    t timestamptz;
BEGIN
    -- Every rule of a first row in one condition, so an accepted row pays
    -- for one expression (PL/pgSQL builds each anew in every transaction)
    -- and one scan of the names for control characters (the character
    -- class of 00005 over them all at once); a refused one is then checked
    -- rule by rule, in the order of 00005 and 00004, for its error.
    IF (NEW.idempotency_key || NEW.operation || NEW.dependency || NEW.method || NEW.target)
           ~ '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]'
       OR octet_length(NEW.idempotency_key) > 255 OR octet_length(NEW.operation) > 200
       OR octet_length(NEW.dependency) > 200 OR octet_length(NEW.method) > 200
       OR octet_length(NEW.target) > 2048
       OR NEW.state NOT IN ('planned', 'submitted')
       OR NEW.idempotency_key = '' OR NEW.operation = '' OR NEW.dependency = '' OR NEW.method = ''
       OR NEW.method <> upper(NEW.method) OR NEW.attempt < 1
       OR NEW.fingerprint !~ '^sha256:[0-9a-f]{64}$'
       OR NEW.state_actor !~ '^(agent|reconciler|human):.'
       OR NOT (NEW.max_send_delay > interval '0' AND NEW.max_send_delay <= interval '10 minutes')
       OR NEW.retry_of IS NULL AND (NEW.attempt <> 1 OR NEW.idempotency_key ~ '#[0-9]+$') THEN
        -- 00005: sizes and control characters of what the agent chose.
        bad := '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]';
        IF NEW.idempotency_key ~ bad OR octet_length(NEW.idempotency_key) > 266 THEN
            RAISE EXCEPTION 'invalid key: it must hold no control character and be at most 266 bytes (it has %)',
                octet_length(NEW.idempotency_key) USING ERRCODE = 'RL007';
        END IF;
        IF octet_length(NEW.operation) > 200 OR octet_length(NEW.dependency) > 200 OR octet_length(NEW.method) > 200 THEN
            RAISE EXCEPTION 'invalid receipt: operation, dependency and method must be at most 200 bytes '
                '(they have %, %, %)', octet_length(NEW.operation), octet_length(NEW.dependency), octet_length(NEW.method)
                USING ERRCODE = 'check_violation';
        END IF;
        IF octet_length(NEW.target) > 2048 THEN
            RAISE EXCEPTION 'invalid receipt: the target must be at most 2048 bytes (it has %)', octet_length(NEW.target)
                USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.operation ~ bad OR NEW.dependency ~ bad OR NEW.method ~ bad OR NEW.target ~ bad THEN
            RAISE EXCEPTION 'invalid receipt: operation, dependency, method and target must hold no control character'
                USING ERRCODE = 'check_violation';
        END IF;
        -- 00001 and 00004.
        IF NEW.state NOT IN ('planned', 'submitted') THEN
            RAISE EXCEPTION 'illegal transition (new) -> %: a receipt starts in planned (or in submitted, '
                'planned and submitted at once)', NEW.state USING ERRCODE = 'RL001';
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
        IF NOT (NEW.max_send_delay > interval '0' AND NEW.max_send_delay <= interval '10 minutes') THEN
            RAISE EXCEPTION 'invalid receipt: max_send_delay must be > 0 and <= 10 minutes (got %)',
                NEW.max_send_delay USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.retry_of IS NULL THEN
            IF NEW.idempotency_key ~ '#[0-9]+$' OR octet_length(NEW.idempotency_key) > 255 THEN
                RAISE EXCEPTION 'invalid key %: a first attempt''s key must not end in #<digits> (reserved '
                    'for retries) and must be at most 255 bytes (it has %)',
                    quote_literal(NEW.idempotency_key), octet_length(NEW.idempotency_key)
                    USING ERRCODE = 'RL007';
            END IF;
            IF NEW.attempt <> 1 THEN
                RAISE EXCEPTION 'invalid receipt: a first attempt has attempt 1 (got %)', NEW.attempt
                    USING ERRCODE = 'check_violation';
            END IF;
        END IF;
    END IF;
    IF NEW.retry_of IS NOT NULL THEN
        -- A retry submitted at once takes the share lock its submission
        -- would (receipts_before_update): a late outcome recorded for the
        -- retried receipt either committed first and is seen here, or
        -- waits for this insert.
        IF NEW.state = 'submitted' THEN
            SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = NEW.retry_of FOR SHARE;
        ELSE
            SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = NEW.retry_of;
        END IF;
        -- (No such receipt: the foreign key refuses the row.)
        IF FOUND THEN
            why := reconciler.retry_error(prev);
            IF why IS NOT NULL THEN
                RAISE EXCEPTION '%', why USING ERRCODE = 'RL002';
            END IF;
            IF prev.dependency <> NEW.dependency OR prev.fingerprint <> NEW.fingerprint THEN
                RAISE EXCEPTION 'a retry of receipt % must repeat its intent (%, %), got (%, %)',
                    NEW.retry_of, prev.dependency, prev.fingerprint, NEW.dependency, NEW.fingerprint
                    USING ERRCODE = 'RL004';
            END IF;
            IF NEW.idempotency_key IS DISTINCT FROM
               regexp_replace(prev.idempotency_key, '#[0-9]+$', '') || '#' || (prev.attempt + 1) THEN
                RAISE EXCEPTION 'invalid key %: the retry of receipt % must be keyed %',
                    quote_literal(NEW.idempotency_key), NEW.retry_of,
                    quote_literal(regexp_replace(prev.idempotency_key, '#[0-9]+$', '') || '#' || (prev.attempt + 1))
                    USING ERRCODE = 'RL007';
            END IF;
            IF NEW.attempt <> prev.attempt + 1 THEN
                RAISE EXCEPTION 'invalid receipt: the retry of receipt % is attempt % (got %)',
                    NEW.retry_of, prev.attempt + 1, NEW.attempt USING ERRCODE = 'check_violation';
            END IF;
        END IF;
    END IF;
    t := clock_timestamp();
    NEW.created_at := t;
    NEW.updated_at := t;
    NEW.unknown_since := NULL;
    NEW.moved_from := NULL;
    IF NEW.state = 'planned' THEN
        NEW.version := 1;
        NEW.submitted_at := NULL;
        NEW.submitted_by := NULL;
        RETURN NEW;
    END IF;
    -- Planned and submitted at once: the move's duplicate guard, under the
    -- lock plan and every submission of the intent take (path 1).
    IF NEW.guarded THEN
        why := pg_advisory_xact_lock(hashtextextended(NEW.dependency || ' ' || NEW.fingerprint, 0))::text;
        SELECT x.id INTO other FROM reconciler.receipts x
        WHERE x.dependency = NEW.dependency AND x.fingerprint = NEW.fingerprint
          AND x.state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review')
        ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'intent % is unresolved in receipt %: a duplicate is neither planned nor submitted',
                NEW.fingerprint, other USING ERRCODE = 'RL005', DETAIL = other::text;
        END IF;
    END IF;
    NEW.version := 2;
    NEW.submitted_at := t;
    NEW.submitted_by := current_user;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

DROP TRIGGER receipts_a_input_limits ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_check_input();

-- A receipt inserted submitted has two events: planned (seq 1) and
-- submitted (seq 2), at the same instant. SECURITY DEFINER as in 00001.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_record_insert() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
BEGIN
    INSERT INTO reconciler.receipt_keys (idempotency_key, receipt_id)
    SELECT n.idempotency_key, n.id FROM new_rows n;
    INSERT INTO reconciler.receipt_events
        (receipt_id, seq, from_state, to_state, at, actor, error, evidence, detail, external_id)
    SELECT n.id, e.seq, e.from_state, e.to_state, n.updated_at, n.state_actor,
           n.state_detail -> 'error', n.state_detail -> 'evidence', n.state_detail, n.external_id
    FROM new_rows n
    CROSS JOIN LATERAL (VALUES (1, NULL, 'planned'), (2, 'planned', 'submitted')) AS e(seq, from_state, to_state)
    WHERE e.seq <= n.version;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- reconciler.plan, as in 00004, with submit: true records a new key's
-- receipt planned and submitted in one step (the insert trigger makes the
-- checks of the move, RL005 and RL002 included, and writes both events). A
-- key it already knows is left as it is and refused with RL008 (DETAIL:
-- its receipt's id): nothing is submitted, and the caller reads that
-- receipt and carries on from its state (submits a planned one with
-- reconciler.transition, replays one past planned, retries one that may be).
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb, interval);
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
    pre_image jsonb DEFAULT NULL,
    max_send_delay interval DEFAULT '5 seconds',
    submit boolean DEFAULT false
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
    prev reconciler.receipts;
    earlier reconciler.receipts;
    want text;
BEGIN
    -- Plans of one key take turns, so exactly one inserts it.
    -- (Locks taken by assignment, not PERFORM: a plain expression is
    -- evaluated in place, where PERFORM would run a query.)
    want := pg_advisory_xact_lock(hashtextextended(plan.idempotency_key, 1))::text;
    SELECT x.* INTO r FROM reconciler.receipt_keys k JOIN reconciler.receipts x ON x.id = k.receipt_id
    WHERE k.idempotency_key = plan.idempotency_key;
    IF FOUND THEN
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
        IF r.retry_of IS DISTINCT FROM plan.retry_of THEN
            RAISE EXCEPTION 'idempotency key % already names receipt %, which retries %, not %',
                plan.idempotency_key, r.id, coalesce(r.retry_of::text, 'nothing'),
                coalesce(plan.retry_of::text, 'nothing') USING ERRCODE = 'RL004';
        END IF;
        IF plan.submit THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % (%): nothing submitted',
                plan.idempotency_key, r.id, r.state USING ERRCODE = 'RL008', DETAIL = r.id::text;
        END IF;
        RETURN r;
    END IF;
    IF plan.retry_of IS NULL THEN
        IF plan.idempotency_key ~ '#[0-9]+$' OR octet_length(plan.idempotency_key) > 255 THEN
            RAISE EXCEPTION 'invalid key %: a first attempt''s key must not end in #<digits> (reserved '
                'for retries) and must be at most 255 bytes (it has %)',
                quote_literal(plan.idempotency_key), octet_length(plan.idempotency_key)
                USING ERRCODE = 'RL007';
        END IF;
    ELSE
        SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = plan.retry_of FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'receipt % does not exist', plan.retry_of USING ERRCODE = 'RL003';
        END IF;
        want := reconciler.retry_error(prev);
        IF want IS NOT NULL THEN
            RAISE EXCEPTION '%', want USING ERRCODE = 'RL002';
        END IF;
        -- A retry repeats its intent. Refused before anything is inserted,
        -- so a wrong payload never takes (and wedges) the step's next key.
        IF prev.fingerprint <> plan.fingerprint OR prev.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'a retry of receipt % must repeat its intent (%, %), got (%, %)',
                prev.id, prev.dependency, prev.fingerprint, plan.dependency, plan.fingerprint
                USING ERRCODE = 'RL004';
        END IF;
        want := regexp_replace(prev.idempotency_key, '#[0-9]+$', '') || '#' || (prev.attempt + 1);
        IF plan.idempotency_key <> want THEN
            RAISE EXCEPTION 'invalid key %: the retry of receipt % must be keyed %',
                quote_literal(plan.idempotency_key), prev.id, quote_literal(want) USING ERRCODE = 'RL007';
        END IF;
    END IF;
    -- The guard of a receipt submitted at once is the insert trigger's.
    IF NOT coalesce(plan.allow_duplicate, false) AND NOT coalesce(plan.submit, false) THEN
        -- Serialize plans (and submissions: receipts_before_update) of one
        -- intent so two agents cannot both pass the guard. (Opted-out plans
        -- need no guard and take no lock.)
        want := pg_advisory_xact_lock(hashtextextended(plan.dependency || ' ' || plan.fingerprint, 0))::text;
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
         state_actor, attempt, retry_of, pre_image, max_send_delay, guarded, state)
    VALUES (plan.idempotency_key, plan.operation, plan.dependency, upper(plan.method), plan.target,
            plan.fingerprint, coalesce(plan.intent, '{}'), plan.actor,
            CASE WHEN plan.retry_of IS NULL THEN 1 ELSE prev.attempt + 1 END, plan.retry_of,
            plan.pre_image, coalesce(plan.max_send_delay, interval '5 seconds'),
            NOT coalesce(plan.allow_duplicate, false),
            CASE WHEN coalesce(plan.submit, false) THEN 'submitted' ELSE 'planned' END)
    RETURNING * INTO r;
    RETURN r;
END
$$;
-- +goose StatementEnd

-- Where the roles of docs/roles.sql are already in use, the agent keeps
-- plan (a new signature) and may insert a receipt submitted at once
-- (docs/roles.sql grants both, for databases set up after this migration).
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_agent') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean,
            bigint, jsonb, interval, boolean) TO reconciler_agent;
        GRANT INSERT (state) ON reconciler.receipts TO reconciler_agent;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- The functions and triggers of 00004 and 00005, as they were.
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb, interval, boolean);
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
    pre_image jsonb DEFAULT NULL,
    max_send_delay interval DEFAULT '5 seconds'
) RETURNS reconciler.receipts LANGUAGE plpgsql AS $$
DECLARE
    r reconciler.receipts;
    prev reconciler.receipts;
    earlier reconciler.receipts;
    want text;
BEGIN
    -- Plans of one key take turns, so exactly one inserts it.
    -- (Locks taken by assignment, not PERFORM: a plain expression is
    -- evaluated in place, where PERFORM would run a query.)
    want := pg_advisory_xact_lock(hashtextextended(plan.idempotency_key, 1))::text;
    SELECT x.* INTO r FROM reconciler.receipt_keys k JOIN reconciler.receipts x ON x.id = k.receipt_id
    WHERE k.idempotency_key = plan.idempotency_key;
    IF FOUND THEN
        IF r.fingerprint <> plan.fingerprint OR r.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'idempotency key % already names receipt % with another intent (%)',
                plan.idempotency_key, r.id, r.fingerprint USING ERRCODE = 'RL004';
        END IF;
        IF r.retry_of IS DISTINCT FROM plan.retry_of THEN
            RAISE EXCEPTION 'idempotency key % already names receipt %, which retries %, not %',
                plan.idempotency_key, r.id, coalesce(r.retry_of::text, 'nothing'),
                coalesce(plan.retry_of::text, 'nothing') USING ERRCODE = 'RL004';
        END IF;
        RETURN r;
    END IF;
    IF plan.retry_of IS NULL THEN
        IF plan.idempotency_key ~ '#[0-9]+$' OR octet_length(plan.idempotency_key) > 255 THEN
            RAISE EXCEPTION 'invalid key %: a first attempt''s key must not end in #<digits> (reserved '
                'for retries) and must be at most 255 bytes (it has %)',
                quote_literal(plan.idempotency_key), octet_length(plan.idempotency_key)
                USING ERRCODE = 'RL007';
        END IF;
    ELSE
        SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = plan.retry_of FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'receipt % does not exist', plan.retry_of USING ERRCODE = 'RL003';
        END IF;
        -- Retry what was proven absent, or what was refused before any
        -- effect could happen and may be sent again (nothing was sent, or
        -- the API said come back later): the error the rejection recorded
        -- says which.
        want := reconciler.retry_error(prev);
        IF want IS NOT NULL THEN
            RAISE EXCEPTION '%', want USING ERRCODE = 'RL002';
        END IF;
        -- A retry repeats its intent. Refused before anything is inserted,
        -- so a wrong payload never takes (and wedges) the step's next key.
        IF prev.fingerprint <> plan.fingerprint OR prev.dependency <> plan.dependency THEN
            RAISE EXCEPTION 'a retry of receipt % must repeat its intent (%, %), got (%, %)',
                prev.id, prev.dependency, prev.fingerprint, plan.dependency, plan.fingerprint
                USING ERRCODE = 'RL004';
        END IF;
        want := regexp_replace(prev.idempotency_key, '#[0-9]+$', '') || '#' || (prev.attempt + 1);
        IF plan.idempotency_key <> want THEN
            RAISE EXCEPTION 'invalid key %: the retry of receipt % must be keyed %',
                quote_literal(plan.idempotency_key), prev.id, quote_literal(want) USING ERRCODE = 'RL007';
        END IF;
    END IF;
    IF NOT coalesce(plan.allow_duplicate, false) THEN
        -- Serialize plans (and submissions: receipts_before_update) of one
        -- intent so two agents cannot both pass the guard. (Opted-out plans
        -- need no guard and take no lock.)
        want := pg_advisory_xact_lock(hashtextextended(plan.dependency || ' ' || plan.fingerprint, 0))::text;
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
         state_actor, attempt, retry_of, pre_image, max_send_delay, guarded)
    VALUES (plan.idempotency_key, plan.operation, plan.dependency, upper(plan.method), plan.target,
            plan.fingerprint, coalesce(plan.intent, '{}'), plan.actor,
            CASE WHEN plan.retry_of IS NULL THEN 1 ELSE prev.attempt + 1 END, plan.retry_of,
            plan.pre_image, coalesce(plan.max_send_delay, interval '5 seconds'),
            NOT coalesce(plan.allow_duplicate, false))
    RETURNING * INTO r;
    RETURN r;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_before_insert() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    prev reconciler.receipts;
    prev_key text;
    prev_attempt integer;
    prev_dependency text;
    prev_fingerprint text;
    why text;
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
    IF NOT (NEW.max_send_delay > interval '0' AND NEW.max_send_delay <= interval '10 minutes') THEN
        RAISE EXCEPTION 'invalid receipt: max_send_delay must be > 0 and <= 10 minutes (got %)',
            NEW.max_send_delay USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.retry_of IS NULL THEN
        IF NEW.idempotency_key ~ '#[0-9]+$' OR octet_length(NEW.idempotency_key) > 255 THEN
            RAISE EXCEPTION 'invalid key %: a first attempt''s key must not end in #<digits> (reserved '
                'for retries) and must be at most 255 bytes (it has %)',
                quote_literal(NEW.idempotency_key), octet_length(NEW.idempotency_key)
                USING ERRCODE = 'RL007';
        END IF;
        IF NEW.attempt <> 1 THEN
            RAISE EXCEPTION 'invalid receipt: a first attempt has attempt 1 (got %)', NEW.attempt
                USING ERRCODE = 'check_violation';
        END IF;
    ELSE
        SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = NEW.retry_of;
        -- (No such receipt: the foreign key refuses the row.)
        IF FOUND THEN
            prev_key := prev.idempotency_key;
            prev_attempt := prev.attempt;
            prev_dependency := prev.dependency;
            prev_fingerprint := prev.fingerprint;
            why := reconciler.retry_error(prev);
            IF why IS NOT NULL THEN
                RAISE EXCEPTION '%', why USING ERRCODE = 'RL002';
            END IF;
            IF prev_dependency <> NEW.dependency OR prev_fingerprint <> NEW.fingerprint THEN
                RAISE EXCEPTION 'a retry of receipt % must repeat its intent (%, %), got (%, %)',
                    NEW.retry_of, prev_dependency, prev_fingerprint, NEW.dependency, NEW.fingerprint
                    USING ERRCODE = 'RL004';
            END IF;
            IF NEW.idempotency_key IS DISTINCT FROM
               regexp_replace(prev_key, '#[0-9]+$', '') || '#' || (prev_attempt + 1) THEN
                RAISE EXCEPTION 'invalid key %: the retry of receipt % must be keyed %',
                    quote_literal(NEW.idempotency_key), NEW.retry_of,
                    quote_literal(regexp_replace(prev_key, '#[0-9]+$', '') || '#' || (prev_attempt + 1))
                    USING ERRCODE = 'RL007';
            END IF;
            IF NEW.attempt <> prev_attempt + 1 THEN
                RAISE EXCEPTION 'invalid receipt: the retry of receipt % is attempt % (got %)',
                    NEW.retry_of, prev_attempt + 1, NEW.attempt USING ERRCODE = 'check_violation';
            END IF;
        END IF;
    END IF;
    NEW.version := 1;
    NEW.created_at := clock_timestamp();
    NEW.updated_at := NEW.created_at;
    NEW.submitted_at := NULL;
    NEW.submitted_by := NULL;
    NEW.unknown_since := NULL;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_record_insert() RETURNS trigger LANGUAGE plpgsql
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
CREATE FUNCTION reconciler.receipts_check_input() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad constant text := '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]';
BEGIN
    IF NEW.idempotency_key ~ bad OR octet_length(NEW.idempotency_key) > 266 THEN
        RAISE EXCEPTION 'invalid key: it must hold no control character and be at most 266 bytes (it has %)',
            octet_length(NEW.idempotency_key) USING ERRCODE = 'RL007';
    END IF;
    IF octet_length(NEW.operation) > 200 OR octet_length(NEW.dependency) > 200 OR octet_length(NEW.method) > 200 THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency and method must be at most 200 bytes '
            '(they have %, %, %)', octet_length(NEW.operation), octet_length(NEW.dependency), octet_length(NEW.method)
            USING ERRCODE = 'check_violation';
    END IF;
    IF octet_length(NEW.target) > 2048 THEN
        RAISE EXCEPTION 'invalid receipt: the target must be at most 2048 bytes (it has %)', octet_length(NEW.target)
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.operation ~ bad OR NEW.dependency ~ bad OR NEW.method ~ bad OR NEW.target ~ bad THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency, method and target must hold no control character'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
-- Named to fire before receipts_before_insert (triggers fire in name order).
CREATE TRIGGER receipts_a_input_limits BEFORE INSERT ON reconciler.receipts
    FOR EACH ROW EXECUTE FUNCTION reconciler.receipts_check_input();

-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_agent') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean,
            bigint, jsonb, interval) TO reconciler_agent;
        REVOKE INSERT (state) ON reconciler.receipts FROM reconciler_agent;
    END IF;
END
$$;
-- +goose StatementEnd
