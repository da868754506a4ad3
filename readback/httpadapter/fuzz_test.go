package httpadapter_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// fuzzShapes are the adapter configurations the fuzzed responses are read
// through: every pagination style, both matchers, and the fetch reads.
var fuzzShapes = []struct{ kind, preset, extra, target string }{
	{"create", "stripe", "", "/v1/charges"},
	{"create", "github", "", "/repos/acme/widgets/issues"},
	{"create", "rest", "", "/items"},
	{"create", "rest", "search:\n  pagination: {style: offset}", "/items"},
	{"create", "rest", "search:\n  pagination: {style: none, whole_list: true}\n  created_at_format: unix\n" +
		"match:\n  fingerprint:\n    fields: {/amount: /amount, /title: /title}", "/items"},
	{"create", "rest", "search:\n  items: \"\"\n  pagination: {style: cursor, cursor: /next, has_more: /more, param: c}", "/items"},
	{"delete", "", "fetch: {id: /id}\nguard:\n  fields: [/title]", "/items/7"},
	{"update", "", "fetch: {id: /id}\ncompare:\n  fields: {/title: /title, /amount: /amount}", "/items/7"},
}

// Issue 8, acceptance 2: the adapter's response handling under fuzzed
// responses (status, headers, body bytes) through every shape: no panic, no
// authoritative absence from a malformed response (a body that is not JSON,
// or a status that is neither a success nor a fetch's "gone"), and every
// string of the Result and of an error valid UTF-8 without NUL.
func FuzzAdapterResponse(f *testing.F) {
	seeds := []struct {
		status  int
		headers string
		body    string
	}{
		{200, "", `{"items":[]}`},
		{200, "", `[]`},
		{200, "", `{"object":"search_result","data":[],"has_more":false,"next_page":null}`},
		{200, "", `{"items":[{"id":"x\u0000","created_at":"2026-11-29T11:59:50Z","metadata":{"idempotency_key":"task-1:step-3:charges.create"}}]}`},
		{200, "", `{"items":[{"id":"a","created_at":1796558390000,"amount":500,"title":"Hello"}]}`},
		{200, "", `{"id":"7","title":"Old","amount":100}`},
		{200, "Link: </items?page=2>; rel=\"next\"", `[{"id":1,"created_at":"2026-11-29T11:59:50Z","body":"x"}]`},
		{200, "", "{\"items\":[{\"id\":\"\xff\xfe\"}]}"},
		{200, "", `{"items":[{}, {}, {}]}`},
		{200, "", `{"items":[], "more": true, "next": "c2"}`},
		{404, "", `{"error":"not found"}`},
		{410, "", ``},
		{503, "Retry-After: 99999999999", "busy\x00\xff"},
		{429, "Retry-After: -5", ""},
		{403, "X-RateLimit-Remaining: 0\nX-RateLimit-Reset: 99999999999999", `{"message":"rate"}`},
		{302, "Location: http://elsewhere.invalid/", ""},
		{200, "", `{"items":[{"id":"a"`},
		{200, "", strings.Repeat("[", 300)},
	}
	for _, s := range seeds {
		for shape := range fuzzShapes {
			f.Add(uint8(shape), s.status, s.headers, []byte(s.body))
		}
	}

	var mu sync.Mutex
	var cur struct {
		status  int
		headers string
		body    []byte
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		status, headers, body := cur.status, cur.headers, cur.body
		mu.Unlock()
		for _, line := range strings.Split(headers, "\n") {
			k, v, ok := strings.Cut(line, ":")
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			if !ok || k == "" || strings.ContainsAny(k, " \t\r\x00:") || strings.ContainsAny(v, "\r\x00") {
				continue
			}
			w.Header().Add(k, v)
		}
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	defer srv.Close()

	adapters := make([]readback.Adapter, len(fuzzShapes))
	for i, s := range fuzzShapes {
		adapters[i] = mustLoad(f, adapterFile(s.kind, s.preset, srv.URL, s.extra))
	}

	f.Fuzz(func(t *testing.T, shape uint8, status int, headers string, body []byte) {
		if status < 200 || status > 599 {
			status = 200 + (status%400+400)%400
		}
		if status == 204 || status == 304 || (status >= 100 && status < 200) {
			status = 200 // no body allowed: the server would drop it
		}
		mu.Lock()
		cur.status, cur.headers, cur.body = status, headers, body
		mu.Unlock()
		s := fuzzShapes[int(shape)%len(fuzzShapes)]
		r := receiptWith(s.target, map[string]any{"amount": 500, "title": "Hello"})
		r.Fingerprint = fingerprintOf(t, r)
		r.PreImage = json.RawMessage(`{"id":"7","title":"Old","amount":100}`)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res, err := adapters[int(shape)%len(fuzzShapes)].Check(ctx, r)
		if err != nil {
			checkText(t, err.Error())
			if res.Verdict != "" || len(res.ExternalIDs) > 0 {
				t.Fatalf("an error with a verdict: %+v", res)
			}
			return
		}
		gone := s.kind != "create" && (status == 404 || status == 410)
		if res.Verdict == readback.VerdictAbsent && res.Authoritative && !gone {
			if status < 200 || status > 299 {
				t.Fatalf("authoritative absence from HTTP %d: %+v", status, res)
			}
			if !json.Valid(body) {
				t.Fatalf("authoritative absence from a body that is not JSON: %+v", res)
			}
		}
		checkText(t, res.Query)
		for _, id := range res.ExternalIDs {
			checkText(t, id)
			if len(id) > 255 || strings.ContainsRune(id, utf8.RuneError) {
				t.Fatalf("unusable external id %q", id)
			}
		}
		if ev, ok := res.Evidence.(*httpadapter.Evidence); ok && ev != nil {
			checkText(t, ev.Reason)
			checkText(t, ev.Confirmation)
			checkText(t, ev.MatchedBy)
			for _, id := range ev.MarkedOutsideWindow {
				checkText(t, id)
			}
			for k, v := range ev.Fields {
				checkText(t, k)
				checkText(t, v)
			}
			if b, err := json.Marshal(ev); err != nil || !utf8.Valid(b) || strings.Contains(string(b), `\u0000`) {
				t.Fatalf("evidence does not store: %s, %v", b, err)
			}
		}
	})
}
