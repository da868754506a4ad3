package ledger_test

// Adversarial review of the issue 7 fixes, agent side. Each test states the
// sequence that breaks (or fails to break) the product's promise: "a
// receipt is never settled safe_to_retry while its effect exists, and no
// side effect is sent twice". A test that FAILS on the branch reproduces a
// break; the comment says how.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Issue 7, adversarial review: net/http resends a request on its own.
// A body-less side effect (POST /orders/7/cancel, DELETE, POST .../refund
// with the amount in the query) that carries an Idempotency-Key (or
// X-Idempotency-Key) header, or whose method is GET, is "replayable" for
// net/http (Request.isReplayable). Sequence:
//
//  1. a first call leaves a keep-alive connection in the pool;
//  2. Do sends the body-less call on that reused connection;
//  3. the server reads it, performs the effect, and the connection drops
//     before the response (a proxy's idle timeout, a crash, a reset);
//  4. the transport sees transportReadFromServerError on a reused
//     connection for a replayable request and would send it AGAIN on a new
//     connection, inside the same Do.
//
// Guaranteed: Do sends no request net/http takes for replayable, so the
// API sees the call once and the receipt is outcome_unknown; over HTTP/1
// only (http URL) and over TLS (which may be HTTP/2), keyed POST and
// DELETE, and GET.
func TestBodylessCallIsNeverResentByTheTransport(t *testing.T) {
	pool := pgtest.NewPool(t)
	for i, tc := range []struct {
		name, method string
		tls, keyed   bool
	}{
		{"keyed POST over http", http.MethodPost, false, true},
		{"keyed POST over https", http.MethodPost, true, true},
		{"keyed DELETE over http", http.MethodDelete, false, true},
		{"keyed DELETE over https", http.MethodDelete, true, true},
		{"GET over http", http.MethodGet, false, false},
		{"X-Idempotency-Key PUT over http", http.MethodPut, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			var effects atomic.Int32
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/warm" {
					writeJSON(w, 200, `{}`)
					return
				}
				n := effects.Add(1) // the server performs the effect
				if n == 1 {
					// ... and the connection drops before the response.
					hijack(t, w, func(net.Conn) {})
					return
				}
				writeJSON(w, 201, fmt.Sprintf(`{"id":"cancel_%d"}`, n))
			})
			var srv *httptest.Server
			var tr *http.Transport
			if tc.tls {
				srv = httptest.NewTLSServer(h)
				tr = srv.Client().Transport.(*http.Transport).Clone()
			} else {
				srv = httptest.NewServer(h)
				tr = &http.Transport{}
			}
			t.Cleanup(srv.Close)
			t.Cleanup(tr.CloseIdleConnections)
			client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			// 1. A keep-alive connection in the pool.
			warm, err := client.Get(srv.URL + "/warm")
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, warm.Body)
			warm.Body.Close()

			key := ledger.Key("task-adv", fmt.Sprintf("cancel-order-%d", i), "orders.cancel")
			req, err := http.NewRequest(tc.method, srv.URL+"/orders/7/cancel", nil)
			if err != nil {
				t.Fatal(err)
			}
			if tc.keyed {
				// The agent passes its key to the API, as SPEC §5 recommends.
				hdr := "Idempotency-Key"
				if tc.method == http.MethodPut {
					hdr = "X-Idempotency-Key"
				}
				req.Header.Set(hdr, key)
			}
			// One dependency per case: the same intent would be a duplicate.
			in := ledger.Intent{IdempotencyKey: key, Operation: "orders.cancel", Dependency: fmt.Sprintf("shop-api-%d", i)}
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: client}
			res, err := caller.Do(context.Background(), in, req)
			if n := effects.Load(); n != 1 {
				t.Fatalf("one Do of a body-less %s reached the API %d times: net/http resent it on a new connection after the reused one dropped",
					tc.method, n)
			}
			if !errors.Is(err, ledger.ErrOutcomeUnknown) || res.Receipt.State != statemachine.OutcomeUnknown {
				t.Fatalf("Do: %v, want outcome_unknown", err)
			}
		})
	}
}

