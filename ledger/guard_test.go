package ledger_test

// Tests of the agent side of issue 7: each closes one path of the issue
// (or confirms and fixes one of its suspicions) and says which.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// lastDetail returns the detail of the receipt's latest event.
func lastDetail(t *testing.T, env *httpEnv, id int64) (ledger.CallError, map[string]any) {
	t.Helper()
	events, err := env.ledger.History(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Error *ledger.CallError `json:"error"`
		Extra map[string]any    `json:"extra"`
	}
	if err := json.Unmarshal(events[len(events)-1].Detail, &d); err != nil {
		t.Fatal(err)
	}
	var ce ledger.CallError
	if d.Error != nil {
		ce = *d.Error
	}
	return ce, d.Extra
}

// gatedDialer dials only once its gate is open (or its context ends).
type gatedDialer struct {
	gate    chan struct{}
	dialing chan struct{} // closed when the first dial starts
	once    sync.Once
	dials   atomic.Int32
}

func newGatedDialer() *gatedDialer {
	return &gatedDialer{gate: make(chan struct{}), dialing: make(chan struct{})}
}

func (g *gatedDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	g.dials.Add(1)
	g.once.Do(func() { close(g.dialing) })
	select {
	case <-g.gate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

// gatedClient is an HTTP/1 client whose dials wait for g's gate.
func gatedClient(t *testing.T, g *gatedDialer) *http.Client {
	t.Helper()
	tr := &http.Transport{DialContext: g.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// Issue 7, path 3: the send deadline. A request for which the transport
// has no connection within MaxSendDelay of the submit is canceled and never
// written: the receipt is rejected, retryable, not_sent (Do's error matches
// ErrNotSent and ErrSendDeadline), and the server never sees it; a dial
// within the deadline succeeds.
func TestIssue7SendDeadlineSlowDial(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_1"}`))
	dialer := newGatedDialer()
	t.Cleanup(func() {
		select {
		case <-dialer.gate:
		default:
			close(dialer.gate)
		}
	})
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: gatedClient(t, dialer)}
	ctx := context.Background()

	in, req := articleCall(t, srv.URL+"/api/articles", "slow-dial")
	in.MaxSendDelay = 300 * time.Millisecond
	res, err := caller.Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrNotSent) || !errors.Is(err, ledger.ErrSendDeadline) {
		t.Fatalf("Do with a dial slower than the deadline: %v, want ErrNotSent and ErrSendDeadline", err)
	}
	r := res.Receipt
	if r.State != statemachine.Rejected || !r.Retryable || res.Sent {
		t.Fatalf("receipt %s retryable %v sent %v, want rejected, retryable, not sent", r.State, r.Retryable, res.Sent)
	}
	if r.MaxSendDelay != 300*time.Millisecond || !r.SendDeadline.Equal(r.SubmittedAt.Add(r.MaxSendDelay)) {
		t.Errorf("receipt max_send_delay %v, send deadline %v, submitted %v: want 300ms and submitted+300ms",
			r.MaxSendDelay, r.SendDeadline, r.SubmittedAt)
	}
	ce, extra := lastDetail(t, env, r.ID)
	if ce.Code != ledger.CodeNotSent || !ce.Retryable || !strings.Contains(ce.Message, "send deadline") {
		t.Errorf("recorded error %+v, want not_sent, retryable, a message about the send deadline", ce)
	}
	if extra["send_deadline"] != true || extra["sent"] != false {
		t.Errorf("recorded extra %v, want send_deadline and not sent", extra)
	}

	// Let the slow dial (and any later one) through: the canceled request
	// is never written on the connection it produced. The same step runs
	// again, as attempt 2 (with the default deadline, so a slow test
	// machine cannot miss it), and is the only request the server sees.
	close(dialer.gate)
	in, req = articleCall(t, srv.URL+"/api/articles", "slow-dial")
	res, err = caller.Do(ctx, in, req)
	if err != nil || res.Receipt.Attempt != 2 || res.Receipt.State != statemachine.Succeeded {
		t.Fatalf("re-run after the gate opened = %+v, %v: want attempt 2 succeeded", res, err)
	}
	if n := env.requests.Load(); n != 1 {
		t.Fatalf("server saw %d requests, want 1 (only attempt 2)", n)
	}
}

// Issue 7, path 3: the deadline is measured from before the submit. A
// submit held up (here by a row lock) past the delay leaves no time to
// send: Do sends nothing, although the database's own deadline
// (submitted_at + max_send_delay, stamped when the submit finally ran) is
// still ahead when Do gives up.
func TestIssue7SendDeadlineCountsFromBeforeSubmit(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_1"}`))
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx := context.Background()
	const delay = 200 * time.Millisecond

	in, req := articleCall(t, srv.URL+"/api/articles", "slow-submit")
	in.Method, in.Target, in.MaxSendDelay = "POST", "/api/articles", delay
	planned, err := env.ledger.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := env.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1 FROM reconciler.receipts WHERE id = $1 FOR UPDATE`, planned.ID); err != nil {
		t.Fatal(err)
	}

	type outcome struct {
		res *ledger.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := caller.Do(ctx, in, req)
		done <- outcome{res, err}
	}()
	// Wait until the submit is blocked on the lock: Do has taken its t0.
	testkit.WaitFor(t, "the submit to wait for the row lock", func() bool {
		var n int
		err := env.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			  AND query LIKE '%UPDATE reconciler.receipts%'`).Scan(&n)
		return err == nil && n > 0
	})
	// t0 is before now, so t0+delay is past once delay has elapsed.
	<-time.After(delay)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if !errors.Is(got.err, ledger.ErrNotSent) || !errors.Is(got.err, ledger.ErrSendDeadline) {
		t.Fatalf("Do after a submit slower than the delay: %v, want ErrNotSent and ErrSendDeadline", got.err)
	}
	if n := env.requests.Load(); n != 0 {
		t.Fatalf("server saw %d requests, want none", n)
	}
	// The database's deadline was still ahead when Do recorded the
	// rejection: the local deadline ended first.
	var ahead bool
	if err := env.pool.QueryRow(ctx, `SELECT e.at < r.submitted_at + r.max_send_delay
		FROM reconciler.receipts r JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.to_state = 'rejected'
		WHERE r.id = $1`, planned.ID).Scan(&ahead); err != nil {
		t.Fatal(err)
	}
	if !ahead {
		t.Errorf("Do rejected the receipt after the database's send deadline: the local deadline started too late")
	}
}

