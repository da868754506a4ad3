package httpadapter_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// newestFirstAPI lists things newest first, two per page, with a cursor at
// /next_cursor (query parameter cursor) and a /has_more flag: the shape of
// most list endpoints, and of the adversarial review's pagedAPI
// (integration/adversarial_test.go). It knows the truth: items holds every
// thing that exists. With key=K in the query it keeps only the things
// marked K, unless ignoreKey; whole serves every thing in one response
// (an endpoint that does not paginate).
type newestFirstAPI struct {
	srv *httptest.Server

	mu        sync.Mutex
	items     []map[string]any // oldest first
	ignoreKey bool
	whole     bool
}

func newNewestFirstAPI(t *testing.T) *newestFirstAPI {
	a := &newestFirstAPI{}
	a.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		defer a.mu.Unlock()
		q := r.URL.Query()
		var list []map[string]any
		for _, it := range slices.Backward(a.items) {
			if q.Has("key") && !a.ignoreKey && it["metadata"].(map[string]any)["idempotency_key"] != q.Get("key") {
				continue
			}
			list = append(list, it)
		}
		if a.whole {
			writeJSON(w, http.StatusOK, map[string]any{"items": append([]map[string]any{}, list...)})
			return
		}
		from, _ := strconv.Atoi(q.Get("cursor"))
		items, more := page(list, from, 2)
		body := map[string]any{"items": items, "has_more": more, "next_cursor": nil}
		if more {
			body["next_cursor"] = strconv.Itoa(from + 2)
		}
		writeJSON(w, http.StatusOK, body)
	}))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *newestFirstAPI) create(key, id string, at time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.items = append(a.items, map[string]any{"id": id, "created_at": at.UTC().Format(time.RFC3339Nano),
		"metadata": map[string]any{"idempotency_key": key}})
}

// thingsFile is the adversarial review's adapter over api: no preset, the
// list at the receipt's target, with the given pagination block and
// search query.
func thingsFile(baseURL, pagination, query string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `version: 1
adapters:
  - name: paged-things
    type: http
    kind: create
    dependency: api
    http:
      base_url: %s
      search:
        method: GET
        path: "{receipt.target}"
        items: /items
        id: /id
        created_at: /created_at
        pagination: %s
`, baseURL, pagination)
	if query != "" {
		fmt.Fprintf(&b, "        query: %s\n", query)
	}
	b.WriteString(`      match:
        marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`)
	return b.String()
}

// thingReceipt is the receipt of a things.create call keyed key.
func thingReceipt(key string) readback.Receipt {
	r := testReceipt("/things")
	r.IdempotencyKey = key
	return r
}

// Issue 7, adversarial review (TestAdversarialPaginationMisconfigPassesTheControl):
// a list served newest first puts the newest success (the ledger's control)
// on page 1, so a pagination misconfiguration that reads only page 1 passes
// the control while every receipt whose thing is on page 2 reads absent.
// With `pagination: {style: none}` on that paginated API the control still
// passes, but no absence is authoritative any more: one unpaged response
// may be a first page. The fake knows the truth: ours exists (on page 2),
// or does not exist at all; neither is ever an authoritative absence.
func TestUnpagedListOfAPaginatedAPINeverProvesAbsence(t *testing.T) {
	for _, exists := range []bool{true, false} {
		t.Run(fmt.Sprintf("ours exists: %v", exists), func(t *testing.T) {
			api := newNewestFirstAPI(t)
			if exists {
				api.create(testKey, "thing-u", testNow.Add(-40*time.Second))
			}
			for i := range 3 { // three later successes: page 1 holds the newest two
				api.create(fmt.Sprintf("task-2:step-%d:things.create", i), fmt.Sprintf("thing-%d", i),
					testNow.Add(-30*time.Second+time.Duration(i)*time.Second))
			}
			a := mustLoad(t, thingsFile(api.srv.URL, "{style: none}", ""))
			// The control, the newest success, is found: the misconfiguration
			// passes it, as in the review.
			control, err := a.Check(context.Background(), thingReceipt("task-2:step-2:things.create"))
			if err != nil || control.Verdict != readback.VerdictPresent {
				t.Fatalf("control: got %+v, %v; want present (it is on page 1)", control, err)
			}
			res, err := a.Check(context.Background(), thingReceipt(testKey))
			if err != nil {
				t.Fatal(err)
			}
			ev := res.Evidence.(*httpadapter.Evidence)
			if res.Authoritative || res.Verdict != readback.VerdictAbsent || !strings.Contains(ev.Reason, "style none") ||
				!strings.Contains(ev.Reason, "whole_list") {
				t.Fatalf("got %+v %+v, want a non-authoritative absence saying why (style none, whole_list)", res, ev)
			}
		})
	}
}

