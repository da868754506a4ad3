package gateway

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of a request in reconciler_gateway_requests_total.
const (
	outcomeSucceeded   = "succeeded"
	outcomeRejected    = "rejected"
	outcomeUnknown     = "outcome_unknown"
	outcomeNotSent     = "not_sent"
	outcomeReplayed    = "replayed"
	outcomeRefused     = "refused"
	outcomePassthrough = "passthrough"
	outcomeError       = "error"
	outcomeRead        = "read" // GET /receipts/{id} answered
)

// Route labels of requests that no configured route serves: a receipt read
// and a path that matches no prefix. A route's own label is its prefix,
// which starts with "/", so these never collide with one.
const (
	routeReceipts = "receipts"
	routeNone     = "none"
)

// Outcomes of a webhook delivery attempt in
// reconciler_gateway_webhook_deliveries_total.
const (
	webhookDelivered = "delivered"
	webhookFailed    = "failed"
	webhookGaveUp    = "gave_up"
)

// Metrics are the gateway's Prometheus metrics. No receipt id or agent id
// is a label: routes and outcomes are bounded sets.
type Metrics struct {
	requests *prometheus.CounterVec
	refusals *prometheus.CounterVec
	replays  *prometheus.CounterVec
	added    *prometheus.HistogramVec
	webhooks *prometheus.CounterVec
}

// NewMetrics registers the gateway's metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reconciler_gateway_requests_total",
			Help: "Requests by route (a route's prefix; receipts for GET /receipts/{id}; none when no prefix matches) and outcome (succeeded, rejected, outcome_unknown, not_sent, replayed, refused, passthrough, error, read)."},
			[]string{"route", "outcome"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reconciler_gateway_refusals_total",
			Help: "Requests refused by the gateway, by route and problem type."}, []string{"route", "type"}),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reconciler_gateway_replays_total",
			Help: "Calls answered from the ledger without sending, by route and receipt state."}, []string{"route", "state"}),
		added: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "reconciler_gateway_added_seconds",
			Help:    "Time the gateway adds to a call: its whole handling minus the upstream exchange (first byte after the connection).",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1}}, []string{"route"}),
		webhooks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reconciler_gateway_webhook_deliveries_total",
			Help: "Webhook delivery attempts by route and outcome (delivered, failed: to be retried, gave_up)."},
			[]string{"route", "outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.refusals, m.replays, m.added, m.webhooks)
	}
	return m
}

func (m *Metrics) request(route, outcome string) {
	if m != nil {
		m.requests.WithLabelValues(route, outcome).Inc()
	}
}

func (m *Metrics) refusal(route, typ string) {
	if m != nil {
		m.refusals.WithLabelValues(route, typ).Inc()
		m.requests.WithLabelValues(route, outcomeRefused).Inc()
	}
}

func (m *Metrics) replay(route, state string) {
	if m != nil {
		m.replays.WithLabelValues(route, state).Inc()
		m.requests.WithLabelValues(route, outcomeReplayed).Inc()
	}
}

func (m *Metrics) addedLatency(route string, d time.Duration) {
	if m != nil && d >= 0 {
		m.added.WithLabelValues(route).Observe(d.Seconds())
	}
}

func (m *Metrics) webhook(route, outcome string) {
	if m != nil {
		m.webhooks.WithLabelValues(route, outcome).Inc()
	}
}
