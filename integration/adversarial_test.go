package integration

// Adversarial review of the issue 7 fixes, reconciler side: sequences
// against real Postgres that make the reconciler settle safe_to_retry while
// the effect exists. A test that FAILS on the branch reproduces a break;
// its comment gives the sequence and the fix.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

// markSucceededFromResponse settles a submitted receipt succeeded as the
// agent's Caller.Do does from a 2xx: a positive control for the ledger.
func markSucceededFromResponse(t *testing.T, db *pgxpool.Pool, id int64, ext string) {
	t.Helper()
	if _, err := db.Exec(context.Background(), `UPDATE reconciler.receipts SET state = 'succeeded', state_actor = 'agent:test',
		external_id = $2, state_detail = '{"evidence": {"source": "http_response", "http_status": 201}}'
		WHERE id = $1`, id, ext); err != nil {
		t.Fatal(err)
	}
}

func stateOf(t *testing.T, db *pgxpool.Pool, id int64) string {
	t.Helper()
	return receipt(t, db, id).State
}

// drainPastWindow runs three drains, a minute of the test clock apart,
// starting a minute after now: far past shortPolicy's window.
func drainPastWindow(t *testing.T, pool *reconcile.Pool, clk *clock) {
	t.Helper()
	clk.Advance(time.Minute)
	for range 3 {
		if _, err := pool.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Minute)
	}
}

// BREAK (positive control from another operation): a binding that covers a
// whole dependency (no `operations:`) draws its ledger control from "the
// latest receipt of the dependency (any operation) that settled succeeded
// from a 2xx" (sqlControlReceipt with an empty operation list). Sequence:
//
//  1. blog-api has articles.create and comments.create; one adapter covers
//     the dependency, configured with the articles path (correct for
//     articles, wrong for comments: it never reads comments);
//  2. an articles.create call succeeds from its 2xx: the control;
//  3. a comments.create call times out after the comment was created;
//  4. the reconciler reads the articles path for the comment's marker:
//     absent, authoritative; the control (the article) passes on that
//     same path; the comment receipt is settled safe_to_retry while the
//     comment exists.
//
// Fix (reconcile/control.go, sql.go): a control is valid per (binding,
// operation): draw it from receipts of the operation of the receipt being
// settled (key the control state by binding and operation), and let a
// declared control vouch only for the operation it names.
func TestAdversarialControlFromAnotherOperation(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	articles := newFakeAPI(t, clk.Now, 0) // what the adapter reads
	comments := newFakeAPI(t, clk.Now, 0) // where comments really live
	// 2. The control: an article created from a 2xx.
	art := seed(t, db, 1, "articles.create", "blog-api", "submitted")[0]
	markSucceededFromResponse(t, db, art, "art-1")
	articles.Create(idempotencyKey(t, db, art), "art-1")
	// 3. A comment whose call timed out: the comment exists.
	com := seed(t, db, 1, "comments.create", "blog-api", "outcome_unknown")[0]
	comments.Create(idempotencyKey(t, db, com), "com-1")

	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "blog-wide", Kind: readback.Create, Dependency: "blog-api",
		Adapter: searchAdapter{base: articles.srv.URL, client: articles.srv.Client()}, Policy: shortPolicy()}); err != nil {
		t.Fatal(err)
	}
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	drainPastWindow(t, pool, clk)
	if st := stateOf(t, db, com); st == "safe_to_retry" {
		ev := settlements(t, db, com)
		t.Fatalf("the comment exists but its receipt was settled safe_to_retry by an adapter that never reads comments; "+
			"its control was an article: %v", ev[len(ev)-1]["evidence"].(map[string]any)["positive_control"])
	}
}

// BREAK (a misconfigured delete adapter settles safe_to_retry): a delete's
// positive control is "a resource known to exist, found present". It shows
// that the adapter can see what exists, i.e. that its ABSENT is real
// (which settles deletes succeeded); it says nothing about its PRESENT,
// which is what settles a delete safe_to_retry ("present after the window:
// the delete did not happen"). An adapter that answers present for
// everything passes. Sequence:
//
//  1. a delete adapter is misconfigured: its fetch path is fixed (or the
//     API soft-deletes and answers 200 for deleted items, or the path names
//     the collection): every fetch finds something, "present";
//  2. its declared control (a resource that exists) is found: passes;
//  3. DELETE /things/42 times out after the delete happened;
//  4. after the window the adapter answers present: safe_to_retry, while
//     the delete's effect (the resource is gone) exists.
//
// Fix (readback/control.go, reconcile/control.go): a delete adapter's
// control needs both sides: a resource known to exist (must read present)
// and one known to be gone (must read absent, e.g. a declared
// `control.absent_target`, or a receipt of the operation settled succeeded
// from a 2xx, whose resource is deleted); until both pass, neither a
// delete's succeeded nor its safe_to_retry settles.
func TestAdversarialDeleteAdapterThatAlwaysSeesPresent(t *testing.T) {
	db := pgtest.NewPool(t)
	clk := newClock()
	var mu sync.Mutex
	existing := map[string]bool{"/things/control": true} // /things/42 was deleted
	// The misconfigured adapter reads /things/control whatever the receipt's
	// target: present for everything.
	fixedPath := readback.AdapterFunc(func(_ context.Context, r readback.Receipt) (readback.Result, error) {
		mu.Lock()
		defer mu.Unlock()
		path := "/things/control" // should have been r.Target
		if existing[path] {
			return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"control"},
				Authoritative: true, Query: "GET " + path}, nil
		}
		return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET " + path}, nil
	})
	ctl := &readback.Control{Source: "declared", Receipt: readback.Receipt{IdempotencyKey: "control-thing",
		Target: "/things/control", Method: "DELETE", SubmittedAt: clk.Now().Add(-time.Hour)}}
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "things-delete", Kind: readback.Delete, Dependency: "del-api",
		Adapter: fixedPath, Policy: shortPolicy(), Control: ctl}); err != nil {
		t.Fatal(err)
	}
	id := seed(t, db, 1, "things.delete", "del-api", "outcome_unknown")[0]
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
	drainPastWindow(t, pool, clk)
	if st := stateOf(t, db, id); st == "safe_to_retry" {
		t.Fatalf("the delete happened (the resource is gone) but a delete adapter that answers present for everything "+
			"passed its control and settled the receipt %s", st)
	}
}

