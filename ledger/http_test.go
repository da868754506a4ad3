package ledger_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Every request carries credentials in the places an API client puts them;
// none of them may reach the database or an error's text.
const (
	httpSecretToken = "SECRET-TOKEN-7f3a"
	httpSecretQuery = "SECRET-QUERY-91c2"
	httpSecretPass  = "SECRET-PASS-04be"
)

// httpEnv is one test's database, ledger and fake API.
type httpEnv struct {
	pool     *pgxpool.Pool
	ledger   *ledger.Client
	requests atomic.Int32
	// release is closed when the test ends, to let hanging handlers go.
	release chan struct{}
	// arrived is closed when the first request reaches the handler.
	arrived     chan struct{}
	arrivedOnce sync.Once

	mu sync.Mutex
	// stateSeen is the receipt's state in the database when the request
	// reached the server, by idempotency key.
	stateSeen map[string]statemachine.State
}

// newHTTPEnv returns an environment on a fresh database.
func newHTTPEnv(t *testing.T) *httpEnv {
	t.Helper()
	return newHTTPEnvOn(t, pgtest.NewPool(t))
}

// newHTTPEnvOn returns an environment on pool, for subtests that share a
// database (their idempotency keys and payloads differ).
func newHTTPEnvOn(t *testing.T, pool *pgxpool.Pool) *httpEnv {
	t.Helper()
	l, err := ledger.New(pool, "agent:http-test")
	if err != nil {
		t.Fatal(err)
	}
	return &httpEnv{pool: pool, ledger: l, release: make(chan struct{}), arrived: make(chan struct{}),
		stateSeen: map[string]statemachine.State{}}
}

// serve starts a server whose handler first reads the request, records the
// receipt's state as the database holds it at that moment, then runs h.
func (env *httpEnv) serve(t *testing.T, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		env.requests.Add(1)
		if _, err := io.ReadAll(r.Body); err != nil {
			t.Errorf("server: reading the request: %v", err)
		}
		key := r.Header.Get("X-Test-Key")
		var state string
		err := env.pool.QueryRow(context.Background(),
			`SELECT state FROM reconciler.receipts WHERE idempotency_key = $1`, key).Scan(&state)
		if err != nil {
			t.Errorf("server: receipt %q: %v", key, err)
		}
		env.mu.Lock()
		env.stateSeen[key] = statemachine.State(state)
		env.mu.Unlock()
		env.arrivedOnce.Do(func() { close(env.arrived) })
		h(w, r)
	}))
	// Cleanups run last-in first-out: release hanging handlers, then close.
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(env.release) })
	return srv
}

func (env *httpEnv) seen(key string) statemachine.State {
	env.mu.Lock()
	defer env.mu.Unlock()
	return env.stateSeen[key]
}

// testHTTPClient returns a client with its own connections, whose resolver
// asks a local DNS server that answers NXDOMAIN to everything, so a lookup
// fails at DNS without any network.
func testHTTPClient(t *testing.T, timeout time.Duration) *http.Client {
	t.Helper()
	dialer := &net.Dialer{Timeout: 5 * time.Second, Resolver: nxdomainResolver(t)}
	tr := &http.Transport{DialContext: dialer.DialContext, ForceAttemptHTTP2: false}
	t.Cleanup(tr.CloseIdleConnections)
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	return &http.Client{Transport: tr, Timeout: timeout}
}

func nxdomainResolver(t *testing.T) *net.Resolver {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, addr, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if resp := nxdomain(buf[:n]); resp != nil {
				_, _ = pc.WriteTo(resp, addr)
			}
		}
	}()
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", pc.LocalAddr().String())
	}}
}

// nxdomain answers a DNS query with its question and RCODE 3 (name error).
func nxdomain(q []byte) []byte {
	if len(q) < 12 {
		return nil
	}
	i := 12
	for i < len(q) && q[i] != 0 {
		i += int(q[i]) + 1
	}
	i += 1 + 4 // the root label, QTYPE, QCLASS
	if i > len(q) {
		return nil
	}
	resp := append([]byte(nil), q[:i]...)
	resp[2] = 0x80 | q[2]&0x79 // QR, the query's opcode and RD
	resp[3] = 0x80 | 3         // RA, NXDOMAIN
	clear(resp[6:12])          // no answer, authority or additional records
	return resp
}

