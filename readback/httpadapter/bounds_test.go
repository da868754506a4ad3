package httpadapter_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// rawAPI answers every request with status and body.
func rawAPI(t *testing.T, status int, body []byte) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// repeat returns prefix, n copies of item joined by commas, then suffix.
func repeat(prefix, item string, n int, suffix string) []byte {
	var b bytes.Buffer
	b.WriteString(prefix)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(item)
	}
	b.WriteString(suffix)
	return b.Bytes()
}

// Issue 8, item 8: one 16 MiB page of `{}` items (about 650 MiB of heap and
// 5 s before) is refused within its bounds: a permanent error, never an
// absence, at a small fraction of the cost. Over max_response_bytes it is
// refused unread; within a raised byte bound, the item count stops the
// scan before anything is decoded. A page padded outside its list, or
// nested absurdly deep, is refused the same way.
func TestOversizedPagesAreBoundedErrors(t *testing.T) {
	huge := repeat(`{"items":[`, "{}", 8<<20, `]}`) // 16 MiB
	tests := []struct {
		name, extra string
		body        []byte
	}{
		{"16 MiB over max_response_bytes", "", huge},
		{"16 MiB within max_response_bytes: item bound", "max_response_bytes: 33554432\n", huge},
		{"over max_page_items", "search:\n  max_page_items: 5\n  pagination: {style: none, whole_list: true}",
			repeat(`{"items":[`, `{"id":"x","created_at":"2026-11-29T11:59:50Z"}`, 6, `]}`)},
		{"padding outside the list", "", repeat(`{"items":[],"junk":[`, "{}", 300000, `]}`)},
		{"nested too deep", "", []byte(`{"items":[],"x":` + strings.Repeat("[", 5000) + strings.Repeat("]", 5000) + `}`)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := rawAPI(t, http.StatusOK, tt.body)
			extra := tt.extra
			if !strings.Contains(extra, "search:") {
				extra += "search:\n  pagination: {style: none, whole_list: true}"
			}
			a := mustLoad(t, adapterFile("create", "rest", srv.URL, extra))
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			start := time.Now()
			res, err := a.Check(context.Background(), testReceipt("/items"))
			elapsed := time.Since(start)
			runtime.ReadMemStats(&after)
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent || !strings.Contains(err.Error(), "bounds") {
				t.Fatalf("got %+v, %v; want a permanent error over the bounds", res, err)
			}
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 128<<20 || elapsed > 3*time.Second {
				t.Fatalf("refusing the page cost %d MiB and %s", alloc>>20, elapsed)
			}
		})
	}
}

// Issue 8, item 8: the bounds are configurable within sane limits; a value
// outside them fails at load.
func TestMaxPageItemsConfig(t *testing.T) {
	for _, tt := range []struct{ extra, field string }{
		{"search:\n  max_page_items: 0\n  pagination: {style: none, whole_list: true}", ""},
		{"search:\n  max_page_items: -1", "http.search.max_page_items"},
		{"search:\n  max_page_items: 1000000", "http.search.max_page_items"},
		{"max_response_bytes: 10", "http.max_response_bytes"},
		{"max_response_bytes: 1073741824", "http.max_response_bytes"},
	} {
		_, err := load(t, adapterFile("create", "rest", "http://127.0.0.1:1", tt.extra))
		if (err == nil) != (tt.field == "") || (err != nil && !strings.Contains(err.Error(), tt.field)) {
			t.Errorf("%q: got %v, want an error at %q", tt.extra, err, tt.field)
		}
	}
}

