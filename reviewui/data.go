package reviewui

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// maxFacetValues is the most values of each filter the queue offers.
const maxFacetValues = 200

// facet is one value of a filter and how many held receipts have it.
type facet struct {
	Value string
	Count int64
}

// facets are the choices of the queue's filters, with their counts.
type facets struct {
	Dependency, Operation, Reason []facet
}

func (s *Server) facets(ctx context.Context) (facets, error) {
	var f facets
	rows, err := s.pool.Query(ctx, sqlFacets, maxFacetValues)
	if err != nil {
		return f, fmt.Errorf("reviewui: filter counts: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var kind string
		var v facet
		if err := rows.Scan(&kind, &v.Value, &v.Count); err != nil {
			return f, fmt.Errorf("reviewui: filter counts: %w", err)
		}
		switch kind {
		case "dependency":
			f.Dependency = append(f.Dependency, v)
		case "operation":
			f.Operation = append(f.Operation, v)
		default:
			f.Reason = append(f.Reason, v)
		}
	}
	if err := rows.Err(); err != nil {
		return f, fmt.Errorf("reviewui: filter counts: %w", err)
	}
	return f, nil
}

// breaker is one dependency's shared breaker.
type breaker struct {
	Dependency string
	OpenUntil  time.Time
	OpenedBy   string
	Reason     string
	UpdatedAt  time.Time
	Open       bool
}

// alarmSource is one kind of alarm counted on the summary bar (see
// alarmSources).
type alarmSource struct {
	Name, Table, Help, SQL string
}

// alarm is an alarm source's count.
type alarm struct {
	Name, Help string
	Count      int64
	Latest     *time.Time
}

// summary is the bar above every page: the backlog by state, the breakers,
// the alarms. A part the login may not read is left out and named in
// Unreadable, rather than failing the page.
type summary struct {
	Backlog    reconcile.Backlog
	Breakers   []breaker
	Alarms     []alarm
	Unreadable []string
}

// OpenBreakers counts the breakers open now.
func (s summary) OpenBreakers() int {
	n := 0
	for _, b := range s.Breakers {
		if b.Open {
			n++
		}
	}
	return n
}

func (s *Server) summary(ctx context.Context) (summary, error) {
	var sum summary
	var err error
	sum.Backlog, err = s.store.Backlog(ctx, s.now(), s.stalePlanned, s.orphanTimeout)
	if err != nil {
		return sum, fmt.Errorf("reviewui: summary: %w", err)
	}
	rows, err := s.pool.Query(ctx, sqlBreakers)
	if err == nil {
		sum.Breakers, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (breaker, error) {
			var b breaker
			err := row.Scan(&b.Dependency, &b.OpenUntil, &b.OpenedBy, &b.Reason, &b.UpdatedAt, &b.Open)
			return b, err
		})
	}
	if unreadable(err) {
		sum.Unreadable = append(sum.Unreadable, "breakers")
	} else if err != nil {
		return sum, fmt.Errorf("reviewui: summary: breakers: %w", err)
	}
	for _, src := range alarmSources {
		var exists bool
		if err := s.pool.QueryRow(ctx, sqlTableExists, src.Table).Scan(&exists); err != nil {
			return sum, fmt.Errorf("reviewui: summary: %s: %w", src.Name, err)
		}
		if !exists {
			continue
		}
		a := alarm{Name: src.Name, Help: src.Help}
		err := s.pool.QueryRow(ctx, src.SQL).Scan(&a.Count, &a.Latest)
		if unreadable(err) {
			sum.Unreadable = append(sum.Unreadable, src.Name)
			continue
		}
		if err != nil {
			return sum, fmt.Errorf("reviewui: summary: %s: %w", src.Name, err)
		}
		sum.Alarms = append(sum.Alarms, a)
	}
	return sum, nil
}

// unreadable reports whether err is the database refusing a read for want
// of a privilege.
func unreadable(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "42501"
}

// check is one readback check of a receipt.
type check struct {
	No            int
	At            time.Time
	Instance      string
	Adapter       string
	Verdict       string
	Authoritative bool
	Matches       int
	Latency       time.Duration
	ErrorClass    string
	Error         string
	Evidence      json.RawMessage
}

