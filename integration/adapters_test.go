package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

// adSecret is the API key the adapters read from the environment; it must
// never reach the database or the logs.
const adSecret = "sk_test_INTEGRATION_SECRET_77"

// adCharge is one charge of adStripe.
type adCharge struct {
	id      string
	created time.Time
	marker  string
}

// adStripe follows Stripe's documented search: GET /v1/charges/search
// ?query=...&page=... answering {"object":"search_result","data":[...],
// "has_more":..,"next_page":..}; errors as {"error":{...}}. Pages hold two
// charges. The query is metadata['idempotency_key']:'X' AND created>=N, or
// only the created clause. It also serves GET /v1/items/{id} for fetches.
type adStripe struct {
	srv   *httptest.Server
	key   string
	force int
	retry string

	mu      sync.Mutex
	charges []adCharge
	items   map[string]map[string]any
}

var (
	adMarkerRe  = regexp.MustCompile(`metadata\['idempotency_key'\]:'((?:[^'\\]|\\.)*)'`)
	adCreatedRe = regexp.MustCompile(`created>=(\d+)`)
)

func newAdStripe(t *testing.T, key string) *adStripe {
	f := &adStripe{key: key, items: map[string]map[string]any{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *adStripe) add(c ...adCharge) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.charges = append(f.charges, c...)
}

func (f *adStripe) setItem(path string, v map[string]any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.items[path] = v
}

func (f *adStripe) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	reply := func(status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(v)
	}
	if f.force != 0 {
		w.Header().Set("Retry-After", f.retry)
		reply(f.force, map[string]any{"error": map[string]any{"type": "rate_limit_error", "message": "Too many requests"}})
		return
	}
	if r.Header.Get("Authorization") != "Bearer "+f.key {
		// Stripe names the (masked) key; this fake echoes it whole so the
		// test proves the adapter redacts what a server sends back.
		reply(http.StatusUnauthorized, map[string]any{"error": map[string]any{"type": "invalid_request_error",
			"message": "Invalid API Key provided: " + strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")}})
		return
	}
	if strings.HasPrefix(r.URL.Path, "/v1/items/") {
		if v, ok := f.items[r.URL.Path]; ok {
			reply(http.StatusOK, v)
			return
		}
		reply(http.StatusNotFound, map[string]any{"error": map[string]any{"type": "invalid_request_error", "code": "resource_missing"}})
		return
	}
	if r.URL.Path != "/v1/charges/search" {
		reply(http.StatusNotFound, map[string]any{"error": map[string]any{"type": "invalid_request_error"}})
		return
	}
	q := r.URL.Query().Get("query")
	var since int64
	if m := adCreatedRe.FindStringSubmatch(q); m != nil {
		since, _ = strconv.ParseInt(m[1], 10, 64)
	}
	marker, byMarker := "", false
	if m := adMarkerRe.FindStringSubmatch(q); m != nil {
		marker, byMarker = strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(m[1]), true
	}
	data := []map[string]any{}
	for _, c := range f.charges {
		if c.created.Unix() >= since && (!byMarker || marker == c.marker) {
			data = append(data, map[string]any{"id": c.id, "object": "charge", "created": c.created.Unix(),
				"metadata": map[string]any{"idempotency_key": c.marker}})
		}
	}
	off, _ := strconv.Atoi(strings.TrimPrefix(r.URL.Query().Get("page"), "p"))
	end := min(off+2, len(data))
	var next any
	if end < len(data) {
		next = "p" + strconv.Itoa(end)
	}
	reply(http.StatusOK, map[string]any{"object": "search_result", "url": "/v1/charges/search",
		"data": data[min(off, len(data)):end], "has_more": next != nil, "next_page": next})
}

// adLogs is a goroutine-safe log sink.
type adLogs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *adLogs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *adLogs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// adEnv is one test's ledger, clock, adapters and logs.
type adEnv struct {
	t      *testing.T
	db     *pgxpool.Pool
	agent  *ledger.Client
	clk    *clock
	adFile string
	logs   *adLogs
	// controls, if set, declares positive controls on the loaded registry
	// (issue 7: until an adapter's control passes, its absences settle
	// nothing).
	controls func(*readback.Registry)
}

func newAdEnv(t *testing.T, adapters string) *adEnv {
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:adapters-test")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(path, []byte(adapters), 0o600); err != nil {
		t.Fatal(err)
	}
	return &adEnv{t: t, db: db, agent: agent, clk: newClock(), adFile: path, logs: &adLogs{}}
}

// succeeded plans a call, submits it and records the API's 2xx, as the
// agent does: a receipt "settled succeeded from a response", which the
// reconciler uses as the positive control of the adapter that reads it.
func (e *adEnv) succeeded(op, dep, target, payload string, pre json.RawMessage, externalID string) *ledger.Receipt {
	e.t.Helper()
	ctx := context.Background()
	r, err := e.agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(e.t.Name(), payload+target, op),
		Operation: op, Dependency: dep, Method: "POST", Target: target, Payload: json.RawMessage(payload), PreImage: pre})
	if err != nil {
		e.t.Fatal(err)
	}
	if r, err = e.agent.Submit(ctx, r); err != nil {
		e.t.Fatal(err)
	}
	if r, err = e.agent.Succeed(ctx, r, externalID, ledger.Detail{Evidence: map[string]any{"source": "http_response", "http_status": 200}}); err != nil {
		e.t.Fatal(err)
	}
	return r
}

