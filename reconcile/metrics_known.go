package reconcile

import (
	"math"

	"github.com/receiptledger/reconciler/readback"
)

// refusedStatements and refusedClasses are the label values of
// reconciler_writes_refused_total: the statements the pool writes with and
// the SQLSTATE classes its help text names.
var (
	refusedStatements = []string{"claim", "complete", "record checks"}
	refusedClasses    = []string{"42", "22", "23", "RL", "P0"}
)

// Known starts the labelled series of every dependency and adapter of reg
// at their idle values, so that an idle daemon's /metrics already has
// every series its alert rules and dashboard read (a labelled family has
// no series until something sets one, and a query over a missing series
// answers nothing rather than zero): each dependency's breaker closed,
// its check failures, lifetime alarms and the refused writes at 0. A positive control that
// has not run yet is NaN: neither passed (1) nor failed (0), so the alert
// on a failing control (== 0) stays quiet until a control has run and
// failed. The pool replaces the NaN (adapter, operation "", control) entry
// when the adapter's first control of that kind reports.
func (m *Metrics) Known(reg *readback.Registry) {
	for _, st := range refusedStatements {
		for _, class := range refusedClasses {
			m.WritesRefused.WithLabelValues(st, class)
		}
	}
	if reg == nil {
		return
	}
	deps := map[string]bool{}
	for _, b := range reg.Bindings() {
		if b.Kind == readback.Blind {
			continue // never read: no breaker, no failures, no control
		}
		if !deps[b.Dependency] {
			deps[b.Dependency] = true
			m.Breaker.WithLabelValues(b.Dependency, "closed").Set(1)
			m.Breaker.WithLabelValues(b.Dependency, "half_open").Set(0)
			m.Breaker.WithLabelValues(b.Dependency, "open").Set(0)
			m.Failures.WithLabelValues(b.Dependency, "transient")
			m.Failures.WithLabelValues(b.Dependency, "permanent")
		}
		// A late answer can void an absence of any operation the adapter
		// reads; "" stands for "every operation" where none is listed.
		ops := b.Operations
		if len(ops) == 0 {
			ops = []string{""}
		}
		for _, op := range ops {
			m.LifetimeExceeded.WithLabelValues(b.Dependency, op)
		}
		kinds := []ControlKind{ControlPresent}
		if b.Kind == readback.Delete {
			kinds = append(kinds, ControlGone)
		}
		for _, k := range kinds {
			m.ControlOK.WithLabelValues(b.Name, "", string(k)).Set(math.NaN())
		}
	}
}

// controlReported records a control's result for the adapter's operation,
// replacing the adapter's "not run yet" entry of that kind.
func (m *Metrics) controlReported(adapter, operation string, kind ControlKind, ok float64) {
	m.ControlOK.DeleteLabelValues(adapter, "", string(kind))
	m.ControlOK.WithLabelValues(adapter, operation, string(kind)).Set(ok)
}
