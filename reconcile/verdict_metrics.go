package reconcile

import "github.com/prometheus/client_golang/prometheus"

// VerdictMetrics measure whether the reconciler's verdicts hold
// (docs/verdict-audits.md): the lag observed against the declared and
// effective windows, the audits of settled absences, and their alarms.
type VerdictMetrics struct {
	// ObservedLag is the time from submission to the read that first
	// found an effect, by dependency and operation.
	ObservedLag *prometheus.HistogramVec // dependency, operation
	// Audits counts audit reads by dependency and verdict (confirmed,
	// contradicted, inconclusive).
	Audits *prometheus.CounterVec // dependency, verdict
	// FalseAbsences counts settled absences an audit contradicted.
	FalseAbsences *prometheus.CounterVec // dependency
	// WindowAlarms counts proofs that a declared window is too short, by
	// kind (present_after_absence, false_absence).
	WindowAlarms *prometheus.CounterVec // dependency, kind
	// DeclaredWindow and EffectiveWindow are each adapter's windows, from
	// the send deadline (max_request_lifetime + consistency_window).
	DeclaredWindow  *prometheus.GaugeVec // dependency, adapter
	EffectiveWindow *prometheus.GaugeVec // dependency, adapter
}

func newVerdictMetrics(reg prometheus.Registerer) *VerdictMetrics {
	m := &VerdictMetrics{
		ObservedLag: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "reconciler_observed_lag_seconds",
			Help:    "Time from submission to the readback that first found the effect, by dependency and operation: the visibility lag as observed (an upper bound: reads are spaced).",
			Buckets: prometheus.ExponentialBuckets(0.1, 2, 16),
		}, []string{"dependency", "operation"}),
		Audits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_verdict_audits_total",
			Help: "Audit reads of settled absences, by dependency and verdict (confirmed, contradicted, inconclusive).",
		}, []string{"dependency", "verdict"}),
		FalseAbsences: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_false_absences_total",
			Help: "Settled absences (safe_to_retry, a delete's succeeded) whose effect an audit found: the verdict was wrong; the receipt is listed for review and the window widened.",
		}, []string{"dependency"}),
		WindowAlarms: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_window_alarms_total",
			Help: "Proofs that a dependency's declared window is too short (kind present_after_absence or false_absence); each widens the effective window.",
		}, []string{"dependency", "kind"}),
		DeclaredWindow: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "reconciler_declared_window_seconds",
			Help: "max_request_lifetime + consistency_window as declared in the adapters file, by dependency and adapter.",
		}, []string{"dependency", "adapter"}),
		EffectiveWindow: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "reconciler_effective_window_seconds",
			Help: "The window absences wait for, from the send deadline: the declared one, or wider after a window alarm, by dependency and adapter.",
		}, []string{"dependency", "adapter"}),
	}
	if reg != nil {
		reg.MustRegister(m.ObservedLag, m.Audits, m.FalseAbsences, m.WindowAlarms, m.DeclaredWindow, m.EffectiveWindow)
	}
	return m
}