// unknown plans a call, submits it and records a transport failure.
func (e *adEnv) unknown(op, dep, target, payload string, pre json.RawMessage) *ledger.Receipt {
	e.t.Helper()
	ctx := context.Background()
	r, err := e.agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(e.t.Name(), payload+target, op),
		Operation: op, Dependency: dep, Method: "POST", Target: target, Payload: json.RawMessage(payload), PreImage: pre})
	if err != nil {
		e.t.Fatal(err)
	}
	if r, err = e.agent.Submit(ctx, r); err != nil {
		e.t.Fatal(err)
	}
	if r, err = e.agent.MarkUnknown(ctx, r, ledger.Detail{Reason: "timeout after the request was written"}); err != nil {
		e.t.Fatal(err)
	}
	return r
}

// drain runs the reconciler once, in-process, as `run --once` would, with
// the adapters loaded from the file like the daemon loads them.
func (e *adEnv) drain() {
	e.t.Helper()
	reg, err := httpadapter.LoadFile(e.adFile, nil, httpadapter.WithClock(e.clk.Now))
	if err != nil {
		e.t.Fatal(err)
	}
	if e.controls != nil {
		e.controls(reg)
	}
	p, err := reconcile.New(e.db, reconcile.Config{Instance: "adapters-test", Registry: reg, Now: e.clk.Now,
		Logger:  slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Workers: 2, OrphanTimeout: -1})
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := p.Drain(context.Background()); err != nil {
		e.t.Fatal(err)
	}
}

// adState is a receipt's state, external id, next check and last event.
type adState struct {
	State, ExternalID string
	NextCheck         time.Time
	Detail            map[string]any
}

func (e *adEnv) state(id int64) adState {
	e.t.Helper()
	var s adState
	var next *time.Time
	err := e.db.QueryRow(context.Background(), `SELECT r.state, coalesce(r.external_id, ''), r.next_check_at,
		(SELECT detail FROM reconciler.receipt_events WHERE receipt_id = r.id ORDER BY seq DESC LIMIT 1)
		FROM reconciler.receipts r WHERE r.id = $1`, id).Scan(&s.State, &s.ExternalID, &next, &s.Detail)
	if err != nil {
		e.t.Fatal(err)
	}
	if next != nil {
		s.NextCheck = *next
	}
	return s
}

