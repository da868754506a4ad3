package reconcile

import "strconv"

// Every statement the reconciler runs, in one place. Each per-row statement
// was checked with EXPLAIN against a million receipts (docs/explain.md):
// the claim walks the partial index receipts_due in next_check_at order, the
// settle joins its unnest'd arrays to the primary key, the orphan sweep
// walks receipts_stale.
//
// Time comparisons take the reconciler's clock as a parameter instead of
// now(), so tests drive them with an injected clock. In production that
// clock is the database's own (internal/dbclock: clock_timestamp() plus the
// monotonic time since it was read, a lower bound), the clock the triggers
// stamp submitted_at, unknown_since and updated_at with (SPEC §5a, "one
// clock"); the host's wall clock is never compared with a stored time.

// sqlDue selects up to @limit due rows, in due order: outcome_unknown
// rows, and reconciling rows whose wait or lease is over, by @due_by. The
// rows in @skip (NULL: none) are left out: receipts whose claim the
// database refused for their own sake, which must not stop the rest. With
// @only (NULL: any), only those rows: the claim that isolates such a
// receipt. Both filters fold away at planning when NULL (the claim runs
// with CacheDescribe, so each is planned for its values).
const sqlDue = `
    SELECT id FROM reconciler.receipts
    WHERE state IN ('outcome_unknown', 'reconciling')
      AND next_check_at <= @due_by
      AND (lease_expires_at IS NULL OR lease_expires_at <= @due_by)
      AND (@skip::bigint[] IS NULL OR id <> ALL (@skip::bigint[]))
      AND (@only::bigint[] IS NULL OR id = ANY (@only::bigint[]))
    ORDER BY next_check_at
    LIMIT @limit`

// sqlClaim leases the rows sqlDue selects, in one statement. A claimed
// row's next_check_at is set to its lease expiry, so a row whose holder
// crashed becomes due again on the same index exactly when its lease runs
// out. Moving outcome_unknown → reconciling records a history event
// through the statement trigger; re-leasing a reconciling row changes no
// state and records none. "id = ANY(ARRAY(...))" rather than a join keeps
// the update on the primary key: with a join the planner hashes the whole
// table once the table is large enough to mis-estimate.
//
// The claim also returns the send deadline (submitted_at + max_send_delay),
// unknown_since (the bounds of the checks run from it), and the late
// outcomes the agent recorded for the row (reconciler.late_outcomes, one
// index probe per claimed row inside this statement: no extra round trip).
//
// @actor and @detail are the claim's history event; @token the lease
// token; @expires the lease expiry (the claim's time plus the lease: a row
// claimed late in a long drain still gets a full lease).
const sqlClaim = `
WITH due AS (` + sqlDue + `
    FOR UPDATE SKIP LOCKED
)
UPDATE reconciler.receipts r
SET state = 'reconciling',
    state_actor = CASE WHEN r.state = 'outcome_unknown' THEN @actor ELSE r.state_actor END,
    state_detail = CASE WHEN r.state = 'outcome_unknown' THEN @detail::jsonb ELSE r.state_detail END,
    lease_owner = @token,
    lease_expires_at = @expires,
    next_check_at = @expires,
    wait_count = CASE WHEN r.state = 'outcome_unknown' THEN 0 ELSE r.wait_count END
WHERE r.id = ANY (ARRAY(SELECT id FROM due))
RETURNING r.id, r.idempotency_key, r.operation, r.dependency, r.method, r.target, r.fingerprint,
          r.intent, r.pre_image, coalesce(r.external_id, ''), r.attempt, r.created_at,
          coalesce(r.submitted_at, r.created_at),
          coalesce(r.submitted_at, r.created_at) + r.max_send_delay,
          coalesce(r.unknown_since, r.submitted_at, r.created_at),
          r.check_count, r.last_check_transient,
          (SELECT jsonb_agg(jsonb_build_object('at', l.at, 'actor', l.actor, 'outcome', l.outcome,
                                               'http_status', l.http_status, 'external_id', l.external_id,
                                               'detail', l.detail) ORDER BY l.at)
           FROM reconciler.late_outcomes l WHERE l.receipt_id = r.id),
          r.wait_count`