// The same on the common path, a new key planned and submitted in one
// statement (PlanAndSubmit): Do's clock starts before that INSERT, so an
// INSERT held up past the delay (here by a lock on the table) leaves Do
// sending nothing, and the rejection is recorded while the database's
// deadline, stamped when the INSERT finally ran, is still ahead.
func TestIssue7SendDeadlineCountsFromBeforePlanAndSubmit(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_1"}`))
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx := context.Background()
	const delay = 200 * time.Millisecond

	in, req := articleCall(t, srv.URL+"/api/articles", "slow-plan-and-submit")
	in.Method, in.Target, in.MaxSendDelay = "POST", "/api/articles", delay
	tx, err := env.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE reconciler.receipts IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		res *ledger.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := caller.Do(ctx, in, req)
		done <- outcome{res, err}
	}()
	testkit.WaitFor(t, "the INSERT to wait for the table lock", func() bool {
		var n int
		err := env.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'
			  AND query LIKE '%INSERT INTO reconciler.receipts%'`).Scan(&n)
		return err == nil && n > 0
	})
	<-time.After(delay)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if !errors.Is(got.err, ledger.ErrNotSent) || !errors.Is(got.err, ledger.ErrSendDeadline) {
		t.Fatalf("Do after a PlanAndSubmit slower than the delay: %v, want ErrNotSent and ErrSendDeadline", got.err)
	}
	if n := env.requests.Load(); n != 0 {
		t.Fatalf("server saw %d requests, want none", n)
	}
	if got.res == nil || got.res.Receipt == nil {
		t.Fatalf("Do returned no receipt: %v", got.err)
	}
	var ahead bool
	var version int
	if err := env.pool.QueryRow(ctx, `SELECT e.at < r.submitted_at + r.max_send_delay, r.version
		FROM reconciler.receipts r JOIN reconciler.receipt_events e ON e.receipt_id = r.id AND e.to_state = 'rejected'
		WHERE r.id = $1`, got.res.Receipt.ID).Scan(&ahead, &version); err != nil {
		t.Fatal(err)
	}
	if version != 3 {
		t.Errorf("receipt version %d, want 3 (planned and submitted in one statement, then rejected)", version)
	}
	if !ahead {
		t.Errorf("Do rejected the receipt after the database's send deadline: the local deadline started too late")
	}
}

// blockingBody is a request body of a known length whose first Read waits
// for release.
type blockingBody struct {
	data    *strings.Reader
	reading chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *blockingBody) Read(p []byte) (int, error) {
	b.once.Do(func() {
		close(b.reading)
		<-b.release
	})
	return b.data.Read(p)
}

// Issue 7, path 3: on an HTTP/1 connection the send deadline is the
// connection's write deadline, so a request whose bytes are not all written
// by then (here a body that stalls past it, after the headers went out)
// writes nothing more: the server never receives the body, and the receipt
// is outcome_unknown (a connection was had, so Do stays conservative). The
// deadline is cleared once a request is written, so the pooled connection
// serves later requests.
func TestIssue7SendDeadlineBoundsHTTP1Writes(t *testing.T) {
	env := newHTTPEnv(t)
	client := testHTTPClient(t, 0)
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: client}
	ctx := context.Background()
	// Long enough for the submit and the dial even on a loaded machine.
	const delay = 500 * time.Millisecond

	t.Run("stalled body", func(t *testing.T) {
		type read struct {
			n   int
			err error
		}
		reads := make(chan read, 1)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, err := io.ReadAll(r.Body)
			reads <- read{len(b), err}
			if err == nil {
				writeJSON(w, 201, `{"id":"art_late_body"}`)
			}
		}))
		t.Cleanup(srv.Close)
		in, req := articleCall(t, srv.URL+"/api/articles", "stalled-body")
		in.MaxSendDelay = delay
		payload := string(in.Payload)
		body := &blockingBody{data: strings.NewReader(payload), reading: make(chan struct{}), release: make(chan struct{})}
		req.Body, req.ContentLength, req.GetBody = io.NopCloser(body), int64(len(payload)), nil
		go func() {
			<-body.reading
			// The deadline started before the body was read: it has
			// passed once delay has elapsed since.
			<-time.After(delay)
			close(body.release)
		}()
		res, err := caller.Do(ctx, in, req)
		if !errors.Is(err, ledger.ErrOutcomeUnknown) || res.Receipt.State != statemachine.OutcomeUnknown || !res.Sent {
			t.Fatalf("Do with a body stalled past the deadline: %v (receipt %s, sent %v), want outcome_unknown, sent",
				err, res.Receipt.State, res.Sent)
		}
		if got := <-reads; got.err == nil || got.n != 0 {
			t.Fatalf("server read %d body bytes (error %v): bytes were written after the send deadline", got.n, got.err)
		}
	})

	t.Run("pooled connection reusable", func(t *testing.T) {
		srv := env.serve(t, status(201, `{"id":"art_1"}`))
		in, req := articleCall(t, srv.URL+"/api/articles", "written-in-time")
		in.MaxSendDelay = delay
		before := env.requests.Load()
		if _, err := caller.Do(ctx, in, req); err != nil {
			t.Fatal(err)
		}
		// Past that request's deadline, the connection it used still writes.
		<-time.After(2 * delay)
		var conns, reused atomic.Int32
		trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
			conns.Add(1)
			if info.Reused {
				reused.Add(1)
			}
		}}
		get, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodGet, srv.URL+"/health", nil)
		if err != nil {
			t.Fatal(err)
		}
		get.Header.Set("X-Test-Key", in.IdempotencyKey)
		resp, err := client.Do(get)
		if err != nil {
			t.Fatalf("GET on the pooled connection: %v", err)
		}
		resp.Body.Close()
		if conns.Load() != 1 || reused.Load() != 1 {
			t.Fatalf("GET took %d connections (%d reused), want the pooled one only: its write deadline was left set",
				conns.Load(), reused.Load())
		}
		if n := env.requests.Load() - before; n != 2 {
			t.Fatalf("server saw %d requests, want 2", n)
		}
	})
}

// Issue 7, path 3: an HTTP/2 connection is shared, so Do never sets its
// write deadline: a request whose headers went out in time succeeds however
// late its answer comes, and the connection keeps serving requests after
// that request's deadline.
func TestIssue7SendDeadlineLeavesHTTP2Alone(t *testing.T) {
	env := newHTTPEnv(t)
	// Long enough that the submit (a flushed commit and a TLS handshake,
	// slow on a loaded machine) never uses the whole send deadline.
	const delay = 2 * time.Second
	var protos sync.Map
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		protos.Store(r.Proto, true)
		if r.Header.Get("X-Slow") != "" {
			// Answer after the request's send deadline has passed.
			<-time.After(2 * delay)
		}
		writeJSON(w, 201, `{"id":"art_h2"}`)
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	client := srv.Client()
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: client}
	ctx := context.Background()

	in, req := articleCall(t, srv.URL+"/api/articles", "h2-slow-answer")
	in.MaxSendDelay = delay
	req.Header.Set("X-Slow", "1")
	if res, err := caller.Do(ctx, in, req); err != nil || res.Response.ProtoMajor != 2 {
		t.Fatalf("Do over HTTP/2 with a late answer: %v (response %v), want success over HTTP/2", err, res.Response)
	}
	in, req = articleCall(t, srv.URL+"/api/articles", "h2-after-deadline")
	in.MaxSendDelay = delay
	var reused atomic.Bool
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { reused.Store(info.Reused) }}
	req = req.WithContext(httptrace.WithClientTrace(ctx, trace))
	if _, err := caller.Do(httptrace.WithClientTrace(ctx, trace), in, req); err != nil || !reused.Load() {
		t.Fatalf("second Do on the shared connection: %v (reused %v), want success on the same connection", err, reused.Load())
	}
	if _, ok := protos.Load("HTTP/2.0"); !ok {
		t.Fatalf("the server saw no HTTP/2 request")
	}
}

// Issue 7, path 4: Do never follows a redirect of the call. The 3xx is the
// answer, classified outcome_unknown; what a followed request would have
// answered never reaches the classification, and the call's headers never
// reach the redirect's target.
func TestIssue7NoRedirects(t *testing.T) {
	pool := pgtest.NewPool(t)

	t.Run("303 after POST, then 429 on the GET", func(t *testing.T) {
		env := newHTTPEnvOn(t, pool)
		var gets atomic.Int32
		// The GET the redirect points at would say 429, which would make
		// the step retryable and the POST be sent again.
		other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			gets.Add(1)
			writeJSON(w, 429, `{"error":"slow down"}`)
		}))
		t.Cleanup(other.Close)
		srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", "http://agent:"+httpSecretPass+"@"+strings.TrimPrefix(other.URL, "http://")+
				"/api/articles/art_303?token="+httpSecretQuery)
			w.WriteHeader(http.StatusSeeOther)
		})
		caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
		ctx := context.Background()

		in, req := articleCall(t, srv.URL+"/api/articles", "redirect-303")
		res, err := caller.Do(ctx, in, req)
		if !errors.Is(err, ledger.ErrOutcomeUnknown) || res.Receipt.State != statemachine.OutcomeUnknown {
			t.Fatalf("Do answered 303: %v (receipt %s), want outcome_unknown", err, res.Receipt.State)
		}
		if res.Response == nil || res.Response.StatusCode != http.StatusSeeOther {
			t.Fatalf("Result.Response = %v, want the 303", res.Response)
		}
		ce, extra := lastDetail(t, env, res.Receipt.ID)
		if ce.Code != "http_303" || ce.Retryable || !strings.Contains(ce.Message, "effect likely exists") {
			t.Errorf("recorded error %+v, want http_303, not retryable, saying the effect likely exists", ce)
		}
		loc, _ := extra["location"].(string)
		if !strings.HasSuffix(loc, "/api/articles/art_303") || strings.Contains(loc, "SECRET") || strings.Contains(loc, "?") {
			t.Errorf("recorded location %q, want the path without credentials or query", loc)
		}
		assertNoCredentials(t, env.pool)

		// The step runs again: nothing is sent, the unknown outcome replays.
		in, req = articleCall(t, srv.URL+"/api/articles", "redirect-303")
		again, err := caller.Do(ctx, in, req)
		if !errors.Is(err, ledger.ErrOutcomeUnknown) || !again.Replayed {
			t.Fatalf("re-run: %v (replayed %v), want the unknown outcome replayed", err, again.Replayed)
		}
		if n, g := env.requests.Load(), gets.Load(); n != 1 || g != 0 {
			t.Fatalf("POSTs %d, GETs %d: want the POST once and no GET", n, g)
		}
	})

	// A 307 keeps the method and body: a bodiless DELETE would be replayed
	// as is on the other host, with the call's custom auth header.
	for _, tc := range []struct {
		method string
		status int
	}{{http.MethodDelete, http.StatusTemporaryRedirect}, {http.MethodPost, http.StatusTemporaryRedirect},
		{http.MethodPost, http.StatusFound}} {
		t.Run(fmt.Sprintf("%d of a %s to another host", tc.status, tc.method), func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			var leaked atomic.Int32
			other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				leaked.Add(1)
				if r.Header.Get("X-Api-Key") != "" {
					t.Errorf("the other host received the call's X-Api-Key")
				}
				writeJSON(w, 201, `{"id":"art_elsewhere"}`)
			}))
			t.Cleanup(other.Close)
			srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
				http.Redirect(w, r, other.URL+"/api/articles/art_1", tc.status)
			})
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
			in, req := articleCall(t, srv.URL+"/api/articles/art_1", fmt.Sprint("redirect-", tc.status, tc.method))
			if tc.method == http.MethodDelete {
				del, err := http.NewRequest(http.MethodDelete, req.URL.String(), nil)
				if err != nil {
					t.Fatal(err)
				}
				del.Header = req.Header
				req, in.Payload = del, nil
			}
			req.Header.Set("X-Api-Key", httpSecretToken)
			res, err := caller.Do(context.Background(), in, req)
			if !errors.Is(err, ledger.ErrOutcomeUnknown) || res.Receipt.State != statemachine.OutcomeUnknown {
				t.Fatalf("Do answered %d: %v, want outcome_unknown", tc.status, err)
			}
			if n := leaked.Load(); n != 0 {
				t.Fatalf("the other host saw %d requests, want none", n)
			}
			ce, _ := lastDetail(t, env, res.Receipt.ID)
			if ce.Code != fmt.Sprint("http_", tc.status) || strings.Contains(ce.Message, "likely exists") {
				t.Errorf("recorded error %+v, want http_%d without a claim that the effect exists", ce, tc.status)
			}
		})
	}

	t.Run("302 then 404 does not reject", func(t *testing.T) {
		env := newHTTPEnvOn(t, pool)
		var followed atomic.Int32
		srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/gone" {
				followed.Add(1)
				writeJSON(w, 404, `{"error":"not found"}`)
				return
			}
			w.Header().Set("Location", "/gone")
			w.WriteHeader(http.StatusFound)
		})
		caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
		in, req := articleCall(t, srv.URL+"/api/articles", "redirect-302")
		res, err := caller.Do(context.Background(), in, req)
		if errors.Is(err, ledger.ErrRejected) || res.Receipt.State != statemachine.OutcomeUnknown {
			t.Fatalf("Do answered 302: %v (receipt %s), want outcome_unknown, not rejected", err, res.Receipt.State)
		}
		if n := env.requests.Load(); n != 1 || followed.Load() != 0 {
			t.Fatalf("server saw %d requests (%d followed), want 1 and none followed", n, followed.Load())
		}
	})
}

// Issue 7 (also reported): 408 is outcome_unknown, not retryable, since
// gateways send it after forwarding the request; 425 stays rejected and
// retryable.
func TestIssue7RequestTimeoutIsUnknown(t *testing.T) {
	pool := pgtest.NewPool(t)
	cases := []struct {
		status    int
		state     statemachine.State
		retryable bool
		err       error
	}{
		{http.StatusRequestTimeout, statemachine.OutcomeUnknown, false, ledger.ErrOutcomeUnknown},
		{http.StatusTooEarly, statemachine.Rejected, true, ledger.ErrRejected},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.status), func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			srv := env.serve(t, status(tc.status, `{}`))
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
			in, req := articleCall(t, srv.URL+"/api/articles", fmt.Sprint("status-", tc.status))
			res, err := caller.Do(context.Background(), in, req)
			if !errors.Is(err, tc.err) || res.Receipt.State != tc.state || res.Receipt.Retryable != tc.retryable {
				t.Fatalf("Do answered %d: %v (receipt %s, retryable %v), want %v, %s, retryable %v",
					tc.status, err, res.Receipt.State, res.Receipt.Retryable, tc.err, tc.state, tc.retryable)
			}
			// A re-run sends nothing after a 408 (the reconciler decides).
			in, req = articleCall(t, srv.URL+"/api/articles", fmt.Sprint("status-", tc.status))
			again, _ := caller.Do(context.Background(), in, req)
			if tc.status == http.StatusRequestTimeout && (!again.Replayed || env.requests.Load() != 1) {
				t.Fatalf("re-run after a 408 sent again (replayed %v, %d requests)", again.Replayed, env.requests.Load())
			}
		})
	}
}

// Issue 7, path 7: LogicalKey strips a final "#<digits>" and nothing else,
// so a key with "#" inside keeps its identity and retries of distinct keys
// never collide.
func TestIssue7LogicalKey(t *testing.T) {
	for in, want := range map[string]string{
		"order#8812:charge":    "order#8812:charge",
		"order#8812:charge#2":  "order#8812:charge",
		"order#8812:charge#12": "order#8812:charge",
		"x#1#2":                "x#1",
		"x#9#2":                "x#9",
		"a#":                   "a#",
		"a#b":                  "a#b",
		"a#2b":                 "a#2b",
		"a:b:c":                "a:b:c",
		"12":                   "12",
		"":                     "",
	} {
		if got := ledger.LogicalKey(in); got != want {
			t.Errorf("LogicalKey(%q) = %q, want %q", in, got, want)
		}
	}
}

// Issue 7, path 7: keys with "#", quotes, unicode and the full 255 bytes
// go through Plan, Retry and Do, and the retry's logical key is the key;
// keys the database cannot take are refused with ErrInvalidKey before
// anything is recorded.
func TestIssue7Keys(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	keys := map[string]string{
		"hash inside":    "order#8812:charge",
		"quotes":         `it's "quoted" \ and 'single'`,
		"unicode":        "заказ:注文#7:🔑",
		"255 ascii":      strings.Repeat("k", ledger.MaxKeyBytes),
		"255 multibyte":  strings.Repeat("键", ledger.MaxKeyBytes/3),
		"derived by Key": ledger.Key("order#8812", `step "1"`, "charge#2"),
	}
	for name, key := range keys {
		t.Run(name, func(t *testing.T) {
			if len(key) > ledger.MaxKeyBytes {
				t.Fatalf("test key is %d bytes", len(key))
			}
			env := newHTTPEnvOn(t, pool)
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
			// Attempt 1: the API is down, nothing is sent.
			in, req := articleCall(t, deadURL(t)+"/api/articles", "key-"+name)
			in.IdempotencyKey = key
			first, err := caller.Do(ctx, in, req)
			if !errors.Is(err, ledger.ErrNotSent) || first.Receipt.IdempotencyKey != key {
				t.Fatalf("first Do: %v (key %q), want ErrNotSent under the key", err, first.Receipt.IdempotencyKey)
			}
			// Attempt 2 (Do retries it): key#2, whose logical key is the key.
			srv := env.serve(t, status(201, `{"id":"art_k"}`))
			in, req = articleCall(t, srv.URL+"/api/articles", "key-"+name)
			in.IdempotencyKey = key
			req.Header.Set("X-Test-Key", key+"#2")
			second, err := caller.Do(ctx, in, req)
			if err != nil {
				t.Fatalf("second Do: %v", err)
			}
			r := second.Receipt
			if r.Attempt != 2 || r.IdempotencyKey != key+"#2" || ledger.LogicalKey(r.IdempotencyKey) != key {
				t.Fatalf("attempt %d under %q (logical %q), want attempt 2 under %q", r.Attempt, r.IdempotencyKey,
					ledger.LogicalKey(r.IdempotencyKey), key+"#2")
			}
			// Plan of the key returns attempt 1; Retry of it returns attempt 2.
			p, err := env.ledger.Plan(ctx, ledger.Intent{IdempotencyKey: key, Operation: in.Operation,
				Dependency: in.Dependency, Method: "POST", Target: "/api/articles", Payload: in.Payload})
			if err != nil || p.ID != first.Receipt.ID {
				t.Fatalf("Plan(%q) = %v, %v; want receipt %d", key, p, err, first.Receipt.ID)
			}
			rr, err := env.ledger.Retry(ctx, p, in)
			if err != nil || rr.ID != r.ID {
				t.Fatalf("Retry = %v, %v; want receipt %d", rr, err, r.ID)
			}
		})
	}

	t.Run("refused", func(t *testing.T) {
		c, err := ledger.New(pool, "agent:keys")
		if err != nil {
			t.Fatal(err)
		}
		var before int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&before); err != nil {
			t.Fatal(err)
		}
		for _, key := range []string{"x#1", "order#8812:charge#2", strings.Repeat("k", ledger.MaxKeyBytes+1),
			strings.Repeat("键", ledger.MaxKeyBytes/3) + "k"} {
			in := article(key)
			if _, err := c.Plan(ctx, in); !errors.Is(err, ledger.ErrInvalidKey) {
				t.Errorf("Plan(%.40q): %v, want ErrInvalidKey", key, err)
			}
		}
		var after int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&after); err != nil {
			t.Fatal(err)
		}
		if after != before {
			t.Errorf("refused keys recorded %d receipts", after-before)
		}
	})
}

