package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// clock is an injected clock the test advances; it starts at the real time
// so timestamps the database stamps (submitted_at) line up with it.
type clock = testkit.Clock

func newClock() *clock { return testkit.NewClock(time.Now()) }

// seed inserts n receipts of operation/dependency and moves them to state
// ("planned", "submitted" or "outcome_unknown") as an agent would; it returns their ids.
func seed(t testing.TB, db *pgxpool.Pool, n int, operation, dependency, state string) []int64 {
	t.Helper()
	ctx := context.Background()
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	rows, err := db.Query(ctx, `
		INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target,
		                                 fingerprint, intent, state_actor)
		SELECT $1 || ':' || g, $2, $3, 'POST', '/things',
		       'sha256:' || encode(sha256(($1 || ':' || g)::bytea), 'hex'), '{}', 'agent:test'
		FROM generate_series(1, $4) g
		RETURNING id`, tag, operation, dependency, n)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	var moves []string
	switch state {
	case "submitted":
		moves = []string{"submitted"}
	case "outcome_unknown":
		moves = []string{"submitted", "outcome_unknown"}
	}
	for _, to := range moves {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $1, state_actor = 'agent:test'
			WHERE id = ANY($2)`, to, ids); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

type receiptRow struct {
	State, ExternalID, LeaseOwner string
	Checks                        int
}

func receipt(t testing.TB, db *pgxpool.Pool, id int64) receiptRow {
	t.Helper()
	var r receiptRow
	err := db.QueryRow(context.Background(), `SELECT state, coalesce(external_id, ''),
		coalesce(lease_owner, ''), check_count FROM reconciler.receipts WHERE id = $1`, id).
		Scan(&r.State, &r.ExternalID, &r.LeaseOwner, &r.Checks)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// settlement returns the detail of the receipt's settlement events (to a
// state the reconciler settles into) in order.
func settlements(t testing.TB, db *pgxpool.Pool, id int64) []map[string]any {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT detail FROM reconciler.receipt_events
		WHERE receipt_id = $1 AND to_state IN ('succeeded', 'safe_to_retry', 'manual_review')
		ORDER BY seq`, id)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (map[string]any, error) {
		var m map[string]any
		err := r.Scan(&m)
		return m, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func checkCount(t testing.TB, db *pgxpool.Pool, id int64) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.readback_checks
		WHERE receipt_id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// fakeAPI is a local stand-in for an external system with a search
// endpoint: GET /search?marker=K lists the resources carrying marker K.
// A resource becomes visible lag after it was created (eventual
// consistency); Fail makes the endpoint answer 503 (with Retry-After).
type fakeAPI struct {
	srv   *httptest.Server
	clock func() time.Time
	lag   time.Duration

	mu        sync.Mutex
	resources map[string][]resource // by marker
	fail      bool
	// retryAfter is the Retry-After header of a 503 ("" for none).
	retryAfter string
	calls      atomic.Int64
	failures   atomic.Int64
	inFlight   atomic.Int64
	maxFlight  atomic.Int64
}

type resource struct {
	id      string
	created time.Time
}

// controlMarker marks the resource every fakeAPI holds from the start: the
// positive control declared for its adapter (issue 7: an adapter's absence
// settles nothing until its control has passed).
const controlMarker = "control-marker"

// fakeControl is the declared control of adapters over fakeAPI: a thing
// made by things.create (a declared control vouches only for its operation).
func fakeControl() *readback.Control {
	return &readback.Control{Receipt: readback.Receipt{IdempotencyKey: controlMarker, Operation: "things.create"}, Source: "declared"}
}

func newFakeAPI(t testing.TB, now func() time.Time, lag time.Duration) *fakeAPI {
	f := &fakeAPI{clock: now, lag: lag, resources: map[string][]resource{}, retryAfter: "1"}
	f.resources[controlMarker] = []resource{{id: "control-thing"}} // created long ago
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// Create records a resource carrying marker, created now.
func (f *fakeAPI) Create(marker, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resources[marker] = append(f.resources[marker], resource{id: id, created: f.clock()})
}

func (f *fakeAPI) SetFail(v bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = v
}

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	f.calls.Add(1)
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	for {
		m := f.maxFlight.Load()
		if n <= m || f.maxFlight.CompareAndSwap(m, n) {
			break
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		f.failures.Add(1)
		if f.retryAfter != "" {
			w.Header().Set("Retry-After", f.retryAfter)
		}
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
		return
	}
	if r.URL.Path != "/search" {
		http.NotFound(w, r)
		return
	}
	ids := []string{}
	for _, res := range f.resources[r.URL.Query().Get("marker")] {
		if !f.clock().Before(res.created.Add(f.lag)) {
			ids = append(ids, res.id)
		}
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"ids": ids})
}

// searchAdapter is a Go adapter (the library route) over fakeAPI's search:
// the receipt's idempotency key is the marker the call carried.
type searchAdapter struct {
	base   string
	client *http.Client
}

func (a searchAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	q := a.base + "/search?marker=" + r.IdempotencyKey
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, q, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return readback.Result{}, readback.PermanentError(fmt.Errorf("search endpoint: %s", resp.Status))
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		return readback.Result{}, readback.TransientError(fmt.Errorf("search: %s", resp.Status), time.Duration(ra)*time.Second)
	case resp.StatusCode != http.StatusOK:
		return readback.Result{}, readback.PermanentError(fmt.Errorf("search: %s", resp.Status))
	}
	var body struct{ IDs []string }
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	res := readback.Result{Query: "GET /search?marker=" + r.IdempotencyKey, ExternalIDs: body.IDs,
		Authoritative: true, Verdict: readback.VerdictAbsent}
	if len(body.IDs) > 0 {
		res.Verdict = readback.VerdictPresent
	}
	return res, nil
}

// registry returns a registry with the fake API's adapter for dependency
// "fake-api" and the given policy.
func registry(t testing.TB, api *fakeAPI, p readback.Policy, extra ...readback.Binding) *readback.Registry {
	t.Helper()
	reg := readback.NewRegistry()
	if api != nil {
		if err := reg.Register(readback.Binding{Name: "fake-search", Kind: readback.Create,
			Dependency: "fake-api", Adapter: searchAdapter{base: api.srv.URL, client: api.srv.Client()},
			Policy: p, Control: fakeControl()}); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range extra {
		if err := reg.Register(b); err != nil {
			t.Fatal(err)
		}
	}
	return reg
}

// shortPolicy: absence is conclusive 10s after submission.
func shortPolicy() readback.Policy {
	return readback.Policy{ConsistencyWindow: 4 * time.Second, MaxRequestLifetime: 6 * time.Second,
		MaxChecks: 50, Deadline: time.Hour, BackoffBase: 100 * time.Millisecond, BackoffCap: time.Second}
}

func newPool(t testing.TB, db *pgxpool.Pool, cfg reconcile.Config) *reconcile.Pool {
	t.Helper()
	if cfg.Instance == "" {
		cfg.Instance = "test-" + strconv.Itoa(int(time.Now().UnixNano()%100000))
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p, err := reconcile.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func idempotencyKey(t testing.TB, db *pgxpool.Pool, id int64) string {
	t.Helper()
	var k string
	if err := db.QueryRow(context.Background(), `SELECT idempotency_key FROM reconciler.receipts WHERE id = $1`, id).Scan(&k); err != nil {
		t.Fatal(err)
	}
	return k
}
