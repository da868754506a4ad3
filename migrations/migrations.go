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
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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

// VersionTable is goose's version table: one row per applied migration.
const VersionTable = "reconciler.goose_db_version"

// upHint is the command that brings a database's schema up to date.
const upHint = "run `reconciler migrate up --database-url URL` as the schema's owner"

// Sentinels of a schema that does not match the binary; a *SchemaError
// matches exactly one of them with errors.Is.
var (
	// ErrSchemaMissing: the database has no reconciler schema (or no
	// version table in it): nothing was ever migrated.
	ErrSchemaMissing = errors.New("schema missing")
	// ErrSchemaBehind: some embedded migrations are not applied.
	ErrSchemaBehind = errors.New("schema behind")
	// ErrSchemaAhead: the database has migrations this binary does not
	// know (a newer reconciler migrated it).
	ErrSchemaAhead = errors.New("schema ahead")
	// ErrSchemaUnreadable: this login may not read the version table.
	ErrSchemaUnreadable = errors.New("schema version unreadable")
)

// SchemaError says how the database's schema differs from the binary's,
// in one line that names the fix.
type SchemaError struct {
	Kind    error    // ErrSchemaMissing, ErrSchemaBehind, ErrSchemaAhead or ErrSchemaUnreadable
	Pending []string // embedded migrations not applied (file names), oldest first
	Unknown []int64  // applied versions the binary does not know
	User    string   // the login, for ErrSchemaUnreadable
	Err     error    // the database's refusal, for ErrSchemaUnreadable
}

func (e *SchemaError) Error() string {
	switch e.Kind {
	case ErrSchemaMissing:
		return "the database has no reconciler schema (no migration applied): " + upHint
	case ErrSchemaBehind:
		more := ""
		if n := len(e.Pending) - 1; n > 0 {
			more = fmt.Sprintf(" (and %d later one(s))", n)
		}
		return fmt.Sprintf("the database schema is behind: migration %s is not applied%s: %s", e.Pending[0], more, upHint)
	case ErrSchemaAhead:
		return fmt.Sprintf("the database schema is ahead of this binary: it has migration %05d, which this reconciler does not know: "+
			"upgrade reconciler (`reconciler version` says which schema version it needs)", e.Unknown[0])
	case ErrSchemaUnreadable:
		return fmt.Sprintf("cannot read the schema version (%s) as %q: permission denied: "+
			"apply docs/roles.sql, which grants SELECT on it to every reconciler role, and log in as a member of one", VersionTable, e.User)
	}
	return "schema check failed"
}

// Is matches the error's kind.
func (e *SchemaError) Is(target error) bool { return target == e.Kind }

// Unwrap returns the database's refusal, if any.
func (e *SchemaError) Unwrap() error { return e.Err }

// Migration is one embedded migration and whether the database has it.
type Migration struct {
	Version   int64
	File      string
	Applied   bool
	AppliedAt time.Time
}

// embedded returns the embedded migrations, oldest first.
func embedded() ([]Migration, error) {
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		return nil, err
	}
	ms := make([]Migration, 0, len(names))
	for _, name := range names {
		prefix, _, _ := strings.Cut(name, "_")
		v, err := strconv.ParseInt(prefix, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("migrations: %s: no version number", name)
		}
		ms = append(ms, Migration{Version: v, File: name})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	return ms, nil
}

// Latest is the version of the newest embedded migration: the schema
// version this binary needs.
func Latest() int64 {
	ms, err := embedded()
	if err != nil || len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].Version
}

