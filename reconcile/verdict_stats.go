package reconcile

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
)

// DependencyVerdicts is what `reconciler stats` reports of one dependency's
// verdicts over a period (docs/verdict-audits.md): how many of each kind,
// how many of its settled absences were audited and what the audits found,
// the lag observed against its windows, and its window alarms.
type DependencyVerdicts struct {
	Dependency string `json:"dependency"`
	// Verdicts counts the receipts settled in the period, by state and
	// reason ("safe_to_retry/absent_after_window").
	Verdicts map[string]int `json:"verdicts"`
	// Audited counts the audits made in the period, by verdict.
	Audited      int `json:"audited"`
	Confirmed    int `json:"confirmed"`
	Contradicted int `json:"contradicted"`
	Inconclusive int `json:"inconclusive"`
	// AwaitingAudit counts the settled absences queued for their audit.
	AwaitingAudit int `json:"awaiting_audit"`
	// Lag is the observed lag per operation: submission to the read that
	// first found the effect, over the receipts settled present.
	Lag []ObservedLag `json:"observed_lag"`
	// Windows are the declared and effective windows of the dependency's
	// adapters that a window alarm ever widened (the others are as
	// declared), and Alarms the window alarms raised in the period.
	Windows []Window `json:"widened_windows,omitempty"`
	Alarms  int      `json:"window_alarms"`
}

// ObservedLag is the distribution of the lag observed for one operation.
type ObservedLag struct {
	Operation string  `json:"operation"`
	Samples   int     `json:"samples"`
	P50       float64 `json:"p50_s"`
	P99       float64 `json:"p99_s"`
	Max       float64 `json:"max_s"`
}

// VerdictStats reports, per dependency, the verdicts settled in the last
// period (by the database's clock), their audits and the lag observed. It reads the
// receipts settled in the period (a scan of receipts by updated_at: this
// is a report, not a hot path), the audits and alarms of the period (their
// at indexes) and the audit queue.
func (s *Store) VerdictStats(ctx context.Context, period time.Duration) ([]DependencyVerdicts, error) {
	by := map[string]*DependencyVerdicts{}
	get := func(dep string) *DependencyVerdicts {
		d := by[dep]
		if d == nil {
			d = &DependencyVerdicts{Dependency: dep, Verdicts: map[string]int{}}
			by[dep] = d
		}
		return d
	}
	fail := func(what string, err error) error { return fmt.Errorf("reconcile: verdict stats: %s: %w", what, err) }
	var since time.Time
	if err := s.pool.QueryRow(ctx, `SELECT now() - make_interval(secs => $1::float8)`, period.Seconds()).Scan(&since); err != nil {
		return nil, fail("clock", err)
	}
	var dep, a, b string
	var n int
	rows, err := s.pool.Query(ctx, sqlStatsVerdicts, since)
	if err != nil {
		return nil, fail("verdicts", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&dep, &a, &b, &n}, func() error {
		get(dep).Verdicts[a+"/"+b] += n
		return nil
	}); err != nil {
		return nil, fail("verdicts", err)
	}
	rows, err = s.pool.Query(ctx, sqlStatsAudits, since)
	if err != nil {
		return nil, fail("audits", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&dep, &a, &n}, func() error {
		d := get(dep)
		d.Audited += n
		switch a {
		case AuditConfirmed:
			d.Confirmed += n
		case AuditContradicted:
			d.Contradicted += n
		default:
			d.Inconclusive += n
		}
		return nil
	}); err != nil {
		return nil, fail("audits", err)
	}
	rows, err = s.pool.Query(ctx, sqlStatsQueue)
	if err != nil {
		return nil, fail("audit queue", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&dep, &n}, func() error {
		get(dep).AwaitingAudit = n
		return nil
	}); err != nil {
		return nil, fail("audit queue", err)
	}
	var l ObservedLag
	rows, err = s.pool.Query(ctx, sqlStatsLag, since)
	if err != nil {
		return nil, fail("observed lag", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&dep, &l.Operation, &l.Samples, &l.P50, &l.P99, &l.Max}, func() error {
		d := get(dep)
		d.Lag = append(d.Lag, l)
		return nil
	}); err != nil {
		return nil, fail("observed lag", err)
	}
	rows, err = s.pool.Query(ctx, sqlStatsAlarms, since)
	if err != nil {
		return nil, fail("window alarms", err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&dep, &n}, func() error {
		get(dep).Alarms = n
		return nil
	}); err != nil {
		return nil, fail("window alarms", err)
	}
	var ws Windows
	if err := ws.Load(ctx, s.pool); err != nil {
		return nil, err
	}
	for _, w := range ws.all() {
		d := get(w.Dependency)
		d.Windows = append(d.Windows, w)
	}
	out := make([]DependencyVerdicts, 0, len(by))
	for _, d := range by {
		out = append(out, *d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Dependency < out[j].Dependency })
	return out, nil
}
