package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// Issue 21, item 4: readiness says whether this process can write the
// ledger now. A database that refuses writes (read-only, SQLSTATE 25006,
// as a primary mid-switchover or a standby) is not ready, though it
// answers every read; and /readyz answers from the last background check
// without a round trip, so a slow or silent database cannot hold it past
// its deadline: a check older than its cadence allows is reported as such.
func TestReadinessWritesAndStaleness(t *testing.T) {
	url := pgtest.NewDatabase(t)
	admin := pgtest.Pool(t, url)
	ctx := context.Background()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))

	h := newLedgerHealth(pgtest.Pool(t, url), nil, logger, false)
	h.check(ctx)
	if why, d := h.notReady(); why != "" || d == nil || d.Mode != ledger.DurabilityLocal {
		t.Fatalf("a writable database: not ready %q, durability %+v", why, d)
	}

	var name string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `ALTER DATABASE `+name+` SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	ro := newLedgerHealth(pgtest.Pool(t, url), nil, logger, false) // new sessions: read-only
	ro.check(ctx)
	if why, _ := ro.notReady(); !strings.Contains(why, "read-only") || !strings.Contains(why, "25006") {
		t.Fatalf("a read-only database: not ready %q, want the 25006 refusal", why)
	}

	// The database falls silent: /readyz answers from memory, at once,
	// and once the last check is older than three cadences and a
	// timeout, says so.
	now := time.Now()
	h.now = func() time.Time { return now }
	if why, _ := h.notReady(); why != "" {
		t.Fatalf("within the cadence: %q", why)
	}
	now = now.Add(3*healthEvery + healthTimeout + time.Second)
	if why, _ := h.notReady(); !strings.Contains(why, "has not answered a check") {
		t.Fatalf("a check older than the cadence: %q", why)
	}

	// --require-synchronous-standby on a server with no standby.
	req := newLedgerHealth(pgtest.Pool(t, url), nil, logger, true)
	req.check(ctx)
	if why, _ := req.notReady(); why == "" {
		t.Fatal("required a synchronous standby on a server without one: ready")
	}
}

// The gateway's /readyz: 200 with the durability and the count of kept
// outcomes while the ledger can be written, 503 with the reason otherwise.
func TestGatewayReadyz(t *testing.T) {
	url := pgtest.NewDatabase(t)
	ctx := context.Background()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	client, err := ledger.New(pgtest.Pool(t, url), "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := gateway.ParseConfig("routes.yaml", []byte("version: 1\nagents: [{id: a, token: {env: T}}]\nroutes: [{prefix: /x, upstream: 'http://127.0.0.1:9', dependency: x}]\n"),
		func(string) (string, bool) { return "token-0123456789abcdef", true })
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(client, cfg, gateway.Options{})
	for _, tc := range []struct {
		require bool
		status  int
	}{{false, http.StatusOK}, {true, http.StatusServiceUnavailable}} {
		h := newLedgerHealth(pgtest.Pool(t, url), nil, logger, tc.require)
		h.check(ctx)
		rec := httptest.NewRecorder()
		gatewayReadyz(h, g)(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		var body gatewayReadiness
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatal(err)
		}
		if rec.Code != tc.status || body.Durability == nil || body.Durability.Mode != ledger.DurabilityLocal ||
			(tc.require && !strings.Contains(body.Reason, "synchronous standby")) {
			t.Fatalf("require %v: %d %s", tc.require, rec.Code, rec.Body)
		}
	}
}
