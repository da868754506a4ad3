package reconcile

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the reconciler's Prometheus metrics. Labels are bounded sets
// (verdicts, reasons, adapter and dependency names from the configuration,
// error classes); receipt ids never appear in labels.
type Metrics struct {
	Settlements  *prometheus.CounterVec   // state, reason
	Checks       *prometheus.CounterVec   // adapter, outcome
	CheckLatency *prometheus.HistogramVec // adapter
	Failures     *prometheus.CounterVec   // dependency, class
	Deferrals    *prometheus.CounterVec   // dependency
	Rescheduled  prometheus.Counter
	LeaseLost    prometheus.Counter
	Refused      prometheus.Counter
	Claimed      prometheus.Counter
	Orphans      prometheus.Counter
	Duplicates   prometheus.Counter
	// LifetimeExceeded counts receipts settled with a late answer recorded
	// after their absence window (ReasonLifetimeExceeded).
	LifetimeExceeded *prometheus.CounterVec // dependency, operation
	Backlog          *prometheus.GaugeVec   // state
	StalePlanned     prometheus.Gauge
	OldestUnknown    prometheus.Gauge
	Breaker          *prometheus.GaugeVec // dependency, state
	DBErrors         prometheus.Counter
	// WritesRefused counts rows (outcomes, checks) the database refused
	// permanently, by statement and SQLSTATE class; WritesBlocked is 1
	// while it refuses a statement as such (Pool.WritesRefused).
	WritesRefused *prometheus.CounterVec // statement, sqlstate_class
	WritesBlocked prometheus.Gauge
	// ClockSkew is the host's wall clock minus the database's.
	ClockSkew prometheus.Gauge
	// ControlOK is 1 while a positive control of an adapter holds for an
	// operation, else 0. control is "present" or "gone" (ControlKind).
	ControlOK *prometheus.GaugeVec // adapter, operation, control
	// Verdicts measure whether verdicts hold: observed lag, audits, alarms.
	Verdicts *VerdictMetrics
}

// NewMetrics creates the metrics and registers them with reg (a fresh
// prometheus.NewRegistry() in production and tests alike: no global state).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Settlements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_settlements_total",
			Help: "Receipts settled, by resulting state (succeeded, safe_to_retry, manual_review) and reason.",
		}, []string{"state", "reason"}),
		Checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_checks_total",
			Help: "Readback checks, by adapter and outcome (present, absent, inconclusive, diverged, transient, permanent).",
		}, []string{"adapter", "outcome"}),
		CheckLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "reconciler_check_duration_seconds",
			Help:    "Latency of readback checks, by adapter.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9),
		}, []string{"adapter"}),
		Failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_check_failures_total",
			Help: "Failed readback checks, by dependency and error class (transient, permanent).",
		}, []string{"dependency", "class"}),
		Deferrals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_deferrals_total",
			Help: "Checks not made because the dependency's protection refused them (open breaker, rate limit, budget); the rows were rescheduled.",
		}, []string{"dependency"}),
		Rescheduled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_rescheduled_total",
			Help: "Rows released with a next check time (inconclusive, not yet conclusive, transient error).",
		}),
		LeaseLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_lease_lost_total",
			Help: "Outcomes discarded because the row's lease had expired and another holder had it.",
		}),
		Refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_outcomes_refused_total",
			Help: "Outcomes the database refused even in their minimal form: not settled; their rows were released with their next check pushed (also counted in reconciler_rescheduled_total) or, if even that was refused, left to their lease's expiry.",
		}),
		Claimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_claimed_total",
			Help: "Rows claimed.",
		}),
		Orphans: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_orphans_total",
			Help: "Stale submitted receipts moved to outcome_unknown by this instance.",
		}),
		Duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_duplicates_detected_total",
			Help: "Creates that matched more than one external resource (settled succeeded, alarm recorded).",
		}),
		LifetimeExceeded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_lifetime_exceeded_total",
			Help: "Receipts settled whose agent recorded an answer to the original request after its absence window (send deadline + max_request_lifetime + consistency_window): the dependency's declared lifetime or window is too short, and every other absence of it rests on that declaration. Each is settled manual_review (lifetime_exceeded) unless positively proven succeeded, logged at ERROR, and kept in reconciler.lifetime_alarms.",
		}, []string{"dependency", "operation"}),
		Backlog: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "reconciler_backlog",
			Help: "Receipts in each non-terminal state (planned, submitted, outcome_unknown, reconciling, manual_review).",
		}, []string{"state"}),
		StalePlanned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_stale_planned",
			Help: "Planned receipts with no transition for longer than the stale-planned threshold (counted, never touched).",
		}),
		OldestUnknown: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_oldest_outcome_unknown_age_seconds",
			Help: "Time since submission of the oldest receipt still outcome_unknown.",
		}),
		Breaker: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "reconciler_breaker_state",
			Help: "1 for the current breaker state of each dependency (closed, half_open, open), 0 for the others.",
		}, []string{"dependency", "state"}),
		DBErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "reconciler_database_errors_total",
			Help: "Failed claim, complete or sweep statements (retried).",
		}),
		WritesRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "reconciler_writes_refused_total",
			Help: "Rows the database refused permanently (not retried: a missing privilege, the schema, a trigger, the row's data), by statement (complete, record checks) and SQLSTATE class (42 privilege or schema, 22 data, 23 integrity, RL the ledger's triggers, P0 a trigger's RAISE). Each is logged at ERROR with its receipt, its verdict and a hint.",
		}, []string{"statement", "sqlstate_class"}),
		WritesBlocked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_writes_blocked",
			Help: "1 while the database refuses one of the reconciler's statements as such (every row of a batch refused for a privilege or the schema, or the claim refused): claims back off to one row per pause and /readyz answers 503; 0 once a write goes through.",
		}),
		ClockSkew: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_clock_skew_seconds",
			Help: "This host's wall clock minus the database's clock, as last measured (the reconciler uses the database's clock; beyond ±1 s it also logs a warning).",
		}),
		ControlOK: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "reconciler_adapter_control_ok",
			Help: "1 while the adapter's positive control (control: present, which gates absences; gone, which gates a delete's still-present) passed recently for the operation, 0 when it failed or has none; NaN, with operation \"\", until the adapter's first control of that kind has run.",
		}, []string{"adapter", "operation", "control"}),
	}
	if reg != nil {
		reg.MustRegister(m.Settlements, m.Checks, m.CheckLatency, m.Failures, m.Deferrals,
			m.Rescheduled, m.LeaseLost, m.Refused, m.Claimed, m.Orphans, m.Duplicates, m.LifetimeExceeded, m.Backlog,
			m.StalePlanned, m.OldestUnknown, m.Breaker, m.DBErrors, m.WritesRefused, m.WritesBlocked, m.ClockSkew, m.ControlOK)
	}
	m.Verdicts = newVerdictMetrics(reg)
	return m
}
