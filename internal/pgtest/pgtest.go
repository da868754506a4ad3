// Package pgtest gives each test its own freshly migrated Postgres database.
//
// Where the server comes from, in order (SPEC §9):
//  1. RECONCILER_TEST_DATABASE_URL, a server the caller runs (the role needs
//     CREATEDB);
//  2. a testcontainers-go Postgres container, where a Docker engine answers;
//  3. a throwaway cluster from the local PostgreSQL server binaries
//     (/usr/lib/postgresql/<ver>/bin), run as the postgres user when the
//     tests run as root, since Postgres refuses to run as root;
//  4. otherwise the test fails with a message that says how to provide one.
//
// Tests never skip for want of a database. Every database is cloned from a
// template migrated once per process, which takes milliseconds.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/migrations"
)

// EnvURL names the variable that points tests at an existing server.
const EnvURL = "RECONCILER_TEST_DATABASE_URL"

// templatePrefix starts the name of each test process's template
// database: one per process, so test binaries sharing one server (go test
// ./... runs packages in parallel) never drop each other's template.
const templatePrefix = "reconciler_test_template_"

// server is the process-wide test server: started once, stopped by Main.
type server struct {
	once     sync.Once
	adminURL string
	template string
	stop     func()
	err      error
}

// The test binary shares one server across its tests; this is the only
// package-level state and it lives in test code only.
var shared server

// Main runs the package's tests and then stops any server this process
// started. Call it from TestMain: func TestMain(m *testing.M) { pgtest.Main(m) }.
func Main(m *testing.M) {
	os.Exit(Run(m))
}

// Run is Main without the exit, for a TestMain that hands the tests to a
// runner which exits itself (testscript.Main): it runs m, stops any server
// this process started and returns m's exit code.
func Run(m interface{ Run() int }) int {
	code := m.Run()
	if shared.template != "" && shared.stop == nil {
		// A server the caller runs outlives this process: leave it
		// without this process's template.
		dropTemplate(shared.adminURL, shared.template)
	}
	if shared.stop != nil {
		shared.stop()
	}
	return code
}

// AdminURL returns the URL of the maintenance database of the test server,
// starting the server and migrating the template on first use.
func AdminURL(tb testing.TB) string {
	tb.Helper()
	shared.once.Do(func() {
		shared.adminURL, shared.stop, shared.err = start()
		if shared.err == nil {
			shared.template = templatePrefix + randomHex(6)
			shared.err = migrateTemplate(shared.adminURL, shared.template)
		}
	})
	if shared.err != nil {
		tb.Fatalf("pgtest: no test database: %v", shared.err)
	}
	return shared.adminURL
}

// NewDatabase creates an empty-but-migrated database for this test, drops it
// when the test ends, and returns its URL.
func NewDatabase(tb testing.TB) string {
	tb.Helper()
	AdminURL(tb)
	return newDatabase(tb, shared.template)
}

// NewEmptyDatabase creates a database with no schema at all, for tests of
// migrating itself.
func NewEmptyDatabase(tb testing.TB) string {
	tb.Helper()
	return newDatabase(tb, "template0")
}

func newDatabase(tb testing.TB, template string) string {
	tb.Helper()
	admin := AdminURL(tb)
	ctx := context.Background()
	name := "t_" + randomHex(8)
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE DATABASE %s TEMPLATE %s`, name, template)); err != nil {
		tb.Fatalf("pgtest: create database: %v", err)
	}
	tb.Cleanup(func() {
		c, err := pgx.Connect(ctx, admin)
		if err != nil {
			tb.Logf("pgtest: drop %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, fmt.Sprintf(`DROP DATABASE IF EXISTS %s WITH (FORCE)`, name)); err != nil {
			tb.Logf("pgtest: drop %s: %v", name, err)
		}
	})
	return withDatabase(admin, name)
}

// NewPool returns a pool on a fresh migrated database, closed when the test ends.
func NewPool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	return Pool(tb, NewDatabase(tb))
}

// Pool opens a pool on url, closed when the test ends.
func Pool(tb testing.TB, url string) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

func migrateTemplate(admin, templateName string) error {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return fmt.Errorf("connect %s: %w", redact(admin), err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `DROP DATABASE IF EXISTS `+templateName+` WITH (FORCE)`); err != nil {
		return fmt.Errorf("drop template: %w", err)
	}
	if _, err := conn.Exec(ctx, `CREATE DATABASE `+templateName); err != nil {
		return fmt.Errorf("create template: %w", err)
	}
	pool, err := pgxpool.New(ctx, withDatabase(admin, templateName))
	if err != nil {
		return err
	}
	err = migrations.Up(ctx, pool)
	pool.Close()
	if err != nil {
		return fmt.Errorf("migrate template: %w", err)
	}
	return nil
}

func start() (adminURL string, stop func(), err error) {
	if u := os.Getenv(EnvURL); u != "" {
		return u, nil, nil
	}
	var reasons []string
	if u, stop, err := startContainer(); err == nil {
		return u, stop, nil
	} else {
		reasons = append(reasons, "testcontainers: "+firstLine(err.Error()))
	}
	if c, err := pgcluster.Start(); err == nil {
		return c.URL, func() { _ = c.Stop() }, nil
	} else {
		reasons = append(reasons, "local server binaries: "+err.Error())
	}
	return "", nil, fmt.Errorf("%s\nProvide one of: %s=postgres://user:pass@host:5432/postgres (a role with CREATEDB); "+
		"a running Docker engine; or the PostgreSQL server packages (apt-get install -y postgresql)",
		strings.Join(reasons, "; "), EnvURL)
}

func startContainer() (string, func(), error) {
	if _, err := os.Stat("/var/run/docker.sock"); err != nil && os.Getenv("DOCKER_HOST") == "" {
		return "", nil, errors.New("no Docker engine (no /var/run/docker.sock, DOCKER_HOST unset)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := tcpostgres.Run(ctx, "postgres:16-alpine",
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return "", nil, err
	}
	u, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = c.Terminate(context.Background())
		return "", nil, err
	}
	return u, func() { _ = c.Terminate(context.Background()) }, nil
}

func withDatabase(raw, name string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	u.Path = "/" + name
	return u.String()
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// Backdate makes receipt id look as if its latest move happened age ago, for
// tests of filters and reports by age. The schema refuses to rewrite
// updated_at (the times of past moves are immutable), so the test's own
// database lets its owner switch the receipts triggers off for this one
// transaction; nothing else sees the change half-made.
func Backdate(tb testing.TB, pool *pgxpool.Pool, id int64, age time.Duration) {
	tb.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, q := range []string{
			`ALTER TABLE reconciler.receipts DISABLE TRIGGER USER`,
			`UPDATE reconciler.receipts SET updated_at = clock_timestamp() - make_interval(secs => ` +
				fmt.Sprintf("%f", age.Seconds()) + `) WHERE id = ` + fmt.Sprint(id),
			`ALTER TABLE reconciler.receipts ENABLE TRIGGER USER`,
		} {
			if _, err := tx.Exec(ctx, q); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("pgtest: backdate receipt %d: %v", id, err)
	}
}

// dropTemplate drops the template database name, best effort.
func dropTemplate(admin, name string) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
}
