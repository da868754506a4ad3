-- +goose Up
-- Soundness (issue 7): the database closes the paths by which a receipt
-- could be sent twice or settled safe_to_retry while its effect exists.
--
--   * One clock: every time a trigger stamps (created_at, updated_at,
--     submitted_at, unknown_since, next_check_at on becoming
--     outcome_unknown, and so each history row's `at`) is clock_timestamp(),
--     the moment the statement ran, never now(), the start of its
--     transaction. Times a client gives on INSERT are overwritten.
--   * The send deadline: max_send_delay, fixed at plan. The agent writes the
--     request's bytes by submitted_at + max_send_delay or not at all.
--   * The duplicate guard holds from plan to submission: it is re-checked
--     on planned -> submitted under plan's lock (path 1).
--   * Idempotency keys whose logical key is unambiguous (path 7), retries
--     that repeat their intent, and keys that always name the same retry.
--   * Who may move (path 8): an agent's login records its own calls only:
--     it makes no reconciler move, and it moves a receipt out of submitted
--     only if it is the login that submitted it (submitted_by).
--   * Columns that describe the intent or a past move never change (path 9).
--   * Late outcomes: what an agent learned after the orphan sweep moved its
--     receipt, kept as evidence for the reconciler (append-only). A late
--     success or a late answer it could not read refuses every retry of the
--     receipt, also one planned before the late outcome arrived (re-checked
--     on planned -> submitted).

-- Set at plan, immutable: the request must be written within this long
-- after submitted_at (SPEC §5a). Validated by the insert trigger, not a
-- CHECK constraint (Postgres would re-evaluate one on every move).
ALTER TABLE reconciler.receipts ADD COLUMN max_send_delay interval NOT NULL DEFAULT '5 seconds';
-- Whether the duplicate guard applies: false when planned with
-- allow_duplicate. Immutable.
ALTER TABLE reconciler.receipts ADD COLUMN guarded boolean NOT NULL DEFAULT true;
-- The latest move to outcome_unknown (orphan sweep, lost answer, requeue):
-- the start of the current check budget, which that move resets.
ALTER TABLE reconciler.receipts ADD COLUMN unknown_since timestamptz;
-- The database login (current_user) that moved the receipt planned ->
-- submitted: the one process that may send its request. Stamped by the
-- update trigger, immutable, NULL until submitted (and for receipts
-- submitted before this migration). Where the roles of docs/roles.sql are
-- in use, a login only in reconciler_agent moves a receipt out of submitted
-- only if it is this login (path 8).
ALTER TABLE reconciler.receipts ADD COLUMN submitted_by name;

-- What an agent observed about its own call after the orphan sweep had
-- already moved the receipt out of submitted (its settle found the receipt
-- moved): the reconciler reads these as evidence. Append-only; written only
-- through reconciler.record_late_outcome.
CREATE TABLE reconciler.late_outcomes (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    receipt_id  bigint NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor       text NOT NULL,
    outcome     text NOT NULL CHECK (outcome IN ('succeeded', 'rejected', 'outcome_unknown')),
    http_status integer,
    external_id text,
    detail      jsonb NOT NULL DEFAULT '{}',
    -- Identity and the lookup of a receipt's late outcomes in one index.
    PRIMARY KEY (receipt_id, id)
);

CREATE TRIGGER late_outcomes_append_only BEFORE UPDATE OR DELETE ON reconciler.late_outcomes
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER late_outcomes_no_truncate BEFORE TRUNCATE ON reconciler.late_outcomes
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- reconciler.retry_error returns NULL when prev may be retried (attempt n+1
-- linked to it), else why not: only what was proven absent, or refused
-- before any effect could happen (nothing sent, or the API said come back
-- later: the recorded error says which), and never a receipt whose agent
-- learned after the orphan sweep moved it that its call was still alive:
-- a late outcome 'succeeded' (the effect exists) or 'outcome_unknown' (a
-- 502, a timeout, an unreadable answer: the request outlived what the
-- settlement assumed, so the effect may exist). A late 'rejected' proves
-- no effect and refuses nothing. One rule for reconciler.plan, for a plain
-- INSERT of a retry, and for the retry's planned -> submitted move (which
-- re-runs it under a share lock of prev, so a late outcome recorded after
-- the retry was planned still stops it being sent).
-- +goose StatementBegin
CREATE FUNCTION reconciler.retry_error(prev reconciler.receipts) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l reconciler.late_outcomes;
BEGIN
    IF NOT (prev.state = 'safe_to_retry'
            OR prev.state = 'rejected' AND (prev.state_detail #>> '{error,retryable}') = 'true') THEN
        RETURN format('receipt %s is %s, neither safe_to_retry nor a retryable rejection: it cannot be retried',
                      prev.id, prev.state);
    END IF;
    -- The late outcome that refuses, a success first. A late
    -- outcome_unknown refuses when the server or a gateway answered (an HTTP
    -- status: the request was still alive on their side), or when it came
    -- after the settlement; a client-side timeout recorded while the
    -- reconciler was still reading back says nothing the window did not
    -- already cover. (PL/pgSQL, not SQL: the query's plan is kept for the
    -- session, which a retry's submission, running this on every retry,
    -- would otherwise pay for each time.)
    SELECT * INTO l FROM reconciler.late_outcomes x
    WHERE x.receipt_id = prev.id
      AND (x.outcome = 'succeeded'
           OR x.outcome = 'outcome_unknown'
              AND (x.http_status IS NOT NULL OR prev.state = 'safe_to_retry' AND x.at >= prev.updated_at))
    ORDER BY x.outcome = 'succeeded' DESC, x.id LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF l.outcome = 'succeeded' THEN
        RETURN format('receipt %s is %s, but its agent received a success after the orphan sweep moved it '
                      '(late outcome %s at %s, HTTP %s, external id %s; reconciler.late_outcomes): the effect exists '
                      'and must not be sent again; a human must look', prev.id, prev.state, l.id, l.at,
                      coalesce(l.http_status::text, 'none'), coalesce(l.external_id, 'none'));
    END IF;
    RETURN format('receipt %s is %s, but its agent saw its call still alive after the orphan sweep moved it, '
                  'with no answer it could read (late outcome_unknown %s at %s, HTTP %s; '
                  'reconciler.late_outcomes): the request outlived the window the settlement assumed, so the '
                  'effect may exist and must not be sent again; a human must look', prev.id, prev.state, l.id,
                  l.at, coalesce(l.http_status::text, 'none'));
END
$$;
-- +goose StatementEnd

-- A row starts in planned, stamped by the database's clock. Keys (path 7):
-- the logical key of a receipt is its key without a final "#<digits>",
-- which only a retry's key may have; so a first attempt's key must not end
-- that way, and a retry's key is exactly "<logical key of the retried>#<its
-- attempt + 1>". Checked here so a plain INSERT obeys the same rules as
-- reconciler.plan (which checks them first, to refuse before its guard).
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

-- Every state change is checked against the table, the actor rule and the
-- roles, re-checks the duplicate guard on submission, bumps the version,
-- stamps the times, and is recorded in history by the statement trigger.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
    other bigint;
    t timestamptz;
    cols text[];
    prev reconciler.receipts;
BEGIN
    -- Path 9: what describes the intent or a past move never changes. One
    -- row comparison (a single expression), so the cheap path stays cheap;
    -- the names of the offending columns are worked out only to refuse.
    IF (NEW.id, NEW.idempotency_key, NEW.operation, NEW.dependency, NEW.method, NEW.target,
        NEW.fingerprint, NEW.intent, NEW.pre_image, NEW.attempt, NEW.retry_of, NEW.created_at,
        NEW.max_send_delay, NEW.guarded, NEW.submitted_at, NEW.submitted_by, NEW.unknown_since,
        NEW.updated_at, NEW.version)
       IS DISTINCT FROM
       (OLD.id, OLD.idempotency_key, OLD.operation, OLD.dependency, OLD.method, OLD.target,
        OLD.fingerprint, OLD.intent, OLD.pre_image, OLD.attempt, OLD.retry_of, OLD.created_at,
        OLD.max_send_delay, OLD.guarded, OLD.submitted_at, OLD.submitted_by, OLD.unknown_since,
        OLD.updated_at, OLD.version) THEN
        cols := ARRAY['id', 'idempotency_key', 'operation', 'dependency', 'method', 'target',
            'fingerprint', 'intent', 'pre_image', 'attempt', 'retry_of', 'created_at', 'max_send_delay',
            'guarded', 'submitted_at', 'submitted_by', 'unknown_since', 'updated_at', 'version'];
        SELECT string_agg(c, ', ') INTO why FROM unnest(cols) AS c
        WHERE (to_jsonb(OLD) -> c) IS DISTINCT FROM (to_jsonb(NEW) -> c);
        RAISE EXCEPTION 'receipt %: % cannot be changed (the intent and the times of past moves are '
            'immutable; the database stamps submitted_at, submitted_by, unknown_since, updated_at and version)',
            OLD.id, why USING ERRCODE = 'RL006';
    END IF;
    -- An UPDATE that leaves the state as it is (leases, schedules) is not a
    -- move and records nothing; so it may not rewrite what the latest move
    -- recorded either.
    IF NEW.state = OLD.state THEN
        IF (NEW.state_actor, NEW.state_detail, NEW.external_id)
           IS DISTINCT FROM (OLD.state_actor, OLD.state_detail, OLD.external_id) THEN
            SELECT string_agg(c, ', ') INTO why FROM unnest(ARRAY['state_actor', 'state_detail', 'external_id']) AS c
            WHERE (to_jsonb(OLD) -> c) IS DISTINCT FROM (to_jsonb(NEW) -> c);
            RAISE EXCEPTION 'receipt %: % cannot be changed without a move (the latest move recorded them)',
                OLD.id, why USING ERRCODE = 'RL006';
        END IF;
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
    -- Who may move (path 8), where the roles of docs/roles.sql are in use.
    -- The moves out of planned and submitted are the agent's (the orphan
    -- sweep makes one too) and pay for no role lookup on the agent's hot
    -- path: a move out of submitted compares the login with submitted_by
    -- first, and looks roles up only when they differ.
    IF OLD.state = 'submitted' THEN
        -- Only the login that submitted a receipt sends its request, so only
        -- it knows what became of it: another agent's login may not settle
        -- it (say, as a retryable not_sent, then retry it: sent twice). The
        -- reconciler's logins (the orphan sweep) and reviewers may; so may
        -- the table's owner and any login in no role of docs/roles.sql. A
        -- receipt submitted before migration 00004 has no submitted_by: the
        -- orphan sweep settles it.
        IF current_user IS DISTINCT FROM OLD.submitted_by THEN
            IF coalesce(pg_has_role(current_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
               AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false)
               AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
                RAISE EXCEPTION 'illegal transition % -> % by %: receipt % was submitted by login %, and only '
                    'that login (or a member of reconciler_worker or reconciler_reviewer) may move it out of '
                    'submitted, not login %', OLD.state, NEW.state, NEW.state_actor, OLD.id,
                    coalesce(quote_ident(OLD.submitted_by), '(unknown: submitted before migration 00004)'),
                    quote_ident(current_user) USING ERRCODE = 'RL001';
            END IF;
        END IF;
    ELSIF OLD.state = 'manual_review' THEN
        -- "human" is a database role too: an agent's or the daemon's login
        -- cannot leave manual_review by writing a human actor.
        IF (coalesce(pg_has_role(current_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
            OR coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false))
           AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
            RAISE EXCEPTION 'illegal transition % -> % by %: only a member of reconciler_reviewer may leave manual_review',
                OLD.state, NEW.state, NEW.state_actor USING ERRCODE = 'RL001';
        END IF;
    ELSIF OLD.state IN ('outcome_unknown', 'reconciling') AND to_regrole('reconciler_agent') IS NOT NULL THEN
        -- To or from reconciling, and outcome_unknown -> manual_review: the
        -- reconciler's moves (or a reviewer's), never an agent's login, which
        -- could otherwise settle its own receipt without a readback. The
        -- owner of the table (who ran the migrations) is not refused: it
        -- could disable this trigger anyway.
        IF NOT (coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false)
                OR coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false)) THEN
            IF NOT pg_has_role(current_user,
                               (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID), 'MEMBER') THEN
                RAISE EXCEPTION 'illegal transition % -> % by %: only a member of reconciler_worker or '
                    'reconciler_reviewer may make this move', OLD.state, NEW.state, NEW.state_actor
                    USING ERRCODE = 'RL001';
            END IF;
        END IF;
    END IF;
    -- Path 1: the duplicate guard of plan holds until the bytes may leave.
    -- Under plan's lock, a guarded receipt is not submitted while another
    -- receipt of the same intent is unresolved (so of two receipts planned
    -- under two keys at once, exactly one is sent); the refused one stays
    -- planned. (The lock is held to commit, so a concurrent submission or
    -- plan of the same intent waits and then sees this one.) A statement
    -- that submits many guarded receipts takes one such lock per intent,
    -- held to commit, and the server's lock table holds about
    -- max_locks_per_transaction x max_connections: bulk loaders submit in
    -- chunks of a few thousand, or insert their receipts with guarded = false.
    IF NEW.state = 'submitted' THEN
        -- A retry is sent only while its previous attempt may still be
        -- retried: a late outcome recorded since the retry was planned (a
        -- success, or a call still alive: reconciler.retry_error) stops it.
        -- The share lock serializes with record_late_outcome, which holds
        -- the previous receipt FOR UPDATE while it writes: either the late
        -- outcome commits first and is seen here, or it waits for this
        -- submission and is recorded against a receipt whose retry is out
        -- (the reconciler and a human then see both). Taken before the
        -- guard's lock, in plan's order (previous receipt, then intent).
        -- Only retries pay for it. RL002; the retry stays planned.
        IF OLD.retry_of IS NOT NULL THEN
            SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = OLD.retry_of FOR SHARE;
            why := reconciler.retry_error(prev);
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'receipt % (attempt %, the retry of receipt %) is not submitted: %',
                    OLD.id, OLD.attempt, OLD.retry_of, why USING ERRCODE = 'RL002', DETAIL = OLD.retry_of::text;
            END IF;
        END IF;
        IF OLD.guarded THEN
            -- (An assignment, not PERFORM: a plain expression is evaluated in
            -- place, where PERFORM would run a query.)
            why := pg_advisory_xact_lock(hashtextextended(OLD.dependency || ' ' || OLD.fingerprint, 0))::text;
            SELECT x.id INTO other FROM reconciler.receipts x
            WHERE x.dependency = OLD.dependency AND x.fingerprint = OLD.fingerprint
              AND x.state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review')
              AND x.id <> OLD.id
            ORDER BY x.id LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'receipt %: intent % is unresolved in receipt %: a duplicate is not submitted',
                    OLD.id, OLD.fingerprint, other USING ERRCODE = 'RL005', DETAIL = other::text;
            END IF;
        END IF;
    END IF;
    -- An agent that learned its call succeeded after the orphan sweep moved
    -- its receipt recorded so (reconciler.record_late_outcome, which holds
    -- the row while it does): the effect exists, so it is never safe_to_retry.
    -- (Nested: a condition with a subquery is a full query even when its
    -- first half is false, and every other move would pay for it.)
    IF NEW.state = 'safe_to_retry' THEN
        IF EXISTS (SELECT FROM reconciler.late_outcomes l
                   WHERE l.receipt_id = OLD.id AND l.outcome = 'succeeded') THEN
            RAISE EXCEPTION 'receipt % has a late succeeded outcome recorded by its agent: it is not safe_to_retry',
                OLD.id USING ERRCODE = 'RL002', DETAIL = 'succeeded';
        END IF;
    END IF;
    -- A move that did not set its own detail must not inherit the previous one's.
    IF NEW.state_detail = OLD.state_detail THEN
        NEW.state_detail := '{}';
    END IF;
    t := clock_timestamp();
    NEW.moved_from := OLD.state;
    NEW.version := OLD.version + 1;
    NEW.updated_at := t;
    IF NEW.state = 'submitted' THEN
        NEW.submitted_at := t;
        NEW.submitted_by := current_user;
    END IF;
    IF NEW.state = 'outcome_unknown' THEN
        -- Every move here (lost answer, orphan, requeue) starts a fresh check
        -- budget and deadline.
        NEW.unknown_since := t;
        NEW.next_check_at := t;
        NEW.check_count := 0;
        NEW.last_check_transient := false;
        NEW.lease_owner := NULL;
        NEW.lease_expires_at := NULL;
        -- Wake idle reconcilers (delivered at commit; Postgres folds
        -- identical notifications of one transaction into one).
        why := pg_notify('reconciler_due', '')::text;
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

