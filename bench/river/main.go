// Command river measures River's throughput of no-op jobs on a Postgres
// server, for comparison with `reconciler bench settle` on the same server
// (issue 12: settling a receipt should cost less than running a job). It
// is a module of its own so the reconciler never depends on River.
//
// It creates a throwaway database on the server of -database-url (the role
// needs CREATEDB), runs River's migrations, inserts -n jobs whose worker
// does nothing (one COPY, before the clock starts), starts one client, and
// times from Start until every job is completed. Output is one name=value
// per line, like bench settle's.
//
// Completion is read from the river_job table (polled every 5 ms), not
// from River's event subscription, which drops events a slow reader misses.
//
//	go run . -database-url postgres://... -n 20000
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "river bench:", err)
		os.Exit(1)
	}
}

// config is what a run measures.
type config struct {
	databaseURL   string
	n             int
	maxWorkers    int
	fetchCooldown time.Duration
	fetchPoll     time.Duration
	timeout       time.Duration
}

func parse(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("river", flag.ContinueOnError)
	fs.StringVar(&c.databaseURL, "database-url", os.Getenv("RECONCILER_DATABASE_URL"),
		"server to measure on (a throwaway database is created there); default $RECONCILER_DATABASE_URL")
	fs.IntVar(&c.n, "n", 20000, "number of jobs (bench settle's -n default)")
	// bench settle claims and settles up to 1000 rows per statement, so
	// River may fetch and run as many jobs at once.
	fs.IntVar(&c.maxWorkers, "max-workers", 1000, "River's MaxWorkers for the queue: jobs fetched and run at once")
	fs.DurationVar(&c.fetchCooldown, "fetch-cooldown", river.FetchCooldownDefault, "River's FetchCooldown")
	fs.DurationVar(&c.fetchPoll, "fetch-poll-interval", river.FetchPollIntervalDefault, "River's FetchPollInterval")
	fs.DurationVar(&c.timeout, "timeout", 10*time.Minute, "give up after this long")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.databaseURL == "" {
		return c, errors.New("-database-url (or RECONCILER_DATABASE_URL) is required")
	}
	if c.n < 1 || c.maxWorkers < 1 {
		return c, errors.New("-n and -max-workers must be at least 1")
	}
	return c, nil
}

// noopArgs is a job that does nothing.
type noopArgs struct{}

// Kind names the job kind.
func (noopArgs) Kind() string { return "noop" }

// noopWorker completes every job at once.
type noopWorker struct {
	river.WorkerDefaults[noopArgs]
}

// Work does nothing.
func (noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

func run(ctx context.Context, args []string, w io.Writer) error {
	c, err := parse(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()

	admin, err := pgx.Connect(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	name := "river_bench_" + randomHex(6)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	defer func() {
		_, _ = admin.Exec(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	}()
	dbURL, err := withDatabase(c.databaseURL, name)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()

	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}

	workers := river.NewWorkers()
	river.AddWorker(workers, noopWorker{})
	client, err := river.NewClient(driver, &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: c.maxWorkers}},
		Workers:           workers,
		FetchCooldown:     c.fetchCooldown,
		FetchPollInterval: c.fetchPoll,
		Logger:            slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return err
	}
	params := make([]river.InsertManyParams, c.n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: noopArgs{}}
	}
	if _, err := client.InsertManyFast(ctx, params); err != nil {
		return fmt.Errorf("insert: %w", err)
	}

	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	// Done when the database holds no job left to work: the completer
	// writes completions in batches, and the event subscription drops
	// events when its reader falls behind, so only the table is trusted.
	// The poll walks River's fetch index (state first), a few ms apart.
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for left := c.n; left > 0; {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return fmt.Errorf("%d of %d jobs not completed: %w", left, c.n, ctx.Err())
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job
			WHERE state IN ('available', 'pending', 'retryable', 'running', 'scheduled')`).Scan(&left); err != nil {
			return fmt.Errorf("count jobs left: %w", err)
		}
	}
	elapsed := time.Since(start)
	if err := client.Stop(ctx); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	var completed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE state = 'completed'`).Scan(&completed); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if completed != c.n {
		return fmt.Errorf("verify: %d of %d jobs completed", completed, c.n)
	}

	fmt.Fprintf(w, "n=%d\n", c.n)
	fmt.Fprintf(w, "max_workers=%d\n", c.maxWorkers)
	fmt.Fprintf(w, "fetch_cooldown_ms=%g\n", float64(c.fetchCooldown)/float64(time.Millisecond))
	fmt.Fprintf(w, "fetch_poll_interval_ms=%g\n", float64(c.fetchPoll)/float64(time.Millisecond))
	fmt.Fprintf(w, "elapsed_s=%.3f\n", elapsed.Seconds())
	fmt.Fprintf(w, "jobs_per_s=%.0f\n", float64(c.n)/elapsed.Seconds())
	return nil
}

// withDatabase returns dbURL pointing at database name instead.
func withDatabase(dbURL, name string) (string, error) {
	u, err := url.Parse(dbURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", errors.New("-database-url must be a postgres:// URL")
	}
	u.Path = "/" + strings.TrimPrefix(name, "/")
	return u.String(), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