// Issue 7, adversarial review: over HTTP/2 the send deadline covered only
// the wait for a connection and a stream; once the headers were written,
// nothing bounded when the BODY was written. A request body produced
// slowly (a streamed upload, an io.Pipe fed by the agent, or a large body
// held back by the server's flow-control window) was written long after
// submitted_at + max_send_delay, and the server acted on it when the body
// ended, after the reconciler's window (SPEC §5a).
//
// Guaranteed: on a connection without a write deadline (HTTP/2) Do keeps
// the deadline armed until the request is written whole; a request still
// being written then is canceled, nothing more of it is written (the
// server never has the whole body), and the receipt is outcome_unknown
// with code send_deadline_mid_write.
func TestHTTP2BodyIsNeverWrittenAfterSendDeadline(t *testing.T) {
	env := newHTTPEnv(t)
	// The deadline must outlast the submit (a flushed commit and a TLS
	// handshake, slow on a loaded machine) but not the body: the rest of
	// the body is held until Do has returned, so no timing decides it.
	const delay = 2 * time.Second
	var bodyDone atomic.Int64 // unix nanos when the server had the whole body
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err != nil {
			w.WriteHeader(400)
			return
		}
		bodyDone.Store(time.Now().UnixNano())
		writeJSON(w, 201, `{"id":"art_slow_body"}`) // the effect happens now
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)

	pr, pw := io.Pipe()
	returned := make(chan struct{})
	go func() {
		pw.Write([]byte(`{"title":"slow`))
		<-returned // the rest of the body comes after the deadline, if ever
		pw.Write([]byte(` body"}`))
		pw.Close()
	}()
	key := ledger.Key("task-adv", "h2-slow-body", "articles.create")
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/api/articles", pr)
	if err != nil {
		t.Fatal(err)
	}
	in := ledger.Intent{IdempotencyKey: key, Operation: "articles.create", Dependency: "blog-api",
		Payload: []byte(`{"title":"slow body"}`), MaxSendDelay: delay}
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: srv.Client()}
	res, err := caller.Do(context.Background(), in, req)
	close(returned)
	if res == nil || res.Receipt == nil {
		t.Fatalf("Do: %v", err)
	}
	if res.Response != nil && res.Response.ProtoMajor != 2 {
		t.Fatalf("not HTTP/2: %s", res.Response.Proto)
	}
	r, gerr := env.ledger.Get(context.Background(), res.Receipt.ID)
	if gerr != nil {
		t.Fatal(gerr)
	}
	done := time.Unix(0, bodyDone.Load())
	if bodyDone.Load() != 0 && done.After(r.SendDeadline) {
		t.Fatalf("the request's last byte reached the server %v after the receipt's send deadline (%s); "+
			"the receipt is %s: the reconciler's window (send deadline + lifetime + consistency) does not bound this effect",
			done.Sub(r.SendDeadline).Round(time.Millisecond), r.SendDeadline.Format(time.RFC3339Nano), r.State)
	}
	ce, extra := lastDetail(t, env, r.ID)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) || r.State != statemachine.OutcomeUnknown ||
		ce.Code != ledger.CodeSendDeadlineMidWrite || extra["send_deadline_mid_write"] != true {
		t.Fatalf("Do: %v; receipt %s, error %+v, extra %v: want outcome_unknown, code %s",
			err, r.State, ce, extra, ledger.CodeSendDeadlineMidWrite)
	}
	if bodyDone.Load() != 0 {
		t.Fatalf("the server had the whole body (in time, but the pipe was held past the deadline)")
	}
}

