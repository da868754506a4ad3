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
	"strings"
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

// Issue 7, adversarial review: "a dependency-wide adapter's control drawn
// from the ledger came from another operation (articles) and vouched for
// comments.create, which then settled safe_to_retry although the comment
// existed". Sequence attempted:
//
//  1. blog-api has articles.create and comments.create; one adapter covers
//     the dependency, configured with the articles path (correct for
//     articles, wrong for comments: it never reads comments);
//  2. an articles.create call succeeds from its 2xx (a ledger control for
//     articles), and the file declares an article as control of
//     articles.create;
//  3. a comments.create call times out after the comment was created;
//  4. the reconciler reads the articles path for the comment's marker:
//     absent, authoritative.
//
// Guaranteed: a control vouches only for its own operation. Control state
// is per (adapter, operation); a ledger control is a receipt of the
// operation being settled, a declared one vouches for the operation it
// names. The comment waits (comments.create has no control: nothing of it
// succeeded from a 2xx) and the adapter is reported unhealthy for
// comments.create; an absent article still settles safe_to_retry on the
// articles control.
func TestControlVouchesOnlyForItsOperation(t *testing.T) {
	for _, declared := range []bool{false, true} {
		t.Run(fmt.Sprintf("declared=%v", declared), func(t *testing.T) {
			db := pgtest.NewPool(t)
			clk := newClock()
			articles := newFakeAPI(t, clk.Now, 0) // what the adapter reads
			comments := newFakeAPI(t, clk.Now, 0) // where comments really live
			// 2. The controls: an article created from a 2xx; a declared one.
			art := seed(t, db, 1, "articles.create", "blog-api", "submitted")[0]
			markSucceededFromResponse(t, db, art, "art-1")
			articles.Create(idempotencyKey(t, db, art), "art-1")
			// 3. A comment whose call timed out: the comment exists.
			com := seed(t, db, 1, "comments.create", "blog-api", "outcome_unknown")[0]
			comments.Create(idempotencyKey(t, db, com), "com-1")
			// An article whose call timed out and never landed.
			lost := seed(t, db, 1, "articles.create", "blog-api", "outcome_unknown")[0]

			b := readback.Binding{Name: "blog-wide", Kind: readback.Create, Dependency: "blog-api",
				Adapter: searchAdapter{base: articles.srv.URL, client: articles.srv.Client()}, Policy: shortPolicy()}
			if declared {
				b.Control = fakeControl()
				b.Control.Receipt.Operation = "articles.create"
			}
			reg := readback.NewRegistry()
			if err := reg.Register(b); err != nil {
				t.Fatal(err)
			}
			pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
			drainPastWindow(t, pool, clk)
			if st := stateOf(t, db, com); st == "safe_to_retry" {
				ev := settlements(t, db, com)
				t.Fatalf("the comment exists but its receipt was settled safe_to_retry by an adapter that never reads comments; "+
					"its control: %v", ev[len(ev)-1]["evidence"].(map[string]any)["positive_control"])
			} else if st != "reconciling" {
				t.Fatalf("comment receipt %s, want reconciling (waiting for a control of comments.create)", st)
			}
			if st := stateOf(t, db, lost); st != "safe_to_retry" {
				t.Fatalf("the lost article's receipt is %s, want safe_to_retry on the articles control", st)
			}
			ctl, _ := settlements(t, db, lost)[0]["evidence"].(map[string]any)["positive_control"].(string)
			if !strings.Contains(ctl, "present control for articles.create") {
				t.Fatalf("the article's settlement names its control %q", ctl)
			}
			var comOK, artOK *reconcile.AdapterHealth
			for _, h := range pool.AdapterHealth() {
				switch h.Operation {
				case "comments.create":
					comOK = &h
				case "articles.create":
					artOK = &h
				}
			}
			if comOK == nil || comOK.OK || !strings.Contains(comOK.Reason, "no present control") || artOK == nil || !artOK.OK {
				t.Fatalf("health: comments %+v, articles %+v; want comments failing with no control, articles OK", comOK, artOK)
			}
		})
	}
}

