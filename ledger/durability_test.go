package ledger_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/statemachine"
)

// ownCluster starts a cluster of the test's own (its settings are the
// server's, not one database's), migrated, and returns it with a pool made
// by ledger.NewPool.
func ownCluster(t *testing.T) (*pgcluster.Cluster, *pgxpool.Pool) {
	t.Helper()
	c, err := pgcluster.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Stop() })
	ctx := context.Background()
	pool, err := ledger.NewPool(ctx, c.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := migrations.Up(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return c, pool
}

// setSystem sets a server setting as a failover manager does (ALTER
// SYSTEM, reload).
func setSystem(t *testing.T, pool *pgxpool.Pool, name, value string) {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "ALTER SYSTEM SET "+name+" = '"+value+"'"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
}

// waitMode re-reads the durability until it is want (a standby connecting
// or its walsender going takes a moment), failing after a minute.
func waitMode(t *testing.T, c *ledger.Client, want ledger.DurabilityMode) ledger.Durability {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	for {
		d, err := c.Durability(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if d.Mode == want {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("durability still %s (%s), want %s", d.Mode, d, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// countingAPI answers 201 to every request and counts them.
func countingAPI(t *testing.T) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"x"}`))
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

func post(t *testing.T, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/things", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// Issue 21, item 1: a client that requires a synchronous standby records
// and sends while one confirms commits, refuses with one clear error and
// sends nothing while none does (standby gone, then
// synchronous_standby_names emptied as a failover manager does), and works
// again once the standby is back.
func TestRequireSynchronousStandby(t *testing.T) {
	primary, pool := ownCluster(t)
	setSystem(t, pool, "synchronous_standby_names", "s1")
	standby, err := primary.Standby("s1")
	if err != nil {
		t.Fatal(err)
	}
	base, err := ledger.New(pool, "agent:durability")
	if err != nil {
		t.Fatal(err)
	}
	// An hour: the test reads the durability itself (Durability), so
	// nothing depends on the recheck's timing.
	client := base.RequireSynchronousStandby(time.Hour)
	api, sent := countingAPI(t)
	caller := &ledger.Caller{Ledger: client, HTTP: api.Client()}
	ctx := context.Background()
	do := func(key string) error {
		_, err := caller.Do(ctx, ledger.Intent{IdempotencyKey: key, Operation: "things.create", Dependency: "api",
			Payload: []byte(`{"key":"` + key + `"}`)}, post(t, api.URL))
		return err
	}

	d := waitMode(t, client, ledger.DurabilityRemoteFlush)
	if d.Required != 1 || d.Synchronous != 1 || !d.Replicated() {
		t.Fatalf("durability with the standby: %+v", d)
	}
	if err := do("t:1:create"); err != nil {
		t.Fatalf("with a synchronous standby: %v", err)
	}

	_ = standby.Stop()
	waitMode(t, client, ledger.DurabilityWaiting)
	err = do("t:2:create")
	if !errors.Is(err, ledger.ErrNoSynchronousStandby) {
		t.Fatalf("standby gone: err %v, want ErrNoSynchronousStandby", err)
	}
	t.Logf("the refusal, standby gone: %v", err)
	// What pg_auto_failover's wait_primary does: commits no longer wait.
	setSystem(t, pool, "synchronous_standby_names", "")
	waitMode(t, client, ledger.DurabilityLocal)
	if err := do("t:3:create"); !errors.Is(err, ledger.ErrNoSynchronousStandby) {
		t.Fatalf("synchronous replication off: err %v, want ErrNoSynchronousStandby", err)
	}
	var planned int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&planned); err != nil {
		t.Fatal(err)
	}
	if sent.Load() != 1 || planned != 1 {
		t.Fatalf("after two refusals: %d requests sent, %d receipts; want 1 and 1", sent.Load(), planned)
	}
	// A pool that does not watch warnings cannot keep the promise.
	plain, err := pgxpool.New(ctx, primary.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()

	setSystem(t, pool, "synchronous_standby_names", "s1")
	back, err := primary.Standby("s1")
	if err != nil {
		t.Fatal(err)
	}
	defer back.Stop()
	waitMode(t, client, ledger.DurabilityRemoteFlush)
	if err := do("t:2:create"); err != nil {
		t.Fatalf("standby back: %v", err)
	}
	if sent.Load() != 2 {
		t.Fatalf("%d requests sent, want 2", sent.Load())
	}
	unwatched, err := ledger.New(plain, "agent:durability")
	if err != nil {
		t.Fatal(err)
	}
	unwatched = unwatched.RequireSynchronousStandby(time.Hour)
	if _, err := unwatched.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: "t:4:create", Operation: "things.create",
		Dependency: "api", Method: "POST", Target: "/things"}); !errors.Is(err, ledger.ErrNoSynchronousStandby) {
		t.Fatalf("a pool not made by ledger.NewPool: err %v, want ErrNoSynchronousStandby", err)
	}
}

// Issue 21, item 1: a submit whose wait for the synchronous standby is
// canceled (pg_cancel_backend, as an operator unsticking a primary whose
// standby is gone does) commits locally and returns with PostgreSQL's
// warning "canceling wait for synchronous replication ... might not have
// been replicated". Nothing may be sent after it: Caller.Do sends nothing
// and rejects the receipt as not_sent, retryable.
func TestCanceledSyncWaitSendsNothing(t *testing.T) {
	_, pool := ownCluster(t)
	setSystem(t, pool, "synchronous_standby_names", "ghost") // a standby that never comes
	client, err := ledger.New(pool, "agent:durability")
	if err != nil {
		t.Fatal(err)
	}
	api, sent := countingAPI(t)
	caller := &ledger.Caller{Ledger: client, HTTP: api.Client(), SettleTimeout: time.Minute}
	ctx := context.Background()

	type result struct {
		res *ledger.Result
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := caller.Do(ctx, ledger.Intent{IdempotencyKey: "t:1:create", Operation: "things.create", Dependency: "api",
			Payload: []byte(`{}`)}, post(t, api.URL))
		done <- result{res, err}
	}()
	// Cancel the submit's wait once it waits.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity
			WHERE wait_event = 'SyncRep' AND query LIKE '%receipts%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the submit never waited for the synchronous standby")
		}
		time.Sleep(10 * time.Millisecond)
	}
	r := <-done
	if !errors.Is(r.err, ledger.ErrNotReplicated) || !errors.Is(r.err, ledger.ErrNotSent) {
		t.Fatalf("err %v, want ErrNotReplicated and ErrNotSent", r.err)
	}
	if sent.Load() != 0 {
		t.Fatalf("%d requests sent after a commit the standby did not confirm", sent.Load())
	}
	if r.res == nil || r.res.Receipt.State != statemachine.Rejected || !r.res.Receipt.Retryable {
		t.Fatalf("receipt %+v, want rejected, retryable", r.res)
	}
	t.Logf("the answer: %v", r.err)
}