// deadURL returns a URL on a loopback port nothing listens on.
func deadURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

// withCredentials puts a password in base's user info and a key in its query.
func withCredentials(t *testing.T, base, path string) string {
	t.Helper()
	u, err := url.Parse(base + path)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("agent", httpSecretPass)
	u.RawQuery = url.Values{"api_key": {httpSecretQuery}}.Encode()
	return u.String()
}

func articleCall(t *testing.T, rawURL, name string) (ledger.Intent, *http.Request) {
	t.Helper()
	key := ledger.Key("task-http", name, "articles.create")
	payload := fmt.Sprintf(`{"title":"Outcome unknown","case":%q}`, name)
	req, err := http.NewRequest(http.MethodPost, rawURL, strings.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+httpSecretToken)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Test-Key", key)
	return ledger.Intent{
		IdempotencyKey: key,
		Operation:      "articles.create",
		Dependency:     "blog-api",
		// Method and Target come from the request.
		Payload: json.RawMessage(payload),
	}, req
}

func writeJSON(w http.ResponseWriter, status int, body string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	io.WriteString(w, body)
}

func status(code int, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) { writeJSON(w, code, body) }
}

func hijack(t *testing.T, w http.ResponseWriter, then func(net.Conn)) {
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		t.Errorf("hijack: %v", err)
		return
	}
	_ = buf.Flush()
	then(conn)
	conn.Close()
}

func only(code int, v ledger.Verdict) func(ledger.Exchange) (ledger.Verdict, bool) {
	return func(ex ledger.Exchange) (ledger.Verdict, bool) {
		if ex.Status() == code {
			return v, true
		}
		return ledger.Verdict{}, false
	}
}

type httpWant struct {
	state      statemachine.State
	externalID string
	code       string // recorded CallError.Code; "" for succeeded
	httpStatus int
	retryable  bool
	sent       bool
	err        error // the sentinel Do's error matches; nil for success
}

