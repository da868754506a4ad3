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
--                        `reconciler review`, `reconciler receipts show`,
--                        `reconciler ui`).
--   reconciler_readonly  stats and dashboards (`reconciler stats`): reads the
--                        ledger, the reconciler's records and the schema
--                        version, writes nothing.
--   reconciler_retention `reconciler archive` (package retention): reads what
--                        it exports and removes settled receipts and their
--                        history only through the removal functions of
--                        migration 00020 (docs/retention.md).
--
-- Apply it as the owner of the schema (whoever ran `reconciler migrate up`),
-- after every migration; it is idempotent and converges, so running it again
-- resets the grants below:
--
--   reconciler roles apply     (the binary embeds this file)
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
--   * No role has UPDATE, DELETE or TRUNCATE on readback_checks,
--     duplicate_alarms, verdict_audits or window_alarms; only the worker may
--     append to them.
--   * UPDATE on receipts is granted on the state columns a component moves,
--     never on the intent (operation, dependency, method, target, intent,
--     pre_image, fingerprint, idempotency_key, created_at, attempt,
--     retry_of): the receipts_before_update trigger checks every move
--     against the state machine, bumps the version and stamps the times
--     itself. No role has DELETE or TRUNCATE on receipts, and the
--     refuse_rewrite triggers refuse those, and any UPDATE or DELETE of a
--     history table, even to the owner.
--   * receipt_events, readback_checks and verdict_audits are partitioned
--     (migration 00021): the grants below are on the parents; no role holds
--     any privilege on a partition (REVOKE ALL ON ALL TABLES above covers
--     them), so none reads, writes, truncates, detaches or drops one, and
--     every partition carries the refuse_rewrite triggers. Partitions are
--     created by reconciler.ensure_history_partitions (SECURITY DEFINER),
--     owned by the owner.
--   * Identity columns (receipts.id, readback_checks.id, duplicate_alarms.id)
--     draw their sequences without a sequence privilege, so none is granted,
--     and no role may INSERT an id of its own (no INSERT on those columns).
--   * late_outcomes is written only by reconciler.record_late_outcome
--     (SECURITY DEFINER, migration 00004), which the agent may call; no role
--     has INSERT on it, and refuse_rewrite refuses UPDATE, DELETE, TRUNCATE.
--   * lifetime_alarms (migration 00014) is written only by the triggers and
--     functions that find a late answer after its absence window (SECURITY
--     DEFINER); no role has INSERT on it, and refuse_rewrite refuses UPDATE,
--     DELETE, TRUNCATE.
--   * receipts.submitted_by (the login that submitted) is granted to no
--     role, for INSERT or UPDATE: the triggers write it (NULL on insert,
--     current_user on planned -> submitted) and refuse any change (RL006).
--
-- What the receipts triggers enforce on top of the grants (migration 00004),
-- whoever holds the privilege:
--   * Who may move (issue 7, path 8). A login that is a member of
--     reconciler_agent and of neither reconciler_worker nor
--     reconciler_reviewer makes only the agent's moves: planned -> submitted
--     or rejected, submitted -> succeeded, rejected or outcome_unknown;
--     and the moves out of submitted only for a receipt it submitted
--     itself (current_user = receipts.submitted_by, whatever actor it
--     writes: another agent's login cannot settle an in-flight call, e.g.
--     as a retryable not_sent, and retry it). Any agent login may submit a
--     planned receipt (plan is idempotent per key, so a restarted agent
--     under another login gets the same planned receipt); the submission
--     is a compare-and-set on planned, so exactly one login submits, and
--     that login alone sends, settles and records late outcomes for it.
--     Moves to or from reconciling, and outcome_unknown -> manual_review,
--     need membership of reconciler_worker or reconciler_reviewer (or the
--     table's owner); leaving manual_review needs reconciler_reviewer and a
--     human actor. Refused with SQLSTATE RL001 (naming the submitting login
--     for a move out of submitted), by UPDATE or through
--     reconciler.transition alike. The agent's hot path pays no role
--     lookup: planned -> submitted none, a move out of submitted one name
--     comparison (roles are looked up only when the login is not the
--     submitter: the worker's orphan sweep, or a refusal). Agent logins
--     use their own login's rights (no SET ROLE): submitted_by is the
--     login's name.
--   * Late outcomes: reconciler.record_late_outcome takes any outcome for a
--     receipt in outcome_unknown, reconciling, manual_review or
--     safe_to_retry from the actor that submitted it and, for a login only
--     in reconciler_agent, only from the login that submitted it
--     (session_user = submitted_by); RL002 otherwise.
--   * Retries: reconciler.retry_error refuses a retry (RL002) of a receipt
--     that is neither safe_to_retry nor a retryable rejection, or has a
--     late outcome 'succeeded' or 'outcome_unknown' (a human must look). It
--     runs at plan, on a plain INSERT of a retry, and again on the retry's
--     planned -> submitted move, which locks the retried receipt FOR SHARE
--     first (so it serializes with record_late_outcome's FOR UPDATE): the
--     agent's UPDATE privilege on receipts is what lets its submission take
--     that lock, and its SELECT on late_outcomes what lets retry_error read.
--   * Immutable columns (path 9). No UPDATE changes idempotency_key,
--     operation, dependency, method, target, fingerprint, intent, pre_image,
--     attempt, retry_of, created_at, max_send_delay, guarded, submitted_at,
--     submitted_by, unknown_since, updated_at or version (the trigger stamps
--     the times, the submitting login and the version on moves); an UPDATE that is no move (same state) changes
--     neither state_actor, state_detail nor external_id. RL006. So the
--     column grants below are only the columns a component writes; the
--     worker's bookkeeping (lease_owner, lease_expires_at, next_check_at,
--     check_count, last_check_transient) stays writable without a move.
--   * Duplicate guard (path 1): a guarded receipt (planned without
--     allow_duplicate) is not moved to submitted while another receipt of
--     the same dependency and fingerprint is unresolved (RL005, DETAIL: its
--     id); checked under the advisory lock reconciler.plan takes.
--   * Keys (path 7): a first attempt's key is at most 255 bytes and does not
--     end in #<digits>; a retry's key is "<logical key>#<attempt>" (RL007).

BEGIN;

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['reconciler_agent', 'reconciler_worker', 'reconciler_reviewer',
                             'reconciler_readonly', 'reconciler_retention'] LOOP
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
REVOKE ALL ON SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly,
         reconciler_retention;
REVOKE ALL ON ALL TABLES IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly,
         reconciler_retention;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly,
         reconciler_retention;
-- Functions are executable by PUBLIC by default; here each role gets only
-- the ones it calls. (Trigger functions need no EXECUTE to fire, and cannot
-- be called directly.)
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA reconciler
    FROM PUBLIC, reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly,
         reconciler_retention;

GRANT USAGE ON SCHEMA reconciler
    TO reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly, reconciler_retention;

-- transition_error explains a refused move inside receipts_before_update,
-- which runs with the rights of whoever moves the receipt.
GRANT EXECUTE ON FUNCTION reconciler.transition_error(text, text, text)
    TO reconciler_agent, reconciler_worker, reconciler_reviewer;

-- Every role reads goose's version table: each runtime command checks,
-- reading only, that the schema is the version it needs before it starts
-- (`run`, `/readyz`, `stats`, `review`, `receipts show`, `adapters check`),
-- and an agent may do the same at start-up.
GRANT SELECT ON reconciler.goose_db_version
    TO reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly, reconciler_retention;

-- reconciler_agent: plan (reconciler.plan, which runs with the caller's
-- rights: it reads receipt_keys and receipts, locks a retried receipt FOR
-- UPDATE, and inserts the receipt with its send deadline), move (ledger's
-- UPDATE, or reconciler.transition: the agent's moves only, see above),
-- record what it learned after the orphan sweep moved its receipt
-- (reconciler.record_late_outcome), read its receipts and their history.
-- (INSERT of max_send_delay and guarded too: plan writes both, and an
-- unguarded receipt is what allow_duplicate asks for, which the agent may;
-- and of state: plan(..., submit => true) inserts a receipt planned and
-- submitted at once, which the insert trigger checks as the move planned
-- -> submitted, and refuses any other first state.)
-- retry_error decides, inside plan, the insert trigger and a retry's
-- submission (which locks the retried receipt FOR SHARE: that needs the
-- UPDATE privilege below), whether a receipt may be retried, which
-- includes reading its late outcomes. submitted_by is not granted: the
-- trigger stamps it.
GRANT EXECUTE ON FUNCTION
    reconciler.plan(text, text, text, text, text, text, jsonb, text, boolean, bigint, jsonb, interval, boolean),
    reconciler.retry_error(reconciler.receipts),
    reconciler.transition(bigint, text, text, jsonb, text, text),
    reconciler.record_late_outcome(bigint, text, text, integer, text, jsonb)
    TO reconciler_agent;
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.receipt_keys,
                reconciler.late_outcomes
    TO reconciler_agent;
GRANT INSERT (idempotency_key, operation, dependency, method, target, fingerprint, intent,
              state_actor, attempt, retry_of, pre_image, max_send_delay, guarded, state)
    ON reconciler.receipts TO reconciler_agent;
GRANT UPDATE (state, state_actor, state_detail, external_id)
    ON reconciler.receipts TO reconciler_agent;
-- The receipt gateway (`reconciler gateway`) runs as an agent: it keeps the
-- responses it may replay, and drops them when they expire.
GRANT SELECT, INSERT, DELETE ON reconciler.gateway_responses TO reconciler_agent;
-- Its webhooks: it registers the receipts of routes with one, claims the
-- deliveries the settlement trigger queued, and records each attempt.
GRANT SELECT, INSERT ON reconciler.webhook_receipts, reconciler.webhook_deliveries TO reconciler_agent;
GRANT UPDATE (attempts, last_status, last_error, last_attempt_at, next_attempt_at, delivered_at, gave_up_at)
    ON reconciler.webhook_deliveries TO reconciler_agent;

-- reconciler_worker: claim (UPDATE ... FOR UPDATE SKIP LOCKED), complete
-- (settle or reschedule, appending readback_checks and duplicate_alarms in
-- the same statement; a check written again after an unknown commit is
-- first looked up in readback_checks, so one read is recorded once), orphan
-- sweep, backlog counts, LISTEN (needs no privilege), the shared breaker
-- rows (upsert with RETURNING), and the late outcomes agents recorded for
-- the rows it claims (and which the trigger reads on a move to
-- safe_to_retry).
GRANT SELECT ON reconciler.receipts, reconciler.readback_checks, reconciler.duplicate_alarms,
    reconciler.late_outcomes, reconciler.lifetime_alarms TO reconciler_worker;
-- (The trigger that refuses a safe_to_retry whose window a late answer
-- voids, and keeps the alarm in reconciler.lifetime_alarms, runs as the
-- table's owner: migration 00014.)
GRANT UPDATE (state, state_actor, state_detail, external_id, lease_owner, lease_expires_at,
              next_check_at, check_count, last_check_transient, wait_count)
    ON reconciler.receipts TO reconciler_worker;
GRANT INSERT (receipt_id, check_no, at, instance, adapter, dependency, verdict, authoritative,
              matches, latency_us, error_class, error, evidence)
    ON reconciler.readback_checks TO reconciler_worker;
GRANT INSERT (receipt_id, detected_at, instance, adapter, dependency, external_ids)
    ON reconciler.duplicate_alarms TO reconciler_worker;
GRANT SELECT, INSERT, UPDATE ON reconciler.dependency_breakers TO reconciler_worker;
-- Verdict audits (migration 00015, docs/verdict-audits.md): the worker
-- claims the absences the settlement trigger queued, deletes each once its
-- audit is recorded, appends the audits and the window alarms (whose rows
-- are the dependencies' effective windows, read back by every replica).
GRANT SELECT, UPDATE (lease_owner, lease_expires_at, attempts, not_before), DELETE
    ON reconciler.audit_queue TO reconciler_worker;
GRANT SELECT ON reconciler.verdict_audits, reconciler.window_alarms TO reconciler_worker;
GRANT INSERT (receipt_id, dependency, operation, adapter, settled_state, settled_at, at, instance,
              verdict, matches, retries, observed_lag, evidence)
    ON reconciler.verdict_audits TO reconciler_worker;
GRANT INSERT (at, instance, dependency, adapter, operation, receipt_id, kind, declared, observed,
              effective_before, effective_after, evidence)
    ON reconciler.window_alarms TO reconciler_worker;
-- Partitioned history (migration 00021, docs/retention.md): the daemon
-- keeps the partitions ahead through ensure_history_partitions (SECURITY
-- DEFINER: the partitions are the owner's; the worker holds no privilege
-- on any partition, so it cannot write, detach or drop one).
GRANT EXECUTE ON FUNCTION reconciler.ensure_history_partitions(bigint) TO reconciler_worker;
-- Every role that reads history may list its partitions (their ranges,
-- and the rows a default partition holds): reconciler_history_* metrics,
-- `reconciler partitions show`, `stats`.
GRANT EXECUTE ON FUNCTION reconciler.history_partitions()
    TO reconciler_worker, reconciler_reviewer, reconciler_readonly, reconciler_retention;

-- reconciler_reviewer: read receipts, their history and the evidence the
-- reconciler gathered, and move held receipts as a human (ledger's UPDATE,
-- or reconciler.transition). It cannot create receipts. It reads the shared
-- breaker state too, for the summary bar of `reconciler ui`.
GRANT EXECUTE ON FUNCTION reconciler.transition(bigint, text, text, jsonb, text, text)
    TO reconciler_reviewer;
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.readback_checks,
                reconciler.duplicate_alarms, reconciler.late_outcomes, reconciler.lifetime_alarms,
                reconciler.dependency_breakers,
                reconciler.verdict_audits, reconciler.window_alarms, reconciler.audit_queue
    TO reconciler_reviewer;
GRANT UPDATE (state, state_actor, state_detail, external_id)
    ON reconciler.receipts TO reconciler_reviewer;

-- reconciler_readonly: `reconciler stats` and dashboards. Reads the ledger,
-- the reconciler's records and the shared breaker state (and goose's version
-- table, above); executes nothing, writes nothing. `receipts show` and
-- `review list|show` work under it too.
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.readback_checks,
                reconciler.duplicate_alarms, reconciler.late_outcomes, reconciler.lifetime_alarms,
                reconciler.dependency_breakers, reconciler.gateway_responses,
                reconciler.webhook_receipts, reconciler.webhook_deliveries,
                reconciler.verdict_audits, reconciler.window_alarms, reconciler.audit_queue,
                reconciler.retention_batches, reconciler.removed_receipts,
                reconciler.history_partitioning
    TO reconciler_readonly;

-- reconciler_retention: `reconciler archive`. Chooses with
-- retention_keep_reason, reads every row it exports, and removes only
-- through retention_remove_receipts and retention_remove_history (SECURITY
-- DEFINER, migration 00020): they re-check every guarantee under a row
-- lock, record the batch, and refuse unless the rows deleted are the rows
-- exported. It holds no DELETE, UPDATE or INSERT on any table, and no
-- other role may call the removal functions.
GRANT EXECUTE ON FUNCTION
    reconciler.retention_keep_reason(reconciler.receipts, timestamptz, interval),
    reconciler.retention_remove_receipts(bigint[], text, text, timestamptz, interval, jsonb),
    reconciler.retention_remove_history(bigint, text, text, jsonb),
    reconciler.ensure_history_partitions(bigint)
    TO reconciler_retention;
GRANT SELECT ON reconciler.receipts, reconciler.receipt_events, reconciler.readback_checks,
                reconciler.late_outcomes, reconciler.duplicate_alarms, reconciler.lifetime_alarms,
                reconciler.gateway_responses, reconciler.webhook_receipts, reconciler.webhook_deliveries,
                reconciler.audit_queue, reconciler.verdict_audits, reconciler.window_alarms,
                reconciler.retention_batches, reconciler.removed_receipts
    TO reconciler_retention;
-- A whole history partition (migration 00022): it chooses the ranges with
-- retention_partition_keep_reason (which reads the receipts sequence's
-- last value: SELECT on a sequence draws no id) and drops only through
-- retention_drop_history_partition (SECURITY DEFINER: only the owner may
-- detach or drop a partition), which re-checks the rule and the rows under
-- the partitions' locks.
GRANT EXECUTE ON FUNCTION
    reconciler.retention_partition_keep_reason(bigint, bigint, timestamptz),
    reconciler.retention_drop_history_partition(bigint, bigint, timestamptz, text, text, jsonb)
    TO reconciler_retention;
GRANT SELECT ON SEQUENCE reconciler.receipts_id_seq TO reconciler_retention;
-- A pinned history range's compaction (migration 00024): it chooses with
-- retention_partition_compact_reason and compacts only through
-- retention_compact_history_partition (SECURITY DEFINER: only the owner
-- may create, attach, detach or drop a partition), which re-checks the rule
-- and the rows that leave under the partitions' locks.
GRANT EXECUTE ON FUNCTION
    reconciler.retention_partition_compact_reason(bigint, bigint, timestamptz),
    reconciler.retention_compact_history_partition(bigint, bigint, timestamptz, text, text, jsonb)
    TO reconciler_retention;

COMMIT;
