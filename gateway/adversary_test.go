package gateway_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// An agent cannot read, wait on, replay or steer another agent's receipts:
// not by their id, and not by reusing another agent's Idempotency-Key,
// whatever state the receipt is in and whether or not a response is kept.
func TestAgentsCannotReachEachOthersReceipts(t *testing.T) {
	var limited atomic.Int32
	up := newFakeUpstream()
	mux := http.NewServeMux()
	mux.Handle("/", up)
	mux.HandleFunc("/api/limited", func(w http.ResponseWriter, r *http.Request) {
		// Rate limited once, then accepted: a retryable rejection whose
		// next attempt is sent.
		if limited.Add(1) == 1 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"lim-1"}`))
	})
	e := newEnv(t, mux, "")
	asB := func(method, path, key, body string) answer {
		return e.do(t, method, path, body, "Authorization", "Bearer "+tokenB, "Idempotency-Key", key)
	}
	refusedKey := func(what string, a answer) {
		t.Helper()
		p := a.problem(t)
		if a.status != http.StatusUnprocessableEntity || p.Type != gateway.ProblemKeyReused.URI() || p.ReceiptID != 0 ||
			a.header.Get(gateway.HeaderReceiptID) != "" || a.header.Get(gateway.HeaderReplayed) != "" {
			t.Fatalf("%s: %d %v %s, want 422 idempotency-key-reused naming no receipt", what, a.status, a.header, a.body)
		}
	}

	// A's call whose outcome is unknown: B's same call under A's key is
	// refused without naming A's receipt.
	unknown := e.post(t, "/blog/fail504", "a-unknown", `{"title":"a"}`)
	idUnknown := unknown.problem(t).ReceiptID
	refusedKey("B reuses A's unknown key", asB("POST", "/blog/fail504", "a-unknown", `{"title":"a"}`))

	// A's call rate limited (rejected, retryable): B's same call under A's
	// key must not become the next attempt, sent as B.
	if a := e.post(t, "/blog/limited", "a-limited", `{"title":"l"}`); a.status != http.StatusTooManyRequests {
		t.Fatalf("set-up 429: %d %s", a.status, a.body)
	}
	receipts := e.receiptCount(t)
	refusedKey("B reuses A's retryable key", asB("POST", "/blog/limited", "a-limited", `{"title":"l"}`))
	if n := limited.Load(); n != 1 {
		t.Fatalf("B's reuse of A's key sent %d requests upstream, want none", n-1)
	}
	if n := e.receiptCount(t); n != receipts {
		t.Fatalf("B's reuse of A's key left %d receipts, want %d", n, receipts)
	}
	// A itself sends it again: the next attempt, sent.
	if a := e.post(t, "/blog/limited", "a-limited", `{"title":"l"}`); a.status != http.StatusCreated || limited.Load() != 2 {
		t.Fatalf("A's own next attempt: %d %s, upstream %d", a.status, a.body, limited.Load())
	}

	// A's call settled by a readback (no response kept): B gets neither
	// the receipt nor its external id.
	if a := e.post(t, "/blog/articles", "a-readback", `{"title":"r"}`); a.status != http.StatusCreated {
		t.Fatalf("set-up call: %d %s", a.status, a.body)
	}
	if _, err := e.db.Exec(context.Background(), `DELETE FROM reconciler.gateway_responses`); err != nil {
		t.Fatal(err)
	}
	refusedKey("B reuses A's settled key without a kept response", asB("POST", "/blog/articles", "a-readback", `{"title":"r"}`))

	// By id: B can neither read nor wait on A's receipt, and cannot tell
	// it from one that does not exist.
	path := "/receipts/" + strconv.FormatInt(idUnknown, 10)
	for _, p := range []string{path, path + "?wait=2s"} {
		a := e.do(t, "GET", p, "", "Authorization", "Bearer "+tokenB)
		if pr := a.problem(t); a.status != http.StatusNotFound || pr.Type != gateway.ProblemReceiptNotFound.URI() ||
			strings.Contains(string(a.body), "a-unknown") {
			t.Fatalf("B reads A's receipt at %s: %d %s", p, a.status, a.body)
		}
	}
	if a := e.do(t, "GET", path, "", "Authorization", "Bearer "+tokenA); a.status != http.StatusOK {
		t.Fatalf("A reads its own receipt: %d %s", a.status, a.body)
	}
	if n := up.count("/api/fail504"); n != 1 {
		t.Fatalf("the upstream got %d requests for A's unknown call, want 1", n)
	}
}

// A hostile upstream cannot speak for the gateway: its own Receipt-* and
// Idempotent-Replayed headers never reach the agent, and naming the
// gateway's headers in Connection does not remove them.
func TestUpstreamCannotForgeReceiptHeaders(t *testing.T) {
	forge := func(w http.ResponseWriter, status int, body string) {
		h := w.Header()
		h.Set("Connection", "Receipt-Id, Receipt-State, Receipt-Retryable")
		h.Set(gateway.HeaderReceiptID, "999999")
		h.Set(gateway.HeaderReceiptState, "succeeded")
		h.Set(gateway.HeaderReceiptRetryable, "true")
		h.Set(gateway.HeaderReplayed, "true")
		h.Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/api/ok", func(w http.ResponseWriter, r *http.Request) { forge(w, http.StatusCreated, `{"id":"x-1"}`) })
	mux.HandleFunc("/api/no", func(w http.ResponseWriter, r *http.Request) {
		forge(w, http.StatusUnprocessableEntity, `{"error":"no"}`)
	})
	e := newEnv(t, mux, "")
	for _, tc := range []struct {
		path, key, state string
		status           int
	}{{"/blog/ok", "forge-ok", "succeeded", http.StatusCreated}, {"/blog/no", "forge-no", "rejected", http.StatusUnprocessableEntity}} {
		for _, replayed := range []string{"", "true"} {
			a := e.post(t, tc.path, tc.key, `{"title":"f"}`)
			var state string
			if err := e.db.QueryRow(context.Background(), `SELECT state FROM reconciler.receipts WHERE idempotency_key = $1`, tc.key).Scan(&state); err != nil {
				t.Fatal(err)
			}
			h := a.header
			if a.status != tc.status || h.Get(gateway.HeaderReceiptID) == "999999" || h.Get(gateway.HeaderReceiptID) == "" ||
				h.Values(gateway.HeaderReceiptState)[0] != tc.state || state != tc.state ||
				h.Get(gateway.HeaderReceiptRetryable) != "" || h.Get(gateway.HeaderReplayed) != replayed ||
				len(h.Values(gateway.HeaderReceiptState)) != 1 {
				t.Fatalf("%s (replayed %q): %d %v, want the gateway's own receipt headers (%s)", tc.path, replayed, a.status, h, tc.state)
			}
		}
	}
}

// Encoded slashes and backslashes cannot smuggle a dot segment past the
// check: nothing that could leave the upstream's base path is sent.
func TestEncodedSeparatorsCannotLeaveTheBasePath(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	assertPathsRefused(t, e, up, "k-sep-",
		"/blog/x%2F..%2F..%2Fadmin",
		"/blog/%2e%2e%2fadmin",
		"/blog/%2E%2E%2Fadmin",
		"/blog/..%5Cadmin",
		"/blog/x%5C..%5C..%5Cadmin",
	)
}

// assertPathsRefused checks that a POST (key keyPrefix<i>) and a GET of each
// path are refused as invalid-path, and that nothing reached the upstream
// or was recorded.
func assertPathsRefused(t *testing.T, e *env, up *fakeUpstream, keyPrefix string, paths ...string) {
	t.Helper()
	for i, p := range paths {
		a := e.post(t, p, keyPrefix+strconv.Itoa(i), `{"title":"x"}`)
		if pr := a.problem(t); a.status != http.StatusBadRequest || pr.Type != gateway.ProblemInvalidPath.URI() {
			t.Fatalf("POST %s: %d %s, want invalid-path", p, a.status, a.body)
		}
		if r := e.do(t, "GET", p, "", "Authorization", "Bearer "+tokenA); r.status != http.StatusBadRequest {
			t.Fatalf("GET %s: %d %s, want invalid-path", p, r.status, r.body)
		}
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	if len(up.hits) != 0 {
		t.Fatalf("the upstream was reached: %v", up.hits)
	}
	if n := e.receiptCount(t); n != 0 {
		t.Fatalf("%d receipts for refused paths", n)
	}
}

// The upstream's credential reaches the agent in no form, not even when
// the API echoes it in its live answer's headers and body, or compresses
// the body because the agent asked for gzip.
func TestEchoedCredentialNeverReachesTheAgent(t *testing.T) {
	var echoed atomic.Int32
	mux := http.NewServeMux()
	mux.HandleFunc("/api/echo", func(w http.ResponseWriter, r *http.Request) {
		seen := r.Header.Get("Authorization")
		if strings.Contains(seen, upstreamKey) {
			echoed.Add(1)
		}
		w.Header().Set("X-Debug-Auth", seen)
		w.Header().Set("Content-Type", "application/json")
		body := `{"id":"e-1","seen":"` + seen + `"}`
		if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
			w.Header().Set("Content-Encoding", "gzip")
			w.WriteHeader(http.StatusCreated)
			gz := gzip.NewWriter(w)
			_, _ = gz.Write([]byte(body))
			_ = gz.Close()
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(body))
	})
	e := newEnv(t, mux, "")
	for i, enc := range []string{"identity", "gzip, deflate, br"} {
		key := "k-echo-" + strconv.Itoa(i)
		for round := range 2 {
			a := e.do(t, "POST", "/blog/echo", `{"title":"echo"}`,
				"Authorization", "Bearer "+tokenA, "Idempotency-Key", key, "Accept-Encoding", enc)
			if a.status != http.StatusCreated || a.header.Get(gateway.HeaderReceiptState) != "succeeded" {
				t.Fatalf("Accept-Encoding %q, round %d: %d %v %s", enc, round, a.status, a.header, a.body)
			}
			raw := string(a.body)
			if a.header.Get("Content-Encoding") == "gzip" {
				zr, err := gzip.NewReader(bytes.NewReader(a.body))
				if err != nil {
					t.Fatal(err)
				}
				var b bytes.Buffer
				_, _ = b.ReadFrom(zr)
				raw = b.String()
			}
			for k, vs := range a.header {
				if strings.Contains(strings.Join(vs, ","), upstreamKey) {
					t.Fatalf("Accept-Encoding %q, round %d: header %s holds the upstream credential", enc, round, k)
				}
			}
			if strings.Contains(raw, upstreamKey) || !strings.Contains(raw, `"id":"e-1"`) {
				t.Fatalf("Accept-Encoding %q, round %d: body %q", enc, round, raw)
			}
		}
	}
	if echoed.Load() != 2 {
		t.Fatalf("the API echoed the credential %d times, want 2 (one per key)", echoed.Load())
	}
	if n := e.countText(t, upstreamKey); n != 0 {
		t.Fatalf("the credential is stored in %d rows", n)
	}
}

// On shutdown, a call still waiting on its upstream when the grace period
// ends is cut, recorded outcome_unknown, and the agent is told so: when
// Run returns, no receipt the gateway was handling is left submitted.
func TestShutdownRecordsCallsCutAfterGrace(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(up.Close)
	t.Cleanup(func() { close(release) })
	db := pgtest.NewPool(t)
	// A long upstream timeout: only the shutdown cuts the call.
	g := newGatewayOn(t, db, strings.Replace(routesFile(up.URL, ""), "timeout: 2s", "timeout: 1m", 1))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	ran := make(chan error, 1)
	waiting := make(chan struct{}, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/receipts/") {
			waiting <- struct{}{}
		}
		g.ServeHTTP(w, r)
	})
	go func() { ran <- g.Run(ctx, l, h, 50*time.Millisecond) }()

	got := make(chan answer, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		a, err := send("POST", "http://"+l.Addr().String()+"/blog/articles", `{"title":"cut"}`,
			"Authorization", "Bearer "+tokenA, "Idempotency-Key", "k-cut")
		if err != nil {
			a = answer{status: -1, body: []byte(err.Error())}
		}
		got <- a
	}()
	select {
	case <-arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the call never reached the upstream")
	}
	// An agent waiting on the receipt is answered when the gateway stops,
	// not held until its wait is over.
	var id int64
	if err := db.QueryRow(context.Background(), `SELECT id FROM reconciler.receipts WHERE idempotency_key = 'k-cut'`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	waited := make(chan answer, 1)
	wg.Add(1)
	go func() {
		defer wg.Done()
		a, err := send("GET", "http://"+l.Addr().String()+"/receipts/"+strconv.FormatInt(id, 10)+"?wait=5m", "",
			"Authorization", "Bearer "+tokenA)
		if err != nil {
			a = answer{status: -1, body: []byte(err.Error())}
		}
		waited <- a
	}()
	select {
	case <-waiting:
	case <-time.After(30 * time.Second):
		t.Fatal("the wait never reached the gateway")
	}
	stop()
	select {
	case err := <-ran:
		if err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, http.ErrServerClosed) {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	var state string
	if err := db.QueryRow(context.Background(), `SELECT state FROM reconciler.receipts WHERE idempotency_key = 'k-cut'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "outcome_unknown" {
		t.Fatalf("when Run returned, the cut call's receipt was %s, want outcome_unknown", state)
	}
	var a answer
	select {
	case a = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("the agent got no answer")
	}
	var wa answer
	select {
	case wa = <-waited:
	case <-time.After(30 * time.Second):
		t.Fatal("the waiting agent got no answer")
	}
	wg.Wait()
	if wa.status != http.StatusOK || !strings.Contains(string(wa.body), `"settled":false`) {
		t.Fatalf("the waiting agent was told %d %s, want the receipt, not settled", wa.status, wa.body)
	}
	if a.status != http.StatusBadGateway || a.header.Get(gateway.HeaderReceiptState) != "outcome_unknown" {
		t.Fatalf("the agent was told %d %v %s, want 502 outcome-unknown", a.status, a.header, a.body)
	}
}

// newGatewayOn is a gateway for routes over db, not yet serving.
func newGatewayOn(t *testing.T, db *pgxpool.Pool, routes string) *gateway.Gateway {
	t.Helper()
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routes), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	return gateway.New(client, cfg, gateway.Options{})
}