// Issue 7, adversarial review: "a delete adapter reading a fixed path
// answers present for everything; its 'present' control passes, and a
// delete that happened settles safe_to_retry ('still present after the
// window')". A delete's "present" control (a resource known to exist reads
// present) shows its ABSENT is real; it says nothing about its PRESENT.
// Sequence attempted:
//
//  1. a delete adapter is misconfigured: its fetch path is fixed (or the
//     API soft-deletes and answers 200 for deleted items, or the path names
//     the collection): every fetch finds something, "present";
//  2. its declared control (a resource that exists) is found: passes;
//  3. DELETE /things/42 times out after the delete happened;
//  4. after the window the adapter answers present.
//
// Guaranteed: a delete's "still present after the window" settles
// safe_to_retry only while the adapter's "gone" control passes: the newest
// receipt of the same delete operation that settled succeeded from the
// API's 2xx must read absent, authoritatively. The misconfigured adapter
// fails it (it reads that resource present), settles nothing and is
// reported unhealthy for the gone control; the correct adapter settles the
// delete that happened succeeded (on its present control) and the one that
// did not safe_to_retry (on its gone control), each settlement naming it.
func TestDeleteStillPresentNeedsGoneControl(t *testing.T) {
	for _, misconfigured := range []bool{true, false} {
		t.Run(fmt.Sprintf("misconfigured=%v", misconfigured), func(t *testing.T) {
			db := pgtest.NewPool(t)
			clk := newClock()
			// A delete the agent saw succeed from its 2xx: its thing is gone.
			gone := seed(t, db, 1, "things.delete", "del-api", "submitted")[0]
			markSucceededFromResponse(t, db, gone, "")
			ids := seed(t, db, 2, "things.delete", "del-api", "outcome_unknown")
			happened, notDone := ids[0], ids[1] // 3. the first delete happened
			var mu sync.Mutex
			// Things by path (the receipt's key stands for its path).
			existing := map[string]bool{"control-thing": true, idempotencyKey(t, db, notDone): true}
			adapter := readback.AdapterFunc(func(_ context.Context, r readback.Receipt) (readback.Result, error) {
				mu.Lock()
				defer mu.Unlock()
				path := r.IdempotencyKey
				if misconfigured {
					path = "control-thing" // 1. a fixed path: should have been the receipt's
				}
				if existing[path] {
					return readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{path},
						Authoritative: true, Query: "GET /things/" + path}, nil
				}
				return readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET /things/" + path}, nil
			})
			// 2. The declared control: a thing that exists.
			ctl := &readback.Control{Source: "declared", Receipt: readback.Receipt{IdempotencyKey: "control-thing",
				Operation: "things.delete", Target: "/things/control", Method: "DELETE", SubmittedAt: clk.Now().Add(-time.Hour)}}
			reg := readback.NewRegistry()
			if err := reg.Register(readback.Binding{Name: "things-delete", Kind: readback.Delete, Dependency: "del-api",
				Adapter: adapter, Policy: shortPolicy(), Control: ctl}); err != nil {
				t.Fatal(err)
			}
			pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now, OrphanTimeout: -1})
			drainPastWindow(t, pool, clk)
			health := map[reconcile.ControlKind]reconcile.AdapterHealth{}
			for _, h := range pool.AdapterHealth() {
				health[h.Control] = h
			}
			if misconfigured {
				if st := stateOf(t, db, happened); st == "safe_to_retry" {
					t.Fatalf("the delete happened (the thing is gone) but an adapter that answers present for everything "+
						"settled the receipt %s", st)
				}
				if st := stateOf(t, db, notDone); st != "reconciling" {
					t.Fatalf("a delete read by an adapter that answers present for everything settled %s", st)
				}
				if h := health[reconcile.ControlGone]; h.OK || !strings.Contains(h.Reason, "confirmed deleted") {
					t.Fatalf("gone control health %+v, want failing: the adapter reads a deleted thing present", h)
				}
				return
			}
			for id, want := range map[int64]string{happened: "succeeded", notDone: "safe_to_retry"} {
				if st := stateOf(t, db, id); st != want {
					t.Fatalf("receipt %d: %s, want %s", id, st, want)
				}
			}
			for id, want := range map[int64]string{happened: "present control for things.delete: declared",
				notDone: fmt.Sprintf("gone control for things.delete: receipt:%d", gone)} {
				c, _ := settlements(t, db, id)[0]["evidence"].(map[string]any)["positive_control"].(string)
				if !strings.HasPrefix(c, want) {
					t.Fatalf("receipt %d's settlement names control %q, want %q...", id, c, want)
				}
			}
			if !health[reconcile.ControlGone].OK || !health[reconcile.ControlPresent].OK {
				t.Fatalf("health %+v, want both controls OK", health)
			}
		})
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

// Issue 7, adversarial review: "the control does not exercise what the
// absence relies on": the control drawn from the ledger was the NEWEST
// receipt that succeeded, which a list sorted newest first serves on page
// 1, so a pagination misconfiguration that reads only page 1 passed it and
// every receipt whose item is past page 1 read as an authoritative
// absence. Sequence attempted:
//
//  1. receipt U (things.create) times out; its thing was created;
//  2. three more things.create calls succeed from their 2xx afterwards;
//  3. the list (newest first, 2 per page) serves them on page 1, U's on
//     page 2; the adapter reads page 1 and stops (no pagination declared,
//     or declared whole when it is not; a cursor pointer naming nothing).
//
// Guaranteed, in two layers: an unpaged list's absence is authoritative
// only when declared whole (or narrowed to the key), and a cursor list
// needs has_more, whose "true" without a cursor is not the end
// (readback/httpadapter); and the ledger control is the receipt of the
// operation submitted closest to the one being settled (the newest
// submitted no later, else the oldest after: here thing-0, on page 2), so
// a list declared whole that is cut short misses the control too and fails
// it. U never settles safe_to_retry; a correct cursor configuration finds
// its thing.
func TestPaginationMisconfigProvesNoAbsence(t *testing.T) {
	for _, tc := range []struct{ name, pagination, want string }{
		{"style none on a paginated list", "{style: none}", "reconciling"},
		{"style none declared whole on a paginated list", "{style: none, whole_list: true}", "reconciling"},
		{"cursor pointer that names nothing", "{style: cursor, cursor: /next, param: cursor, has_more: /has_more}", "reconciling"},
		{"correct cursor", "{style: cursor, cursor: /next_cursor, param: cursor, has_more: /has_more}", "succeeded"},
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
			st := stateOf(t, db, u)
			if st == "safe_to_retry" {
				ev := settlements(t, db, u)
				t.Fatalf("receipt %d's thing exists (page 2 of the list) but it was settled safe_to_retry; control: %v",
					u, ev[len(ev)-1]["evidence"].(map[string]any)["positive_control"])
			}
			if st != tc.want {
				t.Fatalf("receipt %d: %s, want %s", u, st, tc.want)
			}
			if strings.Contains(tc.pagination, "whole_list") {
				// Only the control stands between this misconfiguration
				// and a false absence: it must have failed.
				h := pool.AdapterHealth()
				if len(h) != 1 || h[0].OK || h[0].Operation != "things.create" {
					t.Fatalf("health %+v, want the present control of things.create failing", h)
				}
			}
		})
	}
}
