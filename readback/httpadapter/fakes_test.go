package httpadapter_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeItem is one resource of a fake API.
type fakeItem struct {
	ID      string
	Created time.Time
	// Marker is the idempotency key the agent put in the resource: Stripe
	// and REST metadata.idempotency_key, GitHub's hidden body marker.
	Marker string
	// ReceiptID, when set, is served as REST metadata.receipt_id (a marker
	// by receipt id, for agents that plan before building the request).
	ReceiptID string
	Amount    int
	Title     string
	// Updated is GitHub's updated_at (its since filter); zero means Created.
	Updated time.Time
}

// fakeAPI serves the documented response shapes of one API style with a
// small page size, so pagination is exercised with a handful of items.
type fakeAPI struct {
	t        testing.TB
	style    string // stripe, github, rest
	token    string
	pageSize int
	srv      *httptest.Server

	mu        sync.Mutex
	items     []fakeItem
	resources map[string]map[string]any // fetch: path -> resource
	force     int                       // forced status for the next requests
	headers   http.Header               // headers sent with the forced status
	requests  []string                  // request URIs seen
	auths     []string                  // Authorization headers seen
	// after runs once each request is answered, with the lock held: a
	// concurrent writer changing f.items between two page reads.
	after func(f *fakeAPI, r *http.Request)
	// ignorePage serves the first page whatever the page parameter says (a
	// static list); dropHasMore leaves has_more out of Stripe's pages.
	ignorePage, dropHasMore bool
	// flaky, when set, is asked for every request (numbered from 1) and
	// fails it with the status it returns: 0 serves it, cutBody serves a
	// 200 whose body is cut short. The items (the truth) do not change.
	flaky func(n int) int
}

// cutBody is a flaky "status": a 200 whose JSON body a proxy cut.
const cutBody = -1

// remove deletes the item with id; the caller holds the lock (after).
func (f *fakeAPI) remove(id string) {
	f.items = slices.DeleteFunc(f.items, func(it fakeItem) bool { return it.ID == id })
}

func newFakeAPI(t testing.TB, style, token string) *fakeAPI {
	f := &fakeAPI{t: t, style: style, token: token, pageSize: 2, resources: map[string]map[string]any{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeAPI) add(items ...fakeItem) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.items = append(f.items, items...)
}

func (f *fakeAPI) setResource(path string, r map[string]any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r == nil {
		delete(f.resources, path)
		return
	}
	f.resources[path] = r
}

// fail makes every following request answer status with headers.
func (f *fakeAPI) fail(status int, headers http.Header) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.force, f.headers = status, headers
}

func (f *fakeAPI) seen() (uris, auths []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.requests...), append([]string(nil), f.auths...)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

var (
	stripeMarker  = regexp.MustCompile(`metadata\['idempotency_key'\]:'((?:[^'\\]|\\.)*)'`)
	stripeCreated = regexp.MustCompile(`created>=(\d+)`)
)

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, r.URL.RequestURI())
	f.auths = append(f.auths, r.Header.Get("Authorization"))
	if f.flaky != nil {
		switch st := f.flaky(len(f.requests)); {
		case st == cutBody:
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"items": [{"id": "x`))
			return
		case st == http.StatusTooManyRequests:
			w.Header().Set("Retry-After", "0")
			f.writeError(w, st)
			return
		case st != 0:
			f.writeError(w, st)
			return
		}
	}
	if f.force != 0 {
		for k, v := range f.headers {
			w.Header()[k] = v
		}
		f.writeError(w, f.force)
		return
	}
	if r.Header.Get("Authorization") != "Bearer "+f.token {
		f.writeError(w, http.StatusUnauthorized)
		return
	}
	if res, ok := f.resources[r.URL.Path]; ok {
		writeJSON(w, http.StatusOK, res)
		return
	}
	switch f.style {
	case "stripe":
		f.serveStripe(w, r)
	case "github":
		f.serveGitHub(w, r)
	default:
		f.serveREST(w, r)
	}
	if f.after != nil {
		f.after(f, r)
	}
}

// writeError answers in the API's documented error shape.
func (f *fakeAPI) writeError(w http.ResponseWriter, status int) {
	switch f.style {
	case "stripe":
		writeJSON(w, status, map[string]any{"error": map[string]any{
			"type": "invalid_request_error", "message": "Invalid API Key provided: " + f.token}})
	case "github":
		writeJSON(w, status, map[string]any{"message": "Bad credentials",
			"documentation_url": "https://docs.github.com/rest"})
	default:
		writeJSON(w, status, map[string]any{"error": http.StatusText(status)})
	}
}

// page returns items[off:off+size] and whether more follow.
func page[T any](items []T, off, size int) ([]T, bool) {
	if off >= len(items) {
		return []T{}, false
	}
	end := min(off+size, len(items))
	return items[off:end], end < len(items)
}

// serveStripe: GET /v1/charges/search?query=...&page=... answers a
// search_result {object, url, data, has_more, next_page}.
func (f *fakeAPI) serveStripe(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/charges/search" {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": map[string]any{
			"type": "invalid_request_error", "message": "Unrecognized request URL"}})
		return
	}
	q := r.URL.Query().Get("query")
	// The query is metadata['idempotency_key']:'...' AND created>=N, or only
	// the created clause (the adapter then matches the marker itself).
	marker, byMarker := "", false
	if m := stripeMarker.FindStringSubmatch(q); m != nil {
		marker, byMarker = strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(m[1]), true
	}
	c := stripeCreated.FindStringSubmatch(q)
	if !byMarker && c == nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"type": "invalid_request_error"}})
		return
	}
	var since int64
	if c != nil {
		since, _ = strconv.ParseInt(c[1], 10, 64)
	}
	var data []map[string]any
	for _, it := range f.items {
		if (!byMarker || it.Marker == marker) && it.Created.Unix() >= since {
			data = append(data, map[string]any{"id": it.ID, "object": "charge", "amount": it.Amount,
				"currency": "usd", "created": it.Created.Unix(), "metadata": map[string]any{"idempotency_key": it.Marker}})
		}
	}
	off := 0
	if p := r.URL.Query().Get("page"); p != "" {
		off, _ = strconv.Atoi(strings.TrimPrefix(p, "page_"))
	}
	items, more := page(data, off, f.pageSize)
	var next any
	if more {
		next = fmt.Sprintf("page_%d", off+f.pageSize)
	}
	body := map[string]any{"object": "search_result", "url": "/v1/charges/search",
		"data": items, "has_more": more, "next_page": next}
	if f.dropHasMore {
		delete(body, "has_more")
	}
	writeJSON(w, http.StatusOK, body)
}