func TestHTTPDoClassifiesAndSettles(t *testing.T) {
	rejected := func(code string, status int, retryable bool) httpWant {
		return httpWant{state: statemachine.Rejected, code: code, httpStatus: status, retryable: retryable,
			sent: true, err: ledger.ErrRejected}
	}
	unknown := func(code string, status int) httpWant {
		return httpWant{state: statemachine.OutcomeUnknown, code: code, httpStatus: status, sent: true,
			err: ledger.ErrOutcomeUnknown}
	}
	notSent := httpWant{state: statemachine.Rejected, code: ledger.CodeNotSent, retryable: true, err: ledger.ErrNotSent}
	dataID, err := ledger.ExternalIDAt("/data/id")
	if err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name string
		// handler answers on a live server; without it, url names where
		// the request goes.
		handler    func(t *testing.T, env *httpEnv) http.HandlerFunc
		url        func(t *testing.T) string
		classify   func(ledger.Exchange) (ledger.Verdict, bool)
		externalID func([]byte) (string, error)
		timeout    time.Duration
		want       httpWant
	}{
		{name: "201 created", handler: fixed(status(201, `{"id":"art_42","title":"Outcome unknown"}`)),
			want: httpWant{state: statemachine.Succeeded, externalID: "art_42", sent: true}},
		{name: "200 numeric id at a pointer", handler: fixed(status(200, `{"data":{"id":12345678901234567890}}`)),
			externalID: dataID,
			want:       httpWant{state: statemachine.Succeeded, externalID: "12345678901234567890", sent: true}},
		{name: "204 no content", handler: fixed(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }),
			want: httpWant{state: statemachine.Succeeded, sent: true}},
		{name: "400", handler: fixed(status(400, `{"error":"title too long"}`)),
			want: rejected("http_400", 400, false)},
		{name: "409 already exists, overridden", handler: fixed(status(409, `{"error":"exists","id":"art_7"}`)),
			classify: only(409, ledger.Verdict{Outcome: ledger.OutcomeSucceeded}),
			want:     httpWant{state: statemachine.Succeeded, externalID: "art_7", sent: true}},
		{name: "409 without override", handler: fixed(status(409, `{"error":"exists","id":"art_7"}`)),
			want: rejected("http_409", 409, false)},
		{name: "429", handler: fixed(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "3")
			writeJSON(w, 429, `{"error":"slow down"}`)
		}), want: rejected(ledger.CodeRateLimited, 429, true)},
		{name: "500", handler: fixed(status(500, `{"error":"boom"}`)), want: unknown("http_500", 500)},
		{name: "502", handler: fixed(status(502, `<html>bad gateway</html>`)), want: unknown("http_502", 502)},
		{name: "503 default", handler: fixed(status(503, `{}`)), want: unknown("http_503", 503)},
		{name: "503 overridden", handler: fixed(status(503, `{}`)),
			classify: only(503, ledger.Verdict{Outcome: ledger.OutcomeRejected, Retryable: true}),
			want:     rejected("http_503", 503, true)},
		{name: "504", handler: fixed(status(504, `{}`)), want: unknown("http_504", 504)},
		{name: "200 truncated by content-length", handler: fixed(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(200)
			io.WriteString(w, `{"id":"art_1","tit`)
		}), want: unknown(ledger.CodeTruncatedBody, 200)},
		{name: "200 truncated by close", handler: func(t *testing.T, env *httpEnv) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				hijack(t, w, func(c net.Conn) {
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"+
						`{"id":"art_1","tit`)
				})
			}
		}, want: unknown(ledger.CodeMalformedBody, 200)},
		{name: "hang past the client timeout", timeout: 200 * time.Millisecond,
			handler: func(t *testing.T, env *httpEnv) http.HandlerFunc {
				return func(w http.ResponseWriter, r *http.Request) {
					select {
					case <-env.release:
					case <-r.Context().Done():
					}
				}
			}, want: unknown(ledger.CodeTimeout, 0)},
		{name: "connection closed after the request", handler: func(t *testing.T, env *httpEnv) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { hijack(t, w, func(net.Conn) {}) }
		}, want: unknown(ledger.CodeConnectionClosed, 0)},
		{name: "dial refused", url: deadURL, want: notSent},
		{name: "unresolvable host", url: func(*testing.T) string { return "http://reconciler-test.invalid" },
			want: notSent},
	}
	pool := pgtest.NewPool(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			base := ""
			if tc.handler != nil {
				base = env.serve(t, tc.handler(t, env)).URL
			} else {
				base = tc.url(t)
			}
			in, req := articleCall(t, withCredentials(t, base, "/api/articles"), tc.name)
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, tc.timeout),
				Classify: tc.classify, ExternalID: tc.externalID}

			res, err := caller.Do(context.Background(), in, req)
			if res == nil {
				t.Fatalf("Do returned no result: %v", err)
			}
			r := res.Receipt
			if tc.want.err == nil && err != nil {
				t.Fatalf("Do: %v", err)
			}
			if tc.want.err != nil {
				if !errors.Is(err, tc.want.err) {
					t.Fatalf("Do error = %v, want %v", err, tc.want.err)
				}
				var oe *ledger.OutcomeError
				if !errors.As(err, &oe) || oe.Receipt == nil || oe.Receipt.ID != r.ID {
					t.Fatalf("Do error %v is not an OutcomeError carrying receipt %d", err, r.ID)
				}
				if strings.Contains(err.Error(), "SECRET") {
					t.Errorf("the error's text holds a credential: %v", err)
				}
			}
			if r.State != tc.want.state || r.ExternalID != tc.want.externalID {
				t.Errorf("receipt is %s with external id %q, want %s with %q", r.State, r.ExternalID, tc.want.state, tc.want.externalID)
			}
			if r.Method != "POST" || r.Target != "/api/articles" {
				t.Errorf("receipt intent is %s %s, want POST /api/articles", r.Method, r.Target)
			}
			if res.Sent != tc.want.sent {
				t.Errorf("Result.Sent = %v, want %v", res.Sent, tc.want.sent)
			}
			if tc.want.httpStatus != 0 {
				if res.Response == nil || res.Response.StatusCode != tc.want.httpStatus {
					t.Errorf("Result.Response = %v, want status %d", res.Response, tc.want.httpStatus)
				} else if b, _ := io.ReadAll(res.Response.Body); !bytes.Equal(b, res.Body) {
					t.Errorf("Response.Body reads %q, Result.Body is %q", b, res.Body)
				}
			}

			if tc.handler != nil {
				if n := env.requests.Load(); n != 1 {
					t.Errorf("server saw %d requests, want 1", n)
				}
				if got := env.seen(in.IdempotencyKey); got != statemachine.Submitted {
					t.Errorf("when the request reached the server the receipt was %q, want submitted", got)
				}
			}
			assertHTTPHistory(t, env, r.ID, tc.want)
			assertNoCredentials(t, env.pool)
		})
	}
}