// Issue 7 (also reported: "Client.Retry with a changed payload wedges the
// step on RL004 forever"): a retry whose payload differs is refused before
// anything is recorded, so the right payload still retries.
func TestIssue7RetryWithChangedPayload(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	in := article("task-1:step-1:articles.create")
	r, err := c.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = c.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = c.Reject(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: ledger.CodeNotSent, Retryable: true}}); err != nil {
		t.Fatal(err)
	}
	wrong := in
	wrong.Payload = json.RawMessage(`{"title":"Something else"}`)
	if _, err := c.Retry(ctx, r, wrong); !errors.Is(err, ledger.ErrInvalidIntent) {
		t.Fatalf("Retry with another payload: %v, want ErrInvalidIntent", err)
	}
	var n int
	if err := c.Pool().QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d receipts (%v) after the refused retry, want 1", n, err)
	}
	second, err := c.Retry(ctx, r, in)
	if err != nil || second.Attempt != 2 || second.RetryOf != r.ID {
		t.Fatalf("Retry with the right payload = %+v, %v; want attempt 2", second, err)
	}
}

// Issue 7, path 1: two keys planned for one intent before either is
// submitted both pass the plan-time guard; the submit re-checks it, so the
// second gets the *DuplicateError Plan would have given, nothing is sent,
// and its receipt stays planned.
func TestIssue7SubmitRechecksDuplicateGuard(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(201, `{"id":"art_1"}`))
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx := context.Background()

	inA, _ := articleCall(t, srv.URL+"/api/articles", "same-intent")
	inB := inA
	inA.IdempotencyKey, inB.IdempotencyKey = "guard:key-a", "guard:key-b"
	inA.Method, inA.Target, inB.Method, inB.Target = "POST", "/api/articles", "POST", "/api/articles"
	a, err := env.ledger.Plan(ctx, inA)
	if err != nil {
		t.Fatal(err)
	}
	b, err := env.ledger.Plan(ctx, inB)
	if err != nil {
		t.Fatalf("plan of the second key while the first is planned: %v", err)
	}
	if a, err = env.ledger.Submit(ctx, a); err != nil {
		t.Fatal(err)
	}

	// The client API refuses the second submit.
	_, err = env.ledger.Submit(ctx, b)
	var dup *ledger.DuplicateError
	if !errors.As(err, &dup) || !errors.Is(err, ledger.ErrDuplicateIntent) || dup.Existing.ID != a.ID {
		t.Fatalf("Submit of the second key: %v, want a *DuplicateError carrying receipt %d", err, a.ID)
	}

	// So does Do: nothing is sent.
	_, req := articleCall(t, srv.URL+"/api/articles", "same-intent")
	res, err := caller.Do(ctx, inB, req)
	if !errors.As(err, &dup) || dup.Existing.ID != a.ID {
		t.Fatalf("Do of the second key: %v, want a *DuplicateError carrying receipt %d", err, a.ID)
	}
	if res == nil || res.Receipt.ID != b.ID || res.Sent || env.requests.Load() != 0 {
		t.Fatalf("Do = %+v, %d requests: want receipt %d back, nothing sent", res, env.requests.Load(), b.ID)
	}
	if got, err := env.ledger.Get(ctx, b.ID); err != nil || got.State != statemachine.Planned {
		t.Fatalf("second receipt %+v, %v: want it still planned", got, err)
	}
}

