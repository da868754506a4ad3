package gateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Tokens of the test agents, and the upstream credential.
const (
	tokenA       = "token-of-agent-a-0123456789"
	tokenB       = "token-of-agent-b-0123456789"
	upstreamKey  = "sk_live_upstream_secret_42"
	routesPrefix = "/blog"
	hookSecret   = "whsec_0123456789abcdef0123456789abcdef"
)

func testEnv(name string) (string, bool) {
	v, ok := map[string]string{"TOKEN_A": tokenA, "TOKEN_B": tokenB, "BLOG_KEY": upstreamKey, "HOOK_SECRET": hookSecret}[name]
	return v, ok
}

// routesFile is a routes file for one route to upstream; extra is added to
// the route's mapping.
func routesFile(upstream, extra string) string {
	return `version: 1
limits: {max_request_bytes: 4096}
replay: {retention: 1h}
agents:
  - {id: a, token: {env: TOKEN_A}}
  - {id: b, token: {env: TOKEN_B}}
routes:
  - prefix: ` + routesPrefix + `
    upstream: ` + upstream + `/api
    dependency: blog-api
    auth: {env: BLOG_KEY}
    # Long enough that a loaded machine (the plan-and-submit statement and
    # the connect both count) never turns a test's call into not_sent.
    max_send_delay: 2s
    timeout: 2s
    drop: [/request_id]
` + extra
}

// env is a gateway in front of an upstream, over a fresh ledger.
type env struct {
	db      *pgxpool.Pool
	gw      *httptest.Server
	metrics *prometheus.Registry
}

func newEnv(t *testing.T, upstream http.Handler, extra string) *env {
	t.Helper()
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	return newEnvAt(t, up.URL, extra)
}

func newEnvAt(t *testing.T, upstreamURL, extra string) *env {
	t.Helper()
	return newEnvRoutes(t, routesFile(upstreamURL, extra))
}

// newEnvRoutes is a gateway for a whole routes file, over a fresh ledger.
func newEnvRoutes(t *testing.T, routes string) *env {
	t.Helper()
	db := pgtest.NewPool(t)
	reg := prometheus.NewRegistry()
	_, srv := newGateway(t, db, routes, gateway.Options{Metrics: gateway.NewMetrics(reg)})
	return &env{db: db, gw: srv, metrics: reg}
}

// newGateway is a gateway for a whole routes file over the ledger db, as
// agent:gateway, served until the test ends.
func newGateway(t *testing.T, db *pgxpool.Pool, routes string, opts gateway.Options) (*gateway.Gateway, *httptest.Server) {
	t.Helper()
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routes), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(client, cfg, opts)
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	return g, srv
}

// answer is a gateway response, read whole.
type answer struct {
	status int
	header http.Header
	body   []byte
}

func (a answer) problem(t *testing.T) gateway.Problem {
	t.Helper()
	if ct := a.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q, want application/problem+json; body %s", ct, a.body)
	}
	var p gateway.Problem
	if err := json.Unmarshal(a.body, &p); err != nil {
		t.Fatalf("problem document %s: %v", a.body, err)
	}
	return p
}

// do sends a request to the gateway; headers is name, value pairs.
func (e *env) do(t *testing.T, method, path, body string, headers ...string) answer {
	t.Helper()
	a, err := send(method, e.gw.URL+path, body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// send makes a request to url and reads its answer whole; headers is
// name, value pairs, and a body is sent as JSON. It calls no testing
// method, so a test's goroutines may use it.
func send(method, url, body string, headers ...string) (answer, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, url, rd)
	if err != nil {
		return answer{}, err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	return answer{resp.StatusCode, resp.Header, b}, nil
}

// post is a side-effecting call as agent a with key.
func (e *env) post(t *testing.T, path, key, body string) answer {
	t.Helper()
	return e.do(t, "POST", path, body, "Authorization", "Bearer "+tokenA, "Idempotency-Key", key)
}

// receiptCount counts the ledger's receipts.
func (e *env) receiptCount(t *testing.T) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// countText reports how many times s occurs in every text and bytea value
// the gateway writes: receipts, their history, and the kept responses.
func (e *env) countText(t *testing.T, s string) int {
	t.Helper()
	var n int
	err := e.db.QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM reconciler.receipts r WHERE r::text LIKE '%' || $1 || '%') +
		(SELECT count(*) FROM reconciler.receipt_events e WHERE e::text LIKE '%' || $1 || '%') +
		(SELECT count(*) FROM reconciler.gateway_responses g
		  WHERE g::text LIKE '%' || $1 || '%' OR position(convert_to($1, 'UTF8') in coalesce(g.body, '')) > 0) +
		(SELECT count(*) FROM reconciler.webhook_deliveries d WHERE d::text LIKE '%' || $1 || '%')`, s).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func jsonBody(v any) string {
	b, _ := json.Marshal(v)
	return string(bytes.TrimSpace(b))
}
