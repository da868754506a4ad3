package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

// listItem is one resource of listAPI.
type listItem struct {
	id, marker       string
	created, visible time.Time
}

// listAPI is a shop API with one list endpoint, GET /items?created_after=
// <RFC 3339>[&marker=K]&page=N, answering {"items": [...]} oldest first,
// four to a page, until an empty page. A resource is listed once the
// injected clock reaches its visible time (eventual consistency). Every
// request moves the clock on by step, so a read of several pages takes
// time and a receipt's absence window can close in the middle of one.
// While churn lasts, each request first deletes the oldest foreign
// resource, so the items behind it shift back by one across page
// boundaries between two passes.
type listAPI struct {
	srv  *httptest.Server
	clk  *clock
	step time.Duration

	mu    sync.Mutex
	items []listItem
	churn int
	// shared counts the requests without a marker filter, narrowed the
	// ones with it; starts holds the created_after of the shared ones.
	shared, narrowed int
	starts           map[string]bool
}

func newListAPI(t *testing.T, clk *clock, step time.Duration) *listAPI {
	a := &listAPI{clk: clk, step: step, starts: map[string]bool{}}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *listAPI) add(it listItem) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.items = append(a.items, it)
	slices.SortStableFunc(a.items, func(x, y listItem) int { return x.created.Compare(y.created) })
}

func (a *listAPI) serve(w http.ResponseWriter, r *http.Request) {
	a.clk.Advance(a.step)
	now := a.clk.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.churn > 0 {
		a.churn--
		for i, it := range a.items {
			if it.marker == "" && !it.visible.After(now) {
				a.items = slices.Delete(a.items, i, i+1)
				break
			}
		}
	}
	q := r.URL.Query()
	after, err := time.Parse(time.RFC3339, q.Get("created_after"))
	if r.URL.Path != "/items" || err != nil {
		http.Error(w, `{"error":"bad request"}`, http.StatusBadRequest)
		return
	}
	marker, byMarker := q.Get("marker"), q.Has("marker")
	if byMarker {
		a.narrowed++
	} else {
		a.shared++
		a.starts[q.Get("created_after")] = true
	}
	var list []map[string]any
	for _, it := range a.items {
		if it.visible.After(now) || it.created.Before(after) || (byMarker && it.marker != marker) {
			continue
		}
		item := map[string]any{"id": it.id, "created_at": it.created.UTC().Format(time.RFC3339Nano)}
		if it.marker != "" {
			item["metadata"] = map[string]any{"idempotency_key": it.marker}
		}
		list = append(list, item)
	}
	page, _ := strconv.Atoi(q.Get("page"))
	from, to := min((page-1)*4, len(list)), min(page*4, len(list))
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"items": append([]map[string]any{}, list[from:to]...)})
}

// batchAdapters is the adapters file of the batch tests: one adapter reads
// items.create and notes.create of the shop; a declared control vouches for
// items.create, and notes.create relies on the ledger's. The per-receipt
// search is narrowed to the receipt's key; with batch set, the list read
// without it answers many receipts at once.
func batchAdapters(base string, control time.Time, batch bool) string {
	b := ""
	if batch {
		b = "        batch: {max_receipts: 50}\n"
	}
	return fmt.Sprintf(`version: 1
defaults:
  consistency_window: 2s
  max_request_lifetime: 1s
  max_checks: 60
  deadline: 40s
  backoff: {base: 300ms, cap: 2s}
adapters:
  - name: shop
    type: http
    kind: create
    dependency: shop
    operations: [items.create, notes.create]
    control:
      idempotency_key: "bootstrap:shop:items.create"
      target: /items
      submitted_at: %s
      operation: items.create
    http:
      base_url: %s
      window_skew: 1s
      search:
        path: /items
        query: {created_after: "{window.start}", marker: "{receipt.logical_key}"}
        items: /items
        id: /id
        created_at: /created_at
        pagination: {style: page, param: page, max_pages: 3}
%s      match:
        marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`, control.UTC().Format(time.RFC3339), base, b)
}