// assertNoSecret looks for the secret everywhere the reconciler writes.
func (e *adEnv) assertNoSecret() {
	e.t.Helper()
	var dump string
	err := e.db.QueryRow(context.Background(), `SELECT
		(SELECT coalesce(string_agg(row_to_json(r)::text, ''), '') FROM reconciler.receipts r) ||
		(SELECT coalesce(string_agg(row_to_json(v)::text, ''), '') FROM reconciler.receipt_events v) ||
		(SELECT coalesce(string_agg(row_to_json(c)::text, ''), '') FROM reconciler.readback_checks c)`).Scan(&dump)
	if err != nil {
		e.t.Fatal(err)
	}
	var checks int
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.readback_checks`).Scan(&checks); err != nil || checks == 0 {
		e.t.Fatalf("no check recorded (%v): the test proves nothing", err)
	}
	if strings.Contains(dump, adSecret) {
		e.t.Error("the secret is in the database")
	}
	if logs := e.logs.String(); logs == "" || strings.Contains(logs, adSecret) {
		e.t.Errorf("the secret is in the logs (or nothing was logged): %s", logs)
	}
}

func TestHTTPAdapterCreateEndToEnd(t *testing.T) {
	t.Setenv("ITEST_STRIPE_KEY", adSecret)
	t.Setenv("ITEST_WRONG_KEY", "sk_test_revoked")
	good := newAdStripe(t, adSecret)
	revoked := newAdStripe(t, adSecret)
	limited := newAdStripe(t, adSecret)
	limited.force, limited.retry = http.StatusTooManyRequests, "2"
	adapters := fmt.Sprintf(`version: 1
defaults:
  consistency_window: 5s
  max_request_lifetime: 10s
  backoff: {base: 100ms, cap: 1s}
adapters:
  - name: stripe-charges
    type: http
    kind: create
    dependency: stripe
    idempotency: {native: true, retention: 24h}
    http:
      preset: stripe
      base_url: %s
      auth: {env: ITEST_STRIPE_KEY}
      search:
        query: {query: "created>={window.start_unix}"}
  - name: stripe-eu-charges
    type: http
    kind: create
    dependency: stripe-eu
    http: {preset: stripe, base_url: %s, auth: {env: ITEST_WRONG_KEY}}
  - name: stripe-us-charges
    type: http
    kind: create
    dependency: stripe-us
    http: {preset: stripe, base_url: %s, auth: {env: ITEST_STRIPE_KEY}}
`, good.srv.URL, revoked.srv.URL, limited.srv.URL)
	e := newAdEnv(t, adapters)

	page3 := e.unknown("charges.create", "stripe", "/v1/charges", `{"amount":100}`, nil)
	dup := e.unknown("charges.create", "stripe", "/v1/charges", `{"amount":200}`, nil)
	outside := e.unknown("charges.create", "stripe", "/v1/charges", `{"amount":300}`, nil)
	none := e.unknown("charges.create", "stripe", "/v1/charges", `{"amount":400}`, nil)
	unauthorized := e.unknown("charges.create", "stripe-eu", "/v1/charges", `{"amount":500}`, nil)
	limitedR := e.unknown("charges.create", "stripe-us", "/v1/charges", `{"amount":600}`, nil)
	// The positive control: a charge the agent saw created (a 2xx).
	control := e.succeeded("charges.create", "stripe", "/v1/charges", `{"amount":700}`, nil, "ch_control")

	// The clock starts now that the rows exist, so they are due.
	e.clk = newClock()
	now := e.clk.Now()
	for i := range 4 {
		good.add(adCharge{id: fmt.Sprintf("ch_other%d", i), created: now,
			marker: ledger.Key(t.Name(), fmt.Sprintf("other-%d", i), "charges.create")})
	}
	// The agent marks each charge with its receipt's idempotency key, the
	// one thing it knows before the request is sent.
	good.add(adCharge{id: "ch_page3", created: now, marker: page3.IdempotencyKey},
		adCharge{id: "ch_dup1", created: now, marker: dup.IdempotencyKey},
		adCharge{id: "ch_dup2", created: now, marker: dup.IdempotencyKey},
		adCharge{id: "ch_old", created: now.Add(-2 * time.Hour), marker: outside.IdempotencyKey},
		adCharge{id: "ch_control", created: now, marker: control.IdempotencyKey})

	e.drain()
	checks := []struct {
		name   string
		id     int64
		state  string
		reason string
	}{
		{"found on page 3", page3.ID, "succeeded", "present"},
		{"duplicate", dup.ID, "succeeded", "present_duplicates"},
		{"outside the window, before the window ends", outside.ID, "reconciling", ""},
		{"absent, before the window ends", none.ID, "reconciling", ""},
		{"401", unauthorized.ID, "manual_review", "readback_error"},
		{"429", limitedR.ID, "reconciling", ""},
	}
	for _, c := range checks {
		s := e.state(c.id)
		if s.State != c.state || (c.reason != "" && s.Detail["reason"] != c.reason) {
			t.Errorf("%s: state %s, detail %v; want %s (%s)", c.name, s.State, s.Detail, c.state, c.reason)
		}
	}
	if s := e.state(page3.ID); s.ExternalID != "ch_page3" {
		t.Errorf("page 3: external id %q", s.ExternalID)
	}
	if s := e.state(unauthorized.ID); !strings.Contains(fmt.Sprint(s.Detail["error"]), "401") {
		t.Errorf("401: the reason does not say why: %v", s.Detail)
	}
	// Postgres keeps microseconds.
	if s := e.state(limitedR.ID); s.NextCheck.Before(now.Add(2 * time.Second).Truncate(time.Microsecond)) {
		t.Errorf("429: next check at %s, want at least 2s after %s", s.NextCheck, now)
	}
	var alarms int
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.duplicate_alarms
		WHERE receipt_id = $1`, dup.ID).Scan(&alarms); err != nil || alarms == 0 {
		t.Errorf("duplicate: %d alarms (%v)", alarms, err)
	}

	// After the send deadline (5s, the default max_send_delay) and the
	// consistency window (5s) but inside the request lifetime (10s more),
	// the authoritative absences settle on the strength of Stripe's native
	// idempotency keys: the retry must reuse the key.
	e.clk.Advance(11 * time.Second)
	e.drain()
	for _, id := range []int64{outside.ID, none.ID} {
		s := e.state(id)
		ev, _ := s.Detail["evidence"].(map[string]any)
		if s.State != "safe_to_retry" || ev["guarantee"] != "native_idempotency_key" || ev["reuse_idempotency_key_before"] == nil {
			t.Errorf("receipt %d: %s %v; want safe_to_retry relying on the native idempotency key", id, s.State, s.Detail)
		}
	}
	e.assertNoSecret()
	// The revoked key, which the API echoed in its 401 body, is a secret too.
	if strings.Contains(e.logs.String(), "sk_test_revoked") || !strings.Contains(e.logs.String(), "[redacted]") {
		t.Errorf("the echoed key is not redacted in the logs: %s", e.logs.String())
	}
	if s := e.state(unauthorized.ID); strings.Contains(fmt.Sprint(s.Detail), "sk_test_revoked") {
		t.Errorf("the echoed key is in the settlement: %v", s.Detail)
	}
}

