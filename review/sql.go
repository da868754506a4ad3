package review

// Every statement the review package runs, in one place.

// sqlList lists held receipts, oldest first, with the reason of the move
// that held each one: sqlListHead, then AND and each condition of a filter
// that is set (sqlListOperation, ...), then sqlListTail. Only the conditions
// asked for are sent, so each one is a plain equality the planner can match
// to an index (a "$1 IS NULL OR col = $1" form would leave a generic plan
// walking every held row). The WHERE clause repeats the predicate of the
// partial index receipts_held (state = 'manual_review') and orders by its
// key, so without a filter the scan walks that index and stops at the limit
// however large the table is; with a dependency, operation or reason it
// walks the partial index on that column and updated_at (migration 00018).
// The latest event is a primary-key lookup ((receipt_id, seq) with seq = the
// receipt's version). Ages use the database's clock, the one that stamped
// updated_at.
//
// The reason is filtered on state_detail, which holds the detail of the
// move that held the receipt (the history trigger copies it into that
// event): no join for the rows a filter leaves out.
//
// Named arguments: @operation, @dependency, @reason, @min_age_s (seconds),
// @limit.
const (
	sqlListHead = `
SELECT r.id, r.idempotency_key, r.operation, r.dependency, r.attempt, r.updated_at,
       extract(epoch FROM now() - r.updated_at)::float8,
       coalesce(e.actor, r.state_actor),
       coalesce(e.detail ->> 'reason', ''),
       coalesce(e.error ->> 'code', '')
FROM reconciler.receipts r
LEFT JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.seq = r.version
WHERE r.state = 'manual_review'`
	sqlListOperation  = `r.operation = @operation`
	sqlListDependency = `r.dependency = @dependency`
	sqlListReason     = `r.state_detail ->> 'reason' = @reason`
	sqlListMinAge     = `r.updated_at <= now() - make_interval(secs => @min_age_s::float8)`
	sqlListTail       = `
ORDER BY r.updated_at
LIMIT @limit`
)

// sqlCountOuterHead, sqlCountHead (with the conditions of sqlList that the
// filter sets), optionally sqlCountTail, and sqlCountOuterTail count held
// receipts: with the tail, at most @max of them, so the count stops after
// @max entries of the index it walks. The tail orders by updated_at, as the
// list does, so the planner walks the same partial index in order rather
// than a sequential scan it expects to stop early: held receipts are the
// recent ones, at the end of the table, where such a scan arrives last. No
// join: every condition is on receipts.
const (
	sqlCountOuterHead = `SELECT count(*) FROM (`
	sqlCountHead      = `
SELECT 1 FROM reconciler.receipts r
WHERE r.state = 'manual_review'`
	sqlCountTail = `
ORDER BY r.updated_at
LIMIT @max`
	sqlCountOuterTail = `) held`
)

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