// sqlComplete applies a batch of outcomes in one statement: settlements
// (to_state succeeded/safe_to_retry/manual_review, whose history events the
// trigger writes from the transition tables) and reschedules (to_state
// reconciling: no state change, lease cleared, next check set). Every row is
// guarded by "still reconciling and still leased by the token I claimed it
// with": a row whose lease expired and was reclaimed is left alone and not
// returned. Check records are appended for every check made, whether or not
// the lease still held, because the check did happen, unless they were
// recorded already (the pool records each check when it is made,
// sqlRecordChecks, and passes none here); duplicate alarms only for rows
// this statement settled.
//
// "id = ANY($1)" besides the join pins the update to primary-key lookups
// whatever the planner guesses for unnest's row count.
//
// A check record is inserted only if the same check (receipt, check_no,
// at, instance: its token) is not recorded yet. The checks passed here are
// the ones the recorder could not confirm, and a write of theirs whose
// commit outcome was unknown at the end of the grace period may have
// committed; when the recorder wrote every check, none is passed and the
// probe costs nothing. A retry of a batch whose first attempt may have
// committed (the error came after the COMMIT was sent: $28 true) is
// idempotent: besides the checks, a row whose lease is gone but which holds
// exactly the outcome this batch wrote (same next check for a release, same
// state, actor and detail for a settlement) is returned as applied.
//
// Outcomes: $1 ids, $2 lease tokens, $3 to_state, $4 detail, $5 external
// id, $6 next_check_at, $7 checks to add. $8 actor.
// Checks: $9 receipt id, $10 check_no, $11 at, $12 adapter, $13 dependency,
// $14 verdict, $15 authoritative, $16 matches, $17 latency_us,
// $18 error_class, $19 error, $20 evidence. $21 instance.
// Alarms: $22 receipt id, $23 at, $24 adapter, $25 dependency, $26 ids (jsonb array).
// $27: per outcome, whether its check failed transiently. $28: retry.
// $29: per outcome, waits to add (Outcome.Waited: its check, if any, is
// recorded but does not count: $7 is 0 for it).
var sqlComplete = `
WITH u AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::jsonb[], $5::text[],
                         $6::timestamptz[], $7::int[], $27::bool[], $29::int[])
        AS u(id, lease, to_state, detail, external_id, next_check_at, checks, transient, waits)
), s AS (
    UPDATE reconciler.receipts r
    SET state = u.to_state,
        state_actor = CASE WHEN u.to_state = 'reconciling' THEN r.state_actor ELSE $8 END,
        state_detail = CASE WHEN u.to_state = 'reconciling' THEN r.state_detail ELSE u.detail END,
        external_id = coalesce(u.external_id, r.external_id),
        next_check_at = u.next_check_at,
        lease_owner = NULL,
        lease_expires_at = NULL,
        check_count = r.check_count + u.checks,
        wait_count = r.wait_count + u.waits,
        last_check_transient = CASE WHEN u.checks > 0 THEN u.transient ELSE r.last_check_transient END
    FROM u
    WHERE r.id = ANY ($1::bigint[]) AND r.id = u.id
      AND r.state = 'reconciling' AND r.lease_owner = u.lease
      -- An agent that recorded a late 2xx since the claim wins: the row
      -- stays leased and its next claim settles it succeeded (the trigger
      -- would refuse safe_to_retry and fail the whole batch). So does one
      -- that recorded any answer after the absence window the settlement
      -- declares (send deadline + max_request_lifetime_s +
      -- consistency_window_s: the rule of reconciler.absence_window_end,
      -- migration 00014, written out so the statement runs on a schema
      -- being migrated too): its next claim settles it manual_review,
      -- lifetime_exceeded.
      AND (u.to_state <> 'safe_to_retry' OR NOT EXISTS (
          SELECT FROM reconciler.late_outcomes l WHERE l.receipt_id = r.id
            AND (l.outcome = 'succeeded'
                 OR l.at > coalesce(r.submitted_at, r.created_at) + r.max_send_delay
                           + make_interval(secs => coalesce((u.detail #>> '{evidence,max_request_lifetime_s}')::float8, 0)
                                                 + coalesce((u.detail #>> '{evidence,consistency_window_s}')::float8, 0)))))
    RETURNING r.id
), c AS (
    ` + sqlInsertCheckArrays(9, "", "") + `
), d AS (
    INSERT INTO reconciler.duplicate_alarms
        (receipt_id, detected_at, adapter, dependency, external_ids, instance)
    SELECT a.id, a.at, a.adapter, a.dependency,
           ARRAY(SELECT jsonb_array_elements_text(a.ids)), $21
    FROM unnest($22::bigint[], $23::timestamptz[], $24::text[], $25::text[], $26::jsonb[])
        AS a(id, at, adapter, dependency, ids)
    WHERE a.id IN (SELECT id FROM s)
)
SELECT id FROM s
UNION ALL
SELECT r.id FROM reconciler.receipts r JOIN u ON u.id = r.id
WHERE $28::bool AND r.id = ANY ($1::bigint[]) AND r.id NOT IN (SELECT id FROM s)
  AND r.lease_owner IS DISTINCT FROM u.lease
  AND CASE WHEN u.to_state = 'reconciling'
           THEN r.state = 'reconciling' AND r.next_check_at = u.next_check_at
           ELSE r.state = u.to_state AND r.state_actor = $8 AND r.state_detail = u.detail END`