// Issue 7, path 1 (acceptance): 50 goroutines each call each of 10 intents,
// under one of its 2 keys, through Caller.Do at once. Every POST is held
// until every call has either returned or is itself held in a POST, so all
// the calls race while no outcome is known: every intent is POSTed exactly
// once, and every call ends in success, a replay, or a DuplicateError.
func TestIssue7SameIntentTwoKeysSentOnce(t *testing.T) {
	const goroutines, intents = 50, 10
	env := newHTTPEnv(t)
	var posts [intents]atomic.Int32
	held := make(chan struct{}, goroutines*intents)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		var i int
		fmt.Sscan(r.Header.Get("X-Intent"), &i)
		posts[i].Add(1)
		held <- struct{}{}
		<-release
		writeJSON(w, 201, fmt.Sprintf(`{"id":"art_%d"}`, i))
	}))
	t.Cleanup(srv.Close)
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	tr := &http.Transport{MaxIdleConnsPerHost: intents}
	t.Cleanup(tr.CloseIdleConnections)
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: &http.Client{Transport: tr, Timeout: time.Minute}}

	type call struct {
		intent int
		res    *ledger.Result
		err    error
	}
	calls := make(chan call, goroutines*intents)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for g := range goroutines {
		for i := range intents {
			payload := fmt.Sprintf(`{"title":"Intent %d"}`, i)
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/api/articles", strings.NewReader(payload))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("X-Intent", fmt.Sprint(i))
			in := ledger.Intent{IdempotencyKey: ledger.Key("task-guard", fmt.Sprintf("intent-%d-key-%d", i, g%2), "articles.create"),
				Operation: "articles.create", Dependency: "blog-api", Payload: json.RawMessage(payload),
				// 500 calls share the pool: the deadline is not what
				// this test is about.
				MaxSendDelay: time.Minute}
			wg.Go(func() {
				<-start
				res, err := caller.Do(context.Background(), in, req)
				calls <- call{i, res, err}
			})
		}
	}
	close(start)

	// Wait until every call has returned or is held in a POST.
	var results []call
	nheld := 0
	timeout := time.After(2 * time.Minute)
	for len(results)+nheld < goroutines*intents {
		select {
		case c := <-calls:
			results = append(results, c)
		case <-held:
			nheld++
		case <-timeout:
			t.Fatalf("timed out: %d calls returned, %d held", len(results), nheld)
		}
	}
	releaseOnce.Do(func() { close(release) })
	wg.Wait()
	close(calls)
	for c := range calls {
		results = append(results, c)
	}

	for i := range intents {
		if n := posts[i].Load(); n != 1 {
			t.Errorf("intent %d was POSTed %d times, want exactly once", i, n)
		}
	}
	var sent, replayed, duplicates [intents]int
	for _, c := range results {
		var dup *ledger.DuplicateError
		switch {
		case c.err == nil && c.res != nil && !c.res.Replayed:
			sent[c.intent]++
		case c.res != nil && c.res.Replayed:
			replayed[c.intent]++
		case errors.As(c.err, &dup):
			duplicates[c.intent]++
		default:
			t.Errorf("intent %d: a call ended with %v", c.intent, c.err)
		}
	}
	for i := range intents {
		if sent[i] != 1 {
			t.Errorf("intent %d: %d calls sent and succeeded, want 1", i, sent[i])
		}
	}
	t.Logf("sent %v, replayed %v, duplicates %v", sent, replayed, duplicates)
}

