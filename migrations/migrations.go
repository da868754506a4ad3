// Package migrations holds the database schema as goose SQL migrations,
// embedded so the binary can migrate the database it runs against.
//
// The schema enforces the receipt state machine itself (a trigger), keeps
// history append-only, and exposes the write API as SQL functions, so an agent
// in any language with a plain Postgres driver gets the same guarantees as the
// Go client.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed *.sql
var files embed.FS

// FS returns the embedded migration files.
func FS() fs.FS { return files }

// NewProvider returns a goose provider over db for the embedded migrations,
// creating the reconciler schema that holds goose's version table if needed.
// Migrations run under goose's Postgres session lock, so two processes
// migrating at once take turns instead of racing.
func NewProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS reconciler`); err != nil {
		return nil, fmt.Errorf("migrations: create schema: %w", err)
	}
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return nil, fmt.Errorf("migrations: session locker: %w", err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithSessionLocker(locker),
		goose.WithTableName("reconciler.goose_db_version"),
	)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// OpenDB returns a database/sql handle sharing pool's configuration, for goose.
func OpenDB(pool *pgxpool.Pool) *sql.DB {
	return stdlib.OpenDBFromPool(pool)
}

// Up applies every pending migration.
func Up(ctx context.Context, pool *pgxpool.Pool) error {
	db := OpenDB(pool)
	defer db.Close()
	p, err := NewProvider(ctx, db)
	if err != nil {
		return err
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// Current reports whether every embedded migration has been applied.
func Current(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	db := OpenDB(pool)
	defer db.Close()
	p, err := NewProvider(ctx, db)
	if err != nil {
		return false, err
	}
	pending, err := p.HasPending(ctx)
	if err != nil {
		return false, fmt.Errorf("migrations: status: %w", err)
	}
	return !pending, nil
}