// sqlRecordChecks appends readback checks, written as soon as the adapter
// answers and apart from the settlement (which then writes none of them),
// so a check made by a process that dies before settling is recorded. A
// retry whose first attempt may have committed ($14 true) inserts a check
// only if the same check (receipt, check_no, at, instance) is not recorded
// yet: a per-row probe of readback_checks' primary key, OFFSET 0 as in
// sqlComplete. No lease guard: the check happened whoever holds the row.
//
// Its commit does not wait for the WAL flush (synchronous_commit off for
// this statement's transaction, set_config local, evaluated once): a
// record is visible, and safe from the reconciler's own death, once
// committed; only a crash of the database server within about three
// wal_writer_delay (600 ms by default) could lose it, and never before the
// settlement it precedes, whose synchronous commit flushes the WAL up to
// and past it. Each batch would otherwise wait for an fsync of its own.
//
// $1 receipt id, $2 check_no, $3 at, $4 adapter, $5 dependency, $6 verdict,
// $7 authoritative, $8 matches, $9 latency_us, $10 error_class, $11 error,
// $12 evidence, $13 instance, $14 retry.
var sqlRecordChecks = sqlInsertCheckArrays(1, `
        (SELECT set_config('synchronous_commit', 'off', true)) AS async`, "$14::bool") + "\n"

// sqlInsertChecksInto heads every insert of readback checks: the table and
// its columns, in the order the statements select them.
const sqlInsertChecksInto = `INSERT INTO reconciler.readback_checks
        (receipt_id, check_no, at, adapter, dependency, verdict, authoritative, matches,
         latency_us, error_class, error, evidence, instance)`

// sqlInsertCheckArrays is the insert of readback checks given as one array
// per column (checkRows), shared by sqlComplete and sqlRecordChecks: the
// twelve arrays are parameters $first to $first+11 (receipt id, check_no,
// at, adapter, dependency, verdict, authoritative, matches, latency_us,
// error_class, error, evidence), the instance $first+12.
//
// A check is inserted only if the same check (receipt, check_no, at,
// instance: its token) is not recorded yet: a per-row probe of
// readback_checks' primary key. OFFSET 0 keeps it a probe: the planner
// would otherwise hash the whole table while it is small (docs/explain.md).
// With probeIf (a boolean parameter) the probe is made only when it holds
// (a first write of fresh checks need not look); without it, always.
// alsoFrom, if set, is one more FROM item, joined once (a set_config).
func sqlInsertCheckArrays(first int, alsoFrom, probeIf string) string {
	p := func(i int) string { return "$" + strconv.Itoa(first+i) }
	from := `SELECT x.*, ` + p(12) + ` FROM unnest(` + p(0) + `::bigint[], ` + p(1) + `::int[], ` + p(2) + `::timestamptz[], ` + p(3) + `::text[],
                                ` + p(4) + `::text[], ` + p(5) + `::text[], ` + p(6) + `::bool[], ` + p(7) + `::int[], ` + p(8) + `::bigint[],
                                ` + p(9) + `::text[], ` + p(10) + `::text[], ` + p(11) + `::jsonb[])
        AS x(receipt_id, check_no, at, adapter, dependency, verdict, authoritative, matches,
             latency_us, error_class, error, evidence)`
	where := `
    WHERE `
	if alsoFrom != "" {
		from += "," + alsoFrom
	}
	if probeIf != "" {
		where += `NOT ` + probeIf + ` OR `
	}
	return sqlInsertChecksInto + `
    ` + from + where + `NOT EXISTS (
        SELECT 1 FROM reconciler.readback_checks k
        WHERE k.receipt_id = x.receipt_id AND k.check_no = x.check_no AND k.at = x.at
          AND k.instance = ` + p(12) + `
        OFFSET 0)`
}