// shiftSubmission moves the receipts' times d into the past, as if they had
// been submitted then. The schema refuses to rewrite the times of past
// moves, so the test's database lets its owner switch the receipts
// triggers off for this one transaction (as pgtest.Backdate does).
func shiftSubmission(t *testing.T, db *pgxpool.Pool, ids []int64, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `ALTER TABLE reconciler.receipts DISABLE TRIGGER USER`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE reconciler.receipts SET created_at = created_at - $2::interval,
			submitted_at = submitted_at - $2::interval, unknown_since = unknown_since - $2::interval,
			updated_at = updated_at - $2::interval, next_check_at = next_check_at - $2::interval
			WHERE id = ANY($1)`, ids, d); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `ALTER TABLE reconciler.receipts ENABLE TRIGGER USER`)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// batchTruth is one seed's world: which receipts took effect, when, and
// when their effect became visible.
type batchTruth struct {
	cohorts [][]batchCall
	foreign []time.Duration // creation times of others' resources, from the start
}

type batchCall struct {
	op      string
	present bool
	// effect and lag: the effect happened effect after submission and was
	// listed lag after that.
	effect, lag time.Duration
}

func newBatchTruth(seed uint64) batchTruth {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var t batchTruth
	for range 4 {
		var cohort []batchCall
		for range 6 + rng.IntN(4) {
			op := "items.create"
			if rng.IntN(3) == 0 {
				op = "notes.create"
			}
			cohort = append(cohort, batchCall{op: op, present: rng.IntN(2) == 0,
				effect: time.Duration(rng.Int64N(int64(time.Second))), lag: time.Duration(rng.Int64N(int64(2 * time.Second)))})
		}
		t.cohorts = append(t.cohorts, cohort)
	}
	for range 10 {
		t.foreign = append(t.foreign, time.Duration(rng.Int64N(int64(40*time.Second))))
	}
	return t
}

// settleWorld plays truth against a fresh database with one strategy and
// returns each call's final state (in truth's order) and the API.
func settleWorld(t *testing.T, truth batchTruth, batch bool) ([]string, *listAPI) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:test")
	if err != nil {
		t.Fatal(err)
	}
	clk := newClock()
	api := newListAPI(t, clk, 60*time.Millisecond)
	start := clk.Now()
	// The control of items.create exists; the ledger's control of
	// notes.create (a note the API answered 2xx for) is missing from the
	// API, so that control fails: no absence of a note settles.
	api.add(listItem{id: "control", marker: "bootstrap:shop:items.create", created: start.Add(-50 * time.Second),
		visible: start.Add(-50 * time.Second)})
	note, err := agent.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: "note-control", Operation: "notes.create",
		Dependency: "shop", Method: "POST", Target: "/items", Payload: json.RawMessage(`{"n":0}`)})
	if err == nil {
		_, err = agent.Succeed(ctx, note, "note-0", ledger.Detail{Evidence: map[string]any{"source": "http_response"}})
	}
	if err != nil {
		t.Fatal(err)
	}
	shiftSubmission(t, db, []int64{note.ID}, 60*time.Second)
	var ids []int64
	for c, cohort := range truth.cohorts {
		back := time.Duration(len(truth.cohorts)-c) * 6 * time.Second
		var cids []int64
		for i, call := range cohort {
			key := fmt.Sprintf("c%d-%d", c, i)
			r, err := agent.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: key, Operation: call.op, Dependency: "shop",
				Method: "POST", Target: "/items", Payload: json.RawMessage(fmt.Sprintf(`{"key":%q}`, key))})
			if err == nil {
				r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Reason: "the answer was lost"})
			}
			if err != nil {
				t.Fatal(err)
			}
			cids = append(cids, r.ID)
			if call.present {
				created := r.SubmittedAt.Add(-back + call.effect)
				api.add(listItem{id: "item-" + key, marker: key, created: created, visible: created.Add(call.lag)})
			}
		}
		shiftSubmission(t, db, cids, back)
		ids = append(ids, cids...)
	}
	for i, d := range truth.foreign {
		at := start.Add(-30*time.Second + d)
		api.add(listItem{id: fmt.Sprintf("foreign-%d", i), created: at, visible: at})
	}
	api.mu.Lock()
	api.churn = 40
	api.mu.Unlock()

	dir := t.TempDir()
	file := filepath.Join(dir, "adapters.yaml")
	if err := os.WriteFile(file, []byte(batchAdapters(api.srv.URL, start.Add(-50*time.Second), batch)), 0o600); err != nil {
		t.Fatal(err)
	}
	reg, err := httpadapter.LoadFile(file, nil, httpadapter.WithClock(clk.Now))
	if err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1, Workers: 4})
	for round := 0; countWhere(t, db, "state IN ('outcome_unknown', 'reconciling')") > 0; round++ {
		if round > 400 {
			t.Fatal("receipts still unsettled after 400 rounds")
		}
		clk.Advance(500 * time.Millisecond)
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	states := make([]string, len(ids))
	for i, id := range ids {
		states[i] = receipt(t, db, id).State
	}
	checkSharedEvidence(t, db, batch)
	return states, api
}

// checkSharedEvidence: every settled absence began its read after the
// receipt's absence window; with batched reads, each check of a shared
// read names it, and each of the read's receipts has its own check row.
func checkSharedEvidence(t *testing.T, db *pgxpool.Pool, batch bool) {
	t.Helper()
	ctx := context.Background()
	var early int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts
		WHERE state = 'safe_to_retry'
		  AND (state_detail #>> '{evidence,read_at}')::timestamptz < (state_detail #>> '{evidence,absence_safe_at}')::timestamptz`).
		Scan(&early); err != nil {
		t.Fatal(err)
	}
	if early > 0 {
		t.Fatalf("%d absences settled from a read that began before their absence window", early)
	}
	var reads, rows, perReceipt int
	if err := db.QueryRow(ctx, `SELECT count(DISTINCT evidence #>> '{shared_read,id}'), count(*),
		count(DISTINCT (evidence #>> '{shared_read,id}', receipt_id))
		FROM reconciler.readback_checks WHERE evidence ? 'shared_read'`).Scan(&reads, &rows, &perReceipt); err != nil {
		t.Fatal(err)
	}
	switch {
	case !batch && rows > 0:
		t.Fatalf("per-receipt reads recorded %d shared reads", rows)
	case batch && reads == 0:
		t.Fatal("no check names a shared read")
	case batch && reads >= rows:
		t.Fatalf("%d shared reads for %d checks: no read answered two receipts", reads, rows)
	case perReceipt != rows:
		t.Fatalf("%d check rows for %d (read, receipt) pairs: a receipt has more than one row for one read", rows, perReceipt)
	}
}