// The same key sent again while its first call is still waiting on the
// upstream is answered request-in-progress, and sends nothing: the
// upstream sees exactly one request, and the first call's answer is then
// replayed.
func TestSameKeyWhileInFlightSendsOnce(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 8)
	var hits atomic.Int32
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		arrived <- struct{}{}
		<-release
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"slow-1"}`))
	}), "")
	first := make(chan answer, 1)
	go func() { first <- e.post(t, "/blog/articles", "k-slow", `{"title":"s"}`) }()
	select {
	case <-arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the first call never reached the upstream")
	}
	var wg sync.WaitGroup
	seconds := make(chan answer, 4)
	for range 4 {
		wg.Add(1)
		go func() { defer wg.Done(); seconds <- e.post(t, "/blog/articles", "k-slow", `{"title":"s"}`) }()
	}
	wg.Wait()
	close(seconds)
	for a := range seconds {
		if p := a.problem(t); a.status != http.StatusConflict || p.Type != gateway.ProblemInProgress.URI() || a.header.Get(gateway.HeaderReplayed) != "true" {
			t.Fatalf("the same key in flight: %d %s", a.status, a.body)
		}
	}
	close(release)
	if a := <-first; a.status != http.StatusCreated {
		t.Fatalf("first call: %d %s", a.status, a.body)
	}
	if a := e.post(t, "/blog/articles", "k-slow", `{"title":"s"}`); a.status != http.StatusCreated || a.header.Get(gateway.HeaderReplayed) != "true" {
		t.Fatalf("after it settled: %d %s", a.status, a.body)
	}
	if n := hits.Load(); n != 1 {
		t.Fatalf("the upstream got %d requests, want 1", n)
	}
}

// A connection cannot be held open at will: an agent that trickles its
// body is cut off once Options.ReadTimeout is over, before anything is
// recorded or sent, and a keep-alive connection left idle is closed once
// Options.IdleTimeout is over.
func TestSlowAndIdleConnectionsAreCut(t *testing.T) {
	var hits atomic.Int32
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(up.Close)
	db := pgtest.NewPool(t)
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routesFile(up.URL, "")), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(client, cfg, gateway.Options{ReadTimeout: 300 * time.Millisecond, IdleTimeout: 300 * time.Millisecond})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- g.Run(ctx, l, nil, time.Second) }()
	t.Cleanup(func() { stop(); <-ran })

	// closed sends raw on a new connection and reports what the gateway
	// answered before it closed the connection; the test fails if it is
	// still open after 10 s.
	closed := func(t *testing.T, raw string) string {
		t.Helper()
		conn, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.Write([]byte(raw)); err != nil {
			t.Fatal(err)
		}
		if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatal(err)
		}
		var got bytes.Buffer
		_, err = got.ReadFrom(conn)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("the connection is still open after 10 s; read so far: %q", got.String())
		}
		return got.String()
	}

	t.Run("trickled body", func(t *testing.T) {
		got := closed(t, "POST /blog/articles HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "+tokenA+
			"\r\nIdempotency-Key: k-slow\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"title\":")
		if strings.HasPrefix(got, "HTTP/1.1 2") {
			t.Fatalf("a body that never arrived was answered %q", got)
		}
		var n int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts`).Scan(&n); err != nil || n != 0 || hits.Load() != 0 {
			t.Fatalf("receipts %d (%v), upstream hits %d: want nothing recorded or sent", n, err, hits.Load())
		}
	})
	t.Run("a wait outlasts the read timeout", func(t *testing.T) {
		in := ledger.Intent{IdempotencyKey: "k-waited", Operation: "articles.create", Dependency: "blog-api",
			Method: "POST", Target: "/api/articles", Payload: []byte(`{"title":"waited"}`)}
		r, err := client.As("agent:a").Plan(context.Background(), in)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		a, err := send("GET", "http://"+l.Addr().String()+"/receipts/"+strconv.FormatInt(r.ID, 10)+"?wait=1s", "",
			"Authorization", "Bearer "+tokenA)
		if err != nil {
			t.Fatalf("a wait of 1 s with a read timeout of 300 ms: %v", err)
		}
		if took := time.Since(start); a.status != http.StatusOK || took < time.Second {
			t.Fatalf("a wait of 1 s answered %d after %s: want 200 after the whole wait", a.status, took)
		}
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		got := closed(t, "GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
		if !strings.HasPrefix(got, "HTTP/1.1 200") || !strings.HasSuffix(got, "ok\n") {
			t.Fatalf("healthz on the idle connection answered %q", got)
		}
	})
}

