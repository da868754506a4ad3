// Package scratchdb gives a command that must never touch a real ledger
// (the demo, the experiment, the benches) a migrated database of its own on
// a server it is pointed at: created under a random name, so its receipts
// never mix with real ones and two runs never meet, and dropped at the end,
// even after an interrupt.
package scratchdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/migrations"
)

// dropTimeout bounds the DROP DATABASE at the end, which runs on a context
// of its own: the caller's may be cancelled already (an interrupt).
const dropTimeout = 30 * time.Second

// DB is a migrated database created on a server for one run.
type DB struct {
	// Name is the database's name: the prefix and 12 random hex digits.
	Name  string
	cfg   *pgxpool.Config
	admin *pgx.Conn
}

// Create creates the database <prefix>_<random> on the server serverURL
// names (the role needs CREATEDB) and applies every migration to it.
func Create(ctx context.Context, serverURL, prefix string) (*DB, error) {
	cfg, err := pgxpool.ParseConfig(serverURL)
	if err != nil {
		return nil, fmt.Errorf("database url: %w", err)
	}
	admin, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	d := &DB{Name: prefix + "_" + hex.EncodeToString(b[:]), cfg: cfg, admin: admin}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+d.Name); err != nil {
		admin.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("create a database of its own (the role needs CREATEDB): %w", err)
	}
	cfg.ConnConfig.Database = d.Name
	pool, err := d.Pool(ctx, 4)
	if err == nil {
		err = migrations.Up(ctx, pool)
		pool.Close()
	}
	if err != nil {
		_ = d.Drop()
		return nil, fmt.Errorf("database %s: %w", d.Name, err)
	}
	return d, nil
}

// Pool opens a pool on the database with room for maxConns connections.
func (d *DB) Pool(ctx context.Context, maxConns int) (*pgxpool.Pool, error) {
	cfg := d.cfg.Copy()
	cfg.MaxConns = int32(maxConns)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// Drop drops the database, whoever is still connected, and closes the
// administrative connection.
func (d *DB) Drop() error {
	ctx, cancel := context.WithTimeout(context.Background(), dropTimeout)
	defer cancel()
	defer d.admin.Close(ctx)
	if _, err := d.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+d.Name+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", d.Name, err)
	}
	return nil
}

// Keep closes the administrative connection and leaves the database in
// place (a bench's --keep).
func (d *DB) Keep() {
	ctx, cancel := context.WithTimeout(context.Background(), dropTimeout)
	defer cancel()
	d.admin.Close(ctx)
}
