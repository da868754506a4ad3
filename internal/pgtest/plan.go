package pgtest

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
