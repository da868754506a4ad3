package reconcile

// The statements of the history partitions' keeper (migration 00021,
// docs/retention.md "Partitioned history").
const (
	// sqlPartitionLockTimeout bounds the wait for the locks that creating
	// a partition takes on its parent (and its default partition): a
	// long reader of history must not make every plan queue behind the
	// keeper. A round that times out is retried the next one; partitions
	// are kept several ranges ahead, so one missed round costs nothing.
	sqlPartitionLockTimeout = `SET LOCAL lock_timeout = '2s'`

	// sqlEnsurePartitions creates the partitions due (0 when another
	// session is doing it).
	sqlEnsurePartitions = `SELECT reconciler.ensure_history_partitions()`

	// sqlHistoryPartitions lists the partitions and the receipts' highest
	// id (a backward probe of receipts_pkey), which the ranges ahead are
	// counted from.
	sqlHistoryPartitions = `SELECT h.parent, h.partition, h.from_id, h.to_id, h.default_rows,
		(SELECT coalesce(max(r.id), 0) FROM reconciler.receipts r)
	FROM reconciler.history_partitions() h`
)

// sqlPartitionDetails is one partition's size (its planner estimate of
// rows, its bytes with indexes: catalog reads) and the period of creation
// time its id range covers (the created_at of its first and last receipt:
// two probes of receipts_pkey).
const sqlPartitionDetails = `SELECT c.reltuples::bigint, pg_catalog.pg_total_relation_size(c.oid),
	(SELECT r.created_at FROM reconciler.receipts r WHERE r.id >= $2 AND r.id < $3 ORDER BY r.id LIMIT 1),
	(SELECT r.created_at FROM reconciler.receipts r WHERE r.id >= $2 AND r.id < $3 ORDER BY r.id DESC LIMIT 1)
FROM pg_catalog.pg_class c WHERE c.oid = pg_catalog.to_regclass('reconciler.' || quote_ident($1))`
