-- A late answer reopens a safe_to_retry receipt (SPEC §5a, "late answers
-- void the window"). Until now a late outcome recorded after the receipt
-- settled safe_to_retry raised the alarm and stopped a Retry of it
-- (reconciler.retry_error), but the receipt stayed safe_to_retry, and the
-- duplicate guard reads only unresolved receipts: the same intent planned
-- again under a new key was sent, a second effect beside the one the late
-- answer just proved (a success) or may have made (an answer that leaves
-- the effect unknown, after the declared window: the request outlived its
-- lifetime, so the absence the settlement rested on proves nothing).
--
-- record_late_outcome now moves such a receipt back to outcome_unknown
-- (the fresh-proof move of 00014, reason late_answer) in the same
-- transaction that records the outcome: the guard blocks a re-planned
-- duplicate at once, and the reconciler reads the receipt again and
-- settles it anew: succeeded from the late success, or manual_review
-- (lifetime_exceeded) since no absence may settle it any more. Not once a
-- retry of the receipt is past planned (the move is refused then: a read
-- could find the retry's effect): the outcome and the alarm are still
-- recorded, as before, for a human. A late rejection (proof of no effect)
-- and a late answer inside the declared window that is not a success (a
-- native-key settlement's straggler, which the API deduplicates) change
-- nothing.

-- +goose Up
-- reconciler.retry_error, as in 00004, but a late success is named first
-- whatever the state, and a receipt a late answer reopened says so.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.retry_error(prev reconciler.receipts) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l reconciler.late_outcomes;
BEGIN
    -- A late success refuses in any state, and the refusal says so: a
    -- receipt it reopened is outcome_unknown again, and "it cannot be
    -- retried" alone would hide why.
    SELECT * INTO l FROM reconciler.late_outcomes x
    WHERE x.receipt_id = prev.id AND x.outcome = 'succeeded' ORDER BY x.id LIMIT 1;
    IF FOUND THEN
        RETURN format('receipt %s is %s, but its agent received a success after the orphan sweep moved it '
                      '(late outcome %s at %s, HTTP %s, external id %s; reconciler.late_outcomes): the effect exists '
                      'and must not be sent again; a human must look', prev.id, prev.state, l.id, l.at,
                      coalesce(l.http_status::text, 'none'), coalesce(l.external_id, 'none'));
    END IF;
    IF NOT (prev.state = 'safe_to_retry'
            OR prev.state = 'rejected' AND (prev.state_detail #>> '{error,retryable}') = 'true') THEN
        IF prev.state_detail ->> 'reason' = 'late_answer' THEN
            RETURN format('receipt %s is %s again: a late answer of its call (late outcome %s, HTTP %s, at %s) voided '
                          'the absence it was settled safe_to_retry on, and the reconciler reads it anew: it cannot '
                          'be retried unless that settles it safe_to_retry again', prev.id, prev.state,
                          prev.state_detail #>> '{late_outcome,outcome}',
                          coalesce(prev.state_detail #>> '{late_outcome,http_status}', 'none'),
                          prev.state_detail #>> '{late_outcome,at}');
        END IF;
        RETURN format('receipt %s is %s, neither safe_to_retry nor a retryable rejection: it cannot be retried',
                      prev.id, prev.state);
    END IF;
    -- A late outcome_unknown refuses when the server or a gateway answered
    -- (an HTTP status: the request was still alive on their side), or when
    -- it came after the settlement; a client-side timeout recorded while
    -- the reconciler was still reading back says nothing the window did not
    -- already cover. (PL/pgSQL, not SQL: the query's plan is kept for the
    -- session, which a retry's submission, running this on every retry,
    -- would otherwise pay for each time.)
    SELECT * INTO l FROM reconciler.late_outcomes x
    WHERE x.receipt_id = prev.id AND x.outcome = 'outcome_unknown'
      AND (x.http_status IS NOT NULL OR prev.state = 'safe_to_retry' AND x.at >= prev.updated_at)
    ORDER BY x.id LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN format('receipt %s is %s, but its agent saw its call still alive after the orphan sweep moved it, '
                  'with no answer it could read (late outcome_unknown %s at %s, HTTP %s; '
                  'reconciler.late_outcomes): the request outlived the window the settlement assumed, so the '
                  'effect may exist and must not be sent again; a human must look', prev.id, prev.state, l.id,
                  l.at, coalesce(l.http_status::text, 'none'));
END
$$;
-- +goose StatementEnd

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
    late reconciler.late_outcomes;
    ev jsonb;
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
            coalesce(record_late_outcome.detail, '{}'))
    RETURNING * INTO late;
    IF r.state IN ('safe_to_retry', 'manual_review') THEN
        PERFORM reconciler.note_lifetime_alarm(r, r.state_detail -> 'evidence');
    END IF;
    IF r.state = 'safe_to_retry' THEN
        ev := r.state_detail -> 'evidence';
        -- Reopened on a success, or on an answer that leaves the effect
        -- unknown after the window the settlement declared (the alarm's
        -- condition; a settlement that declares none, a human's, is
        -- reopened by a success only). A late rejection proves no effect
        -- (retry_error lets the retry go): nothing to reopen.
        IF (late.outcome = 'succeeded'
            OR (late.outcome = 'outcome_unknown'
                AND (ev ? 'max_request_lifetime_s' OR ev ? 'consistency_window_s')
                AND late.at > reconciler.absence_window_end(r, ev)))
           AND NOT EXISTS (SELECT FROM reconciler.receipts x WHERE x.retry_of = r.id AND x.state <> 'planned') THEN
            UPDATE reconciler.receipts x
            SET state = 'outcome_unknown', state_actor = record_late_outcome.actor,
                state_detail = jsonb_strip_nulls(jsonb_build_object(
                    'reason', 'late_answer',
                    'late_outcome', jsonb_build_object('id', late.id, 'outcome', late.outcome,
                                                       'http_status', late.http_status, 'at', late.at)))
            WHERE x.id = r.id;
        END IF;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION reconciler.retry_error(prev reconciler.receipts) RETURNS text
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
