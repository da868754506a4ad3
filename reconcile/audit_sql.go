package reconcile

// The statements of verdict audits and effective windows (migration 00015,
// docs/verdict-audits.md), in one place.

// sqlAuditClaim leases up to @limit queued audits whose verdict settled at
// or before its dependency's cut-off (@deps, @cutoffs: the audit delay of
// each dependency's declaration), oldest first, that are neither leased
// nor put off. Each dependency's candidates are a range scan of
// audit_queue_due. It returns what the adapter needs of the receipt.
const sqlAuditClaim = `
WITH due AS (
    SELECT q.receipt_id
    FROM unnest(@deps::text[], @cutoffs::timestamptz[]) AS d(dependency, cutoff)
    CROSS JOIN LATERAL (
        SELECT q.receipt_id, q.settled_at FROM reconciler.audit_queue q
        WHERE q.dependency = d.dependency COLLATE "C" AND q.settled_at <= d.cutoff
          AND (q.lease_expires_at IS NULL OR q.lease_expires_at <= @now)
          AND (q.not_before IS NULL OR q.not_before <= @now)
        ORDER BY q.settled_at
        LIMIT @limit
        FOR UPDATE SKIP LOCKED
    ) q
    ORDER BY q.settled_at
    LIMIT @limit
), claimed AS (
    UPDATE reconciler.audit_queue q
    SET lease_owner = @token, lease_expires_at = @expires
    WHERE q.receipt_id = ANY (ARRAY(SELECT receipt_id FROM due))
    RETURNING q.receipt_id, q.settled_state, q.settled_at, q.attempts
)
-- LATERAL with a LIMIT (never pulled up into a join): one primary-key
-- probe of receipts per claimed audit, never a scan of the whole table.
SELECT r.id, r.idempotency_key, r.operation, r.dependency, r.method, r.target, r.fingerprint,
       r.intent, r.pre_image, coalesce(r.external_id, ''), r.attempt, r.created_at,
       coalesce(r.submitted_at, r.created_at),
       coalesce(r.submitted_at, r.created_at) + r.max_send_delay,
       c.settled_state, c.settled_at, c.attempts,
       coalesce(r.state_detail -> 'evidence', '{}'::jsonb)
FROM claimed c
CROSS JOIN LATERAL (SELECT * FROM reconciler.receipts x WHERE x.id = c.receipt_id LIMIT 1) r`

// sqlAuditRecord appends one audit and ends its queue entry, as long as
// this claim still holds it (@token): a lease that expired and was taken
// over records nothing.
const sqlAuditRecord = `
WITH done AS (
    DELETE FROM reconciler.audit_queue
    WHERE receipt_id = @receipt AND lease_owner = @token
    RETURNING receipt_id
)
INSERT INTO reconciler.verdict_audits (receipt_id, dependency, operation, adapter, settled_state,
    settled_at, at, instance, verdict, matches, retries, observed_lag, evidence)
SELECT receipt_id, @dependency, @operation, @adapter, @settled_state, @settled_at, @at, @instance,
       @verdict, @matches, @retries, make_interval(secs => @lag_s::float8), @evidence::jsonb
FROM done`

// sqlAuditSkip ends the queue entry of a receipt left out of the sample.
const sqlAuditSkip = `DELETE FROM reconciler.audit_queue WHERE receipt_id = @receipt AND lease_owner = @token`

// sqlAuditPutOff gives a claimed audit back, not to be claimed before
// @not_before; @failed counts a failed read.
const sqlAuditPutOff = `
UPDATE reconciler.audit_queue
SET lease_owner = NULL, lease_expires_at = NULL, not_before = @not_before,
    attempts = attempts + CASE WHEN @failed::boolean THEN 1 ELSE 0 END
WHERE receipt_id = @receipt AND lease_owner = @token`