func TestHTTPAdapterUpdateDeleteEndToEnd(t *testing.T) {
	t.Setenv("ITEST_STRIPE_KEY", adSecret)
	api := newAdStripe(t, adSecret)
	adapters := fmt.Sprintf(`version: 1
defaults:
  consistency_window: 5s
  max_request_lifetime: 10s
  backoff: {base: 100ms, cap: 1s}
adapters:
  - name: items-update
    type: http
    kind: update
    dependency: shop
    operations: [items.update]
    http:
      base_url: %[1]s
      auth: {env: ITEST_STRIPE_KEY}
      fetch: {path: "{receipt.target}", id: /id}
      compare:
        fields: {/title: /title}
  - name: items-delete
    type: http
    kind: delete
    dependency: shop
    operations: [items.delete]
    http:
      base_url: %[1]s
      auth: {env: ITEST_STRIPE_KEY}
      fetch: {path: "{receipt.target}", id: /id}
      guard:
        fields: [/title]
`, api.srv.URL)
	e := newAdEnv(t, adapters)
	pre := json.RawMessage(`{"id":"it_1","title":"old"}`)
	item := func(title string) map[string]any { return map[string]any{"id": "it_1", "title": title} }

	cases := []struct {
		name, op, path string
		resource       map[string]any // nil: 404
		first, final   string
	}{
		{"update done", "items.update", "/v1/items/u1", item("new"), "succeeded", "succeeded"},
		{"update not done", "items.update", "/v1/items/u2", item("old"), "reconciling", "safe_to_retry"},
		{"update changed by someone else", "items.update", "/v1/items/u3", item("theirs"), "manual_review", "manual_review"},
		{"delete done", "items.delete", "/v1/items/d1", nil, "succeeded", "succeeded"},
		{"delete not done", "items.delete", "/v1/items/d2", item("old"), "reconciling", "safe_to_retry"},
		{"delete target changed by someone else", "items.delete", "/v1/items/d3", item("theirs"), "manual_review", "manual_review"},
	}
	// Positive controls: an update the agent saw succeed, whose item holds
	// the new title; and, for the delete adapter, a declared item known to
	// exist (a deleted one reads absent, like a misconfiguration).
	// And, for its "still present" answers, a delete the agent saw succeed
	// (its 2xx), whose item is gone (404).
	e.succeeded("items.update", "shop", "/v1/items/c1", `{"title":"new"}`, pre, "it_c1")
	e.succeeded("items.delete", "shop", "/v1/items/g1", `{}`, pre, "")
	api.setItem("/v1/items/c1", item("new"))
	api.setItem("/v1/items/c2", item("old"))
	e.controls = func(reg *readback.Registry) {
		b, _ := reg.Lookup("items.delete", "shop")
		b.Control = &readback.Control{Source: "declared", Receipt: readback.Receipt{Operation: "items.delete",
			Dependency: "shop", Method: "POST", Target: "/v1/items/c2", Intent: json.RawMessage(`{}`), PreImage: pre}}
	}
	ids := make([]int64, len(cases))
	for i, c := range cases {
		payload := `{"title":"new"}`
		if c.op == "items.delete" {
			payload = `{}`
		}
		ids[i] = e.unknown(c.op, "shop", c.path, payload, pre).ID
		if c.resource != nil {
			api.setItem(c.path, c.resource)
		}
	}
	e.clk = newClock() // the rows exist now: they are due
	e.drain()
	for i, c := range cases {
		if s := e.state(ids[i]); s.State != c.first {
			t.Errorf("%s: first drain: %s %v, want %s", c.name, s.State, s.Detail, c.first)
		}
	}
	e.clk.Advance(time.Minute)
	e.drain()
	for i, c := range cases {
		s := e.state(ids[i])
		if s.State != c.final {
			t.Errorf("%s: after the window: %s %v, want %s", c.name, s.State, s.Detail, c.final)
		}
		if c.final == "manual_review" && s.Detail["reason"] != "diverged" {
			t.Errorf("%s: reason %v, want diverged", c.name, s.Detail["reason"])
		}
	}
	e.assertNoSecret()
}
