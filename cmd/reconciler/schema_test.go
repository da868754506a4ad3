package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/reconcile"
)

// staticAdapters writes an adapters file whose one adapter reads back the
// receipts of dependency "blog" as present, without calling anything.
func staticAdapters(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "adapters.yaml")
	src := "version: 1\nadapters:\n  - {name: blog, type: static, kind: create, dependency: blog, static: {verdict: present}}\n"
	if err := os.WriteFile(path, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// runtimeCommands are the commands that need a current schema, on url.
func runtimeCommands(t *testing.T, url string) map[string][]string {
	adapters := staticAdapters(t)
	return map[string][]string{
		"run --once":             {"run", "--once", "--adapters", adapters, "--database-url", url},
		"stats":                  {"stats", "--database-url", url},
		"review list":            {"review", "list", "--database-url", url},
		"review show":            {"review", "show", "--database-url", url, "1"},
		"review resolve":         {"review", "resolve", "--database-url", url, "--as", "succeeded", "--reason", "checked", "--operator", "t", "1"},
		"review requeue":         {"review", "requeue", "--database-url", url, "--reason", "look again", "--operator", "t", "1"},
		"receipts show":          {"receipts", "show", "--database-url", url, "1"},
		"adapters check receipt": {"adapters", "check", "--config", adapters, "--database-url", url, "--receipt", "1"},
		"adapters check control": {"adapters", "check", "--config", adapters, "--database-url", url, "--control"},
	}
}

// schemaExists reports whether the database has a reconciler schema.
func schemaExists(t *testing.T, url string) bool {
	t.Helper()
	var ok bool
	if err := pgtest.Pool(t, url).QueryRow(context.Background(),
		`SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'reconciler')`).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func wantOneLine(t *testing.T, name string, code int, stdout, stderr string, wantCode int, contains ...string) {
	t.Helper()
	line := strings.TrimSpace(stderr)
	t.Logf("%s: exit %d: %s", name, code, line)
	if code != wantCode || strings.Contains(line, "\n") || strings.Contains(line, "SQLSTATE") {
		t.Errorf("%s: exit %d, stderr %q (stdout %q); want exit %d and one line without a raw SQL error", name, code, stderr, stdout, wantCode)
		return
	}
	for _, s := range contains {
		if !strings.Contains(line, s) {
			t.Errorf("%s: stderr %q; want it to say %q", name, line, s)
		}
	}
}

// Issue 10, items 1 and 6: on a database never migrated, every runtime
// command exits 1 with one line naming the fix, and creates nothing.
func TestUnmigratedDatabase(t *testing.T) {
	url := pgtest.NewEmptyDatabase(t)
	for name, args := range runtimeCommands(t, url) {
		code, out, errOut := runCLI(t, "", args...)
		wantOneLine(t, name, code, out, errOut, 1, "no reconciler schema", "reconciler migrate up --database-url")
	}
	code, out, errOut := runCLI(t, "", "migrate", "--database-url", url, "status")
	if code != 0 || !strings.Contains(out, "no schema: nothing applied") || !strings.Contains(out, "00005_input_limits.sql") ||
		strings.Contains(out, "applied 2") {
		t.Errorf("migrate status: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if body := readyz(t, url, nil); !strings.Contains(body, "503") || !strings.Contains(body, "no reconciler schema") {
		t.Errorf("/readyz: %s", body)
	}
	if schemaExists(t, url) {
		t.Fatal("a read-only command created the reconciler schema")
	}
}

// A database migrated up to 00004 only: each command names 00005.
func TestSchemaBehind(t *testing.T) {
	url := pgtest.NewEmptyDatabase(t)
	pool := pgtest.Pool(t, url)
	db := migrations.OpenDB(pool)
	defer db.Close()
	p, err := migrations.NewProvider(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(context.Background(), 4); err != nil {
		t.Fatal(err)
	}
	for name, args := range runtimeCommands(t, url) {
		code, out, errOut := runCLI(t, "", args...)
		wantOneLine(t, name, code, out, errOut, 1, "migration 00005_input_limits.sql is not applied", "reconciler migrate up --database-url")
	}
	if body := readyz(t, url, nil); !strings.Contains(body, "503") || !strings.Contains(body, "00005_input_limits.sql") {
		t.Errorf("/readyz: %s", body)
	}
	code, out, errOut := runCLI(t, "", "migrate", "--database-url", url, "status")
	if code != 0 || !strings.Contains(out, "00004_soundness.sql") || !regexpLine(out, `00005_input_limits.sql\s+pending`) {
		t.Errorf("migrate status: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "migrate", "--database-url", url, "up")
	if code != 0 || !strings.Contains(out, "applied 00005_input_limits.sql") || !strings.Contains(out, fmt.Sprintf("the schema is at version %d", migrations.Latest())) {
		t.Errorf("migrate up: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "stats", "--database-url", url)
	if code != 0 {
		t.Errorf("stats after migrate up: exit %d %q %q", code, out, errOut)
	}
}

// A database a newer binary migrated: the binary says to upgrade.
func TestSchemaAhead(t *testing.T) {
	url := pgtest.NewDatabase(t)
	if _, err := pgtest.Pool(t, url).Exec(context.Background(),
		`INSERT INTO reconciler.goose_db_version (version_id, is_applied) VALUES (99999, true)`); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "", "stats", "--database-url", url)
	wantOneLine(t, "stats", code, out, errOut, 1, "ahead", "99999", "upgrade reconciler")
}

// Issue 10, item 8: `stats extra` is refused like `review list extra`, and
// a filtered empty `review list` says nothing matches, not that none is held.
func TestStatsExtraAndEmptyFilter(t *testing.T) {
	db := newReviewDB(t)
	code, out, errOut := runCLI(t, "", "stats", "--database-url", db.url, "extra")
	wantOneLine(t, "stats extra", code, out, errOut, 2, `unexpected argument "extra"`)
	code, out, errOut = runCLI(t, "", "review", "list", "--database-url", db.url, "--operation", "nothing.matches")
	if code != 0 || !strings.HasPrefix(out, "no receipts match") {
		t.Errorf("filtered empty review list: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	empty := pgtest.NewDatabase(t)
	code, out, errOut = runCLI(t, "", "review", "list", "--database-url", empty)
	if code != 0 || !strings.HasPrefix(out, "no receipts held in manual_review") {
		t.Errorf("empty review list: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}

func regexpLine(out, pattern string) bool {
	for _, l := range strings.Split(out, "\n") {
		if regexp.MustCompile(pattern).MatchString(l) {
			return true
		}
	}
	return false
}

// readyz serves /readyz on url's database, with refused as the pool's
// WritesRefused, and returns "<status> <body>".
func readyz(t *testing.T, url string, refused func() error) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	lh := newLedgerHealth(pgtest.Pool(t, url), nil, logger, false)
	lh.check(context.Background())
	srv, err := serveHTTP(addr, lh, prometheus.NewRegistry(), logger, nil, refused)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return fmt.Sprintf("%d %s", resp.StatusCode, b)
}

// A daemon whose writes the database refuses as such (its role lacks a
// grant) is not ready, and says why; it is ready again once they go
// through.
func TestReadyzReportsRefusedWrites(t *testing.T) {
	url := pgtest.NewDatabase(t)
	refusal := fmt.Errorf("%w: complete, 3 times in a row: SQLSTATE 42501 (apply docs/roles.sql)", reconcile.ErrWritesRefused)
	if body := readyz(t, url, func() error { return refusal }); !strings.HasPrefix(body, "503 ") ||
		!strings.Contains(body, "42501") || !strings.Contains(body, "docs/roles.sql") {
		t.Errorf("/readyz while writes are refused: %s", body)
	}
	if body := readyz(t, url, func() error { return nil }); !strings.HasPrefix(body, "200 ") {
		t.Errorf("/readyz once writes go through: %s", body)
	}
}

// Issue 10, item 8: the daemon's backlog gauges are right from the start,
// not after the first metrics interval (15 s). (A guard: with this adapter
// the pool's first loop turn already refreshed them; run now also sets them
// before the pool starts.)
func TestBacklogGaugesAtStart(t *testing.T) {
	db := newReviewDB(t) // three held receipts
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"reconciler", "run", "--adapters", staticAdapters(t), "--instance", "t",
			"--metrics-addr", addr, "--database-url", db.url}, strings.NewReader(""), io.Discard, io.Discard)
	}()
	defer func() {
		cancel()
		<-done
	}()
	want := `reconciler_backlog{state="manual_review"} 3`
	var last string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if last = string(b); strings.Contains(last, want) {
			return
		}
	}
	t.Fatalf("no %q within 5 s of start; /metrics has: %s", want, grepLines(last, "reconciler_backlog"))
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}