// The same call sent by two agents under keys of their own while the
// first is unresolved is refused as a duplicate intent (nothing sent),
// but the refusal named the first agent's receipt, its state and where
// to wait for it: another agent learns of a call that is not its own.
// It names the receipt only to the agent that made it.
func TestDuplicateIntentNamesOnlyTheAgentsOwnReceipt(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	unknown := e.post(t, "/blog/fail504", "a-dup", `{"title":"d"}`)
	idA := unknown.problem(t).ReceiptID
	if idA == 0 {
		t.Fatalf("set-up call: %d %s", unknown.status, unknown.body)
	}
	b := e.do(t, "POST", "/blog/fail504", `{"title":"d"}`, "Authorization", "Bearer "+tokenB, "Idempotency-Key", "b-dup")
	p := b.problem(t)
	if p.Type != gateway.ProblemDuplicateIntent.URI() || p.ExistingReceiptID != 0 || p.ReceiptID != 0 || p.WaitURL != "" ||
		strings.Contains(p.Detail, strconv.FormatInt(idA, 10)) || b.header.Get(gateway.HeaderReceiptID) != "" {
		t.Fatalf("B's duplicate of A's call: %d %v %s; want a duplicate-intent refusal naming no receipt", b.status, b.header, b.body)
	}
	a := e.post(t, "/blog/fail504", "a-dup-2", `{"title":"d"}`)
	if p := a.problem(t); p.Type != gateway.ProblemDuplicateIntent.URI() || p.ExistingReceiptID != idA || p.WaitURL == "" {
		t.Fatalf("A's own duplicate: %d %s; want its receipt %d named", a.status, a.body, idA)
	}
	if n := up.count("/api/fail504"); n != 1 {
		t.Fatalf("the upstream got %d requests, want 1", n)
	}
}