// Issue 7, adversarial review: an unpaged list (style none) proves an
// absence only when the file declares that the endpoint answers the whole
// collection (whole_list), or when the query is narrowed to the receipt's
// key and the API honoured it. Each fake knows the truth; the table says
// what the adapter may conclude from it.
func TestUnpagedListAbsence(t *testing.T) {
	const narrowed = `{key: "{receipt.logical_key}"}`
	tests := []struct {
		name       string
		pagination string
		query      string
		whole      bool // the endpoint answers everything in one response
		ignoreKey  bool // the endpoint ignores the key filter
		ours       bool // ours exists (the oldest thing: page 2 of a paginated answer)
		// want
		verdict       readback.Verdict
		authoritative bool
		confirmation  string
		reason        string
	}{
		{name: "whole list declared, the endpoint answers it whole, ours absent",
			pagination: "{style: none, whole_list: true}", whole: true,
			verdict: readback.VerdictAbsent, authoritative: true, confirmation: "whole_list"},
		{name: "whole list declared, the endpoint answers it whole, ours present",
			pagination: "{style: none, whole_list: true}", whole: true, ours: true,
			verdict: readback.VerdictPresent, authoritative: true},
		{name: "whole list not declared, the endpoint answers it whole: the adapter cannot know",
			pagination: "{style: none}", whole: true,
			verdict: readback.VerdictAbsent, reason: "not narrowed"},
		{name: "narrowed to the key and honoured, ours absent: an empty answer",
			pagination: "{style: none}", query: narrowed,
			verdict: readback.VerdictAbsent, authoritative: true, confirmation: "narrowed"},
		{name: "narrowed to the key and honoured, ours present",
			pagination: "{style: none}", query: narrowed, ours: true,
			verdict: readback.VerdictPresent, authoritative: true},
		{name: "narrowed to the key but the API ignores the filter, ours on page 2",
			pagination: "{style: none}", query: narrowed, ignoreKey: true, ours: true,
			verdict: readback.VerdictAbsent, reason: "ignored the filter"},
		{name: "narrowed to the key but the API ignores the filter, ours absent",
			pagination: "{style: none}", query: narrowed, ignoreKey: true,
			verdict: readback.VerdictAbsent, reason: "ignored the filter"},
		{name: "the cursor declared properly: page 2 is read",
			pagination: "{style: cursor, cursor: /next_cursor, has_more: /has_more, param: cursor}", ours: true,
			verdict: readback.VerdictPresent, authoritative: true},
		{name: "the cursor declared properly, ours absent: read to has_more false",
			pagination: "{style: cursor, cursor: /next_cursor, has_more: /has_more, param: cursor}",
			verdict:    readback.VerdictAbsent, authoritative: true},
		{name: "has_more declared, cursor pointer names nothing: the list may go on",
			pagination: "{style: cursor, cursor: /next, has_more: /has_more, param: cursor}", ours: true,
			verdict: readback.VerdictAbsent, reason: "no cursor"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			api := newNewestFirstAPI(t)
			api.whole, api.ignoreKey = tt.whole, tt.ignoreKey
			if tt.ours {
				api.create(testKey, "thing-u", testNow.Add(-40*time.Second))
			}
			for i := range 3 {
				api.create(fmt.Sprintf("task-2:step-%d:things.create", i), fmt.Sprintf("thing-%d", i),
					testNow.Add(-30*time.Second+time.Duration(i)*time.Second))
			}
			a := mustLoad(t, thingsFile(api.srv.URL, tt.pagination, tt.query))
			res, err := a.Check(context.Background(), thingReceipt(testKey))
			if err != nil {
				t.Fatal(err)
			}
			ev := res.Evidence.(*httpadapter.Evidence)
			if res.Verdict != tt.verdict || res.Authoritative != tt.authoritative || ev.Confirmation != tt.confirmation ||
				!strings.Contains(ev.Reason, tt.reason) {
				t.Fatalf("got %s authoritative=%v %+v; want %s authoritative=%v, confirmation %q, reason %q",
					res.Verdict, res.Authoritative, ev, tt.verdict, tt.authoritative, tt.confirmation, tt.reason)
			}
			if tt.ours && res.Verdict == readback.VerdictPresent && (len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "thing-u") {
				t.Fatalf("found %v, want thing-u", res.ExternalIDs)
			}
		})
	}
}

