package pgtest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// PlanNode is a node of EXPLAIN (FORMAT JSON), for the tests that check
// which indexes a statement's plan reads.
type PlanNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	IndexName string     `json:"Index Name"`
	Plans     []PlanNode `json:"Plans"`
}

// Walk calls f on n and on every node under it, depth first.
func (n PlanNode) Walk(f func(PlanNode)) {
	f(n)
	for _, c := range n.Plans {
		c.Walk(f)
	}
}

// PartitionRoots maps each partition and partition index of the reconciler
// schema to its root (receipt_events_legacy_pkey to receipt_events_pkey,
// receipt_events_p0000000000001000000 to receipt_events), so a plan test
// can name the index or table a statement reads whatever partition the
// plan shows.
func PartitionRoots(tb testing.TB, db *pgxpool.Pool) map[string]string {
	tb.Helper()
	rows, err := db.Query(context.Background(), `
		SELECT c.relname::text, r.relname::text
		FROM pg_catalog.pg_class c
		JOIN pg_catalog.pg_class r ON r.oid = pg_catalog.pg_partition_root(c.oid)
		WHERE c.relnamespace = 'reconciler'::regnamespace AND c.relispartition`)
	if err != nil {
		tb.Fatalf("partition roots: %v", err)
	}
	roots := map[string]string{}
	for rows.Next() {
		var name, root string
		if err := rows.Scan(&name, &root); err != nil {
			tb.Fatalf("partition roots: %v", err)
		}
		roots[name] = root
	}
	if err := rows.Err(); err != nil {
		tb.Fatalf("partition roots: %v", err)
	}
	return roots
}