// fixed adapts a handler that needs no test state.
func fixed(h http.HandlerFunc) func(*testing.T, *httpEnv) http.HandlerFunc {
	return func(*testing.T, *httpEnv) http.HandlerFunc { return h }
}

func assertHTTPHistory(t *testing.T, env *httpEnv, id int64, want httpWant) {
	t.Helper()
	events, err := env.ledger.History(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var path []statemachine.State
	for _, e := range events {
		path = append(path, e.To)
	}
	wantPath := []statemachine.State{statemachine.Planned, statemachine.Submitted, want.state}
	if fmt.Sprint(path) != fmt.Sprint(wantPath) {
		t.Fatalf("history %v, want %v", path, wantPath)
	}
	last := events[len(events)-1]
	var detail struct {
		Error *ledger.CallError `json:"error"`
		Extra map[string]any    `json:"extra"`
	}
	if err := json.Unmarshal(last.Detail, &detail); err != nil {
		t.Fatalf("detail %s: %v", last.Detail, err)
	}
	if sent, _ := detail.Extra["sent"].(bool); sent != want.sent {
		t.Errorf("recorded sent = %v, want %v (detail %s)", detail.Extra["sent"], want.sent, last.Detail)
	}
	if want.code == "" {
		if len(last.Error) != 0 && string(last.Error) != "null" {
			t.Errorf("succeeded event records an error: %s", last.Error)
		}
		if last.ExternalID != want.externalID {
			t.Errorf("event external id %q, want %q", last.ExternalID, want.externalID)
		}
		return
	}
	var ce ledger.CallError
	if err := json.Unmarshal(last.Error, &ce); err != nil {
		t.Fatalf("event error %s: %v", last.Error, err)
	}
	if ce.Code != want.code || ce.HTTPStatus != want.httpStatus || ce.Retryable != want.retryable || ce.Message == "" {
		t.Errorf("recorded error %+v, want code %s, http_status %d, retryable %v and a message",
			ce, want.code, want.httpStatus, want.retryable)
	}
	t.Logf("recorded error: %s", last.Error)
}

// assertNoCredentials scans every stored receipt and event for the
// request's credentials.
func assertNoCredentials(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var dump string
	err := pool.QueryRow(context.Background(), `
		SELECT coalesce((SELECT string_agg(r::text, E'\n') FROM reconciler.receipts r), '') || E'\n' ||
		       coalesce((SELECT string_agg(e::text, E'\n') FROM reconciler.receipt_events e), '')`).Scan(&dump)
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{httpSecretToken, httpSecretQuery, httpSecretPass, "api_key", "Bearer"} {
		if strings.Contains(dump, secret) {
			t.Errorf("the database holds %q:\n%s", secret, dump)
		}
	}
}

// Re-running a step with the same key sends nothing once the receipt is
// past planned: the agent gets the recorded outcome back.
func TestHTTPDoReplaysSettledKey(t *testing.T) {
	cases := []struct {
		name    string
		handler http.HandlerFunc
		state   statemachine.State
		err     error
	}{
		{"outcome unknown", status(504, `{}`), statemachine.OutcomeUnknown, ledger.ErrOutcomeUnknown},
		{"succeeded", status(201, `{"id":"art_9"}`), statemachine.Succeeded, nil},
		{"rejected", status(422, `{"error":"invalid"}`), statemachine.Rejected, ledger.ErrRejected},
	}
	pool := pgtest.NewPool(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			srv := env.serve(t, tc.handler)
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
			ctx := context.Background()

			in, req := articleCall(t, srv.URL+"/api/articles", "replay-"+tc.name)
			first, err1 := caller.Do(ctx, in, req)
			if !errors.Is(err1, tc.err) || (tc.err == nil && err1 != nil) {
				t.Fatalf("first Do: %v, want %v", err1, tc.err)
			}
			before, err := env.ledger.History(ctx, first.Receipt.ID)
			if err != nil {
				t.Fatal(err)
			}

			in, req = articleCall(t, srv.URL+"/api/articles", "replay-"+tc.name)
			second, err2 := caller.Do(ctx, in, req)
			if !errors.Is(err2, tc.err) || (tc.err == nil && err2 != nil) {
				t.Fatalf("second Do: %v, want %v", err2, tc.err)
			}
			if n := env.requests.Load(); n != 1 {
				t.Fatalf("server saw %d requests, want 1: the re-run sent again", n)
			}
			if !second.Replayed || second.Sent || second.Response != nil ||
				second.Receipt.ID != first.Receipt.ID || second.Receipt.State != tc.state {
				t.Errorf("second Do = %+v, want a replay of receipt %d in %s", second, first.Receipt.ID, tc.state)
			}
			if second.Receipt.ExternalID != first.Receipt.ExternalID {
				t.Errorf("replayed external id %q, want %q", second.Receipt.ExternalID, first.Receipt.ExternalID)
			}
			var oe1, oe2 *ledger.OutcomeError
			if errors.As(err1, &oe1) && (!errors.As(err2, &oe2) || oe2.Cause == nil || *oe2.Cause != *oe1.Cause) {
				t.Errorf("replayed cause %+v, want the recorded %+v", oe2, oe1.Cause)
			}
			after, err := env.ledger.History(ctx, first.Receipt.ID)
			if err != nil {
				t.Fatal(err)
			}
			if len(after) != len(before) {
				t.Errorf("the re-run added history: %d events, had %d", len(after), len(before))
			}
		})
	}
}

