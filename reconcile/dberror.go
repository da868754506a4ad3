package reconcile

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/sanitize"
)

// dbFailure is what a failed statement says about trying it again.
type dbFailure int

const (
	// dbTransient: the database did not answer, or answered "not now"
	// (a dropped connection, a failover, a restart or shutdown, a
	// serialization failure or deadlock, too many connections, a lock or
	// statement timeout). The same statement may succeed later: it is kept
	// and retried, nothing is lost.
	dbTransient dbFailure = iota
	// dbRowRefused: the database refused some row's data (SQLSTATE class
	// 22 data exception, 23 integrity violation, 54 program limit, the
	// schema's own RLxxx refusals, a trigger's plain RAISE, P0xxx). The same
	// rows fail again whatever the wait: the batch is split so the other
	// rows are written, and the refused row is given up.
	dbRowRefused
	// dbStatementRefused: the database refuses the statement as this role
	// or schema stands (class 42: a missing privilege, an undefined table
	// or column; 0A, 28, 3D, 3F, and any SQLSTATE not known to be
	// transient). Only an operator changes that: nothing is retried, and a
	// worker whose writes are all refused so backs off (Pool.WritesRefused).
	dbStatementRefused
)

// classifyDB says how to treat err from a statement. An error without a
// SQLSTATE (a network error, a timeout, a closed pool, the end of a
// context) is transient: the database never judged the statement.
func classifyDB(err error) dbFailure {
	code := sqlState(err)
	if code == "" || len(code) != 5 {
		return dbTransient
	}
	// A permanent error taken for a transient one would hold its rows
	// forever; the other way round only costs one backoff.
	switch code {
	case "25006", // read_only_sql_transaction: connected to a standby mid-failover
		"55P03", // lock_not_available (lock_timeout)
		"55006": // object_in_use
		return dbTransient
	}
	switch code[:2] {
	case "08", // connection exception
		"40", // transaction rollback: serialization failure, deadlock, completion unknown
		"53", // insufficient resources: too many connections, out of memory, disk full
		"57", // operator intervention: admin/crash shutdown, cannot connect now, query canceled
		"58", // system error (I/O)
		"72": // snapshot too old
		return dbTransient
	case "22", "23", "54", "RL", "P0":
		return dbRowRefused
	}
	return dbStatementRefused
}

// permanentDB reports whether err is a refusal that retrying the same
// statement cannot change.
func permanentDB(err error) bool { return classifyDB(err) != dbTransient }

// sqlState returns err's SQLSTATE, or "" if the database did not answer
// with one.
func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// sqlStateClass is the class of err's SQLSTATE (its first two characters,
// a bounded label set), "none" for an error without one.
func sqlStateClass(err error) string {
	if c := sqlState(err); len(c) >= 2 {
		return c[:2]
	}
	return "none"
}

// refusalHint tells an operator what a permanent refusal means and what
// to do about it.
func refusalHint(err error) string {
	code := sqlState(err)
	switch {
	case code == "42501":
		return "the reconciler's database role lacks a privilege: apply docs/roles.sql as the schema's owner " +
			"(and `reconciler migrate up`), or grant the worker role what it needs"
	case code == "42P01" || code == "42703" || code == "42883" || code == "3F000":
		return "the schema is not the one this reconciler expects: run `reconciler migrate up`"
	case strings.HasPrefix(code, "42"), strings.HasPrefix(code, "0A"):
		return "the database refuses the statement itself: check the schema version and the role's grants"
	case strings.HasPrefix(code, "RL"):
		return "the ledger's triggers refused this receipt's move (see the SQLSTATE's message)"
	case strings.HasPrefix(code, "P0"):
		return "a trigger raised an exception for this receipt: look for a trigger on reconciler tables that is not the schema's own"
	case strings.HasPrefix(code, "22"), strings.HasPrefix(code, "23"), strings.HasPrefix(code, "54"):
		return "the database refused this receipt's data: the API's answer could not be stored, even reduced to the reconciler's own fields"
	}
	return "the database refuses this write; retrying it cannot change that"
}