// pagedAPI lists things newest first, two per page, with a cursor at
// /next_cursor and a /has_more flag: the shape of most list endpoints.
type pagedAPI struct {
	srv   *httptest.Server
	mu    sync.Mutex
	items []map[string]any // oldest first
}

func newPagedAPI(t *testing.T) *pagedAPI {
	a := &pagedAPI{}
	a.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		defer a.mu.Unlock()
		list := slices.Clone(a.items)
		slices.Reverse(list)
		from, _ := strconv.Atoi(r.URL.Query().Get("cursor"))
		end := min(from+2, len(list))
		page := list[min(from, len(list)):end]
		body := map[string]any{"items": page, "has_more": end < len(list), "next_cursor": nil}
		if end < len(list) {
			body["next_cursor"] = strconv.Itoa(end)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(body)
	}))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *pagedAPI) create(key, id string, at time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.items = append(a.items, map[string]any{"id": id, "created_at": at.UTC().Format(time.RFC3339Nano),
		"metadata": map[string]any{"idempotency_key": key}})
}

// BREAK (the control does not exercise what the absence relies on):
// the control drawn from the ledger is the NEWEST receipt that succeeded,
// and a list sorted newest first serves it on page 1. A pagination
// misconfiguration that reads only page 1 (style none on a paginated API;
// a cursor pointer that names nothing, without has_more) passes that
// control, and every receipt whose item is past page 1 reads as an
// authoritative absence. Sequence:
//
//  1. receipt U (things.create) times out; its thing was created;
//  2. three more things.create calls succeed from their 2xx afterwards;
//  3. the list (newest first, 2 per page) serves them on page 1, U's on
//     page 2; the adapter reads page 1 and stops (no cursor found /
//     no pagination declared): absent, authoritative (a cursor list
//     "cannot skip items");
//  4. the control (the newest success) is on page 1: passes; U settles
//     safe_to_retry while its thing exists.
//
// Fix: an absence through a list whose last page was full is not
// authoritative unless the end of the list was seen (has_more false, or a
// short page): require has_more for cursor lists and treat a full page as
// "may go on" for style none; and run the control under the checked
// receipt's window, with a control at least as old as the receipt
// (readback/httpadapter/adapter.go; reconcile/sql.go sqlControlReceipt
// picking a receipt submitted before the one being settled).
func TestAdversarialPaginationMisconfigPassesTheControl(t *testing.T) {
	for _, tc := range []struct{ name, pagination string }{
		{"style none on a paginated list", "{style: none}"},
		{"cursor pointer that names nothing", "{style: cursor, cursor: /next, param: cursor}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := pgtest.NewPool(t)
			clk := newClock()
			api := newPagedAPI(t)
			// 1. The receipt whose call timed out; its thing exists.
			u := seed(t, db, 1, "things.create", "paged-api", "outcome_unknown")[0]
			api.create(idempotencyKey(t, db, u), "thing-u", clk.Now())
			// 2. Three later calls that succeeded from their 2xx.
			for i, id := range seed(t, db, 3, "things.create", "paged-api", "submitted") {
				markSucceededFromResponse(t, db, id, fmt.Sprintf("thing-%d", i))
				api.create(idempotencyKey(t, db, id), fmt.Sprintf("thing-%d", i), clk.Now().Add(time.Duration(i+1)*time.Millisecond))
			}
			file := writeFile(t, "adapters.yaml", fmt.Sprintf(`
version: 1
adapters:
  - name: paged-things
    type: http
    kind: create
    dependency: paged-api
    consistency_window: 4s
    max_request_lifetime: 6s
    max_checks: 50
    deadline: 1h
    backoff: {base: 100ms, cap: 1s}
    http:
      base_url: %s
      search:
        method: GET
        path: "{receipt.target}"
        items: /items
        id: /id
        created_at: /created_at
        pagination: %s
      match:
        marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`, api.srv.URL, tc.pagination))
			reg, err := httpadapter.LoadFile(file, nil, httpadapter.WithClock(clk.Now))
			if err != nil {
				t.Fatal(err)
			}
			pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
			drainPastWindow(t, pool, clk)
			if st := stateOf(t, db, u); st == "safe_to_retry" {
				ev := settlements(t, db, u)
				t.Fatalf("receipt %d's thing exists (page 2 of the list) but it was settled safe_to_retry; control: %v",
					u, ev[len(ev)-1]["evidence"].(map[string]any)["positive_control"])
			}
		})
	}
}