-- reconciler.plan records a planned receipt (with the pre-image of an
-- update, if given, and its send deadline), or returns the existing one for
-- a known idempotency key. It refuses:
--   RL004  a known key with another intent or retrying another receipt, and
--          a retry whose intent (dependency, fingerprint) differs from the
--          retried receipt's, before inserting anything;
--   RL007  a first key ending in #<digits> or longer than 255 bytes, and a
--          retry key other than "<logical key of the retried>#<attempt+1>";
--   RL003  a retry of an unknown receipt; RL002 of one that may not be retried;
--   RL005  unless allow_duplicate, an intent unresolved for the same
--          dependency in another receipt (DETAIL: its id).
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb);
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

-- reconciler.record_late_outcome records what an agent learned about its
-- own call after the orphan sweep had moved the receipt out of submitted,
-- whatever the outcome (succeeded, rejected or outcome_unknown): only for a
-- receipt in outcome_unknown, reconciling, manual_review or safe_to_retry
-- (an answer that arrives after an absence was settled means a declared
-- window was too short: a late success or outcome_unknown stops any retry
-- of the receipt, see retry_error) whose planned -> submitted move was made
-- by actor, and, where the roles of docs/roles.sql are in use, by the
-- calling login when it is only in reconciler_agent (session_user =
-- submitted_by: another agent's login cannot put words in its mouth, e.g. a
-- late success with a made-up external id); RL002 otherwise. It holds the
-- receipt FOR UPDATE while it writes, so a concurrent settlement either
-- commits first or sees the row (and a late success keeps the receipt from
-- safe_to_retry), and so does the submission of a retry planned before
-- (receipts_before_update re-runs retry_error under FOR SHARE of this
-- receipt). SECURITY DEFINER, so no role needs INSERT on late_outcomes;
-- search_path pinned as in 00001.
-- +goose StatementBegin
CREATE FUNCTION reconciler.record_late_outcome(
    receipt_id bigint,
    actor text,
    outcome text,
    http_status integer DEFAULT NULL,
    external_id text DEFAULT NULL,
    detail jsonb DEFAULT '{}'
) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    st text;
    submitter text;
    login name;
