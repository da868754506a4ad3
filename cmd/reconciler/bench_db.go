package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/internal/scratchdb"
	"github.com/receiptledger/reconciler/ledger"
)

// benchServerFlag is --database-url for the benches that can start their
// own server: optional, unlike the other commands'.
func benchServerFlag() *cli.StringFlag {
	return &cli.StringFlag{
		Name: "database-url",
		Usage: "server to create the bench's scratch database on (the role needs CREATEDB; the " +
			"database is dropped at the end); default: a throwaway cluster from the local server binaries",
		EnvVars: []string{"RECONCILER_DATABASE_URL"},
	}
}

// scratchDB is a migrated database of a command's own (a bench, the demo),
// on the server it was pointed at or on a throwaway cluster.
type scratchDB struct {
	*scratchdb.DB
	log  io.Writer
	keep bool
	stop func()
}

// Close drops the database (unless kept) and stops the throwaway cluster.
// It runs even after an interrupt: the command's context is not used.
func (b *scratchDB) Close() {
	if b.keep {
		b.Keep()
	} else if err := b.Drop(); err != nil {
		fmt.Fprintf(b.log, "could not %v\n", err)
	}
	b.stop()
}

// openBenchDB creates and migrates a database named reconciler_bench_<random>
// on the server serverURL names, or on a throwaway cluster without one; see
// openScratchDB.
func openBenchDB(ctx context.Context, log io.Writer, serverURL string, keep bool) (*scratchDB, error) {
	return openScratchDB(ctx, log, serverURL, "reconciler_bench", keep)
}

// openScratchDB creates and migrates a database named <prefix>_<random> on
// the server serverURL names, so the command never mixes with a real
// ledger's receipts and two runs never meet; with serverURL empty it starts
// a throwaway cluster instead (when local server binaries exist). With keep,
// the database is left in place (never on a throwaway cluster). Progress
// goes to log.
func openScratchDB(ctx context.Context, log io.Writer, serverURL, prefix string, keep bool) (*scratchDB, error) {
	serverURL, stop, err := serverOrThrowaway(log, serverURL)
	if err != nil {
		return nil, err
	}
	if stop != nil {
		keep = false
	} else {
		stop = func() {}
	}
	d, err := scratchdb.Create(ctx, serverURL, prefix)
	if err != nil {
		stop()
		return nil, err
	}
	return &scratchDB{DB: d, log: log, keep: keep, stop: stop}, nil
}

// serverOrThrowaway returns serverURL when it is set, and otherwise starts a
// throwaway cluster from the local server binaries and returns its URL and
// the function that stops it (nil for a given server).
func serverOrThrowaway(log io.Writer, serverURL string) (string, func(), error) {
	if serverURL != "" {
		return serverURL, nil, nil
	}
	fmt.Fprintln(log, "starting a throwaway Postgres cluster from the local server binaries ...")
	cluster, err := pgcluster.Start()
	if err != nil {
		return "", nil, fmt.Errorf("no --database-url and no local cluster: %w", err)
	}
	return cluster.URL, func() { _ = cluster.Stop() }, nil
}

// pool opens a pool on the bench's database with room for conns concurrent
// users, so that agents measure the database and not a wait for a
// connection.
func (b *scratchDB) pool(ctx context.Context, conns int) (*pgxpool.Pool, error) {
	return b.Pool(ctx, max(conns, 4))
}

// openBenchAgent opens the bench's scratch database (see openBenchDB), a
// pool on it with room for conns users and the agent "agent:bench" on that
// pool; closeDB closes the pool and drops the database.
func openBenchAgent(ctx context.Context, log io.Writer, serverURL string, conns int) (db *pgxpool.Pool, agent *ledger.Client, closeDB func(), err error) {
	bdb, err := openBenchDB(ctx, log, serverURL, false)
	if err != nil {
		return nil, nil, nil, err
	}
	db, err = bdb.pool(ctx, conns)
	if err != nil {
		bdb.Close()
		return nil, nil, nil, err
	}
	closeDB = func() { db.Close(); bdb.Close() }
	if agent, err = ledger.New(db, "agent:bench"); err != nil {
		closeDB()
		return nil, nil, nil, err
	}
	return db, agent, closeDB, nil
}

// parseList splits a comma-separated flag value and parses each item.
func parseList[T any](flag, raw string, parse func(string) (T, error)) ([]T, error) {
	var out []T
	for item := range strings.SplitSeq(raw, ",") {
		v, err := parse(strings.TrimSpace(item))
		if err != nil {
			return nil, fmt.Errorf("--%s: %q: %w", flag, item, err)
		}
		out = append(out, v)
	}
	return out, nil
}

// positiveInt parses a whole number of at least 1.
func positiveInt(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err == nil && n < 1 {
		err = fmt.Errorf("must be at least 1")
	}
	return n, err
}

// positiveDuration parses a Go duration greater than zero.
func positiveDuration(s string) (time.Duration, error) {
	d, err := time.ParseDuration(s)
	if err == nil && d <= 0 {
		err = fmt.Errorf("must be positive")
	}
	return d, err
}