// Issue 7, suspicion confirmed and fixed: the orphan sweep moves a receipt
// to outcome_unknown while its agent waits for the response. The agent can
// no longer settle it, but the 2xx and its external id are kept as a late
// outcome for the reconciler, and Do's error says the reconciler will
// settle the receipt from it.
func TestIssue7LateOutcomeKept(t *testing.T) {
	env := newHTTPEnv(t)
	proceed := make(chan struct{})
	srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-proceed:
		case <-env.release:
		}
		writeJSON(w, 201, `{"id":"art_late"}`)
	})
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0)}
	ctx := context.Background()

	in, req := articleCall(t, srv.URL+"/api/articles", "late")
	type outcome struct {
		res *ledger.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := caller.Do(ctx, in, req)
		done <- outcome{res, err}
	}()
	<-env.arrived
	var id int64
	if err := env.pool.QueryRow(ctx, `SELECT id FROM reconciler.receipts WHERE idempotency_key = $1`,
		in.IdempotencyKey).Scan(&id); err != nil {
		t.Fatal(err)
	}
	// The sweep, behind the agent's back.
	if _, err := env.ledger.As("reconciler:sweep").Transition(ctx, ledger.Move{ID: id,
		From: statemachine.Submitted, To: statemachine.OutcomeUnknown,
		Detail: ledger.Detail{Reason: "orphaned"}}); err != nil {
		t.Fatal(err)
	}
	close(proceed)
	got := <-done

	if !errors.Is(got.err, ledger.ErrOutcomeUnknown) || !strings.Contains(got.err.Error(), "reconciler will settle") {
		t.Fatalf("Do: %v, want outcome unknown saying the reconciler will settle it", got.err)
	}
	if got.res.Receipt.State != statemachine.OutcomeUnknown {
		t.Fatalf("receipt is %s, want outcome_unknown", got.res.Receipt.State)
	}
	var outcomeName, actor, ext string
	var status int
	if err := env.pool.QueryRow(ctx, `SELECT outcome, actor, coalesce(external_id, ''), coalesce(http_status, 0)
		FROM reconciler.late_outcomes WHERE receipt_id = $1`, id).Scan(&outcomeName, &actor, &ext, &status); err != nil {
		t.Fatalf("late outcome of receipt %d: %v", id, err)
	}
	if outcomeName != "succeeded" || ext != "art_late" || status != 201 || actor != "agent:http-test" {
		t.Fatalf("late outcome %s %q %d by %s, want succeeded art_late 201 by agent:http-test", outcomeName, ext, status, actor)
	}
}

