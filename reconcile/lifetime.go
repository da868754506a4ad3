package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// lifetimeAlarm raises the alarm for a settlement o of a receipt whose
// agent recorded an answer after its absence window (SPEC §5a, "late
// answers void the window"): an ERROR log, reconciler_lifetime_exceeded_total
// and the run's summary. The database keeps the alarm's row
// (reconciler.lifetime_alarms) in the settling statement. Called under s.mu.
func (s *session) lifetimeAlarm(o Outcome) {
	ev := o.Detail.Evidence
	if ev == nil || ev.LifetimeExceeded == nil {
		return
	}
	lx := ev.LifetimeExceeded
	s.summary.LifetimeExceeded++
	if s.p.m != nil {
		s.p.m.LifetimeExceeded.WithLabelValues(o.Dependency, ev.Operation).Inc()
	}
	args := []any{"receipt_id", o.ID, "dependency", o.Dependency, "operation", ev.Operation,
		"adapter", o.Adapter, "state", string(o.To), "late_outcome", lx.Outcome,
		"late_at", lx.LateAt, "window_end", lx.WindowEnd,
		"max_request_lifetime", ev.MaxRequestLifetime, "consistency_window", ev.ConsistencyWindow}
	if lx.HTTPStatus != nil {
		args = append(args, "http_status", *lx.HTTPStatus)
	}
	s.p.log.Error("request outlived its dependency's declared lifetime: an answer to it was recorded after "+
		"its absence window, so no absence of this dependency is safe until its max_request_lifetime or "+
		"consistency_window is raised", args...)
}

// LifetimeAlarms are the late answers recorded after their receipt's absence
// window, of one dependency (reconciler.lifetime_alarms).
type LifetimeAlarms struct {
	Dependency string    `json:"dependency"`
	Count      int64     `json:"count"`
	Latest     time.Time `json:"latest"`
}

// LifetimeAlarms counts the alarms of late answers after the absence window,
// per dependency, in dependency order.
func (s *Store) LifetimeAlarms(ctx context.Context) ([]LifetimeAlarms, error) {
	rows, err := s.pool.Query(ctx, sqlLifetimeAlarms)
	if err != nil {
		return nil, fmt.Errorf("reconcile: lifetime alarms: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (LifetimeAlarms, error) {
		var a LifetimeAlarms
		err := row.Scan(&a.Dependency, &a.Count, &a.Latest)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: lifetime alarms: %w", err)
	}
	return out, nil
}