// Concurrent calls of one step send one request: the database lets one
// submit win, and the others get the receipt back without sending.
func TestHTTPDoSameKeyConcurrently(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_1"}`))
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}

	const n = 8
	results := make([]*ledger.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		in, req := articleCall(t, srv.URL+"/api/articles", "concurrent")
		wg.Go(func() { results[i], errs[i] = caller.Do(context.Background(), in, req) })
	}
	wg.Wait()
	if got := env.requests.Load(); got != 1 {
		t.Fatalf("server saw %d requests, want 1", got)
	}
	sent := 0
	for i := range n {
		switch {
		case errs[i] == nil && !results[i].Replayed:
			sent++
		case errs[i] == nil || errors.Is(errs[i], ledger.ErrOutcomeUnknown):
			// A replay: succeeded, or still in flight when it looked.
		default:
			t.Errorf("Do %d: %v", i, errs[i])
		}
	}
	if sent != 1 {
		t.Errorf("%d calls sent and succeeded, want 1", sent)
	}
}

// A POST the server drops after reading it, on a reused keep-alive
// connection, is not resent by the transport, even with an
// Idempotency-Key header that makes net/http consider it replayable: Do
// clears GetBody, so the body cannot be rewound.
func TestHTTPDoNoTransportReplay(t *testing.T) {
	env := newHTTPEnv(t)
	var victim atomic.Int32
	srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.Header.Get("X-Test-Key"), "victim") {
			victim.Add(1)
			hijack(t, w, func(net.Conn) {})
			return
		}
		writeJSON(w, 201, `{"id":"art_1"}`)
	})
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx := context.Background()

	in, req := articleCall(t, srv.URL+"/api/articles", "warm")
	if _, err := caller.Do(ctx, in, req); err != nil {
		t.Fatal(err)
	}
	in, req = articleCall(t, srv.URL+"/api/articles", "victim")
	req.Header.Set("Idempotency-Key", in.IdempotencyKey)
	res, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) {
		t.Fatalf("Do: %v, want outcome unknown", err)
	}
	if n := victim.Load(); n != 1 {
		t.Fatalf("server saw the request %d times, want 1", n)
	}
	events, err := env.ledger.History(ctx, res.Receipt.ID)
	if err != nil {
		t.Fatal(err)
	}
	var detail struct {
		Extra map[string]any `json:"extra"`
	}
	if err := json.Unmarshal(events[len(events)-1].Detail, &detail); err != nil {
		t.Fatal(err)
	}
	if detail.Extra["connection_reused"] != true {
		t.Fatalf("the request went out on a fresh connection (detail %v): the test did not exercise reuse", detail.Extra)
	}
}

