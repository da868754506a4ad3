-- Issue 19, items 1 and 2 (SPEC §5a): the rules of time the database holds
-- for every client, the Go client, the gateway and a plain SQL agent alike.
--
--   * Late answers void the window. The absence window of a receipt ends at
--     submitted_at + max_send_delay + max_request_lifetime +
--     consistency_window: after it, an effect of the original request would
--     be visible, so an absence proves it has none. An answer of any kind to
--     the original request (a late outcome, reconciler.late_outcomes)
--     recorded after that moment shows the request outlived the lifetime
--     declared for its dependency: no absence settles such a receipt. The
--     move reconciling -> safe_to_retry is refused (RL002, DETAIL
--     lifetime_exceeded); the reconciler settles it manual_review (reason
--     lifetime_exceeded) instead (its settling statement skips such a row,
--     leaving it leased, so its next claim does). The declared lifetime and window are the
--     ones the settlement states in its evidence (max_request_lifetime_s,
--     consistency_window_s); a settlement that states none is held to the
--     strictest window, the send deadline alone.
--   * The alarm. Every such late outcome found by a settlement of the
--     reconciler that states its window, or recorded after one (on a
--     receipt safe_to_retry or manual_review whose settlement states it),
--     is kept in reconciler.lifetime_alarms (append-only): every other
--     absence of that dependency rests on the same declaration. `reconciler
--     stats` counts them; the daemon logs and counts each one it settles.
--   * A native key protects only within its retention. A safe_to_retry
--     whose guarantee is native_idempotency_key (its absence was read after
--     the consistency window but before the full window) allows a retry
--     only while the API still deduplicates the reused key: the retry's
--     request must be written (its send deadline, now + its max_send_delay)
--     before the evidence's reuse_idempotency_key_before. After that, the
--     retry is refused (RL009, DETAIL the retried receipt's id) unless the
--     absence was read after the full window. Checked when a retry is
--     inserted (reconciler.plan or a plain INSERT) and again when it is
--     submitted.
--   * A fresh proof. A new move, safe_to_retry -> outcome_unknown, sends a
--     receipt back to the reconciler, which reads it again and settles it
--     anew (now past the full window: request_lifetime_elapsed); then the
--     retry goes through. Any kind of actor may make it (where the roles
--     are in use, an agent's login only for a receipt it submitted), but
--     not once a retry of the receipt is past planned.
--   * Which guarantee a retry used. The retry's events record it in their
--     detail, under retry_basis: the retried receipt, its guarantee
--     (request_lifetime_elapsed, native_idempotency_key, human_review,
--     retryable_rejection or unstated), and reuse_idempotency_key_before
--     for a native key.

-- +goose Up

-- Late outcomes recorded after the absence window their receipt's
-- settlement declared: each one says the dependency's declared request
-- lifetime (or consistency window) is too short. One row per late outcome.
CREATE TABLE reconciler.lifetime_alarms (
    receipt_id      bigint NOT NULL,
    late_outcome_id bigint NOT NULL,
    dependency      text NOT NULL,
    operation       text NOT NULL,
    -- The late outcome: what was recorded, and when.
    outcome         text NOT NULL,
    http_status     integer,
    late_at         timestamptz NOT NULL,
    -- The end of the absence window the settlement declared.
    window_end      timestamptz NOT NULL,
    detected_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The database login whose statement found it.
    detected_by     name NOT NULL DEFAULT session_user,
    PRIMARY KEY (receipt_id, late_outcome_id)
);
CREATE TRIGGER lifetime_alarms_append_only BEFORE UPDATE OR DELETE ON reconciler.lifetime_alarms
    FOR EACH ROW EXECUTE FUNCTION reconciler.refuse_rewrite();
CREATE TRIGGER lifetime_alarms_no_truncate BEFORE TRUNCATE ON reconciler.lifetime_alarms
    FOR EACH STATEMENT EXECUTE FUNCTION reconciler.refuse_rewrite();

-- reconciler.absence_window_end is the end of r's absence window under the
-- declaration evidence states (a settlement's evidence: max_request_lifetime_s
-- and consistency_window_s, in seconds): submitted_at + max_send_delay +
-- lifetime + window. A declaration it does not state counts as 0, the
-- strictest window.
-- +goose StatementBegin
CREATE FUNCTION reconciler.absence_window_end(r reconciler.receipts, evidence jsonb)
RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT coalesce(r.submitted_at, r.created_at) + r.max_send_delay
         + make_interval(secs =>
               CASE WHEN jsonb_typeof(evidence -> 'max_request_lifetime_s') = 'number'
                    THEN greatest((evidence ->> 'max_request_lifetime_s')::float8, 0) ELSE 0 END
             + CASE WHEN jsonb_typeof(evidence -> 'consistency_window_s') = 'number'
                    THEN greatest((evidence ->> 'consistency_window_s')::float8, 0) ELSE 0 END)
$$;
-- +goose StatementEnd

-- reconciler.note_lifetime_alarm keeps an alarm for each late outcome of r
-- recorded after the window the evidence declares, when it declares one
-- (a settlement of a blind adapter declares none: nothing to contradict).
-- +goose StatementBegin
CREATE FUNCTION reconciler.note_lifetime_alarm(r reconciler.receipts, evidence jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    w timestamptz;
BEGIN
    IF NOT (evidence ? 'max_request_lifetime_s' OR evidence ? 'consistency_window_s') THEN
        RETURN;
    END IF;
    w := reconciler.absence_window_end(r, evidence);
    INSERT INTO reconciler.lifetime_alarms
        (receipt_id, late_outcome_id, dependency, operation, outcome, http_status, late_at, window_end)
    SELECT r.id, l.id, r.dependency, r.operation, l.outcome, l.http_status, l.at, w
    FROM reconciler.late_outcomes l
    WHERE l.receipt_id = r.id AND l.at > w
    ON CONFLICT DO NOTHING;
END
$$;
-- +goose StatementEnd

-- A settlement by the reconciler (a move out of reconciling): refused to
-- safe_to_retry when a late outcome voids its window; otherwise any such
-- late outcome raises the alarm. SECURITY DEFINER (search_path pinned as in
-- 00001), so the reconciler's role needs no INSERT on lifetime_alarms.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_check_window() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    ev jsonb := NEW.state_detail -> 'evidence';
    w timestamptz;
    l reconciler.late_outcomes;
BEGIN
    w := reconciler.absence_window_end(NEW, ev);
    SELECT * INTO l FROM reconciler.late_outcomes x
    WHERE x.receipt_id = NEW.id AND x.at > w ORDER BY x.id LIMIT 1;
    IF NOT FOUND THEN
        RETURN NEW;
    END IF;
    IF NEW.state = 'safe_to_retry' THEN
        RAISE EXCEPTION 'receipt % is not safe_to_retry: lifetime exceeded: its agent recorded a late % '
            '(HTTP %) at %, after its absence window closed at % (send deadline + max_request_lifetime + '
            'consistency_window, as the settlement declares): the request outlived its declared lifetime, '
            'so no absence proves it had no effect; settle it manual_review (lifetime_exceeded)',
            NEW.id, l.outcome, coalesce(l.http_status::text, 'none'), l.at, w
            USING ERRCODE = 'RL002', DETAIL = 'lifetime_exceeded';
    END IF;
    PERFORM reconciler.note_lifetime_alarm(NEW, ev);
    RETURN NEW;
END
$$;
-- +goose StatementEnd
-- Named to fire after receipts_before_update (row triggers fire in name
-- order), which has checked and stamped the move. Only settlements by the
-- reconciler pay for it.
CREATE TRIGGER receipts_check_window BEFORE UPDATE ON reconciler.receipts
    FOR EACH ROW
    WHEN (OLD.state = 'reconciling' AND NEW.state IN ('succeeded', 'safe_to_retry', 'manual_review'))
    EXECUTE FUNCTION reconciler.receipts_check_window();

-- reconciler.retry_basis says what a retry of prev rests on, refusing
-- (RL009) a retry that rests on the API's native idempotency key whose
-- request may be written (by send_by) after the key's retention, unless the
-- absence was also read after the full window. Only a retry of a receipt
-- retry_error allows is asked.
-- +goose StatementBegin
CREATE FUNCTION reconciler.retry_basis(prev reconciler.receipts, send_by timestamptz) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    ev jsonb := prev.state_detail -> 'evidence';
    g text;
    reuse timestamptz;
    read_at timestamptz;
    w timestamptz;
BEGIN
    IF prev.state <> 'safe_to_retry' THEN
        RETURN jsonb_build_object('retry_of', prev.id, 'guarantee', 'retryable_rejection',
                                  'code', prev.state_detail #>> '{error,code}');
    END IF;
    g := coalesce(ev ->> 'guarantee',
                  CASE WHEN prev.state_actor LIKE 'human:%' THEN 'human_review' ELSE 'unstated' END);
    IF g <> 'native_idempotency_key' THEN
        RETURN jsonb_build_object('retry_of', prev.id, 'guarantee', g);
    END IF;
    reuse := (ev ->> 'reuse_idempotency_key_before')::timestamptz;
    IF reuse IS NOT NULL AND send_by < reuse THEN
        RETURN jsonb_build_object('retry_of', prev.id, 'guarantee', g,
                                  'reuse_idempotency_key_before', reuse, 'send_by', send_by);
    END IF;
    -- Past the retention: the API no longer absorbs a straggler of the
    -- original. Only an absence read after the full window still holds.
    read_at := (ev ->> 'read_at')::timestamptz;
    w := reconciler.absence_window_end(prev, ev);
    IF read_at IS NOT NULL AND read_at >= w THEN
        RETURN jsonb_build_object('retry_of', prev.id, 'guarantee', 'request_lifetime_elapsed',
                                  'read_at', read_at, 'absence_window_end', w);
    END IF;
    RAISE EXCEPTION 'receipt % is safe_to_retry on the API''s native idempotency key, which it retains until % '
        '(reuse_idempotency_key_before), but a retry now may be written as late as %: the API would no longer '
        'deduplicate it against a straggler of the original, and the absence was read at %, before the full '
        'absence window closed at % (send deadline + max_request_lifetime + consistency_window). No retry '
        'until a fresh proof (a settlement read after that window)',
        prev.id, coalesce(reuse::text, '(not recorded)'), send_by, coalesce(read_at::text, '(not recorded)'), w
        USING ERRCODE = 'RL009', DETAIL = prev.id::text;
END
$$;
-- +goose StatementEnd

-- A retry (inserted, or submitted after it was planned) records its basis
-- in its detail, so its history says which guarantee let it be sent; a
-- native key past its retention refuses it (RL009). Fires after
-- receipts_before_insert and receipts_before_update (name order), which
-- have run retry_error under the retried receipt's lock. SECURITY DEFINER:
-- the agent's role needs no grant on the helpers.
-- +goose StatementBegin
CREATE FUNCTION reconciler.receipts_retry_basis() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    prev reconciler.receipts;
BEGIN
    SELECT * INTO prev FROM reconciler.receipts x WHERE x.id = NEW.retry_of;
    IF FOUND THEN
        NEW.state_detail := coalesce(NEW.state_detail, '{}') || jsonb_build_object('retry_basis',
            reconciler.retry_basis(prev, clock_timestamp() + NEW.max_send_delay));
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER receipts_retry_basis BEFORE INSERT ON reconciler.receipts
    FOR EACH ROW WHEN (NEW.retry_of IS NOT NULL)
    EXECUTE FUNCTION reconciler.receipts_retry_basis();
CREATE TRIGGER receipts_retry_basis_submit BEFORE UPDATE ON reconciler.receipts
    FOR EACH ROW WHEN (OLD.state = 'planned' AND NEW.state = 'submitted' AND NEW.retry_of IS NOT NULL)
    EXECUTE FUNCTION reconciler.receipts_retry_basis();

-- reconciler.record_late_outcome, as in 00004, and: a late outcome recorded
-- for a receipt already settled safe_to_retry or manual_review, after the
-- window that settlement declared, raises the alarm at once.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.record_late_outcome(
    receipt_id bigint,
    actor text,
    outcome text,
    http_status integer DEFAULT NULL,
    external_id text DEFAULT NULL,
    detail jsonb DEFAULT '{}'
) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, reconciler, pg_temp AS $$
DECLARE
    r reconciler.receipts;
    submitter text;
BEGIN
    SELECT * INTO r FROM reconciler.receipts x
    WHERE x.id = record_late_outcome.receipt_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'receipt % does not exist', record_late_outcome.receipt_id
            USING ERRCODE = 'RL002', DETAIL = 'missing';
    END IF;
    -- (SECURITY DEFINER: current_user is the owner here; session_user is
    -- the caller's login.)
    IF session_user IS DISTINCT FROM r.submitted_by THEN
        IF coalesce(pg_has_role(session_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(session_user, to_regrole('reconciler_worker'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(session_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
            RAISE EXCEPTION 'receipt % was submitted by login %: no late outcome by login % is recorded for it',
                record_late_outcome.receipt_id, coalesce(quote_ident(r.submitted_by), '(unknown)'), quote_ident(session_user)
                USING ERRCODE = 'RL002', DETAIL = r.state;
        END IF;
    END IF;
    SELECT e.actor INTO submitter FROM reconciler.receipt_events e
    WHERE e.receipt_id = record_late_outcome.receipt_id
      AND e.from_state = 'planned' AND e.to_state = 'submitted';
    IF r.state NOT IN ('outcome_unknown', 'reconciling', 'manual_review', 'safe_to_retry')
       OR submitter IS DISTINCT FROM record_late_outcome.actor THEN
        RAISE EXCEPTION 'receipt % is % (submitted by %): no late outcome by % is recorded for it',
            record_late_outcome.receipt_id, r.state, coalesce(submitter, 'nobody'), record_late_outcome.actor
            USING ERRCODE = 'RL002', DETAIL = r.state;
    END IF;
    INSERT INTO reconciler.late_outcomes (receipt_id, actor, outcome, http_status, external_id, detail)
    VALUES (record_late_outcome.receipt_id, record_late_outcome.actor, record_late_outcome.outcome,
            record_late_outcome.http_status, record_late_outcome.external_id,
            coalesce(record_late_outcome.detail, '{}'));
    IF r.state IN ('safe_to_retry', 'manual_review') THEN
        PERFORM reconciler.note_lifetime_alarm(r, r.state_detail -> 'evidence');
    END IF;
END
$$;
-- +goose StatementEnd

-- A fresh proof: safe_to_retry -> outcome_unknown sends a receipt back to
-- the reconciler (by any kind of actor; under the roles, an agent's login
-- only for a receipt it submitted), unless a retry of it went out already.
-- transition_error is 00001's table with that move; receipts_before_update
-- is 00004's with it.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.transition_error(from_state text, to_state text, actor text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN ($1, $2) NOT IN (
                ('planned', 'submitted'), ('planned', 'rejected'),
                ('submitted', 'succeeded'), ('submitted', 'rejected'), ('submitted', 'outcome_unknown'),
                ('outcome_unknown', 'reconciling'), ('outcome_unknown', 'manual_review'),
                ('reconciling', 'succeeded'), ('reconciling', 'safe_to_retry'), ('reconciling', 'manual_review'),
                ('manual_review', 'succeeded'), ('manual_review', 'safe_to_retry'),
                ('manual_review', 'rejected'), ('manual_review', 'outcome_unknown'),
                ('safe_to_retry', 'outcome_unknown'))
            THEN CASE WHEN $1 IN ('succeeded', 'rejected')
                      THEN $1 || ' is terminal' ELSE 'not in the transition table' END
        WHEN $1 = 'manual_review' AND $3 NOT LIKE 'human:%'
            THEN 'only a human may leave manual_review'
    END
$$;
-- +goose StatementEnd


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
            manual_review>outcome_unknown,safe_to_retry>outcome_unknown}'::text[])
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
    ELSIF OLD.state = 'safe_to_retry' THEN
        -- A fresh proof (migration 00014): the receipt goes back to the
        -- reconciler, e.g. because its proof rested on a native key whose
        -- retention has passed. Not once a retry of it went out: a read of
        -- the receipt could then find the retry's effect and settle it
        -- succeeded too. Where the roles are in use, an agent's login
        -- asks only for the receipts it submitted.
        SELECT x.id, x.state INTO other, why FROM reconciler.receipts x
        WHERE x.retry_of = OLD.id AND x.state <> 'planned' ORDER BY x.id LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'receipt %: its retry, receipt %, is % already: no fresh proof of the original is made',
                OLD.id, other, why USING ERRCODE = 'RL002', DETAIL = other::text;
        END IF;
        IF current_user IS DISTINCT FROM OLD.submitted_by
           AND coalesce(pg_has_role(current_user, to_regrole('reconciler_agent'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_worker'), 'MEMBER'), false)
           AND NOT coalesce(pg_has_role(current_user, to_regrole('reconciler_reviewer'), 'MEMBER'), false) THEN
            RAISE EXCEPTION 'illegal transition % -> % by %: receipt % was submitted by login %, and only that login '
                '(or a member of reconciler_worker or reconciler_reviewer) may ask for a fresh proof of it, not login %',
                OLD.state, NEW.state, NEW.state_actor, OLD.id, coalesce(quote_ident(OLD.submitted_by), '(unknown)'),
                quote_ident(current_user) USING ERRCODE = 'RL001';
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


-- Where the roles of docs/roles.sql are in use, the worker, reviewers and
-- `stats` read the alarms (docs/roles.sql grants the same, for databases
-- set up after this migration). The functions above run inside SECURITY
-- DEFINER ones and need no grant.
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        GRANT SELECT ON reconciler.lifetime_alarms
            TO reconciler_worker, reconciler_reviewer, reconciler_readonly;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER receipts_retry_basis_submit ON reconciler.receipts;
DROP TRIGGER receipts_retry_basis ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_retry_basis();
DROP FUNCTION reconciler.retry_basis(reconciler.receipts, timestamptz);
DROP TRIGGER receipts_check_window ON reconciler.receipts;
DROP FUNCTION reconciler.receipts_check_window();

-- reconciler.record_late_outcome of 00004, as it was.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.record_late_outcome(
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

-- The move table of 00001 and the move trigger of 00004, as they were.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.transition_error(from_state text, to_state text, actor text)
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


DROP FUNCTION reconciler.note_lifetime_alarm(reconciler.receipts, jsonb);
DROP FUNCTION reconciler.absence_window_end(reconciler.receipts, jsonb);
DROP TABLE reconciler.lifetime_alarms;
