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
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// BREAK (no side effect sent twice): net/http resends a request on its own.
// Do clears GetBody, which stops the transport from replaying a request
// WITH a body, but a body-less side effect (POST /orders/7/cancel, DELETE,
// POST .../refund with the amount in the query) that carries an
// Idempotency-Key (or X-Idempotency-Key) header is "replayable" for
// net/http (Request.isReplayable). Sequence:
//
//  1. a first call leaves a keep-alive connection in the pool;
//  2. Do sends the body-less POST on that reused connection;
//  3. the server reads it, performs the effect, and the connection drops
//     before the response (a proxy's idle timeout, a crash, a reset);
//  4. the transport sees transportReadFromServerError on a reused
//     connection for a replayable request and sends it AGAIN on a new
//     connection, inside the same Do. The API (which does not honour the
//     header, or honours it only per node) performs the effect twice.
//
// Do records "transport_attempts": 2 in the detail, after the fact. The
// ledger must make the request non-replayable for net/http (e.g. send it
// with a non-nil, non-NoBody Body and no GetBody, Content-Length 0), or
// refuse the second GotConn once a write began.
func TestAdversarialBodylessCallWithIdempotencyHeaderIsSentTwice(t *testing.T) {
	env := newHTTPEnv(t)
	var effects atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
	}))
	t.Cleanup(srv.Close)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	// 1. A keep-alive connection in the pool.
	warm, err := client.Get(srv.URL + "/warm")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, warm.Body)
	warm.Body.Close()

	key := ledger.Key("task-adv", "cancel-order-7", "orders.cancel")
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders/7/cancel", nil)
	if err != nil {
		t.Fatal(err)
	}
	// The agent passes its key to the API, as SPEC §5 recommends.
	req.Header.Set("Idempotency-Key", key)
	in := ledger.Intent{IdempotencyKey: key, Operation: "orders.cancel", Dependency: "shop-api"}
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: client}
	res, err := caller.Do(context.Background(), in, req)
	t.Logf("Do: %v (receipt %+v)", err, res)
	if n := effects.Load(); n != 1 {
		t.Fatalf("one Do of a body-less POST with an Idempotency-Key header reached the API %d times: "+
			"net/http resent it on a new connection after the reused one dropped", n)
	}
}

// BREAK (send deadline): over HTTP/2 the send deadline only covers the wait
// for a connection and a stream; once the headers are written, nothing
// bounds when the BODY is written. A request body that is produced slowly
// (a streamed upload, an io.Pipe fed by the agent, or simply a large body
// held back by the server's flow-control window) is written long after
// submitted_at + max_send_delay, and the server acts on it when the body
// ends. The reconciler assumes the original "can only take effect between
// submitted_at and submitted_at + max_send_delay + max_request_lifetime"
// (SPEC §5a) and settles safe_to_retry after that; the effect lands later.
// Over HTTP/1 the same body is cut by the connection's write deadline (the
// request is then outcome_unknown), so the two transports differ.
//
// Fix (ledger/http.go, send): wrap req.Body in a reader that fails every
// Read after the send deadline (with HTTP/2 the transport then resets the
// stream: the server never sees a complete request), and treat a body
// still being written at the deadline as outcome_unknown.
func TestAdversarialHTTP2BodyWrittenAfterSendDeadline(t *testing.T) {
	env := newHTTPEnv(t)
	const delay = 300 * time.Millisecond
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
	go func() {
		pw.Write([]byte(`{"title":"slow`))
		time.Sleep(4 * delay) // the rest of the body comes after the deadline
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
}

// BREAK (no side effect sent twice): a success that reaches the agent after
// its receipt was settled safe_to_retry is recorded (late_outcomes) and
// "refuses every retry of that receipt" (reconciler.retry_error). But the
// rule is only applied when a retry is PLANNED. Sequence:
//
//  1. receipt R1 is settled safe_to_retry (the declared window was too short);
//  2. the harness runs the step again: Do plans R2 = Retry(R1) (allowed);
//  3. before R2 is submitted, R1's original request answers 201; Do's
//     settle finds R1 safe_to_retry and records the late success;
//  4. R2 is submitted: the planned->submitted re-check looks only for
//     unresolved receipts of the intent (R1 is safe_to_retry, not
//     unresolved) and never at retry_error: R2 goes out, a second effect.
//
// Fix (migrations, receipts_before_update): on planned -> submitted of a
// receipt with retry_of, re-run reconciler.retry_error(prev) under the
// retried row's lock (FOR SHARE, the lock record_late_outcome takes) and
// refuse (RL002) when it fails.
func TestAdversarialRetryPlannedBeforeLateSuccessIsStillSubmitted(t *testing.T) {
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
	// 4. ... but the retry planned a moment earlier is submitted.
	if sub, err := agent.Submit(ctx, r2); err == nil {
		t.Fatalf("receipt %d (retry of %d, whose agent recorded a late 201) moved to %s: it will be sent, "+
			"a second effect", sub.ID, r1.ID, sub.State)
	}
}

// BREAK (same promise, weaker evidence): Do records a late outcome against
// a safe_to_retry receipt only when the late answer is a success. A 502 or
// a timeout that arrives after the reconciler proved the absence shows just
// as well that the original request was still alive past the declared
// send deadline + lifetime + window (the gateway answered it), so the
// effect may exist; nothing is recorded and the retry goes out at once.
//
// Fix (ledger/http.go, Do): record any late answer to a safe_to_retry
// receipt (outcome_unknown included) and let reconciler.retry_error refuse
// a retry of a receipt with any late outcome other than rejected.
func TestAdversarialLate502AfterSafeToRetryAllowsRetry(t *testing.T) {
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
			writeJSON(w, 502, `{"error":"upstream timed out"}`)
			return
		}
		writeJSON(w, 201, `{"id":"art_retry"}`)
	}))
	t.Cleanup(srv.Close)
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: srv.Client()}
	in, req := articleCall(t, srv.URL+"/api/articles", "late-502")
	done := make(chan *ledger.Result, 1)
	go func() {
		res, _ := caller.Do(ctx, in, req)
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
	close(answer) // the original answers 502, after the settlement
	<-done
	// The step runs again.
	in2, req2 := articleCall(t, srv.URL+"/api/articles", "late-502")
	res, err := caller.Do(ctx, in2, req2)
	if err == nil && res != nil && !res.Replayed && calls.Load() == 2 {
		t.Fatalf("the original answered 502 after its receipt was settled safe_to_retry (it outlived the window), "+
			"yet the retry was sent at once (receipt %d): nothing records that the effect may exist", res.Receipt.ID)
	}
	var dup *ledger.DuplicateError
	if errors.As(err, &dup) {
		t.Logf("refused as duplicate: %v", err)
	}
}