// A context canceled after the request left settles the receipt anyway:
// outcome_unknown, recorded with a context detached from the dead one.
func TestHTTPDoContextCanceledAfterSend(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-env.release:
		case <-r.Context().Done():
		}
	})
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-env.arrived
		cancel()
	}()

	in, req := articleCall(t, srv.URL+"/api/articles", "canceled")
	res, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Do: %v, want outcome unknown wrapping context.Canceled", err)
	}
	if res.Receipt.State != statemachine.OutcomeUnknown {
		t.Fatalf("receipt is %s, want outcome_unknown", res.Receipt.State)
	}
	assertHTTPHistory(t, env, res.Receipt.ID, httpWant{state: statemachine.OutcomeUnknown,
		code: ledger.CodeCanceled, sent: true})
	got, err := env.ledger.Get(context.Background(), res.Receipt.ID)
	if err != nil || got.State != statemachine.OutcomeUnknown {
		t.Fatalf("stored receipt %+v, %v: want outcome_unknown", got, err)
	}
}

// A planned receipt whose caller died before submitting is resumed by the
// re-run: nothing was sent, so sending now is the first send.
func TestHTTPDoResumesPlanned(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_3"}`))
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	in, req := articleCall(t, srv.URL+"/api/articles", "resume")
	in.Method, in.Target = "POST", "/api/articles"
	if _, err := env.ledger.Plan(context.Background(), in); err != nil {
		t.Fatal(err)
	}
	res, err := caller.Do(context.Background(), in, req)
	if err != nil || res.Replayed || res.Receipt.State != statemachine.Succeeded || res.Receipt.ExternalID != "art_3" {
		t.Fatalf("Do = %+v, %v: want a fresh send that succeeded with art_3", res, err)
	}
}

func TestHTTPDoRefusesMismatchedMethod(t *testing.T) {
	env := newHTTPEnv(t)
	caller := &ledger.Caller{Ledger: env.ledger}
	in, req := articleCall(t, "http://127.0.0.1:1/api/articles", "mismatch")
	in.Method = "PUT"
	if _, err := caller.Do(context.Background(), in, req); !errors.Is(err, ledger.ErrInvalidIntent) {
		t.Fatalf("Do: %v, want ErrInvalidIntent", err)
	}
	var n int
	if err := env.pool.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d receipts (%v), want none", n, err)
	}
}