// sqlReleaseRefused releases a leased row whose outcome the database
// refused even in its minimal form, recording a check error so that
// check_count grows and the bounds eventually settle the row (issue 8). It
// does not count as a transient failure of the dependency (the dependency's
// retry budget is not spent on it). $1 id, $2 lease token, $3 the
// outcome's next check, $4 the check's time (NULL: the database's clock),
// $5 the least wait in seconds (sqlRefusedNextCheck), $6 adapter, $7 error,
// $8 instance.
const sqlReleaseRefused = `
WITH r AS (
    UPDATE reconciler.receipts r
    SET next_check_at = ` + sqlRefusedNextCheck + `,
        lease_owner = NULL,
        lease_expires_at = NULL,
        check_count = r.check_count + 1,
        last_check_transient = false
    WHERE r.id = $1 AND r.state = 'reconciling' AND r.lease_owner = $2
    RETURNING r.id, r.check_count, r.dependency
), c AS (
    ` + sqlInsertChecksInto + `
    SELECT r.id, r.check_count, coalesce($4::timestamptz, clock_timestamp()), $6, r.dependency,
           'error', false, 0, 0, 'transient', $7, '{"sanitized": true}'::jsonb, $8
    FROM r
)
SELECT id FROM r`

// sqlReleaseBare releases a leased row whose outcome, and even a check
// error, the database refused (a role without INSERT on readback_checks):
// it writes only what a claim writes, the lease and the next check. $1 id,
// $2 lease token, $3 to $5 as in sqlReleaseRefused.
const sqlReleaseBare = `
UPDATE reconciler.receipts r
SET next_check_at = ` + sqlRefusedNextCheck + `,
    lease_owner = NULL,
    lease_expires_at = NULL
WHERE r.id = $1 AND r.state = 'reconciling' AND r.lease_owner = $2
RETURNING r.id`

// sqlRefusedNextCheck is the next check of a row whose outcome was
// refused: the outcome's own ($3), but no earlier than $5 seconds after the
// check ($4, else the database's clock), so that a refusal, which checking
// again at once cannot cure, never brings the row back in a hot loop.
// greatest ignores a NULL $3.
const sqlRefusedNextCheck = `greatest($3::timestamptz,
        coalesce($4::timestamptz, clock_timestamp()) + make_interval(secs => $5::float8))`

// sqlSweepOrphans moves submitted receipts with no transition since $3 to
// outcome_unknown, at most $4 per statement (the orphan sweep of SPEC §3).
// $1 actor, $2 detail. It runs under SET LOCAL statement_timeout and
// lock_timeout (sqlSweepLimits) so a hung lock cannot stop the claim loop.
const sqlSweepOrphans = `
UPDATE reconciler.receipts r
SET state = 'outcome_unknown', state_actor = $1, state_detail = $2::jsonb
FROM (
    SELECT id FROM reconciler.receipts
    WHERE state = 'submitted' AND updated_at < $3
    ORDER BY updated_at
    LIMIT $4
    FOR UPDATE SKIP LOCKED
) o
WHERE r.id = o.id AND r.state = 'submitted'
RETURNING r.id, r.dependency`

// sqlSweepLimits bounds the orphan sweep's transaction: $1 statement
// timeout, $2 lock timeout (milliseconds, as text).
const sqlSweepLimits = `SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $2, true)`

// sqlControlReceipt finds a ledger-drawn positive control (SPEC §5a): a
// receipt of dependency $1 and operation $2 (the operation of the receipt
// being settled: a control vouches only for its own operation) that
// settled succeeded from the API's own 2xx response (the agent's settle
// records evidence {"source": "http_response"}).
//
// With $4 NULL it is the newest such receipt. With $4 the submission time
// of the receipt being settled, it is the newest submitted no later than
// $4, else the oldest submitted after it: the control closest to that
// receipt, so a read that misses the receipt (a list read newest first and
// cut short) misses its control too and fails it.
//
// It walks the primary key backwards over at most $3 of the newest
// receipts, so its cost is bounded whatever the table's size, and needs no
// index of its own (an index every receipt move would pay for, for a query
// run every few minutes); the sort is over those rows at most.
const sqlControlReceipt = `
SELECT r.id, r.idempotency_key, r.operation, r.dependency, r.method, r.target, r.fingerprint,
       r.intent, r.pre_image, coalesce(r.external_id, ''), r.attempt, r.created_at,
       r.sub, r.sub + r.max_send_delay,
       coalesce(r.unknown_since, r.submitted_at, r.created_at)
FROM (SELECT *, coalesce(submitted_at, created_at) AS sub
      FROM reconciler.receipts ORDER BY id DESC LIMIT $3) r
WHERE r.dependency = $1 AND r.operation = $2
  AND r.state = 'succeeded' AND r.state_detail -> 'evidence' ->> 'source' = 'http_response'
ORDER BY ($4::timestamptz IS NULL OR r.sub <= $4) DESC,
         CASE WHEN $4::timestamptz IS NULL OR r.sub <= $4 THEN r.sub END DESC NULLS LAST,
         r.sub, r.id DESC
LIMIT 1`

