package retention

// The archiver's statements. Times are the database's (clock_timestamp()),
// like every stored time they are compared with (SPEC §5a, "one clock").
const (
	// sqlNow is the database's clock, from which the policy's cut-offs are
	// counted.
	sqlNow = `SELECT clock_timestamp()`

	// sqlIDRange bounds the receipts' ids.
	sqlIDRange = `SELECT coalesce(min(id), 0), coalesce(max(id), 0) FROM reconciler.receipts`

	// sqlCreatedAt is the creation time of the first receipt at or after an
	// id: a probe of the primary key, for the binary search of the highest
	// id created before the cut-off (ids are drawn in creation order, and a
	// receipt settles after it was created, so no receipt above it can be
	// old enough). No index on created_at: one more index on receipts
	// would cost every move an insert.
	sqlCreatedAt = `SELECT created_at FROM reconciler.receipts WHERE id >= $1 ORDER BY id LIMIT 1`

	// sqlChains walks the first attempts settled before the cut-off, in id
	// order from @after up to @bound (the primary key's range), and returns
	// each with its retry chain and whether every receipt of the chain may
	// go (reconciler.retention_keep_reason, the rule the removal re-checks).
	sqlChains = `WITH RECURSIVE heads AS (
		SELECT x.id FROM reconciler.receipts x
		WHERE x.id > @after AND x.id <= @bound AND x.retry_of IS NULL
		  AND x.state IN ('succeeded', 'rejected', 'safe_to_retry') AND x.updated_at < @settled_before
		ORDER BY x.id LIMIT @limit
	), chain AS (
		SELECT h.id AS head, h.id FROM heads h
		UNION ALL
		SELECT c.head, r.id FROM chain c JOIN reconciler.receipts r ON r.retry_of = c.id
	)
	SELECT c.head, array_agg(c.id ORDER BY c.id),
	       bool_and(reconciler.retention_keep_reason(x, @settled_before, @horizon_us * interval '1 microsecond') IS NULL)
	FROM chain c JOIN reconciler.receipts x ON x.id = c.id
	GROUP BY c.head ORDER BY c.head`

	// sqlExportReceipts is every row a receipts batch removes, as the
	// removal deletes them, one JSON object per row.
	sqlExportReceipts = `SELECT 'receipts', to_jsonb(x) FROM reconciler.receipts x WHERE x.id = ANY ($1)
	UNION ALL SELECT 'late_outcomes', to_jsonb(l) FROM reconciler.late_outcomes l WHERE l.receipt_id = ANY ($1)
	UNION ALL SELECT 'verdict_audits', to_jsonb(v) FROM reconciler.verdict_audits v WHERE v.receipt_id = ANY ($1)
	UNION ALL SELECT 'webhook_receipts', to_jsonb(w) FROM reconciler.webhook_receipts w WHERE w.receipt_id = ANY ($1)
	UNION ALL SELECT 'webhook_deliveries', to_jsonb(d) FROM reconciler.webhook_deliveries d WHERE d.receipt_id = ANY ($1)
	UNION ALL SELECT 'gateway_responses', to_jsonb(g) FROM reconciler.gateway_responses g WHERE g.receipt_id = ANY ($1)`

	// sqlRemoveReceipts removes a receipts batch, re-checking every rule.
	// (Durations travel as microseconds: the database's own type.)
	sqlRemoveReceipts = `SELECT reconciler.retention_remove_receipts($1, $2, $3, $4, $5 * interval '1 microsecond', $6)`

	// sqlHistoryDue is the oldest receipts batch whose history is past the
	// history policy and still in the ledger.
	sqlHistoryDue = `SELECT b.id FROM reconciler.retention_batches b
	WHERE b.kind = 'receipts' AND b.settled_before < $1
	  AND NOT EXISTS (SELECT FROM reconciler.retention_batches h WHERE h.kind = 'history' AND h.of_batch = b.id)
	ORDER BY b.id LIMIT 1`

	// sqlExportHistory is the history of a receipts batch's receipts.
	sqlExportHistory = `SELECT 'receipt_events', to_jsonb(e) FROM reconciler.removed_receipts t
		JOIN reconciler.receipt_events e ON e.receipt_id = t.receipt_id WHERE t.batch_id = $1
	UNION ALL SELECT 'readback_checks', to_jsonb(c) FROM reconciler.removed_receipts t
		JOIN reconciler.readback_checks c ON c.receipt_id = t.receipt_id WHERE t.batch_id = $1`

	// sqlRemoveHistory removes a batch's history.
	sqlRemoveHistory = `SELECT reconciler.retention_remove_history($1, $2, $3, $4)`

	// sqlPartitionsDue is every history partition range that may be
	// dropped (migration 00022), oldest first. The ranges are those of
	// receipt_events (the default partition has none); the drop refuses a
	// range the other tables do not share. The rule probes the receipts' and removed receipts' primary
	// keys over the range, the cheap conditions first: the ranges ahead and
	// those still holding a receipt cost one probe each.
	sqlPartitionsDue = `SELECT r.from_id, r.to_id FROM reconciler.history_partitions() r
	WHERE r.parent = 'receipt_events' AND r.to_id IS NOT NULL
	  AND reconciler.retention_partition_keep_reason(r.from_id, r.to_id, $1) IS NULL
	ORDER BY r.to_id`

	// sqlExportPartition is every row of a range's partitions ($1 NULL: the
	// first partition, from MINVALUE), through the parents: the range's
	// condition prunes each scan to the one partition.
	sqlExportPartition = `SELECT 'receipt_events', to_jsonb(e) FROM reconciler.receipt_events e
		WHERE e.receipt_id >= coalesce($1, -9223372036854775808) AND e.receipt_id < $2
	UNION ALL SELECT 'readback_checks', to_jsonb(c) FROM reconciler.readback_checks c
		WHERE c.receipt_id >= coalesce($1, -9223372036854775808) AND c.receipt_id < $2
	UNION ALL SELECT 'verdict_audits', to_jsonb(v) FROM reconciler.verdict_audits v
		WHERE v.receipt_id >= coalesce($1, -9223372036854775808) AND v.receipt_id < $2`

	// sqlDropPartition drops a range's partitions, re-checking the rule and
	// the rows under their locks.
	sqlDropPartition = `SELECT reconciler.retention_drop_history_partition(@lo, @hi, @history_before, @archive, @sha256, @expected)`

	// sqlPartitionsToCompact is every history partition range a receipt
	// still in the ledger pins but that may be compacted (migration 00024),
	// oldest first, with the compactions it had: those whose receipts left
	// since the range's last partition batch (whose history is still
	// there) are more than (1 - @max_kept_share) of them with the kept
	// ones. Counted in receipts by their primary keys, not in rows: a
	// receipt's history is a few rows, kept or not alike.
	sqlPartitionsToCompact = `SELECT r.from_id, r.to_id, c.n
	FROM reconciler.history_partitions() r
	CROSS JOIN LATERAL (SELECT count(*) AS n, coalesce(max(d.id), 0) AS last FROM reconciler.retention_batches d
		WHERE d.kind = 'partition' AND d.range_hi = r.to_id AND d.range_lo IS NOT DISTINCT FROM r.from_id) c
	CROSS JOIN LATERAL (SELECT count(*) AS kept FROM reconciler.receipts x
		WHERE x.id >= coalesce(r.from_id, -9223372036854775808) AND x.id < r.to_id) k
	CROSS JOIN LATERAL (SELECT count(*) AS gone FROM reconciler.removed_receipts t
		WHERE t.receipt_id >= coalesce(r.from_id, -9223372036854775808) AND t.receipt_id < r.to_id
		  AND t.batch_id > c.last) g
	WHERE r.parent = 'receipt_events' AND r.to_id IS NOT NULL
	  AND reconciler.retention_partition_compact_reason(r.from_id, r.to_id, @history_before) IS NULL
	  AND k.kept > 0 AND g.gone > 0 AND k.kept < @max_kept_share::float8 * (k.kept + g.gone)
	ORDER BY r.to_id`

	// sqlExportCompaction is every row of a range's partitions whose
	// receipt is no longer in the ledger: what the compaction removes. The
	// receipts are bounded by the range too, so the anti-join reads only
	// theirs (by the primary key), never the whole ledger.
	sqlExportCompaction = `SELECT 'receipt_events', to_jsonb(e) FROM reconciler.receipt_events e
		WHERE e.receipt_id >= coalesce($1, -9223372036854775808) AND e.receipt_id < $2
		  AND NOT EXISTS (SELECT FROM reconciler.receipts x WHERE x.id = e.receipt_id
		                  AND x.id >= coalesce($1, -9223372036854775808) AND x.id < $2)
	UNION ALL SELECT 'readback_checks', to_jsonb(c) FROM reconciler.readback_checks c
		WHERE c.receipt_id >= coalesce($1, -9223372036854775808) AND c.receipt_id < $2
		  AND NOT EXISTS (SELECT FROM reconciler.receipts x WHERE x.id = c.receipt_id
		                  AND x.id >= coalesce($1, -9223372036854775808) AND x.id < $2)
	UNION ALL SELECT 'verdict_audits', to_jsonb(v) FROM reconciler.verdict_audits v
		WHERE v.receipt_id >= coalesce($1, -9223372036854775808) AND v.receipt_id < $2
		  AND NOT EXISTS (SELECT FROM reconciler.receipts x WHERE x.id = v.receipt_id
		                  AND x.id >= coalesce($1, -9223372036854775808) AND x.id < $2)`

	// sqlCompactPartition compacts a range's partitions, re-checking the
	// rule and the rows under their locks.
	sqlCompactPartition = `SELECT reconciler.retention_compact_history_partition(@lo, @hi, @history_before, @archive, @sha256, @expected)`
)

// receiptTables and historyTables are the tables each kind of batch
// removes from: the removal compares its count of each with the export's.
// Functions, so no caller can change them.
func receiptTables() []string {
	return []string{"receipts", "late_outcomes", "verdict_audits", "webhook_receipts", "webhook_deliveries", "gateway_responses"}
}

func historyTables() []string { return []string{"receipt_events", "readback_checks"} }