// Issue 7, path 3: every time a receipt carries is the database's clock:
// SubmittedAt is the submitted event's time, and SendDeadline is
// SubmittedAt + MaxSendDelay (the default 5 s when the intent sets none).
func TestIssue7TimesFromTheDatabase(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	r, err := c.Plan(ctx, article("times"))
	if err != nil {
		t.Fatal(err)
	}
	if r.MaxSendDelay != ledger.DefaultMaxSendDelay || !r.SubmittedAt.IsZero() || !r.SendDeadline.IsZero() {
		t.Fatalf("planned receipt: delay %v, submitted %v, deadline %v; want 5s and zero times", r.MaxSendDelay, r.SubmittedAt, r.SendDeadline)
	}
	if r, err = c.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	h, err := c.History(ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !r.SubmittedAt.Equal(h[1].At) || !r.SendDeadline.Equal(r.SubmittedAt.Add(5*time.Second)) {
		t.Fatalf("submitted %v (event at %v), deadline %v: want the event's time and +5s", r.SubmittedAt, h[1].At, r.SendDeadline)
	}
	for _, d := range []time.Duration{-time.Second, ledger.MaxSendDelayLimit + time.Microsecond} {
		in := article(fmt.Sprint("bad-delay-", d))
		in.MaxSendDelay = d
		if _, err := c.Plan(ctx, in); !errors.Is(err, ledger.ErrInvalidIntent) {
			t.Errorf("Plan with MaxSendDelay %v: %v, want ErrInvalidIntent", d, err)
		}
	}
}

// rawServer answers every request on a plain TCP listener with a 201 and
// hands the raw request head (and an empty chunked body's bytes, if any)
// to heads.
func rawServer(t *testing.T) (string, chan string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	heads := make(chan string, 16)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				br := bufio.NewReader(conn)
				var head strings.Builder
				for {
					line, err := br.ReadString('\n')
					head.WriteString(line)
					if err != nil || line == "\r\n" {
						break
					}
				}
				if strings.Contains(strings.ToLower(head.String()), "transfer-encoding: chunked") {
					b := make([]byte, 5) // "0\r\n\r\n"
					n, _ := io.ReadFull(br, b)
					head.Write(b[:n])
				}
				heads <- head.String()
				io.WriteString(conn, "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 11\r\nConnection: close\r\n\r\n{\"id\":\"x1\"}")
			}()
		}
	}()
	return "http://" + ln.Addr().String(), heads
}

