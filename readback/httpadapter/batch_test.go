package httpadapter_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// batchWorld draws receipts submitted over the last hour, half of which
// took effect (an item carrying their key, created shortly after), among
// foreign items, and serves them from api.
func batchWorld(api *fakeAPI, seed uint64, n int) []readback.Receipt {
	rng := rand.New(rand.NewPCG(seed, 7))
	var rs []readback.Receipt
	for i := range n {
		key := fmt.Sprintf("task-%d:step-%d:items.create", seed, i)
		sub := testNow.Add(-time.Duration(rng.Int64N(int64(time.Hour))))
		rs = append(rs, readback.Receipt{ID: int64(i + 1), IdempotencyKey: key, Operation: "items.create",
			Dependency: "api", Method: "POST", Target: "/items", SubmittedAt: sub})
		if rng.IntN(2) == 0 {
			api.add(fakeItem{ID: fmt.Sprintf("it-%d", i), Marker: key, Created: sub.Add(time.Duration(rng.Int64N(int64(time.Minute))))})
		}
		if rng.IntN(2) == 0 {
			api.add(fakeItem{ID: fmt.Sprintf("other-%d", i), Marker: "someone-else",
				Created: testNow.Add(-time.Duration(rng.Int64N(int64(time.Hour))))})
		}
	}
	slices.SortFunc(api.items, func(a, b fakeItem) int { return a.Created.Compare(b.Created) })
	return rs
}

// An adapter declaring search.batch answers each receipt of a shared read
// exactly as its own Check does (verdict, authority, matched ids), for a
// cursor list and for a page-number list (two passes), over several seeds;
// with a page bound too small for the union of the windows, the group
// splits into later windows and only receipts whose own window is still too
// large are left to their own check.
func TestCheckBatchAnswersAsCheck(t *testing.T) {
	cases := []struct {
		name, style, preset, extra string
		// split: the page bound is too small for the union of the windows.
		split bool
	}{
		{name: "stripe cursor", style: "stripe", preset: "stripe", extra: `search:
  batch: {query: {query: "created>={window.start_unix}", limit: "100"}}
  pagination: {max_pages: 100}
window_skew: 1s`},
		{name: "rest pages, narrowed per receipt", style: "rest", preset: "rest", extra: `search:
  query: {key: "{receipt.logical_key}", created_after: "{window.start}"}
  pagination: {max_pages: 100}
  batch: {}
window_skew: 1s`},
		{name: "rest pages split", style: "rest", preset: "rest", split: true, extra: `search:
  query: {key: "{receipt.logical_key}", created_after: "{window.start}"}
  pagination: {max_pages: 4}
  batch: {max_receipts: 500}
window_skew: 1s`},
	}
	for _, tc := range cases {
		for _, seed := range []uint64{1, 2, 3} {
			t.Run(fmt.Sprintf("%s/seed=%d", tc.name, seed), func(t *testing.T) {
				api := newFakeAPI(t, tc.style, token)
				if !tc.split {
					api.pageSize = 10
				}
				rs := batchWorld(api, seed, 24)
				a := mustLoad(t, adapterFile("create", tc.preset, api.srv.URL, tc.extra))
				bt, ok := a.(readback.Batcher)
				if !ok || bt.MaxBatch() == 0 {
					t.Fatal("the adapter declares search.batch but reads per receipt")
				}
				ctx := context.Background()
				calls := 0
				read := readback.SharedRead{ID: "read-1", Call: func(_ context.Context, do func() error) error {
					calls++
					return do()
				}}
				before := len(api.requests)
				answers, err := bt.CheckBatch(ctx, read, rs)
				if err != nil {
					t.Fatal(err)
				}
				shared, _ := api.seen()
				shared = shared[before:]
				if calls != len(shared) {
					t.Fatalf("%d requests, %d of them through SharedRead.Call", len(shared), calls)
				}
				alone := 0
				for i, r := range rs {
					want, werr := a.Check(ctx, r)
					got := answers[i]
					if got.Alone {
						alone++
						continue
					}
					if (werr == nil) != (got.Err == nil) {
						t.Fatalf("receipt %d: Check error %v, batch error %v", r.ID, werr, got.Err)
					}
					if got.Result.Verdict != want.Verdict || got.Result.Authoritative != want.Authoritative ||
						!slices.Equal(got.Result.ExternalIDs, want.ExternalIDs) {
						t.Errorf("receipt %d: batch %s (authoritative %v, %v), Check %s (authoritative %v, %v)", r.ID,
							got.Result.Verdict, got.Result.Authoritative, got.Result.ExternalIDs,
							want.Verdict, want.Authoritative, want.ExternalIDs)
					}
				}
				if !tc.split {
					if alone > 0 || len(shared) >= len(rs) {
						t.Fatalf("%d receipts left alone, %d requests for %d receipts", alone, len(shared), len(rs))
					}
					return
				}
				// The first read reached max_pages: the group split into
				// later windows, read with later created_after.
				starts := map[string]bool{}
				for _, uri := range shared {
					u, _ := url.Parse(uri)
					if strings.Contains(uri, "key=") {
						t.Fatalf("a shared read names a key: %s", uri)
					}
					starts[u.Query().Get("created_after")] = true
				}
				if len(starts) < 3 || alone == len(rs) {
					t.Fatalf("%d window starts, %d of %d receipts alone: the group did not split", len(starts), alone, len(rs))
				}
				t.Logf("%d requests, %d window starts, %d receipts alone", len(shared), len(starts), alone)
			})
		}
	}
}

