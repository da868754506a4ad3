package httpadapter_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/receiptledger/reconciler/readback"
)

// keyCase is an idempotency key and the logical key it belongs to: the key
// with a final "#<digits>" removed, and nothing else (a first attempt's key
// cannot end that way; the database refuses it).
type keyCase struct{ name, key, logical string }

func keyCases() []keyCase {
	long := strings.Repeat("k", 251) + "#12"    // 255 bytes, a retry's key
	longFirst := strings.Repeat("é", 127) + "/" // 255 bytes, a first key
	return []keyCase{
		{"hash inside", "order#8812:charge", "order#8812:charge"},
		{"hash inside, retry", "order#8812:charge#2", "order#8812:charge"},
		{"two hashes, retry", "a#b#13", "a#b"},
		{"hash then letters", "x#1a", "x#1a"},
		{"single quote", `task-'9':step\2:charges.create`, `task-'9':step\2:charges.create`},
		{"double quote, retry", `say "hi"#3`, `say "hi"`},
		{"unicode", "commande:été:💳", "commande:été:💳"},
		{"unicode, retry", "commande:été:💳#2", "commande:été:💳"},
		{"slash and query characters", "a/b?c=d&e#f", "a/b?c=d&e#f"},
		{"percent and plus", "100%25+x y", "100%25+x y"},
		{"255 bytes, retry", long, strings.Repeat("k", 251)},
		{"255 bytes, first", longFirst, longFirst},
	}
}

// Issue 7, path 7: {receipt.logical_key} strips only a final #<digits>, so
// `order#8812:charge` searches for the whole key; every key renders into a
// query value unchanged, whatever it holds.
func TestLogicalKeyRule(t *testing.T) {
	for _, kc := range keyCases() {
		t.Run(kc.name, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			// Narrowed by the key: the fake keeps only items marked with it.
			f.add(fakeItem{ID: "ours", Created: inWindow(1), Marker: kc.logical},
				fakeItem{ID: "prefix", Created: inWindow(2), Marker: "order"},
				fakeItem{ID: "full_key", Created: inWindow(3), Marker: kc.key + "#9"})
			a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
				"search:\n  query: {key: \"{receipt.logical_key}\", full: \"{receipt.idempotency_key}\"}"))
			r := testReceipt("/items")
			r.IdempotencyKey = kc.key
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ours" {
				t.Fatalf("got %+v, want present with only the item marked %q", res, kc.logical)
			}
			uris, _ := f.seen()
			u, err := url.Parse(uris[0])
			if err != nil {
				t.Fatal(err)
			}
			if got := u.Query().Get("key"); got != kc.logical {
				t.Errorf("{receipt.logical_key} = %q, want %q", got, kc.logical)
			}
			if got := u.Query().Get("full"); got != kc.key {
				t.Errorf("{receipt.idempotency_key} = %q, want %q", got, kc.key)
			}
		})
	}
}

// Issue 7, path 7: Stripe's search quotes the key ('...' with \' and \\):
// every key, quotes included, searches for itself.
func TestStripeSearchFindsEveryKey(t *testing.T) {
	for _, kc := range keyCases() {
		t.Run(kc.name, func(t *testing.T) {
			f := newFakeAPI(t, "stripe", token)
			f.add(fakeItem{ID: "ch_ours", Created: inWindow(1), Marker: kc.logical},
				fakeItem{ID: "ch_prefix", Created: inWindow(2), Marker: "order"})
			a := mustLoad(t, adapterFile("create", "stripe", f.srv.URL, ""))
			r := testReceipt("/v1/charges")
			r.IdempotencyKey = kc.key
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ch_ours" {
				t.Fatalf("got %+v, want present with ch_ours", res)
			}
		})
	}
}

// Issue 7, path 7: a key substituted into a path is exactly one segment:
// its '/' never splits it, its '?' or '#' never end the path, and the
// server reads back the key itself.
func TestKeyInAPathIsOneSegment(t *testing.T) {
	for _, kc := range keyCases() {
		t.Run(kc.name, func(t *testing.T) {
			var mu sync.Mutex
			var got []string
			f := newFakeAPI(t, "rest", token)
			f.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				got = append(got, r.RequestURI)
				mu.Unlock()
				w.WriteHeader(http.StatusNotFound)
			})
			a := mustLoad(t, adapterFile("delete", "", f.srv.URL+"/api/",
				"fetch: {path: \"/items/{receipt.logical_key}/state\", id: /id}"))
			r := testReceipt("/items")
			r.IdempotencyKey = kc.key
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictAbsent {
				t.Fatalf("got %+v, want absent (404)", res)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(got) != 1 {
				t.Fatalf("requests %q, want one", got)
			}
			path, _, _ := strings.Cut(got[0], "?")
			segs := strings.Split(path, "/")
			if len(segs) != 5 || segs[1] != "api" || segs[2] != "items" || segs[4] != "state" {
				t.Fatalf("request path %q, want /api/items/<one segment>/state", path)
			}
			if key, err := url.PathUnescape(segs[3]); err != nil || key != kc.logical {
				t.Fatalf("segment %q reads %q, want %q", segs[3], key, kc.logical)
			}
		})
	}
}

// Issue 7, path 7: a key that is "." or ".." would make the path name
// another resource: refused (permanent), nothing is sent.
func TestDotKeyInAPathIsRefused(t *testing.T) {
	for _, key := range []string{".", "..", "..#2"} {
		t.Run(key, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			a := mustLoad(t, adapterFile("delete", "", f.srv.URL, "fetch: {path: \"/items/{receipt.logical_key}\", id: /id}"))
			r := testReceipt("/items")
			r.IdempotencyKey = key
			_, err := a.Check(context.Background(), r)
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
				t.Fatalf("got %v, want a permanent error", err)
			}
			if uris, _ := f.seen(); len(uris) != 0 {
				t.Fatalf("requests sent: %q", uris)
			}
		})
	}
}