// Issue 7, adversarial review: what Do writes for a body-less call, now
// that net/http must never take it for replayable (see
// TestBodylessCallIsNeverResentByTheTransport). Over HTTP/1 only (an http
// URL, net/http's Transport): a keyed POST keeps "Content-Length: 0" and
// its key header (lower-cased); GET and DELETE carry no body and no
// length, as before. Through a RoundTripper that may speak HTTP/2, a POST
// goes out with an empty chunked body.
func TestBodylessCallOnTheWire(t *testing.T) {
	pool := pgtest.NewPool(t)
	base, heads := rawServer(t)
	custom := roundTripperFunc(func(r *http.Request) (*http.Response, error) { return http.DefaultTransport.RoundTrip(r) })
	for i, tc := range []struct {
		name, method string
		rt           http.RoundTripper
		want, not    []string
	}{
		{"keyed POST", http.MethodPost, nil,
			[]string{"POST /op HTTP/1.1\r\n", "\r\nContent-Length: 0\r\n", "\r\nidempotency-key: "}, []string{"Transfer-Encoding", "Idempotency-Key"}},
		{"keyed DELETE", http.MethodDelete, nil,
			[]string{"DELETE /op HTTP/1.1\r\n", "\r\nidempotency-key: "}, []string{"Content-Length", "Transfer-Encoding"}},
		{"keyed GET", http.MethodGet, nil,
			[]string{"GET /op HTTP/1.1\r\n", "\r\nIdempotency-Key: "}, []string{"Content-Length", "Transfer-Encoding"}},
		{"keyed POST, custom RoundTripper", http.MethodPost, custom,
			[]string{"POST /op HTTP/1.1\r\n", "\r\nTransfer-Encoding: chunked\r\n", "\r\n\r\n0\r\n\r\n", "\r\nIdempotency-Key: "}, []string{"Content-Length"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			key := ledger.Key("task-wire", fmt.Sprint(i), "op")
			req, err := http.NewRequest(tc.method, base+"/op", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Idempotency-Key", key)
			in := ledger.Intent{IdempotencyKey: key, Operation: "op", Dependency: fmt.Sprintf("wire-%d", i)}
			tr := &http.Transport{}
			t.Cleanup(tr.CloseIdleConnections)
			client := &http.Client{Transport: tr}
			if tc.rt != nil {
				client = &http.Client{Transport: tc.rt}
			}
			if _, err := (&ledger.Caller{Ledger: env.ledger, HTTP: client}).Do(context.Background(), in, req); err != nil {
				t.Fatal(err)
			}
			head := <-heads
			for _, w := range tc.want {
				if !strings.Contains(head, w) {
					t.Errorf("request lacks %q:\n%s", w, head)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(head, n+":") {
					t.Errorf("request has %q:\n%s", n, head)
				}
			}
			t.Logf("%s", head)
		})
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// Issue 7, adversarial review: the second line of defence against a
// resend. A RoundTripper that retries on its own (here one that sends the
// request again after an EOF, as retrying middlewares do) gets a second
// connection after the request was written on the first: Do refuses it,
// the new connection's write deadline is in the past so nothing is written
// on it, and the receipt is outcome_unknown with code transport_resend.
func TestTransportResendIsRefused(t *testing.T) {
	env := newHTTPEnv(t)
	var effects atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if effects.Add(1) == 1 {
			hijack(t, w, func(net.Conn) {}) // the effect happened; the answer is lost
			return
		}
		writeJSON(w, 201, `{"id":"art_twice"}`)
	}))
	t.Cleanup(srv.Close)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	retrying := roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := tr.RoundTrip(r)
		if err != nil {
			resp, err = tr.RoundTrip(r)
		}
		return resp, err
	})
	in, req := articleCall(t, srv.URL+"/api/articles", "retrying-middleware")
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: &http.Client{Transport: retrying, Timeout: 10 * time.Second}}
	res, err := caller.Do(context.Background(), in, req)
	if n := effects.Load(); n != 1 {
		t.Fatalf("the API saw the call %d times", n)
	}
	ce, extra := lastDetail(t, env, res.Receipt.ID)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) || ce.Code != ledger.CodeTransportResend || extra["transport_resend_refused"] != true {
		t.Fatalf("Do: %v (error %+v, extra %v), want outcome_unknown, code %s", err, ce, extra, ledger.CodeTransportResend)
	}
	t.Logf("Do: %v", err)
}