// Issue 8, item 8: created_at in milliseconds read as seconds
// (created_at_format: unix) puts every item tens of thousands of years in
// the future; seconds read as milliseconds, in 1970. Such an item might be
// the receipt's (by fingerprint), so the search proves no absence (not
// authoritative, with a reason), where it used to read an authoritative
// one. A marked item matches whatever its time.
func TestAbsurdCreationTimesProveNoAbsence(t *testing.T) {
	created := testNow.Add(-30 * time.Second)
	for _, tt := range []struct {
		name, format string
		value        int64
	}{
		{"milliseconds as unix", "unix", created.UnixMilli()},
		{"seconds as unix_ms", "unix_ms", created.Unix()},
		{"before 2000", "unix", 1},
		{"a year ahead", "unix", created.Add(365 * 24 * time.Hour).Unix()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			body := fmt.Sprintf(`{"items":[{"id":"someone","amount":1,"title":"x","created_at":%d,"metadata":{}}]}`, tt.value)
			srv := rawAPI(t, http.StatusOK, []byte(body))
			extra := "search:\n  created_at_format: " + tt.format + "\n  pagination: {style: none, whole_list: true}\n" +
				"match:\n  fingerprint:\n    fields: {/amount: /amount, /title: /title}"
			a := mustLoad(t, adapterFile("create", "rest", srv.URL, extra))
			r := testReceipt("/items")
			r.Fingerprint = fingerprintOf(t, r)
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			ev := res.Evidence.(*httpadapter.Evidence)
			if res.Verdict == readback.VerdictAbsent && res.Authoritative || !strings.Contains(ev.Reason, "created-at") {
				t.Fatalf("got %+v %+v, want a non-authoritative answer naming the creation time", res, ev)
			}
		})
	}
	t.Run("a marked item matches whatever its time", func(t *testing.T) {
		body := fmt.Sprintf(`{"items":[{"id":"ours","created_at":%d,"metadata":{"idempotency_key":%q}}]}`, created.UnixMilli(), testKey)
		srv := rawAPI(t, http.StatusOK, []byte(body))
		a := mustLoad(t, adapterFile("create", "rest", srv.URL, "search:\n  created_at_format: unix\n  pagination: {style: none, whole_list: true}"))
		res, err := a.Check(context.Background(), testReceipt("/items"))
		if err != nil || res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ours" {
			t.Fatalf("got %+v, %v; want present with ours", res, err)
		}
	})
}

// Issue 8, item 1 (the adapter's side): an id that is not valid UTF-8,
// holds a NUL or is longer than 255 bytes is never recorded altered (it
// would name another resource): the match fails permanently. Error bodies
// are sanitized: valid UTF-8, no NUL, bounded.
func TestHostileTextNeverReachesAResult(t *testing.T) {
	for _, id := range []string{"art_1\x00", "art_\xff\xfe", strings.Repeat("a", 256), "art\u0000x"} {
		t.Run(fmt.Sprintf("id %.12q", id), func(t *testing.T) {
			// Invalid bytes are sent raw, a NUL as the JSON escape \u0000.
			body := `{"items":[{"id":"` + strings.ReplaceAll(id, "\x00", `\u0000`) + `","created_at":"2026-11-29T11:59:50Z",` +
				`"metadata":{"idempotency_key":"` + testKey + `"}}]}`
			srv := rawAPI(t, http.StatusOK, []byte(body))
			a := mustLoad(t, adapterFile("create", "rest", srv.URL, "search:\n  pagination: {style: none, whole_list: true}"))
			res, err := a.Check(context.Background(), testReceipt("/items"))
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
				t.Fatalf("got %+v, %v; want a permanent error", res, err)
			}
			checkText(t, err.Error())
		})
	}
	t.Run("error body", func(t *testing.T) {
		srv := rawAPI(t, http.StatusServiceUnavailable, []byte("busy\x00 \xff"+strings.Repeat("é", 150)))
		a := mustLoad(t, adapterFile("create", "rest", srv.URL, ""))
		_, err := a.Check(context.Background(), testReceipt("/items"))
		if class, _ := readback.Classify(err); err == nil || class != readback.Transient {
			t.Fatalf("got %v, want transient", err)
		}
		checkText(t, err.Error())
		if len(err.Error()) > 2500 {
			t.Fatalf("error of %d bytes", len(err.Error()))
		}
	})
}

// checkText fails unless s is valid UTF-8 without NUL.
func checkText(t testing.TB, s string) {
	t.Helper()
	if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
		t.Fatalf("text %q is not valid UTF-8 without NUL", s)
	}
}