BEGIN
    SELECT x.state, x.submitted_by INTO st, login FROM reconciler.receipts x
    WHERE x.id = record_late_outcome.receipt_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'receipt % does not exist', record_late_outcome.receipt_id
            USING ERRCODE = 'RL002', DETAIL = 'missing';
    END IF;
    -- (SECURITY DEFINER: current_user is the owner here; session_user is
    -- the caller's login.)
    IF session_user IS DISTINCT FROM login THEN
        IF coalesce(pg_has_role(session_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(session_user, to_regrole('reconciler_worker'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(session_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
            RAISE EXCEPTION 'receipt % was submitted by login %: no late outcome by login % is recorded for it',
                record_late_outcome.receipt_id, coalesce(quote_ident(login), '(unknown)'), quote_ident(session_user)
                USING ERRCODE = 'RL002', DETAIL = st;
        END IF;
    END IF;
    SELECT e.actor INTO submitter FROM reconciler.receipt_events e
    WHERE e.receipt_id = record_late_outcome.receipt_id
      AND e.from_state = 'planned' AND e.to_state = 'submitted';
    IF st NOT IN ('outcome_unknown', 'reconciling', 'manual_review', 'safe_to_retry')
       OR submitter IS DISTINCT FROM record_late_outcome.actor THEN
        RAISE EXCEPTION 'receipt % is % (submitted by %): no late outcome by % is recorded for it',
            record_late_outcome.receipt_id, st, coalesce(submitter, 'nobody'), record_late_outcome.actor
            USING ERRCODE = 'RL002', DETAIL = st;
    END IF;
    INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome, http_status, external_id, detail)
    VALUES (record_late_outcome.receipt_id, record_late_outcome.actor, record_late_outcome.outcome,
            record_late_outcome.http_status, record_late_outcome.external_id,
            coalesce(record_late_outcome.detail, '{}'));
END
$$;
-- +goose StatementEnd

-- +goose Down
-- Below 00004 the ledger loses what its soundness rests on: the late
-- outcomes (a late success or a late answer refuses every retry of its
-- receipt; after down and up again that retry is allowed) and, of every
-- receipt, its send deadline (max_send_delay: up again, every receipt's
-- falls back to 5 s, and an absence window computed from it may be too
-- short), guarded (up again, a receipt planned with allow_duplicate is
-- guarded), submitted_by (which login may settle a submitted receipt) and
-- unknown_since (the start of its check budget). So the step is refused
-- while any receipt is unsettled or any late outcome of a receipt not
-- settled succeeded is kept (RL010), unless the session accepts the loss
-- (reconciler.accept_down_data_loss = 'on': `reconciler migrate down
-- --accept-data-loss`). docs/rules-of-time.md lists what every Down drops.
-- +goose StatementBegin
DO $$
DECLARE
    unsettled bigint;
    late bigint;
    late_receipts bigint;
BEGIN
    IF coalesce(current_setting('reconciler.accept_down_data_loss', true), '') = 'on' THEN
        RETURN;
    END IF;
    -- The lock the drops below take anyway, taken first: no receipt or late
    -- outcome is written between the count and the drop.
    LOCK TABLE reconciler.receipts, reconciler.late_outcomes IN ACCESS EXCLUSIVE MODE;
    SELECT count(*) INTO unsettled FROM reconciler.receipts
    WHERE state IN ('planned', 'submitted', 'outcome_unknown', 'reconciling', 'manual_review');
    SELECT count(*), count(DISTINCT l.receipt_id) INTO late, late_receipts
    FROM reconciler.late_outcomes l JOIN reconciler.receipts r ON r.id = l.receipt_id
    WHERE r.state <> 'succeeded';
    IF unsettled > 0 OR late > 0 THEN
        RAISE EXCEPTION 'migrate down below 00004 refused: % receipts are unsettled (planned, submitted, '
            'outcome_unknown, reconciling or manual_review) and % late outcomes of % receipts not settled '
            'succeeded are kept', unsettled, late, late_receipts
            USING ERRCODE = 'RL010',
                  DETAIL = 'This step drops table reconciler.late_outcomes (late answers that refuse a retry of '
                           'their receipt: after down and up again, that retry would be allowed) and the receipts'' '
                           'columns max_send_delay (each send deadline: up again it falls back to 5 s), guarded '
                           '(allow_duplicate), submitted_by (the login that may settle a submitted receipt) and '
                           'unknown_since (the start of the check budget).',
                  HINT = 'Settle the receipts first (reconciler run, reconciler review), stay at 00004, or '
                         'accept the loss for this session (reconciler migrate down --accept-data-loss, which '
                         'sets reconciler.accept_down_data_loss = ''on'').';
    END IF;
END
$$;
-- +goose StatementEnd
DROP FUNCTION reconciler.record_late_outcome(bigint, text, text, integer, text, jsonb);
DROP FUNCTION reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb, interval);
DROP FUNCTION reconciler.retry_error(reconciler.receipts);
DROP TABLE reconciler.late_outcomes;

-- The functions of 00001, as they were.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_before_insert() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.receipts_before_update() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    why text;
BEGIN
    IF NEW.id <> OLD.id OR NEW.idempotency_key <> OLD.idempotency_key
       OR NEW.fingerprint <> OLD.fingerprint OR NEW.created_at <> OLD.created_at
       OR NEW.version <> OLD.version THEN
        RAISE EXCEPTION 'receipt %: id, idempotency_key, fingerprint, created_at and version cannot be changed', OLD.id
            USING ERRCODE = 'RL006';
    END IF;
    IF NEW.state = OLD.state THEN
        NEW.moved_from := NULL;
        RETURN NEW;
    END IF;
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
    IF OLD.state = 'manual_review'
       AND (coalesce(pg_has_role(current_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
            OR coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false))
       AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
        RAISE EXCEPTION 'illegal transition % -> % by %: only a member of reconciler_reviewer may leave manual_review',
            OLD.state, NEW.state, NEW.state_actor USING ERRCODE = 'RL001';
    END IF;
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

ALTER TABLE reconciler.receipts DROP COLUMN submitted_by;
ALTER TABLE reconciler.receipts DROP COLUMN unknown_since;
ALTER TABLE reconciler.receipts DROP COLUMN guarded;
ALTER TABLE reconciler.receipts DROP COLUMN max_send_delay;

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
        IF NOT (prev.state = 'safe_to_retry'
                OR prev.state = 'rejected' AND (prev.state_detail #>> '{error,retryable}') = 'true') THEN
            RAISE EXCEPTION 'receipt % is %, neither safe_to_retry nor a retryable rejection: it cannot be retried',
                prev.id, prev.state USING ERRCODE = 'RL002';
        END IF;
    END IF;
    IF NOT plan.allow_duplicate THEN
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
