package protect

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// SharedOpen is a dependency's shared breaker row: the dependency is open,
// for every instance, until Until. A zero Until means no instance has
// opened it.
type SharedOpen struct {
	Until  time.Time
	By     string // instance that set Until
	Reason string
}

// Store shares "open until" between the instances of the reconciler.
// Implementations must be safe for concurrent use.
type Store interface {
	// Load returns dep's shared row, or a zero SharedOpen if it has none.
	Load(ctx context.Context, dep string) (SharedOpen, error)
	// Open records that dep is open until until, keeping the later of the
	// stored and the new time (with the by and reason of whichever is
	// kept), and returns the row as stored.
	Open(ctx context.Context, dep string, until time.Time, by, reason string) (SharedOpen, error)
}

// PGStore is the Postgres Store, over reconciler.dependency_breakers
// (migration 00003).
//
// Used directly, it stores and returns the times it is given. A Guard binds
// it to the Guard's clock (see New): then open_until is kept on the
// database's clock (SPEC §5a, "one clock"): Open stores clock_timestamp() +
// (until − now), Load returns now + (open_until − clock_timestamp()), with
// now read from the Guard's clock. No instance's clock is then ever
// compared with a time another instance's clock produced, so an instance
// whose clock is minutes off neither holds every instance's breaker open
// nor ignores their openings.
type PGStore struct {
	pool  *pgxpool.Pool
	clock Clock // nil: times as given
}

// NewPGStore returns a Store over pool.
func NewPGStore(pool *pgxpool.Pool) *PGStore { return &PGStore{pool: pool} }

// withClock returns a copy of s that converts through clock (see PGStore).
func (s *PGStore) withClock(clock Clock) Store {
	c := *s
	c.clock = clock
	return &c
}

const (
	sqlLoad = `SELECT open_until, opened_by, reason
FROM reconciler.dependency_breakers WHERE dependency = $1`

	// GREATEST keeps the later time under concurrent openings: ON CONFLICT
	// DO UPDATE locks the row, so two instances' upserts serialize and
	// neither can shorten the other's.
	sqlOpen = `INSERT INTO reconciler.dependency_breakers AS b
    (dependency, open_until, opened_by, reason, updated_at)
VALUES ($1, $2, $3, $4, clock_timestamp())
ON CONFLICT (dependency) DO UPDATE SET
    opened_by  = CASE WHEN excluded.open_until > b.open_until THEN excluded.opened_by ELSE b.opened_by END,
    reason     = CASE WHEN excluded.open_until > b.open_until THEN excluded.reason ELSE b.reason END,
    open_until = GREATEST(b.open_until, excluded.open_until),
    updated_at = clock_timestamp()
RETURNING open_until, opened_by, reason`

	// The same on the database's clock: $2 and the first column returned
	// are the time left, in microseconds, from clock_timestamp().
	sqlLoadLeft = `SELECT (extract(epoch FROM open_until - clock_timestamp()) * 1e6)::bigint, opened_by, reason
FROM reconciler.dependency_breakers WHERE dependency = $1`

	sqlOpenLeft = `INSERT INTO reconciler.dependency_breakers AS b
    (dependency, open_until, opened_by, reason, updated_at)
VALUES ($1, clock_timestamp() + $2::bigint * interval '1 microsecond', $3, $4, clock_timestamp())
ON CONFLICT (dependency) DO UPDATE SET
    opened_by  = CASE WHEN excluded.open_until > b.open_until THEN excluded.opened_by ELSE b.opened_by END,
    reason     = CASE WHEN excluded.open_until > b.open_until THEN excluded.reason ELSE b.reason END,
    open_until = GREATEST(b.open_until, excluded.open_until),
    updated_at = clock_timestamp()
RETURNING (extract(epoch FROM open_until - clock_timestamp()) * 1e6)::bigint, opened_by, reason`
)

func left(now time.Time, us int64) time.Time { return now.Add(time.Duration(us) * time.Microsecond) }

// Load implements Store.
func (s *PGStore) Load(ctx context.Context, dep string) (SharedOpen, error) {
	var o SharedOpen
	var err error
	if s.clock != nil {
		now := s.clock.Now()
		var us int64
		err = s.pool.QueryRow(ctx, sqlLoadLeft, dep).Scan(&us, &o.By, &o.Reason)
		o.Until = left(now, us)
	} else {
		err = s.pool.QueryRow(ctx, sqlLoad, dep).Scan(&o.Until, &o.By, &o.Reason)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return SharedOpen{}, nil
	}
	if err != nil {
		return SharedOpen{}, fmt.Errorf("protect: load breaker of %s: %w", dep, err)
	}
	return o, nil
}

// Open implements Store.
func (s *PGStore) Open(ctx context.Context, dep string, until time.Time, by, reason string) (SharedOpen, error) {
	var o SharedOpen
	var err error
	if s.clock != nil {
		now := s.clock.Now()
		var us int64
		err = s.pool.QueryRow(ctx, sqlOpenLeft, dep, until.Sub(now).Microseconds(), by, reason).Scan(&us, &o.By, &o.Reason)
		o.Until = left(now, us)
	} else {
		err = s.pool.QueryRow(ctx, sqlOpen, dep, until, by, reason).Scan(&o.Until, &o.By, &o.Reason)
	}
	if err != nil {
		return SharedOpen{}, fmt.Errorf("protect: open breaker of %s: %w", dep, err)
	}
	return o, nil
}

// MemStore is an in-memory Store: for tests, and for a single process that
// shares nothing. Guards sharing one must share one clock (it keeps times
// as given). Guards that share one MemStore behave like instances that
// share one database.
type MemStore struct {
	mu   sync.Mutex
	rows map[string]SharedOpen
}

// NewMemStore returns an empty MemStore.
func NewMemStore() *MemStore { return &MemStore{rows: map[string]SharedOpen{}} }

// Load implements Store.
func (s *MemStore) Load(_ context.Context, dep string) (SharedOpen, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rows[dep], nil
}

// Open implements Store.
func (s *MemStore) Open(_ context.Context, dep string, until time.Time, by, reason string) (SharedOpen, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cur, ok := s.rows[dep]; !ok || until.After(cur.Until) {
		s.rows[dep] = SharedOpen{Until: until, By: by, Reason: reason}
	}
	return s.rows[dep], nil
}