// Acceptance (issue 22): on the same truth, reading per receipt and reading
// in batches settle every receipt alike, and as the truth says: a call that
// took effect succeeded, one of items.create that did not safe_to_retry,
// and one of notes.create that did not manual_review (the ledger's control
// of notes.create fails, while the declared one of items.create passes).
// The truth is drawn from several seeds; on the way the batched reader
// meets pages that shift between two passes (foreign resources deleted),
// groups too large for max_pages that split into later windows (cohorts
// submitted 6 s apart, 3 pages of 4 items), and absence windows that close
// while a shared read is under way (each request takes 60 ms of the
// injected clock).
func TestBatchedAndPerReceiptReadsSettleAlike(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			truth := newBatchTruth(seed)
			var want []string
			for _, cohort := range truth.cohorts {
				for _, call := range cohort {
					switch {
					case call.present:
						want = append(want, "succeeded")
					case call.op == "notes.create":
						want = append(want, "manual_review")
					default:
						want = append(want, "safe_to_retry")
					}
				}
			}
			per, perAPI := settleWorld(t, truth, false)
			batched, batchAPI := settleWorld(t, truth, true)
			for i := range want {
				if per[i] != want[i] || batched[i] != want[i] {
					t.Errorf("call %d: per receipt %s, batched %s, truth says %s", i, per[i], batched[i], want[i])
				}
			}
			if perAPI.shared != 0 {
				t.Errorf("per-receipt reads made %d requests without the key", perAPI.shared)
			}
			if len(batchAPI.starts) < 2 {
				t.Errorf("shared reads began at %d window starts: no group split", len(batchAPI.starts))
			}
			t.Logf("requests: per receipt %d, batched %d shared + %d narrowed (%d window starts)",
				perAPI.narrowed, batchAPI.shared, batchAPI.narrowed, len(batchAPI.starts))
		})
	}
}