// serveGitHub: GET /repos/{o}/{r}/issues?since=&per_page=&page= answers an
// array, with a Link header to the next page.
func (f *fakeAPI) serveGitHub(w http.ResponseWriter, r *http.Request) {
	if !regexp.MustCompile(`^/repos/[^/]+/[^/]+/issues$`).MatchString(r.URL.Path) {
		writeJSON(w, http.StatusNotFound, map[string]any{"message": "Not Found"})
		return
	}
	since, _ := time.Parse(time.RFC3339, r.URL.Query().Get("since"))
	var data []map[string]any
	for i, it := range f.items {
		updated := it.Updated
		if updated.IsZero() {
			updated = it.Created
		}
		if updated.Before(since) {
			continue // GitHub's since filters on updated_at, not created_at
		}
		data = append(data, map[string]any{"id": 1000 + i, "number": i + 1, "title": it.Title,
			"body":       "Filed by the agent.\n\n<!-- receipt:" + it.Marker + " -->",
			"user":       map[string]any{"login": "agent-bot"},
			"created_at": it.Created.UTC().Format(time.RFC3339), "updated_at": updated.UTC().Format(time.RFC3339)})
	}
	pg, _ := strconv.Atoi(r.URL.Query().Get("page"))
	pg = max(pg, 1)
	items, more := page(data, (pg-1)*f.pageSize, f.pageSize)
	if more {
		q := r.URL.Query()
		q.Set("page", strconv.Itoa(pg+1))
		w.Header().Set("Link", fmt.Sprintf(`<%s%s?%s>; rel="next", <%s%s?page=99>; rel="last"`,
			f.srv.URL, r.URL.Path, q.Encode(), f.srv.URL, r.URL.Path))
	}
	w.Header().Set("X-RateLimit-Remaining", "4999")
	writeJSON(w, http.StatusOK, items)
}

// serveREST: GET /items?created_after=...&page=N (or &offset=N) answers
// {"items": [...]}, oldest first; key=K keeps only the items marked K.
func (f *fakeAPI) serveREST(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/items" {
		writeJSON(w, http.StatusNotFound, map[string]any{"error": "not found"})
		return
	}
	q := r.URL.Query()
	after, _ := time.Parse(time.RFC3339, q.Get("created_after"))
	var data []map[string]any
	for _, it := range f.items {
		if it.Created.Before(after) || (q.Has("key") && it.Marker != q.Get("key")) {
			continue
		}
		metadata := map[string]any{"idempotency_key": it.Marker}
		if it.ReceiptID != "" {
			metadata["receipt_id"] = it.ReceiptID
		}
		data = append(data, map[string]any{"id": it.ID, "title": it.Title, "amount": it.Amount,
			"created_at": it.Created.UTC().Format(time.RFC3339), "metadata": metadata})
	}
	pg, _ := strconv.Atoi(q.Get("page"))
	pg = max(pg, 1)
	off := (pg - 1) * f.pageSize
	if q.Has("offset") {
		off, _ = strconv.Atoi(q.Get("offset"))
	}
	if f.ignorePage {
		off = 0
	}
	items, _ := page(data, off, f.pageSize)
	writeJSON(w, http.StatusOK, map[string]any{"items": items})
}