// Issue 7, adversarial review: a cursor list needs its "more pages" flag.
// Without has_more, a cursor pointer that names nothing (the review's
// `{style: cursor, cursor: /next, param: cursor}`) read as the end of the
// list after page 1, and a newest-first control on page 1 passed; the
// configuration is now refused at load, naming the field. whole_list
// belongs to unpaged lists only.
func TestPaginationConfigErrors(t *testing.T) {
	tests := []struct{ name, pagination, field string }{
		{"cursor without has_more", "{style: cursor, cursor: /next, param: cursor}", "http.search.pagination.has_more"},
		{"cursor with an empty has_more", "{style: cursor, cursor: /next_cursor, has_more: \"\", param: cursor}", "http.search.pagination.has_more"},
		{"cursor with a malformed has_more", "{style: cursor, cursor: /next_cursor, has_more: has_more, param: cursor}", "http.search.pagination.has_more"},
		{"whole_list on a cursor list", "{style: cursor, cursor: /next_cursor, has_more: /has_more, param: cursor, whole_list: true}", "http.search.pagination.whole_list"},
		{"whole_list on a page list", "{style: page, whole_list: true}", "http.search.pagination.whole_list"},
		{"whole_list on a link list", "{style: link, whole_list: true}", "http.search.pagination.whole_list"},
		{"whole_list not a boolean", "{style: none, whole_list: yes please}", "http"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, thingsFile("https://api.example.com", tt.pagination, ""))
			var ce *readback.ConfigError
			if !errors.As(err, &ce) || ce.Adapter != "paged-things" || ce.Field != tt.field {
				t.Fatalf("got %v, want a ConfigError naming %s", err, tt.field)
			}
		})
	}
	// Every preset that pages by cursor declares has_more.
	for _, preset := range []string{"stripe", "github", "rest"} {
		if _, err := load(t, adapterFile("create", preset, "https://api.example.com", "")); err != nil {
			t.Errorf("preset %s: %v", preset, err)
		}
	}
}

// Issue 7, adversarial review: an API clock more than window_skew off the
// database's put the receipt's own, marked item outside the window, and the
// adapter read it as absent. A marked item now matches whatever its
// creation time (recorded in marked_outside_window); the window still
// filters fingerprint matches, which cannot tell two identical calls apart.
func TestWindowFiltersOnlyFingerprintMatches(t *testing.T) {
	fp := "match:\n  fingerprint: {fields: {/amount: /amount, /title: /title}}\n" +
		"search:\n  query: {created_after: \"\"}\n  pagination: {style: page}"
	tests := []struct {
		name    string
		item    fakeItem
		extra   string
		verdict readback.Verdict
		by      string
		marked  bool // recorded in marked_outside_window
		outside int  // ignored as outside the window, per pass
	}{
		{name: "marked, API clock 10 min behind",
			item:    fakeItem{ID: "ours", Created: testNow.Add(-11 * time.Minute), Marker: testKey},
			extra:   "search:\n  query: {created_after: \"\"}",
			verdict: readback.VerdictPresent, by: "marker", marked: true},
		{name: "marked, API clock 10 min ahead",
			item:    fakeItem{ID: "ours", Created: testNow.Add(10 * time.Minute), Marker: testKey},
			extra:   "search:\n  query: {created_after: \"\"}",
			verdict: readback.VerdictPresent, by: "marker", marked: true},
		{name: "marked, inside the window",
			item:    fakeItem{ID: "ours", Created: inWindow(1), Marker: testKey},
			extra:   "search:\n  query: {created_after: \"\"}",
			verdict: readback.VerdictPresent, by: "marker"},
		{name: "fingerprint only, inside the window",
			item:    fakeItem{ID: "same", Created: inWindow(1), Marker: otherKey, Amount: 500, Title: "Hello"},
			extra:   fp,
			verdict: readback.VerdictPresent, by: "fingerprint"},
		{name: "fingerprint only, outside the window: another call's",
			item:    fakeItem{ID: "same", Created: testNow.Add(-3 * time.Hour), Marker: otherKey, Amount: 500, Title: "Hello"},
			extra:   fp,
			verdict: readback.VerdictAbsent, outside: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.add(tt.item)
			a := mustLoad(t, adapterFile("create", "rest", f.srv.URL, tt.extra))
			r := testReceipt("/items")
			r.Fingerprint = fingerprintOf(t, r)
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			ev := res.Evidence.(*httpadapter.Evidence)
			marked := slices.Equal(ev.MarkedOutsideWindow, []string{tt.item.ID})
			// outside_window counts over every pass (a page list is read twice).
			if res.Verdict != tt.verdict || ev.MatchedBy != tt.by || marked != tt.marked || ev.OutsideWindow != tt.outside*ev.Passes {
				t.Fatalf("got %s by %q %+v; want %s by %q, marked outside the window %v, %d ignored",
					res.Verdict, ev.MatchedBy, ev, tt.verdict, tt.by, tt.marked, tt.outside)
			}
		})
	}
}