// A shared read answers every receipt of its group, but an absence counts
// only for the receipts whose absence window had closed when the read
// began (SPEC §5a): one whose window closes while the read is under way
// settles nothing from it, and settles from the next read.
func TestSharedReadSettlesNoAbsenceWhoseWindowClosedMidRead(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:test")
	if err != nil {
		t.Fatal(err)
	}
	clk := newClock()
	api := newListAPI(t, clk, time.Second) // each request takes a second
	start := clk.Now()
	api.add(listItem{id: "control", marker: "bootstrap:shop:items.create", created: start.Add(-50 * time.Second),
		visible: start.Add(-50 * time.Second)})
	var ids []int64
	// Absence windows (5 s send delay, 1 s lifetime, 2 s window) closed
	// 12 s before the read, and closing half a second into it.
	for i, back := range []time.Duration{20 * time.Second, 7500 * time.Millisecond} {
		r, err := agent.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: fmt.Sprintf("mid-%d", i), Operation: "items.create",
			Dependency: "shop", Method: "POST", Target: "/items", Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))})
		if err == nil {
			r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Reason: "the answer was lost"})
		}
		if err != nil {
			t.Fatal(err)
		}
		shiftSubmission(t, db, []int64{r.ID}, back+time.Since(start))
		ids = append(ids, r.ID)
	}
	file := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(file, []byte(batchAdapters(api.srv.URL, start.Add(-50*time.Second), true)), 0o600); err != nil {
		t.Fatal(err)
	}
	reg, err := httpadapter.LoadFile(file, nil, httpadapter.WithClock(clk.Now))
	if err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if st := receipt(t, db, ids[0]).State; st != "safe_to_retry" {
		t.Fatalf("the receipt whose window had closed: %s, want safe_to_retry", st)
	}
	if st := receipt(t, db, ids[1]).State; st != "reconciling" {
		t.Fatalf("the receipt whose window closed mid-read: %s, want reconciling (checked, not settled)", st)
	}
	var reads int
	if err := db.QueryRow(ctx, `SELECT count(DISTINCT evidence #>> '{shared_read,id}') FROM reconciler.readback_checks
		WHERE receipt_id = ANY($1) AND verdict = 'absent'`, ids).Scan(&reads); err != nil {
		t.Fatal(err)
	}
	if reads != 1 || checkCount(t, db, ids[1]) != 1 {
		t.Fatalf("%d shared reads answered the two receipts, want one (and one check of the second)", reads)
	}
	for round := 0; receipt(t, db, ids[1]).State != "safe_to_retry"; round++ {
		if round > 20 {
			t.Fatalf("the second receipt is %s after 20 rounds", receipt(t, db, ids[1]).State)
		}
		clk.Advance(time.Second)
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A shared read that finds an effect after an earlier authoritative
// absence of the same receipt past its window proves the declared window
// too short, as a receipt's own read does (TestAnEffectAfterAnAbsence
// PastTheWindowWidensIt): a window alarm that widens it. The control is
// missing at first, so the absence cannot settle the receipt.
func TestSharedReadPresentAfterAbsenceWidensTheWindow(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	agent, err := ledger.New(db, "agent:test")
	if err != nil {
		t.Fatal(err)
	}
	clk := newClock()
	api := newListAPI(t, clk, 60*time.Millisecond)
	start := clk.Now()
	r, err := agent.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: "late-item", Operation: "items.create", Dependency: "shop",
		Method: "POST", Target: "/items", Payload: json.RawMessage(`{"key":"late-item"}`)})
	if err == nil {
		r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Reason: "the answer was lost"})
	}
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(file, []byte(batchAdapters(api.srv.URL, start.Add(-50*time.Second), true)), 0o600); err != nil {
		t.Fatal(err)
	}
	reg, err := httpadapter.LoadFile(file, nil, httpadapter.WithClock(clk.Now))
	if err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	sharedAbsencePastWindow := func() bool {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks c JOIN reconciler.receipts r ON r.id = c.receipt_id
			WHERE c.receipt_id = $1 AND c.verdict = 'absent' AND c.authoritative
			  AND (c.evidence ? 'shared_read' OR c.evidence -> 'adapter_evidence' ? 'shared_read')
			  AND c.at >= r.submitted_at + r.max_send_delay + interval '3 seconds'`, r.ID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	drainUntil(t, pool, clk, 500*time.Millisecond, 200, sharedAbsencePastWindow)
	if st := receipt(t, db, r.ID).State; st != "reconciling" && st != "outcome_unknown" {
		t.Fatalf("an absence settled without its control: %s", st)
	}
	api.add(listItem{id: "control", marker: "bootstrap:shop:items.create", created: start.Add(-50 * time.Second),
		visible: start.Add(-50 * time.Second)})
	api.add(listItem{id: "item-late", marker: "late-item", created: r.SubmittedAt.Add(time.Second), visible: clk.Now()})
	drainUntil(t, pool, clk, 500*time.Millisecond, 200, func() bool { return receipt(t, db, r.ID).State == "succeeded" })
	var kind string
	var declared, effective float64
	if err := db.QueryRow(ctx, `SELECT kind, extract(epoch FROM declared), extract(epoch FROM effective_after)
		FROM reconciler.window_alarms WHERE receipt_id = $1`, r.ID).Scan(&kind, &declared, &effective); err != nil {
		t.Fatalf("no window alarm from a shared read: %v", err)
	}
	if kind != reconcile.AlarmPresentAfterAbsence || effective <= declared {
		t.Fatalf("window alarm %s: declared %vs, effective %vs", kind, declared, effective)
	}
}