// sqlAuditRetries counts the later attempts of a receipt's logical key
// (the retry chain through receipts_retry_of) that may have taken effect:
// sent and not settled as having done nothing. Their effects are accounted
// for when an audit finds the key's marker on several resources.
const sqlAuditRetries = `
WITH RECURSIVE chain AS (
    SELECT id, state FROM reconciler.receipts WHERE retry_of = $1
    UNION ALL
    SELECT r.id, r.state FROM reconciler.receipts r JOIN chain c ON r.retry_of = c.id
)
SELECT count(*) FILTER (WHERE state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review',
                                        'succeeded'))::int
FROM chain`

// sqlLastAbsenceSince returns when the latest authoritative absent read of
// a receipt that began at or after $2 began (NULL: none). Run only when a
// read finds an effect past its window (rare): a primary-key range scan of
// the receipt's checks.
const sqlLastAbsenceSince = `
SELECT max(at) FROM reconciler.readback_checks
WHERE receipt_id = $1 AND at >= $2 AND verdict = 'absent' AND authoritative`

// sqlWindows reads the effective windows: per declaration (dependency,
// adapter, declared window), the widest window its alarms set, with the
// alarm that set it.
const sqlWindows = `
SELECT DISTINCT ON (dependency, adapter, declared)
       dependency, adapter, extract(epoch FROM declared)::float8,
       extract(epoch FROM effective_after)::float8, extract(epoch FROM observed)::float8,
       kind, receipt_id, at
FROM reconciler.window_alarms
ORDER BY dependency, adapter, declared, effective_after DESC, at`

// sqlWindowAlarm appends one window alarm.
const sqlWindowAlarm = `
INSERT INTO reconciler.window_alarms (at, instance, dependency, adapter, operation, receipt_id, kind,
    declared, observed, effective_before, effective_after, evidence)
VALUES (@at, @instance, @dependency, @adapter, @operation, @receipt, @kind,
        make_interval(secs => @declared_s::float8), make_interval(secs => @observed_s::float8),
        make_interval(secs => @before_s::float8), make_interval(secs => @after_s::float8), @evidence::jsonb)`

// sqlStatsVerdicts counts the receipts settled by the reconciler since $1
// by dependency, state and reason. Terminal receipts are not updated after
// they settle, so updated_at is when they settled.
const sqlStatsVerdicts = `
SELECT dependency, state, coalesce(state_detail ->> 'reason', ''), count(*)::int
FROM reconciler.receipts
WHERE updated_at >= $1 AND state IN ('succeeded', 'safe_to_retry', 'manual_review')
  AND state_actor LIKE 'reconciler:%'
GROUP BY 1, 2, 3`

// sqlStatsAudits counts the audits made since $1 by dependency and verdict.
const sqlStatsAudits = `
SELECT dependency, verdict, count(*)::int FROM reconciler.verdict_audits WHERE at >= $1 GROUP BY 1, 2`

// sqlStatsQueue counts the absences waiting for their audit.
const sqlStatsQueue = `SELECT dependency, count(*)::int FROM reconciler.audit_queue GROUP BY 1`

// sqlStatsLag is the observed lag of the receipts settled present since
// $1, by dependency and operation: the settling read's time since
// submission (its evidence).
const sqlStatsLag = `
SELECT dependency, operation, count(*)::int,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lag), percentile_cont(0.99) WITHIN GROUP (ORDER BY lag),
       max(lag)
FROM (SELECT dependency, operation, (state_detail -> 'evidence' ->> 'since_submission_s')::float8 AS lag
      FROM reconciler.receipts
      WHERE updated_at >= $1 AND state = 'succeeded'
        AND state_detail ->> 'reason' IN ('present', 'present_duplicates')
        AND jsonb_typeof(state_detail -> 'evidence' -> 'since_submission_s') = 'number') s
GROUP BY 1, 2
ORDER BY 1, 2`

// sqlStatsAlarms counts the window alarms raised since $1 by dependency.
const sqlStatsAlarms = `
SELECT dependency, count(*)::int FROM reconciler.window_alarms WHERE at >= $1 GROUP BY 1`