// Issue 7, adversarial review: a success that reaches the agent after its
// receipt was settled safe_to_retry is recorded (late_outcomes) and refuses
// every retry of that receipt (reconciler.retry_error), but the rule was
// only applied when a retry was PLANNED. Sequence:
//
//  1. receipt R1 is settled safe_to_retry (the declared window was too short);
//  2. the harness runs the step again: R2 = Retry(R1) is planned (allowed);
//  3. before R2 is submitted, R1's original request answers 201 and the
//     agent records the late success;
//  4. R2 is submitted and would go out: a second effect.
//
// Guaranteed (schema: planned -> submitted of a retry re-runs
// retry_error; ledger: Submit and Do turn the refusal into ErrRetryRefused):
// R2 is refused at its submit, stays planned, and Do sends nothing.
func TestRetryPlannedBeforeLateSuccessIsNeverSubmitted(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	agent, err := ledger.New(pool, "agent:adv")
	if err != nil {
		t.Fatal(err)
	}
	in := ledger.Intent{IdempotencyKey: ledger.Key("task-adv", "late-success", "articles.create"),
		Operation: "articles.create", Dependency: "blog-api", Method: "POST", Target: "/api/articles",
		Payload: []byte(`{"title":"late success"}`)}
	r1, err := agent.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r1, err = agent.Submit(ctx, r1); err != nil {
		t.Fatal(err)
	}
	if r1, err = agent.MarkUnknown(ctx, r1, ledger.Detail{Reason: "timeout"}); err != nil {
		t.Fatal(err)
	}
	// 1. The reconciler settles it (the test's pool owns the table).
	rec := agent.As("reconciler:adv")
	if r1, err = rec.Transition(ctx, ledger.Move{ID: r1.ID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if r1, err = rec.Transition(ctx, ledger.Move{ID: r1.ID, From: statemachine.Reconciling, To: statemachine.SafeToRetry}); err != nil {
		t.Fatal(err)
	}
	// 2. The step runs again: its retry is planned.
	r2, err := agent.Retry(ctx, r1, in)
	if err != nil {
		t.Fatal(err)
	}
	// 3. The original's 201 arrives: recorded as a late success.
	if err := agent.RecordLateOutcome(ctx, r1.ID, ledger.OutcomeSucceeded, 201, "art_1", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	// The database now refuses any NEW retry...
	if _, err := pool.Exec(ctx, `SELECT reconciler.retry_error(r) FROM reconciler.receipts r WHERE id = $1`, r1.ID); err != nil {
		t.Fatal(err)
	}
	// 4. ... and the retry planned a moment earlier is not submitted.
	if sub, err := agent.Submit(ctx, r2); err == nil {
		t.Fatalf("receipt %d (retry of %d, whose agent recorded a late 201) moved to %s: it will be sent, "+
			"a second effect", sub.ID, r1.ID, sub.State)
	} else if !errors.Is(err, ledger.ErrRetryRefused) {
		t.Fatalf("Submit of the refused retry: %v, want ErrRetryRefused", err)
	}
	// Through Do: the step runs again. The late success reopened R1
	// (migration 00023: back to outcome_unknown, since its retry had not
	// gone out), so Do finds it with the reconciler and sends nothing.
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		writeJSON(w, 201, `{"id":"art_2"}`)
	}))
	t.Cleanup(srv.Close)
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/api/articles", strings.NewReader(string(in.Payload)))
	if err != nil {
		t.Fatal(err)
	}
	res, err := (&ledger.Caller{Ledger: agent, HTTP: srv.Client()}).Do(ctx, in, req)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) || calls.Load() != 0 || res == nil || res.Receipt.ID != r1.ID {
		t.Fatalf("Do of the step again: %v (result %+v, %d calls), want ErrOutcomeUnknown for receipt %d, nothing sent",
			err, res, calls.Load(), r1.ID)
	}
	if cur, err := agent.Get(ctx, r2.ID); err != nil || cur.State != statemachine.Planned {
		t.Fatalf("receipt %d: %v, %v: want it planned", r2.ID, cur, err)
	}
	t.Logf("Do: %v", err)
}

