package review

// Every statement the review package runs, in one place.

// sqlList lists held receipts, oldest first, with the reason of the move
// that held each one. The WHERE clause repeats the predicate of the partial
// index receipts_held (state = 'manual_review') and orders by its key, so
// the scan walks that index and stops at the limit however large the table
// is; the latest event is a primary-key lookup ((receipt_id, seq) with seq =
// the receipt's version). Ages use the database's clock, the one that
// stamped updated_at.
//
// $1 operation or NULL, $2 dependency or NULL, $3 minimum age in seconds or
// NULL, $4 limit.
const sqlList = `
SELECT r.id, r.idempotency_key, r.operation, r.dependency, r.attempt, r.updated_at,
       extract(epoch FROM now() - r.updated_at)::float8,
       coalesce(e.actor, r.state_actor),
       coalesce(e.detail ->> 'reason', ''),
       coalesce(e.error ->> 'code', '')
FROM reconciler.receipts r
LEFT JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.seq = r.version
WHERE r.state = 'manual_review'
  AND ($1::text IS NULL OR r.operation = $1::text)
  AND ($2::text IS NULL OR r.dependency = $2::text)
  AND ($3::float8 IS NULL OR r.updated_at <= now() - make_interval(secs => $3::float8))
ORDER BY r.updated_at
LIMIT $4`

// sqlReceipt reads one receipt's projection. $1 id.
const sqlReceipt = `
SELECT id, idempotency_key, operation, dependency, method, target, fingerprint, intent, pre_image,
       state, coalesce(external_id, ''), attempt, coalesce(retry_of, 0), created_at, submitted_at,
       updated_at, version, check_count, next_check_at
FROM reconciler.receipts WHERE id = $1`

// sqlEvents reads one receipt's history in order. $1 id.
const sqlEvents = `
SELECT seq, coalesce(from_state, ''), to_state, at, actor, error, evidence, detail,
       coalesce(detail ->> 'reason', ''), detail -> 'extra', coalesce(external_id, '')
FROM reconciler.receipt_events WHERE receipt_id = $1 ORDER BY seq`

// sqlLatestEvent reads who made a receipt's latest move and when, to name
// them when a resolution finds the receipt already moved. $1 id.
const sqlLatestEvent = `
SELECT e.actor, e.at
FROM reconciler.receipts r
JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.seq = r.version
WHERE r.id = $1`

// sqlContradicted lists the receipts whose settled absence an audit
// contradicted, newest audit first: a walk of the partial index
// verdict_audits_contradicted (few rows), a primary-key lookup of each
// receipt and of its retry (receipts_retry_of).
//
// $1 operation or NULL, $2 dependency or NULL, $3 minimum age in seconds or
// NULL, $4 limit.
const sqlContradicted = `
SELECT r.id, r.idempotency_key, r.operation, r.dependency, r.attempt, r.state,
       a.settled_at, a.at, a.matches, a.retries,
       coalesce((SELECT x.id FROM reconciler.receipts x WHERE x.retry_of = r.id), 0),
       extract(epoch FROM now() - a.at)::float8
FROM reconciler.verdict_audits a
JOIN reconciler.receipts r ON r.id = a.receipt_id
WHERE a.verdict = 'contradicted'
  AND ($1::text IS NULL OR r.operation = $1::text)
  AND ($2::text IS NULL OR r.dependency = $2::text)
  AND ($3::float8 IS NULL OR a.at <= now() - make_interval(secs => $3::float8))
ORDER BY a.at DESC
LIMIT $4`

// sqlAudits reads one receipt's audits. $1 id.
const sqlAudits = `
SELECT at, adapter, settled_state, settled_at, verdict, matches, retries,
       extract(epoch FROM observed_lag)::float8, evidence
FROM reconciler.verdict_audits WHERE receipt_id = $1 ORDER BY at, id`
