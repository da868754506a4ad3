-- Database roles of the receipt ledger (SPEC §7): one group role per
-- component, each with only the privileges that component's statements
-- need, and none able to rewrite history.
--
--   reconciler_agent     the agent harness (package ledger): plans its calls
--                        (reconciler.plan) and records their moves.
--   reconciler_worker    the reconciler daemon (reconcile, internal/protect):
--                        claims, settles and sweeps receipts, appends readback
--                        checks and duplicate alarms, shares breaker state.
--   reconciler_reviewer  people resolving manual_review (package review,
--                        `reconciler review`, `reconciler receipts show`).
--
-- Apply it as the owner of the schema (whoever ran `reconciler migrate up`),
-- after every migration; it is idempotent and converges, so running it again
-- resets the grants below:
--
--   psql -v ON_ERROR_STOP=1 "$RECONCILER_DATABASE_URL" -f docs/roles.sql
--
-- Creating roles needs CREATEROLE (or a superuser) once per server; roles are
-- server-wide, grants are per database. The group roles cannot log in: give
-- each process its own login role in one of them, e.g.
--
--   CREATE ROLE billing_agent LOGIN PASSWORD '...' IN ROLE reconciler_agent;
--   CREATE ROLE reconciler_1  LOGIN PASSWORD '...' IN ROLE reconciler_worker;
--   CREATE ROLE alice         LOGIN PASSWORD '...' IN ROLE reconciler_reviewer;
--
-- (Membership is inherited, the default: no SET ROLE is needed.) Run
-- `reconciler migrate` as the owner only, never as one of these.
--
-- How history stays append-only for everyone:
--   * No role has INSERT, UPDATE, DELETE or TRUNCATE on receipt_events or
--     receipt_keys. Their rows are written only by the statement triggers of
--     receipts, reconciler.receipts_record_insert/_update, which are SECURITY
--     DEFINER (migration 00001): they run with the rights of their owner, the
--     migrating role, which must therefore stay the owner of those functions
--     and of the two tables.
--   * No role has UPDATE, DELETE or TRUNCATE on readback_checks or
--     duplicate_alarms; only the worker may append to them.
--   * UPDATE on receipts is granted on the state columns a component moves,
--     never on the intent (operation, dependency, method, target, intent,
--     pre_image, fingerprint, idempotency_key, created_at, attempt,
--     retry_of): the receipts_before_update trigger checks every move
--     against the state machine, bumps the version and stamps the times
--     itself. No role has DELETE or TRUNCATE on receipts, and the
--     refuse_rewrite triggers refuse those, and any UPDATE or DELETE of a
--     history table, even to the owner.
--   * Identity columns (receipts.id, readback_checks.id, duplicate_alarms.id)
--     draw their sequences without a sequence privilege, so none is granted,
--     and no role may INSERT an id of its own (no INSERT on those columns).

BEGIN;

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['reconciler_agent', 'reconciler_worker', 'reconciler_reviewer'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created concurrently by another session: fine.
            END;
        END IF;
    END LOOP;
END
$$;

-- Start from nothing, so that running this file again converges on exactly
-- the grants below (revoking a table privilege revokes its column
-- privileges too).
REVOKE ALL ON SCHEMA reconciler FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer;
REVOKE ALL ON ALL TABLES IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer;
-- Functions are executable by PUBLIC by default; here each role gets only
-- the ones it calls. (Trigger functions need no EXECUTE to fire, and cannot
-- be called directly.)
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer;

GRANT USAGE ON SCHEMA reconciler TO reconciler_agent, reconciler_worker, reconciler_reviewer;

-- transition_error explains a refused move inside receipts_before_update,
-- which runs with the rights of whoever moves the receipt.
GRANT EXECUTE ON FUNCTION reconciler.transition_error(text, text, text)
    TO reconciler_agent, reconciler_worker, reconciler_reviewer;

-- reconciler_agent: plan (reconciler.plan, which runs with the caller's
-- rights: it reads receipt_keys and receipts, locks a retried receipt FOR
-- UPDATE, and inserts the receipt), move (ledger's UPDATE, or
-- reconciler.transition), read its receipts and their history.
GRANT EXECUTE ON FUNCTION
    reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb),
    reconciler.transition(bigint, text, text, jsonb, text, text)
    TO reconciler_agent;
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.receipt_keys
    TO reconciler_agent;
GRANT INSERT (idempotency_key, operation, dependency, method, target, fingerprint, intent,
              state_actor, attempt, retry_of, pre_image)
    ON reconciler.receipts TO reconciler_agent;
GRANT UPDATE (state, state_actor, state_detail, external_id)
    ON reconciler.receipts TO reconciler_agent;

-- reconciler_worker: claim (UPDATE ... FOR UPDATE SKIP LOCKED), complete
-- (settle or reschedule, appending readback_checks and duplicate_alarms in
-- the same statement), orphan sweep, backlog counts, LISTEN (needs no
-- privilege), and the shared breaker rows (upsert with RETURNING).
GRANT SELECT ON reconciler.receipts, reconciler.duplicate_alarms TO reconciler_worker;
GRANT UPDATE (state, state_actor, state_detail, external_id, lease_owner, lease_expires_at,
              next_check_at, check_count, last_check_transient)
    ON reconciler.receipts TO reconciler_worker;
GRANT INSERT (receipt_id, check_no, at, instance, adapter, dependency, verdict, authoritative,
              matches, latency_us, error_class, error, evidence)
    ON reconciler.readback_checks TO reconciler_worker;
GRANT INSERT (receipt_id, detected_at, instance, adapter, dependency, external_ids)
    ON reconciler.duplicate_alarms TO reconciler_worker;
GRANT SELECT, INSERT, UPDATE ON reconciler.dependency_breakers TO reconciler_worker;

-- reconciler_reviewer: read receipts, their history and the evidence the
-- reconciler gathered, and move held receipts as a human (ledger's UPDATE,
-- or reconciler.transition). It cannot create receipts.
GRANT EXECUTE ON FUNCTION reconciler.transition(bigint, text, text, jsonb, text, text)
    TO reconciler_reviewer;
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.readback_checks,
                reconciler.duplicate_alarms
    TO reconciler_reviewer;
GRANT UPDATE (state, state_actor, state_detail, external_id)
    ON reconciler.receipts TO reconciler_reviewer;

COMMIT;
