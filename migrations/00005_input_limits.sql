-- Issue 8, item 8: sizes and control characters of what an agent chose
-- (key, operation, dependency, method, target) are checked when a receipt is
-- planned, in reconciler.plan and in the insert trigger, with one clear
-- error each, instead of a 10 MB operation being accepted, a 10 KB
-- dependency planning and failing at submit (an index row too large), or a
-- 3 KB key failing with a btree error:
--   RL007            a key holding a control character, or over 266 bytes
--                    (a first attempt's 255 plus "#<attempt>");
--   check_violation  an operation, dependency or method over 200 bytes, a
--                    target over 2048 bytes, or a control character in any
--                    of them.
-- Control characters: C0 (U+0001-U+001F; NUL cannot be stored at all), DEL,
-- C1 (U+0080-U+009F), the line and paragraph separators and bidirectional
-- controls (U+061C, U+200E, U+200F, U+2028-U+202E, U+2066-U+2069) and the
-- byte order mark (U+FEFF): the characters that rewrite an operator's
-- terminal or hide what a name says. ledger.Plan checks the same first.

-- +goose Up

-- The checks are written out in the trigger and in reconciler.plan rather
-- than in a shared function: a trigger function needs no EXECUTE privilege
-- to fire, a function it calls would (docs/roles.sql grants each role only
-- the functions it calls).
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

-- reconciler.plan as in 00004, checking its input first (before any lock),
-- with the same checks as the trigger.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.plan(
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
    bad constant text := '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]';
BEGIN
    IF plan.idempotency_key ~ bad OR octet_length(plan.idempotency_key) > 266 THEN
        RAISE EXCEPTION 'invalid key: it must hold no control character and be at most 266 bytes (it has %)',
            octet_length(plan.idempotency_key) USING ERRCODE = 'RL007';
    END IF;
    IF octet_length(plan.operation) > 200 OR octet_length(plan.dependency) > 200 OR octet_length(plan.method) > 200 THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency and method must be at most 200 bytes '
            '(they have %, %, %)', octet_length(plan.operation), octet_length(plan.dependency), octet_length(plan.method)
            USING ERRCODE = 'check_violation';
    END IF;
    IF octet_length(plan.target) > 2048 THEN
        RAISE EXCEPTION 'invalid receipt: the target must be at most 2048 bytes (it has %)', octet_length(plan.target)
            USING ERRCODE = 'check_violation';
    END IF;
    IF plan.operation ~ bad OR plan.dependency ~ bad OR plan.method ~ bad OR plan.target ~ bad THEN
        RAISE EXCEPTION 'invalid receipt: operation, dependency, method and target must hold no control character'
            USING ERRCODE = 'check_violation';
    END IF;
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

-- +goose Down
DROP TRIGGER receipts_a_input_limits ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_check_input();
-- reconciler.plan as in 00004.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.plan(
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