// sqlControlOperations lists the operations of dependency $1 with a
// receipt, among the $2 newest, that settled succeeded from the API's 2xx
// response: the operations a dependency-wide adapter has ledger controls
// for (`reconciler adapters check --control`).
const sqlControlOperations = `
SELECT DISTINCT r.operation
FROM (SELECT * FROM reconciler.receipts ORDER BY id DESC LIMIT $2) r
WHERE r.dependency = $1
  AND r.state = 'succeeded' AND r.state_detail -> 'evidence' ->> 'source' = 'http_response'
ORDER BY 1`

// sqlBacklogDue counts the rows awaiting settlement from the partial index
// receipts_due, and the age of the oldest (from submission). $1 now.
const sqlBacklogDue = `
SELECT count(*) FILTER (WHERE state = 'outcome_unknown'),
       count(*) FILTER (WHERE state = 'reconciling'),
       count(*) FILTER (WHERE next_check_at <= $1),
       coalesce(extract(epoch FROM $1 - min(coalesce(submitted_at, created_at))
                        FILTER (WHERE state = 'outcome_unknown')), 0),
       coalesce(extract(epoch FROM $1 - min(coalesce(submitted_at, created_at))), 0)
FROM reconciler.receipts
WHERE state IN ('outcome_unknown', 'reconciling')`

// sqlBacklogStale counts planned and submitted rows, and those older than
// the stale cut-offs, from receipts_stale. $1 stale-planned cut-off, $2
// orphan cut-off.
const sqlBacklogStale = `
SELECT count(*) FILTER (WHERE state = 'planned'),
       count(*) FILTER (WHERE state = 'planned' AND updated_at < $1),
       count(*) FILTER (WHERE state = 'submitted'),
       count(*) FILTER (WHERE state = 'submitted' AND updated_at < $2)
FROM reconciler.receipts
WHERE state IN ('planned', 'submitted')`

// sqlBacklogHeld counts manual_review rows from receipts_held.
const sqlBacklogHeld = `
SELECT count(*) FROM reconciler.receipts WHERE state = 'manual_review'`

// sqlLifetimeAlarms counts the alarms of late answers after the absence
// window (reconciler.lifetime_alarms), per dependency. A small table: one
// row per such answer, each an incident.
const sqlLifetimeAlarms = `
SELECT dependency, count(*), max(detected_at) FROM reconciler.lifetime_alarms GROUP BY dependency ORDER BY dependency`

// sqlDuplicates counts recorded duplicate alarms.
const sqlDuplicates = `SELECT count(*) FROM reconciler.duplicate_alarms`

// notifyChannel is the channel the receipts row trigger (00001) notifies
// when a receipt becomes outcome_unknown.
const notifyChannel = "reconciler_due"

// sqlRenew extends the leases of rows in flight (the heartbeat), in one
// statement per batch: $1 ids, $2 their lease tokens, $3 the new expiry.
// Only rows still reconciling and still leased by the token are renewed;
// next_check_at follows the lease, so a row whose holder dies is due again
// exactly when its lease runs out (as after a claim).
const sqlRenew = `
UPDATE reconciler.receipts r
SET lease_expires_at = $3, next_check_at = $3
FROM unnest($1::bigint[], $2::text[]) AS u(id, lease)
WHERE r.id = ANY ($1::bigint[]) AND r.id = u.id
  AND r.state = 'reconciling' AND r.lease_owner = u.lease
RETURNING r.id`

// sqlReclaimOwn releases, due now ($3), the rows leased by an earlier
// process of this instance: tokens "<instance>/<nonce>/<seq>" with instance
// $1 and a nonce other than this process's ($2). A restart under the same
// instance name resumes at once instead of waiting out its old leases. It
// walks the partial index receipts_due (reconciling rows only).
const sqlReclaimOwn = `
UPDATE reconciler.receipts r
SET lease_owner = NULL, lease_expires_at = NULL, next_check_at = $3
WHERE r.state = 'reconciling' AND r.lease_owner IS NOT NULL
  AND left(r.lease_owner, length($1) + 1) = $1 || '/'
  AND substr(r.lease_owner, length($1) + 2) ~ '^[0-9a-f]{8}/[0-9]+$'
  AND NOT starts_with(r.lease_owner, $1 || '/' || $2 || '/')
  AND r.lease_expires_at > $3`
