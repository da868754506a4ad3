// Package dbclock is a clock anchored to the database's (SPEC §5a, "one
// clock"). Every time the reconciler compares with a stored time (due,
// lease, orphan cut-off, window, deadline, breaker open-until) was stamped
// by the database's clock_timestamp(), so "now" must be the database's too,
// never the host's wall clock, which may be minutes off.
//
// A Clock reads SELECT clock_timestamp() and notes the local monotonic
// times just before the query was sent and just after its answer arrived.
// The database read its clock somewhere in between, so at the arrival the
// database's time was at least the value read: Now() returns that value
// plus the monotonic time elapsed since the arrival, a lower bound of the
// database's current time (exact up to the round trip, which Uncertainty
// reports). A lower bound is the safe side for every comparison the
// reconciler makes: a window or a lease judged "not yet over" a little too
// long costs a later check, never a false proof.
//
// The host's wall clock only serves to measure and report the skew.
package dbclock

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// QueryRower is what a Clock needs of the database: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it.
type QueryRower interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Sample is the result of one synchronisation.
type Sample struct {
	// DB is the database's clock_timestamp() as read.
	DB time.Time
	// RoundTrip is the time between sending the query and its answer: the
	// uncertainty of the anchor.
	RoundTrip time.Duration
	// Skew is the host's wall clock minus the database's time at the
	// answer (estimated at the middle of the round trip): positive when the
	// host runs ahead.
	Skew time.Duration
}

// Clock is a database-anchored clock. Safe for concurrent use. Create it
// with New and call Sync before using Now (and periodically after).
type Clock struct {
	query func(ctx context.Context) (time.Time, error)
	wall  func() time.Time

	mu     sync.RWMutex
	synced bool
	anchor time.Time // database time read
	at     time.Time // local time of the answer, with its monotonic reading
	last   Sample
}

// Option configures a Clock.
type Option func(*Clock)

// WithWallClock sets the host's wall clock (default time.Now), used only to
// measure the skew. Tests inject a skewed one to show it changes nothing
// but the reported skew.
func WithWallClock(wall func() time.Time) Option {
	return func(c *Clock) {
		if wall != nil {
			c.wall = wall
		}
	}
}

// New returns a clock anchored to the database db connects to. It reads nothing
// until Sync.
func New(db QueryRower, opts ...Option) *Clock {
	return NewFunc(func(ctx context.Context) (time.Time, error) {
		var t time.Time
		err := db.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&t)
		return t, err
	}, opts...)
}

// NewFunc returns a clock anchored to the time query returns (the
// database's clock_timestamp()).
func NewFunc(query func(ctx context.Context) (time.Time, error), opts ...Option) *Clock {
	c := &Clock{query: query, wall: time.Now}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Sync reads the database's clock and re-anchors. On failure the previous
// anchor stays in use (the monotonic clock does not drift enough between
// syncs to matter) and the error is returned.
func (c *Clock) Sync(ctx context.Context) (Sample, error) {
	sent := time.Now()
	db, err := c.query(ctx)
	recv := time.Now()
	wall := c.wall()
	if err != nil {
		return Sample{}, fmt.Errorf("dbclock: read the database's clock: %w", err)
	}
	rtt := recv.Sub(sent) // monotonic
	s := Sample{DB: db, RoundTrip: rtt, Skew: wall.Sub(db.Add(rtt / 2))}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.synced, c.anchor, c.at, c.last = true, db, recv, s
	return s, nil
}

// Synced reports whether the clock has read the database's time at least
// once.
func (c *Clock) Synced() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.synced
}

// Now returns a lower bound of the database's current time: the last
// value read plus the monotonic time elapsed since its answer arrived.
// Before the first Sync it returns the host's wall clock (callers that
// compare with stored times must Sync first; the reconciler's pool does).
func (c *Clock) Now() time.Time {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if !c.synced {
		return c.wall()
	}
	// time.Since uses the monotonic reading of c.at: immune to wall-clock
	// steps and skew. The result carries no monotonic reading of its own.
	return c.anchor.Add(time.Since(c.at)).Round(0)
}

// Last returns the latest successful sample (zero before the first Sync).
func (c *Clock) Last() Sample {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.last
}

// Skew returns the host's wall clock minus the database's clock, as last
// measured, and whether it has been measured.
func (c *Clock) Skew() (time.Duration, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.last.Skew, c.synced
}
