package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Issue 9, item 5: three `reconciler run` processes on one database, with
// a backlog of 1,500 unknowns and, at the same time, 6 agents (goroutines
// calling the API through ledger.Caller) doing 25 tasks each against an
// API that loses the answer to 30 % of writes (half before storing, half
// after). Agents retry only what the reconcilers proved absent. Afterwards:
// at most one settlement per receipt, every history legal, every backlog
// verdict the API's truth, every task done exactly once in the API (no
// duplicate, nothing lost), and the three instances shared the work
// (per-instance settlement counts are logged).
func testSeveralInstances(t *testing.T, bin string) {
	const (
		backlog   = 1500
		agents    = 6
		tasksEach = 25
	)
	seed := faultSeed(t, 13)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	rng := rand.New(rand.NewPCG(seed, 1))
	api := newTruthAPI(t, seed, truthFaults{latency: 10 * time.Millisecond, loseBefore: 0.15, loseAfter: 0.15})
	adapters := truthAdapters(t, api.srv.URL, "rate: .inf")
	instances := []string{"a", "b", "c"}
	var daemons []*daemon
	for _, name := range instances {
		metrics := freeAddr(t)
		daemons = append(daemons, startDaemon(t, bin, url, "--adapters", adapters, "--instance", name,
			"--metrics-addr", metrics, "--log-level", "warn"))
		waitFor(t, time.Minute, "instance "+name+" ready", func() (bool, string) {
			s := httpStatus("http://" + metrics + "/readyz")
			return s == 200, fmt.Sprint("status ", s)
		})
	}

	start := time.Now()
	truth := seedTruth(t, db, api, rng, backlog, 0.5)
	agent, err := ledger.New(db, "agent:fault")
	if err != nil {
		t.Fatal(err)
	}
	caller := &ledger.Caller{Ledger: agent, HTTP: &http.Client{Timeout: 2 * time.Second}}
	var wg sync.WaitGroup
	errs := make(chan error, agents*tasksEach)
	var keys []string
	for a := range agents {
		for k := range tasksEach {
			keys = append(keys, ledger.Key(fmt.Sprintf("fault-agent-%d-task-%d", a, k), "make", "things.create"))
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, key := range keys[a*tasksEach : (a+1)*tasksEach] {
				if err := doTask(db, caller, api.srv.URL, key); err != nil {
					errs <- fmt.Errorf("task %s: %w", key, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	waitSettled(t, db, truth, 3*time.Minute)
	took := time.Since(start)
	for i, d := range daemons {
		if err, _ := d.stop(t, 30*time.Second); err != nil {
			t.Fatalf("instance %s exited with %v; stderr:\n%s", instances[i], err, d.stderr.String())
		}
	}

	st, v := verifyNoReview(t, db, truth, "")
	for _, key := range keys {
		if n := api.count(key); n != 1 {
			t.Errorf("task %s: %d things in the API, want exactly 1", key, n)
		}
	}
	if k := countWhere(t, db, "state IN ('outcome_unknown', 'reconciling') OR lease_owner IS NOT NULL"); k != 0 {
		t.Fatalf("%d receipts left open or leased", k)
	}
	var per []string
	total := 0
	for _, name := range instances {
		n := st.byActor["reconciler:"+name]
		total += n
		per = append(per, fmt.Sprintf("%s=%d", name, n))
		if n == 0 {
			t.Errorf("instance %s settled nothing: the instances did not share the backlog", name)
		}
	}
	sort.Strings(per)
	var attempts int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts
		WHERE idempotency_key LIKE 'fault-agent-%'`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d backlog receipts and %d agent tasks (%d attempts, %d writes reaching the API) settled in %s; "+
		"settlements per instance: %s (of %d by reconcilers); backlog: succeeded=%d safe_to_retry=%d, 0 false verdicts, every task done once",
		backlog, len(keys), attempts, api.writes.Load(), took.Round(100*time.Millisecond), strings.Join(per, " "), total,
		v.succeeded, v.safeToRetry)
}

// doTask makes one task's call through the ledger until it has succeeded:
// an unknown outcome waits for the reconcilers' verdict; a proven absence
// (safe_to_retry) or a retryable rejection is retried, which Caller.Do
// plans as the next attempt under the same key.
func doTask(db *pgxpool.Pool, caller *ledger.Caller, base, key string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for {
		payload, _ := json.Marshal(map[string]any{"title": "thing " + key, "metadata": map[string]string{"key": key}})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/things", bytes.NewReader(payload))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		res, err := caller.Do(ctx, ledger.Intent{IdempotencyKey: key, Operation: "things.create",
			Dependency: "truth-api", Target: "/v1/things", Payload: payload, Drop: []string{"/metadata/key"},
			MaxSendDelay: 100 * time.Millisecond}, req)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ledger.ErrOutcomeUnknown):
			// The reconcilers settle it; then Do again: a succeeded
			// receipt replays, a safe_to_retry one is retried.
			if err := waitReceipt(ctx, db, res.Receipt.ID); err != nil {
				return err
			}
		case errors.Is(err, ledger.ErrNotSent):
			// Nothing was written: try again.
		default:
			return err
		}
	}
}

// waitReceipt waits until receipt id has settled (is past outcome_unknown
// and reconciling).
func waitReceipt(ctx context.Context, db *pgxpool.Pool, id int64) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		var state string
		if err := db.QueryRow(ctx, `SELECT state FROM reconciler.receipts WHERE id = $1`, id).Scan(&state); err != nil {
			return err
		}
		if s := statemachine.State(state); s != statemachine.OutcomeUnknown && s != statemachine.Reconciling {
			if s == statemachine.ManualReview {
				return fmt.Errorf("receipt %d went to manual_review", id)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("receipt %d not settled: %w", id, ctx.Err())
		case <-tick.C:
		}
	}
}
