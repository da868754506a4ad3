package ledger_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// unknownReceipt plans, submits and marks unknown one receipt under key.
func unknownReceipt(t *testing.T, c *ledger.Client, key string) *ledger.Receipt {
	t.Helper()
	ctx := context.Background()
	in := article(key)
	in.Payload = []byte(`{"title":` + strconv.Quote(key) + `}`)
	r, err := c.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = c.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = c.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	return r
}

// settleAs moves an outcome_unknown receipt to succeeded as the reconciler.
func settleAs(t *testing.T, c *ledger.Client, r *ledger.Receipt, ext string) {
	t.Helper()
	ctx := context.Background()
	rec := c.As("reconciler:await-test")
	r, err := rec.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rec.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.Reconciling, To: statemachine.Succeeded, ExternalID: ext}); err != nil {
		t.Fatal(err)
	}
}

// listeners counts the sessions of this database LISTENing for settlements.
func listeners(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND query = 'LISTEN reconciler_settled'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitListeners waits (bounded) until exactly want sessions LISTEN.
func waitListeners(t *testing.T, pool *pgxpool.Pool, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for listeners(t, pool) != want {
		if time.Now().After(deadline) {
			t.Fatalf("listening sessions = %d, want %d", listeners(t, pool), want)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not racing it
	}
}

// Acceptance 3: Await returns within 100 ms of the settlement, woken by the
// NOTIFY of migration 00009; the latency is printed, and only a generous
// bound is asserted.
func TestAwaitWokenBySettlement(t *testing.T) {
	c := newClient(t)
	r := unknownReceipt(t, c, "await:1:articles.create")
	type result struct {
		r   *ledger.Receipt
		err error
		at  time.Time
	}
	got := make(chan result, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r, err := c.Await(ctx, r.ID)
		got <- result{r, err, time.Now()}
	}()
	waitListeners(t, c.Pool(), 1)
	start := time.Now()
	settleAs(t, c, r, "art-1")
	res := <-got
	if res.err != nil {
		t.Fatal(res.err)
	}
	if res.r.State != statemachine.Succeeded || res.r.ExternalID != "art-1" {
		t.Fatalf("Await returned %+v, want succeeded with art-1", res.r)
	}
	latency := res.at.Sub(start)
	t.Logf("Await returned %v after the settle statement was issued", latency)
	if latency > 5*time.Second {
		t.Fatalf("Await took %v after the settlement: not woken by the notification", latency)
	}
	// The last waiter gone, the dedicated connection closes.
	waitListeners(t, c.Pool(), 0)
}

func TestAwaitReturnsAtOnceAndOnTimeout(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	settled := unknownReceipt(t, c, "await:2:articles.create")
	settleAs(t, c, settled, "art-2")
	r, err := c.Await(ctx, settled.ID)
	if err != nil || r.State != statemachine.Succeeded {
		t.Fatalf("Await of a settled receipt = %+v, %v", r, err)
	}
	if n := listeners(t, c.Pool()); n != 0 {
		t.Fatalf("a settled receipt opened %d listening sessions", n)
	}

	pending := unknownReceipt(t, c, "await:3:articles.create")
	tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	r, err = c.Await(tctx, pending.ID)
	if !errors.Is(err, context.DeadlineExceeded) || r == nil || r.State != statemachine.OutcomeUnknown {
		t.Fatalf("Await past its deadline = %+v, %v; want the outcome_unknown receipt and DeadlineExceeded", r, err)
	}

	if _, err := c.Await(ctx, 987654); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("Await of no receipt: %v, want ErrNotFound", err)
	}
}

// A receipt in flight is moved on by its agent without a notification
// (migration 00011): Await re-reads it on its timer, and returns the
// agent's own outcome. Without the timer it would wait out its context
// (the minute given here).
func TestAwaitInFlightReturnsTheAgentsOutcome(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	in := article("await:inflight:articles.create")
	r, err := c.PlanAndSubmit(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		r   *ledger.Receipt
		err error
	}
	got := make(chan result, 1)
	go func() {
		actx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		r, err := c.Await(actx, r.ID)
		got <- result{r, err}
	}()
	waitListeners(t, c.Pool(), 1)
	start := time.Now()
	if _, err := c.Succeed(ctx, r, "art-inflight", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	res := <-got
	if res.err != nil || res.r.State != statemachine.Succeeded || res.r.ExternalID != "art-inflight" {
		t.Fatalf("Await of an in-flight receipt = %+v, %v; want succeeded with art-inflight", res.r, res.err)
	}
	t.Logf("Await returned the agent's outcome %v after it was recorded", time.Since(start))
}

// Many waiters on many receipts share one dedicated connection, and each
// is woken by its own receipt's settlement only.
func TestAwaitManyShareOneConnection(t *testing.T) {
	c := newClient(t)
	const n = 20
	rs := make([]*ledger.Receipt, n)
	for i := range rs {
		rs[i] = unknownReceipt(t, c, ledger.Key("await-many", string(rune('a'+i)), "articles.create"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, n)
	states := make([]statemachine.State, n)
	for i := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each waiter writes as another agent: clients made by As
			// share the listener.
			r, err := c.As(statemachine.Actor("agent:waiter")).Await(ctx, rs[i].ID)
			errs[i] = err
			if r != nil {
				states[i] = r.State
			}
		}()
	}
	waitListeners(t, c.Pool(), 1)
	for _, r := range rs {
		settleAs(t, c, r, "x")
	}
	wg.Wait()
	for i := range rs {
		if errs[i] != nil || states[i] != statemachine.Succeeded {
			t.Fatalf("waiter %d: %v, %s", i, errs[i], states[i])
		}
	}
	waitListeners(t, c.Pool(), 0)
}

// NotifySettled is told of every settlement, of any receipt, through the
// connection Await uses: one session LISTENs for both, it stays open while
// either waits, and closes when neither does.
func TestNotifySettledSharesAwaitsConnection(t *testing.T) {
	c := newClient(t)
	a := unknownReceipt(t, c, "notify:a:articles.create")
	b := unknownReceipt(t, c, "notify:b:articles.create")
	d := unknownReceipt(t, c, "notify:d:articles.create")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	awaited := make(chan error, 1)
	go func() {
		_, err := c.Await(ctx, a.ID)
		awaited <- err
	}()
	waitListeners(t, c.Pool(), 1)

	watch, stop := context.WithCancel(ctx)
	defer stop()
	settled := make(chan struct{}, 1)
	c.As("agent:watcher").NotifySettled(watch, settled)
	told := func(what string) {
		t.Helper()
		select {
		case <-settled:
		case <-ctx.Done():
			t.Fatalf("NotifySettled was not told %s", what)
		}
	}
	told("to look at once, the connection already listening")
	if n := listeners(t, c.Pool()); n != 1 {
		t.Fatalf("%d sessions LISTEN for Await and NotifySettled, want one shared", n)
	}
	settleAs(t, c, b, "art-b")
	told("of a settlement nobody awaits")
	settleAs(t, c, a, "art-a")
	if err := <-awaited; err != nil {
		t.Fatal(err)
	}
	told("of the awaited settlement")
	// Await gone, the connection still listens for NotifySettled.
	settleAs(t, c, d, "art-d")
	told("of a settlement after Await returned")
	stop()
	waitListeners(t, c.Pool(), 0)
}

// The listening session is terminated by the server and the receipt
// settled at once, most likely before the listener is back: nothing
// notifies that settlement to it, and Await finds it by reading the
// receipt again when LISTEN is back in effect. The failure is logged to
// the client's logger (WithLogger) before that.
func TestAwaitSurvivesTheListenerBeingTerminated(t *testing.T) {
	var logs testkit.LogBuffer
	c := newClient(t).WithLogger(slog.New(slog.NewTextHandler(&logs, nil)))
	r := unknownReceipt(t, c, "await:terminated:articles.create")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type result struct {
		r   *ledger.Receipt
		err error
	}
	got := make(chan result, 1)
	go func() {
		r, err := c.Await(ctx, r.ID)
		got <- result{r, err}
	}()
	waitListeners(t, c.Pool(), 1)
	if _, err := c.Pool().Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND query = 'LISTEN reconciler_settled'`); err != nil {
		t.Fatal(err)
	}
	settleAs(t, c, r, "art-terminated")
	res := <-got
	if res.err != nil || res.r.State != statemachine.Succeeded || res.r.ExternalID != "art-terminated" {
		t.Fatalf("Await across the listener's reconnection = %v, %v; want succeeded with art-terminated", res.r.State, res.err)
	}
	if got := logs.String(); !strings.Contains(got, "LISTEN connection failed") || !strings.Contains(got, "reconciler_settled") {
		t.Fatalf("the listener's failure was not logged to the client's logger; logs:\n%s", got)
	}
}
