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
type PGStore struct {
	pool *pgxpool.Pool
}

// NewPGStore returns a Store over pool.
func NewPGStore(pool *pgxpool.Pool) *PGStore { return &PGStore{pool: pool} }

const (
	sqlLoad = `SELECT open_until, opened_by, reason
FROM reconciler.dependency_breakers WHERE dependency = $1`

	// GREATEST keeps the later time under concurrent openings: ON CONFLICT
	// DO UPDATE locks the row, so two instances' upserts serialize and
	// neither can shorten the other's.
	sqlOpen = `INSERT INTO reconciler.dependency_breakers AS b
    (dependency, open_until, opened_by, reason, updated_at)
VALUES ($1, $2, $3, $4, now())
ON CONFLICT (dependency) DO UPDATE SET
    opened_by  = CASE WHEN excluded.open_until > b.open_until THEN excluded.opened_by ELSE b.opened_by END,
    reason     = CASE WHEN excluded.open_until > b.open_until THEN excluded.reason ELSE b.reason END,
    open_until = GREATEST(b.open_until, excluded.open_until),
    updated_at = now()
RETURNING open_until, opened_by, reason`
)

// Load implements Store.
func (s *PGStore) Load(ctx context.Context, dep string) (SharedOpen, error) {
	var o SharedOpen
	err := s.pool.QueryRow(ctx, sqlLoad, dep).Scan(&o.Until, &o.By, &o.Reason)
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
	err := s.pool.QueryRow(ctx, sqlOpen, dep, until, by, reason).Scan(&o.Until, &o.By, &o.Reason)
	if err != nil {
		return SharedOpen{}, fmt.Errorf("protect: open breaker of %s: %w", dep, err)
	}
	return o, nil
}

// MemStore is an in-memory Store: for tests, and for a single process that
// shares nothing. Guards that share one MemStore behave like instances that
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