// refusal describes a database refusal in a bounded line of its own text.
func refusal(err error) string {
	var pe *pgconn.PgError
	msg := err.Error()
	if errors.As(err, &pe) {
		msg = "SQLSTATE " + pe.Code + ": " + pe.Message
	}
	out, _ := sanitize.Text(msg, 512)
	return out
}

// ErrWritesRefused means the database refuses the reconciler's writes for a
// reason of the statement itself (a missing privilege, a schema that is
// not current), not of one row: every write of that statement would fail
// alike until an operator acts.
var ErrWritesRefused = errors.New("the database refuses the reconciler's writes")

// refusals are the statements the database currently refuses as such, with
// the refusal and a streak that sizes the claims' backoff. Safe for
// concurrent use.
type refusals struct {
	mu sync.Mutex
	by map[string]*refused
	// gauge, if set, is 1 while any statement is refused.
	gauge prometheus.Gauge
}

// publish updates the gauge; r.mu is held.
func (r *refusals) publish() {
	if r.gauge == nil {
		return
	}
	v := 0.0
	if len(r.by) > 0 {
		v = 1
	}
	r.gauge.Set(v)
}

// refused is one statement's run of refusals.
type refused struct {
	err    error
	since  time.Time
	streak int
}

// note records a refusal of statement (err), lengthening its streak.
func (r *refusals) note(statement string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.by == nil {
		r.by = map[string]*refused{}
	}
	f := r.by[statement]
	if f == nil {
		f = &refused{since: time.Now()}
		r.by[statement] = f
	}
	f.err = err
	f.streak++
	r.publish()
}

// clear forgets statement's refusals: one of its writes went through.
func (r *refusals) clear(statement string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.by, statement)
	r.publish()
}

// streak returns how many times in a row statement was refused (0: it is
// not).
func (r *refusals) streak(statement string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f := r.by[statement]; f != nil {
		return f.streak
	}
	return 0
}

// err returns nil if no statement is refused, else an ErrWritesRefused
// naming the first in name order, its SQLSTATE and what to do.
func (r *refusals) err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.by) == 0 {
		return nil
	}
	names := make([]string, 0, len(r.by))
	for name := range r.by {
		names = append(names, name)
	}
	slices.Sort(names)
	f := r.by[names[0]]
	return fmt.Errorf("%w: %s, %d times in a row since %s: %w (%s)", ErrWritesRefused, names[0], f.streak,
		f.since.UTC().Format(time.RFC3339), f.err, refusalHint(f.err))
}

// WritesRefused returns nil while the database accepts this pool's
// statements. Once it refuses one as such (a whole batch of outcomes, or a
// claim, refused with a SQLSTATE of the statement: a missing privilege, a
// schema that is not current), it returns an error matching
// ErrWritesRefused that names the statement, the SQLSTATE and what to do,
// until a write of that statement goes through again. Meanwhile the pool
// claims one row at a time, after a backoff that doubles from PollInterval
// up to MaxRefusedPause, and a Drain ends with this error. /readyz reports
// it.
func (p *Pool) WritesRefused() error { return p.refusals.err() }

// MaxRefusedPause bounds the pause between claims while the database
// refuses the pool's outcomes (WritesRefused): each pause ends with a claim
// of one row, a probe.
const MaxRefusedPause = time.Minute

// refusedPause is the pause before the next claim while complete is
// refused (false: it is not).
func (p *Pool) refusedPause() (time.Duration, bool) {
	n := p.refusals.streak("complete")
	if n == 0 {
		return 0, false
	}
	d := p.cfg.PollInterval
	for i := 1; i < n && d < MaxRefusedPause; i++ {
		d *= 2
	}
	return min(d, MaxRefusedPause), true
}