func TestHTTPExternalIDAt(t *testing.T) {
	cases := []struct {
		pointer, body, want string
		err                 bool
	}{
		{"/id", `{"id":"a1"}`, "a1", false},
		{"/id", `{"id":42}`, "42", false},
		{"/id", `{"id":null}`, "", false},
		{"/id", `{"other":1}`, "", false},
		{"/id", ``, "", false},
		{"/data/0/id", `{"data":[{"id":"x"}]}`, "x", false},
		{"/a~1b/c~0d", `{"a/b":{"c~d":"esc"}}`, "esc", false},
		// RFC 6901 array indexes are plain digits: "+1" and "-0" name
		// nothing (strconv.Atoi would read them as 1 and 0).
		{"/data/+1/id", `{"data":[{"id":"x"},{"id":"y"}]}`, "", false},
		{"/data/-0/id", `{"data":[{"id":"x"}]}`, "", false},
		{"/data/01/id", `{"data":[{"id":"x"},{"id":"y"}]}`, "", false},
		{"/id", `{"id":{"nested":1}}`, "", true},
		{"/id", `{"id":"trunc`, "", true},
		{"/id", `not json`, "", true},
	}
	for _, tc := range cases {
		f, err := ledger.ExternalIDAt(tc.pointer)
		if err != nil {
			t.Fatalf("ExternalIDAt(%q): %v", tc.pointer, err)
		}
		got, err := f([]byte(tc.body))
		if got != tc.want || (err != nil) != tc.err {
			t.Errorf("ExternalIDAt(%q)(%s) = %q, %v; want %q, error %v", tc.pointer, tc.body, got, err, tc.want, tc.err)
		}
	}
	for _, bad := range []string{"id", "/a~2"} {
		if _, err := ledger.ExternalIDAt(bad); err == nil {
			t.Errorf("ExternalIDAt(%q) accepted a malformed pointer", bad)
		}
	}
}

// Running a step again after it was rejected as retryable (nothing was sent)
// sends attempt 2, linked to attempt 1; after a deterministic rejection it
// sends nothing.
func TestHTTPDoRetriesRetryableRejection(t *testing.T) {
	pool := pgtest.NewPool(t)
	env := newHTTPEnvOn(t, pool)
	ctx := context.Background()
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}

	// The API is down: nothing is sent.
	in, req := articleCall(t, deadURL(t)+"/api/articles", "retry-after-not-sent")
	first, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrNotSent) || !first.Receipt.Retryable {
		t.Fatalf("first Do: %v (retryable %v), want ErrNotSent on a retryable receipt", err, first.Receipt.Retryable)
	}

	// It is back: the same step is attempt 2.
	srv := env.serve(t, status(201, `{"id":"art_2"}`))
	in, req = articleCall(t, srv.URL+"/api/articles", "retry-after-not-sent")
	second, err := caller.Do(ctx, in, req)
	if err != nil {
		t.Fatalf("second Do: %v", err)
	}
	r := second.Receipt
	if second.Replayed || r.Attempt != 2 || r.RetryOf != first.Receipt.ID || r.State != statemachine.Succeeded ||
		r.ExternalID != "art_2" || ledger.LogicalKey(r.IdempotencyKey) != in.IdempotencyKey {
		t.Fatalf("second Do = %+v, want attempt 2 of receipt %d, succeeded", r, first.Receipt.ID)
	}
	if n := env.requests.Load(); n != 1 {
		t.Fatalf("server saw %d requests, want 1", n)
	}

	// A deterministic 4xx is not retryable: the step replays its rejection.
	env = newHTTPEnvOn(t, pool) // one server per env
	caller = &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	srv400 := env.serve(t, status(400, `{"error":"bad"}`))
	in, req = articleCall(t, srv400.URL+"/api/articles", "no-retry-after-400")
	if _, err := caller.Do(ctx, in, req); !errors.Is(err, ledger.ErrRejected) {
		t.Fatalf("first Do: %v, want ErrRejected", err)
	}
	in, req = articleCall(t, srv400.URL+"/api/articles", "no-retry-after-400")
	third, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrRejected) || !third.Replayed || third.Receipt.Attempt != 1 {
		t.Fatalf("re-run after a 400 = %+v, %v; want the recorded rejection replayed", third, err)
	}
	if _, err := env.ledger.Retry(ctx, third.Receipt, in); !errors.Is(err, ledger.ErrStateConflict) {
		t.Fatalf("Retry of a non-retryable rejection: %v, want ErrStateConflict", err)
	}
}