// Status reads which embedded migrations the database has, with plain
// SELECTs: it creates nothing, so it runs as any role docs/roles.sql
// defines. exists is false when the database has no version table (no
// migration was ever applied); unknown lists applied versions the binary
// does not know.
func Status(ctx context.Context, pool *pgxpool.Pool) (ms []Migration, exists bool, unknown []int64, err error) {
	ms, err = embedded()
	if err != nil {
		return nil, false, nil, err
	}
	var table *string
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1)::text`, VersionTable).Scan(&table); err != nil {
		return nil, false, nil, readError(ctx, pool, err)
	}
	if table == nil {
		return ms, false, nil, nil
	}
	// goose deletes a version's row when it rolls it back; is_applied is
	// false only in rows of goose's older, append-only bookkeeping, where
	// the latest row of a version wins.
	rows, err := pool.Query(ctx, `SELECT version_id, is_applied, tstamp FROM `+VersionTable+` ORDER BY id`)
	if err != nil {
		return nil, false, nil, readError(ctx, pool, err)
	}
	type state struct {
		applied bool
		at      time.Time
	}
	applied := map[int64]state{}
	for rows.Next() {
		var v int64
		var s state
		if err := rows.Scan(&v, &s.applied, &s.at); err != nil {
			rows.Close()
			return nil, false, nil, fmt.Errorf("migrations: read %s: %w", VersionTable, err)
		}
		applied[v] = s
	}
	if err := rows.Err(); err != nil {
		return nil, false, nil, readError(ctx, pool, err)
	}
	known := map[int64]bool{0: true} // goose's row 0 marks the table's creation
	for i := range ms {
		known[ms[i].Version] = true
		if s := applied[ms[i].Version]; s.applied {
			ms[i].Applied, ms[i].AppliedAt = true, s.at
		}
	}
	for v, s := range applied {
		if s.applied && !known[v] {
			unknown = append(unknown, v)
		}
	}
	sort.Slice(unknown, func(i, j int) bool { return unknown[i] < unknown[j] })
	return ms, true, unknown, nil
}

// readError turns a refusal to read the version table into a
// *SchemaError naming the login.
func readError(ctx context.Context, pool *pgxpool.Pool, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42501" { // insufficient_privilege
		return &SchemaError{Kind: ErrSchemaUnreadable, User: pool.Config().ConnConfig.User, Err: err}
	}
	return fmt.Errorf("migrations: read %s: %w", VersionTable, err)
}

// Check reports whether the database's schema is the one this binary
// needs: nil when every embedded migration is applied and no other, else a
// *SchemaError (ErrSchemaMissing, ErrSchemaBehind, ErrSchemaAhead or
// ErrSchemaUnreadable) whose message names the fix. It only reads (the
// grants of docs/roles.sql suffice), so every runtime command calls it
// before it touches the ledger; only `reconciler migrate` creates or
// changes the schema.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	ms, exists, unknown, err := Status(ctx, pool)
	if err != nil {
		return err
	}
	if !exists {
		return &SchemaError{Kind: ErrSchemaMissing, Pending: fileNames(ms)}
	}
	var pending []string
	for _, m := range ms {
		if !m.Applied {
			pending = append(pending, m.File)
		}
	}
	if len(pending) == len(ms) {
		return &SchemaError{Kind: ErrSchemaMissing, Pending: pending}
	}
	if len(pending) > 0 {
		return &SchemaError{Kind: ErrSchemaBehind, Pending: pending, Unknown: unknown}
	}
	if len(unknown) > 0 {
		return &SchemaError{Kind: ErrSchemaAhead, Unknown: unknown}
	}
	return nil
}

func fileNames(ms []Migration) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.File
	}
	return out
}

// SQL returns the text of embedded migration version: its file name and
// the whole goose file (the Up part, then the Down part).
func SQL(version int64) (file, text string, err error) {
	ms, err := embedded()
	if err != nil {
		return "", "", err
	}
	for _, m := range ms {
		if m.Version == version {
			b, err := fs.ReadFile(files, m.File)
			return m.File, string(b), err
		}
	}
	return "", "", fmt.Errorf("migrations: no migration %d in this binary (it has %d to %d)", version, ms[0].Version, ms[len(ms)-1].Version)
}

// UpSQL is the part of a goose migration file that `migrate up` runs:
// everything before its "-- +goose Down" annotation.
func UpSQL(text string) string {
	if i := strings.Index(text, "\n-- +goose Down"); i >= 0 {
		return text[:i+1]
	}
	return text
}