// search.batch is refused where a shared read could prove nothing or would
// name a receipt's key.
func TestBatchConfigRefusals(t *testing.T) {
	for _, tc := range []struct{ name, extra, field string }{
		{"key in the batch query", `search:
  batch: {query: {key: "{receipt.logical_key}"}}`, "search.batch.query.key"},
		{"key in the batch path", `search:
  path: "/items/{receipt.id}"
  batch: {}`, "search.batch.path"},
		{"unpaged list not whole", `search:
  pagination: {style: none}
  batch: {}`, "search.batch"},
		{"max receipts", `search:
  batch: {max_receipts: -1}`, "search.batch.max_receipts"},
		{"fetch path names the receipt", `fetch:
  id: /id
  batch: {path: "/items/{receipt.external_id}", items: /data}`, "fetch.batch.path"},
		{"fetch without items", `fetch:
  id: /id
  batch: {path: /items}`, "fetch.batch.items"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kind, preset := "create", "rest"
			if strings.HasPrefix(tc.extra, "fetch") {
				kind, preset = "delete", ""
			}
			_, err := load(t, adapterFile(kind, preset, "https://api.example.com", tc.extra))
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("want an error naming %s, got %v", tc.field, err)
			}
		})
	}
}

// A fetch block declaring fetch.batch fetches many resources by id in one
// request and answers each receipt as its own fetch does: an update whose
// resource holds the intended fields, the pre-image or neither, or is
// gone, and a delete whose resource is still there or gone. A receipt
// without an external id is left to its own fetch.
func TestFetchBatchAnswersAsCheck(t *testing.T) {
	resources := map[string]map[string]any{
		"a": {"id": "a", "title": "new"}, // updated
		"b": {"id": "b", "title": "old"}, // untouched
		"c": {"id": "c", "title": "???"}, // someone else's change
		// d is gone
	}
	var requests []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests = append(requests, r.URL.RequestURI())
		if id, ok := strings.CutPrefix(r.URL.Path, "/items/"); ok {
			if res, ok := resources[id]; ok {
				writeJSON(w, http.StatusOK, res)
				return
			}
			writeJSON(w, http.StatusNotFound, map[string]any{"error": "not found"})
			return
		}
		var data []map[string]any
		for _, id := range strings.Split(r.URL.Query().Get("ids"), ",") {
			if res, ok := resources[id]; ok {
				data = append(data, res)
			}
		}
		writeJSON(w, http.StatusOK, map[string]any{"data": append([]map[string]any{}, data...)})
	}))
	t.Cleanup(srv.Close)
	for _, kind := range []string{"update", "delete"} {
		t.Run(kind, func(t *testing.T) {
			extra := `fetch:
  path: "/items/{receipt.external_id}"
  id: /id
  batch: {path: /items, items: /data, max_receipts: 2}
`
			if kind == "update" {
				extra += "compare: {fields: {/title: /title}}\n"
			}
			a := mustLoad(t, adapterFile(kind, "", srv.URL, extra))
			bt := a.(readback.Batcher)
			var rs []readback.Receipt
			for i, id := range []string{"a", "b", "c", "d", ""} {
				rs = append(rs, readback.Receipt{ID: int64(i + 1), IdempotencyKey: "k-" + id, Operation: "items." + kind,
					Dependency: "api", Method: "PATCH", Target: "/items/" + id, ExternalID: id, SubmittedAt: testNow,
					Intent: []byte(`{"method":"PATCH","target":"/items/x","payload":{"title":"new"}}`), PreImage: []byte(`{"title":"old"}`)})
			}
			requests = nil
			answers, err := bt.CheckBatch(context.Background(), readback.SharedRead{ID: "r"}, rs)
			if err != nil {
				t.Fatal(err)
			}
			if len(requests) != 2 {
				t.Fatalf("%d requests for 4 ids, 2 to a request: %v", len(requests), requests)
			}
			for i, r := range rs {
				got := answers[i]
				if r.ExternalID == "" {
					if !got.Alone {
						t.Fatalf("receipt without an external id: %+v, want Alone", got)
					}
					continue
				}
				want, werr := a.Check(context.Background(), r)
				if werr != nil || got.Err != nil {
					t.Fatalf("receipt %s: Check error %v, batch error %v", r.ExternalID, werr, got.Err)
				}
				if got.Result.Verdict != want.Verdict || got.Result.Authoritative != want.Authoritative ||
					!slices.Equal(got.Result.ExternalIDs, want.ExternalIDs) {
					t.Errorf("receipt %s: batch %s %v %v, Check %s %v %v", r.ExternalID, got.Result.Verdict,
						got.Result.Authoritative, got.Result.ExternalIDs, want.Verdict, want.Authoritative, want.ExternalIDs)
				}
			}
		})
	}
}