// Known is called with the receipt a known key names before Do replays,
// submits or retries anything, and its refusal stops Do with nothing sent;
// a new key's call never calls it.
func TestHTTPDoKnownHookGuardsAKnownKey(t *testing.T) {
	env := newHTTPEnv(t)
	ctx := context.Background()
	errNotYours := errors.New("not yours")
	var seen []int64
	refuse := true
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0),
		Known: func(_ context.Context, r *ledger.Receipt) error {
			seen = append(seen, r.ID)
			if refuse {
				return errNotYours
			}
			return nil
		}}

	// A new key: sent, the hook not called. The API is down, so the
	// receipt may be retried.
	in, req := articleCall(t, deadURL(t)+"/api/articles", "known-hook")
	first, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrNotSent) || !first.Receipt.Retryable || len(seen) != 0 {
		t.Fatalf("first Do: %v, hook saw %v; want ErrNotSent, a retryable receipt, the hook not called", err, seen)
	}

	// The same key again, the API back: the hook refuses, nothing is sent,
	// no attempt 2 is planned.
	srv := env.serve(t, status(201, `{"id":"art_k"}`))
	in, req = articleCall(t, srv.URL+"/api/articles", "known-hook")
	if res, err := caller.Do(ctx, in, req); !errors.Is(err, errNotYours) || res != nil {
		t.Fatalf("Do refused by the hook = %+v, %v; want its error and no result", res, err)
	}
	if n := env.requests.Load(); n != 0 || len(seen) != 1 || seen[0] != first.Receipt.ID {
		t.Fatalf("server saw %d requests, hook saw %v; want none sent, the hook called with receipt %d", n, seen, first.Receipt.ID)
	}
	var attempts int
	if err := env.pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&attempts); err != nil || attempts != 1 {
		t.Fatalf("receipts: %d, %v; want only the first attempt", attempts, err)
	}

	// Allowed, the same key becomes attempt 2.
	refuse = false
	in, req = articleCall(t, srv.URL+"/api/articles", "known-hook")
	second, err := caller.Do(ctx, in, req)
	if err != nil || second.Receipt.Attempt != 2 || env.requests.Load() != 1 {
		t.Fatalf("Do allowed by the hook = %+v, %v; want attempt 2 sent once", second, err)
	}
}

// failReads fails (context canceled) every read of one receipt by id, the
// read that follows the database's answer that a key is known.
type failReads struct{}

func (failReads) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(strings.TrimSpace(d.SQL), "SELECT") && strings.HasSuffix(d.SQL, "FROM reconciler.receipts WHERE id = $1") {
		c, cancel := context.WithCancel(ctx)
		cancel()
		return c
	}
	return ctx
}

func (failReads) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// When the database answered that a retry key is known (its attempt
// planned by an earlier call) and reading that receipt failed, the error
// still said ErrKnownKey, with no receipt: Do took it for the key's
// receipt, to be carried on from, and panicked on it (a nil receipt). The
// failure is Do's error now, nothing sent.
func TestHTTPDoKnownKeyWhoseReadFailsIsAnError(t *testing.T) {
	env := newHTTPEnv(t)
	ctx := context.Background()
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	in, req := articleCall(t, deadURL(t)+"/api/articles", "known-read-fails")
	first, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrNotSent) || !first.Receipt.Retryable {
		t.Fatalf("first Do: %v; want ErrNotSent and a retryable receipt", err)
	}
	// Attempt 2 planned by a call that stopped before its submit.
	if _, err := env.ledger.Retry(ctx, first.Receipt, in); err != nil {
		t.Fatal(err)
	}

	cfg := env.pool.Config()
	cfg.ConnConfig.Tracer = failReads{}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	failing, err := ledger.New(pool, "agent:http-test")
	if err != nil {
		t.Fatal(err)
	}
	srv := env.serve(t, status(201, `{"id":"art_r"}`))
	caller = &ledger.Caller{Ledger: failing, HTTP: testHTTPClient(t, 0)}
	in, req = articleCall(t, srv.URL+"/api/articles", "known-read-fails")
	res, err := caller.Do(ctx, in, req)
	if err == nil || errors.Is(err, ledger.ErrKnownKey) || res != nil || env.requests.Load() != 0 {
		t.Fatalf("Do = %+v, %v, %d sent; want the read's failure, not ErrKnownKey, no result, nothing sent", res, err, env.requests.Load())
	}
}