// Issue 7, adversarial review: Do recorded a late answer to a
// safe_to_retry receipt only when it was a success. A 502 or a timeout that
// arrives after the reconciler proved the absence shows just as well that
// the original request was still alive past the declared send deadline +
// lifetime + window (the gateway answered it), so the effect may exist;
// nothing was recorded and the retry went out at once.
//
// Guaranteed: Do records any late answer to a safe_to_retry receipt, its
// error says so and that no retry will be sent, and the database refuses
// every retry of a receipt with a late succeeded or outcome_unknown; a late
// rejection (proof of no effect) leaves the retry allowed.
func TestLateAnswerAfterSafeToRetryRefusesRetry(t *testing.T) {
	for _, tc := range []struct {
		status  int
		refused bool
	}{{502, true}, {201, true}, {400, false}} {
		t.Run(strconv.Itoa(tc.status), func(t *testing.T) { testLateAnswerAfterSafeToRetry(t, tc.status, tc.refused) })
	}
}

func testLateAnswerAfterSafeToRetry(t *testing.T, status int, refused bool) {
	ctx := context.Background()
	env := newHTTPEnv(t)
	answer := make(chan struct{})
	var once sync.Once
	arrived := make(chan struct{})
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if calls.Add(1) == 1 {
			once.Do(func() { close(arrived) })
			<-answer // the original stays in flight past the window
			writeJSON(w, status, `{"id":"art_late","error":"upstream timed out"}`)
			return
		}
		writeJSON(w, 201, `{"id":"art_retry"}`)
	}))
	t.Cleanup(srv.Close)
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: srv.Client()}
	in, req := articleCall(t, srv.URL+"/api/articles", "late-502")
	done := make(chan *ledger.Result, 1)
	var firstErr error
	go func() {
		var res *ledger.Result
		res, firstErr = caller.Do(ctx, in, req)
		done <- res
	}()
	<-arrived
	// The orphan sweep and the reconciler settle the in-flight receipt.
	var id int64
	if err := env.pool.QueryRow(ctx, `SELECT id FROM reconciler.receipts WHERE idempotency_key = $1`, in.IdempotencyKey).Scan(&id); err != nil {
		t.Fatal(err)
	}
	rec := env.ledger.As("reconciler:adv")
	for _, m := range []ledger.Move{{ID: id, From: statemachine.Submitted, To: statemachine.OutcomeUnknown},
		{ID: id, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling},
		{ID: id, From: statemachine.Reconciling, To: statemachine.SafeToRetry}} {
		if _, err := rec.Transition(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	close(answer) // the original answers, after the settlement
	<-done
	t.Logf("first Do: %v", firstErr)
	var late int
	if err := env.pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.late_outcomes WHERE receipt_id = $1`, id).Scan(&late); err != nil || late != 1 {
		t.Fatalf("late outcomes of receipt %d: %d (%v), want the late %d recorded", id, late, err, status)
	}
	if refused != strings.Contains(fmt.Sprint(firstErr), "no retry will be sent") {
		t.Fatalf("first Do's error %q: want it to say whether a retry will be sent (refused: %v)", firstErr, refused)
	}
	// The step runs again.
	in2, req2 := articleCall(t, srv.URL+"/api/articles", "late-502")
	res, err := caller.Do(ctx, in2, req2)
	t.Logf("second Do: %v", err)
	if !refused {
		if err != nil || calls.Load() != 2 {
			t.Fatalf("after a late %d (no effect) the retry: %v (%d calls), want it sent and succeeded", status, err, calls.Load())
		}
		return
	}
	if err == nil && res != nil && !res.Replayed && calls.Load() == 2 {
		t.Fatalf("the original answered %d after its receipt was settled safe_to_retry (it outlived the window), "+
			"yet the retry was sent at once (receipt %d): nothing records that the effect may exist", status, res.Receipt.ID)
	}
	// A late 201 reopened the receipt (migration 00023): the step run
	// again finds it with the reconciler; a late 502 without a declared
	// window left it safe_to_retry, and its retry is refused.
	want := ledger.ErrRetryRefused
	if status == 201 {
		want = ledger.ErrOutcomeUnknown
	}
	if !errors.Is(err, want) || calls.Load() != 1 {
		t.Fatalf("second Do: %v (%d calls), want %v and nothing sent", err, calls.Load(), want)
	}
}