// lateOutcome is what an agent learned of its call after the orphan sweep
// had moved the receipt.
type lateOutcome struct {
	At         time.Time
	Actor      string
	Outcome    string
	HTTPStatus *int
	ExternalID string
	Detail     json.RawMessage
}

// duplicate is a duplicate alarm raised on a receipt.
type duplicate struct {
	At          time.Time
	Instance    string
	Adapter     string
	ExternalIDs []string
}

// entry is one line of a receipt's timeline: exactly one of its pointers is
// set.
type entry struct {
	At        time.Time
	Move      *review.Event
	Check     *check
	Late      *lateOutcome
	Duplicate *duplicate
	Audit     *review.Audit
}

// detail is everything the receipt page shows.
type detail struct {
	Timeline *review.Timeline
	Entries  []entry
	Checks   int
	// Contradicted is whether an audit read found the effect whose absence
	// the receipt settled on: its terminal state was a wrong verdict.
	Contradicted bool
}

func (s *Server) detail(ctx context.Context, id int64) (*detail, error) {
	t, err := review.Show(ctx, s.pool, id)
	if err != nil {
		return nil, err
	}
	d := &detail{Timeline: t}
	for i := range t.Events {
		d.Entries = append(d.Entries, entry{At: t.Events[i].At, Move: &t.Events[i]})
	}
	rows, err := s.pool.Query(ctx, sqlChecks, id)
	if err != nil {
		return nil, fmt.Errorf("reviewui: checks of receipt %d: %w", id, err)
	}
	checks, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (check, error) {
		var c check
		var us int64
		err := row.Scan(&c.No, &c.At, &c.Instance, &c.Adapter, &c.Verdict, &c.Authoritative, &c.Matches,
			&us, &c.ErrorClass, &c.Error, &c.Evidence)
		c.Latency = time.Duration(us) * time.Microsecond
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("reviewui: checks of receipt %d: %w", id, err)
	}
	d.Checks = len(checks)
	for i := range checks {
		d.Entries = append(d.Entries, entry{At: checks[i].At, Check: &checks[i]})
	}
	rows, err = s.pool.Query(ctx, sqlLateOutcomes, id)
	if err != nil {
		return nil, fmt.Errorf("reviewui: late outcomes of receipt %d: %w", id, err)
	}
	lates, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (lateOutcome, error) {
		var l lateOutcome
		err := row.Scan(&l.At, &l.Actor, &l.Outcome, &l.HTTPStatus, &l.ExternalID, &l.Detail)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("reviewui: late outcomes of receipt %d: %w", id, err)
	}
	for i := range lates {
		d.Entries = append(d.Entries, entry{At: lates[i].At, Late: &lates[i]})
	}
	rows, err = s.pool.Query(ctx, sqlReceiptDuplicates, id)
	if err != nil {
		return nil, fmt.Errorf("reviewui: duplicate alarms of receipt %d: %w", id, err)
	}
	dups, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (duplicate, error) {
		var d duplicate
		err := row.Scan(&d.At, &d.Instance, &d.Adapter, &d.ExternalIDs)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("reviewui: duplicate alarms of receipt %d: %w", id, err)
	}
	for i := range dups {
		d.Entries = append(d.Entries, entry{At: dups[i].At, Duplicate: &dups[i]})
	}
	for i := range t.Audits {
		d.Entries = append(d.Entries, entry{At: t.Audits[i].At, Audit: &t.Audits[i]})
		d.Contradicted = d.Contradicted || t.Audits[i].Verdict == reconcile.AuditContradicted
	}
	// One story in time order; a move and the check that led to it can
	// share a timestamp, and then the check comes first (it is why).
	sort.SliceStable(d.Entries, func(i, j int) bool {
		if !d.Entries[i].At.Equal(d.Entries[j].At) {
			return d.Entries[i].At.Before(d.Entries[j].At)
		}
		return d.Entries[i].Move == nil && d.Entries[j].Move != nil
	})
	return d, nil
}
