package httpadapter_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

const token = "sk_test_SECRET_do_not_leak_4242"

var testNow = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// testKey is testReceipt's idempotency key: the marker the agent put in the
// resource it created. otherKey is another receipt's.
const (
	testKey  = "task-1:step-3:charges.create"
	otherKey = "task-1:step-4:charges.create"
)

func env(name string) (string, bool) {
	if name == "API_TOKEN" {
		return token, true
	}
	return "", false
}

// adapterFile returns an adapters file with one http adapter; extra is
// YAML indented under http.
func adapterFile(kind, preset, baseURL, extra string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "version: 1\nadapters:\n  - name: under-test\n    type: http\n    kind: %s\n    dependency: api\n    http:\n", kind)
	if preset != "" {
		fmt.Fprintf(&b, "      preset: %s\n", preset)
	}
	fmt.Fprintf(&b, "      base_url: %s\n", baseURL)
	if !strings.Contains(extra, "auth:") {
		b.WriteString("      auth: {env: API_TOKEN}\n")
	}
	for _, line := range strings.Split(strings.Trim(extra, "\n"), "\n") {
		if line != "" {
			b.WriteString("      " + line + "\n")
		}
	}
	return b.String()
}

func load(t testing.TB, file string) (readback.Adapter, error) {
	t.Helper()
	reg, err := readback.Load("adapters.yaml", strings.NewReader(file),
		httpadapter.Types(httpadapter.WithLookupEnv(env), httpadapter.WithClock(func() time.Time { return testNow })))
	if err != nil {
		return nil, err
	}
	if err := httpadapter.CheckKinds("adapters.yaml", reg); err != nil {
		return nil, err
	}
	b, ok := reg.Lookup("any", "api")
	if !ok {
		t.Fatal("adapter not registered")
	}
	return b.Adapter, nil
}

func mustLoad(t testing.TB, file string) readback.Adapter {
	t.Helper()
	a, err := load(t, file)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func testReceipt(target string) readback.Receipt {
	return readback.Receipt{ID: 42, IdempotencyKey: testKey, Operation: "x.create",
		Dependency: "api", Method: "POST", Target: target,
		Intent:      json.RawMessage(`{"method":"POST","payload":{"amount":500,"title":"Hello"},"target":"` + target + `"}`),
		SubmittedAt: testNow.Add(-time.Minute), CreatedAt: testNow.Add(-time.Minute)}
}

// presetCase is how each preset is exercised against its fake.
type presetCase struct {
	preset, target string
	// listAll is YAML making the search list every recent item (the
	// marker then matched by the adapter), so pagination is exercised.
	listAll string
	extra   string
}

func presetCases() []presetCase {
	return []presetCase{
		{preset: "stripe", target: "/v1/charges",
			listAll: "search:\n  query: {query: \"created>={window.start_unix}\"}"},
		{preset: "github", target: "/repos/acme/widgets/issues", extra: "search:\n  query: {creator: agent-bot}"},
		{preset: "rest", target: "/items"},
	}
}

func inWindow(i int) time.Time { return testNow.Add(-30*time.Second + time.Duration(i)*time.Second) }

func TestPresets(t *testing.T) {
	type scenario struct {
		name    string
		listAll bool
		setup   func(f *fakeAPI)
		check   func(t *testing.T, f *fakeAPI, res readback.Result, err error)
	}
	scenarios := []scenario{
		{name: "found on page 3", listAll: true,
			setup: func(f *fakeAPI) {
				for i := range 4 {
					f.add(fakeItem{ID: fmt.Sprintf("other_%d", i), Created: inWindow(i), Marker: fmt.Sprintf("task-1:step-%d:charges.create", 10+i)})
				}
				f.add(fakeItem{ID: "target_1", Created: inWindow(5), Marker: testKey})
			},
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				if err != nil {
					t.Fatal(err)
				}
				ev := res.Evidence.(*httpadapter.Evidence)
				if res.Verdict != readback.VerdictPresent || !res.Authoritative || len(res.ExternalIDs) != 1 || ev.Pages < 3 {
					t.Fatalf("got %+v %+v, want present with one id after >= 3 pages", res, ev)
				}
				if ev.MatchedBy != "marker" {
					t.Errorf("matched by %q, want marker", ev.MatchedBy)
				}
			}},
		// Issue 7, adversarial review: a marked item created outside the
		// window (the API's clock 3h behind) still matches, and the
		// evidence says so. The rest preset filters created_after=
		// {window.start} on the server (its list is not narrowed to the
		// key), so there it never comes back: its window_skew must cover
		// the API's clock (docs/adapters.md).
		{name: "a marked item created outside the window matches",
			setup: func(f *fakeAPI) {
				f.add(fakeItem{ID: "old_1", Created: testNow.Add(-3 * time.Hour), Updated: testNow, Marker: testKey},
					fakeItem{ID: "old_other", Created: testNow.Add(-3 * time.Hour), Updated: testNow, Marker: otherKey})
			},
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				if err != nil {
					t.Fatal(err)
				}
				ev := res.Evidence.(*httpadapter.Evidence)
				if f.style == "rest" {
					if res.Verdict != readback.VerdictAbsent || ev.Items != 0 {
						t.Fatalf("got %+v %+v, want an absence (the server filtered both out)", res, ev)
					}
					return
				}
				if res.Verdict != readback.VerdictPresent || !res.Authoritative || len(res.ExternalIDs) != 1 ||
					len(ev.MarkedOutsideWindow) != 1 || ev.MarkedOutsideWindow[0] != res.ExternalIDs[0] {
					t.Fatalf("got %+v %+v, want present with the marked item, recorded as outside the window", res, ev)
				}
			}},
		{name: "two resources with the marker are a duplicate",
			setup: func(f *fakeAPI) {
				f.add(fakeItem{ID: "dup_1", Created: inWindow(1), Marker: testKey},
					fakeItem{ID: "dup_2", Created: inWindow(2), Marker: testKey},
					fakeItem{ID: "other", Created: inWindow(3), Marker: otherKey})
			},
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				if err != nil {
					t.Fatal(err)
				}
				if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 2 {
					t.Fatalf("got %+v, want present with two ids", res)
				}
			}},
		{name: "401 is permanent",
			setup: func(f *fakeAPI) { f.fail(http.StatusUnauthorized, nil) },
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				class, _ := readback.Classify(err)
				if err == nil || class != readback.Permanent || !strings.Contains(err.Error(), "401") {
					t.Fatalf("got %v (%s), want a permanent 401", err, class)
				}
			}},
		{name: "429 with Retry-After 2 is transient for at least 2s",
			setup: func(f *fakeAPI) { f.fail(http.StatusTooManyRequests, http.Header{"Retry-After": {"2"}}) },
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				class, wait := readback.Classify(err)
				if class != readback.Transient || wait < 2*time.Second {
					t.Fatalf("got %v (%s, %s), want transient with at least 2s", err, class, wait)
				}
			}},
		{name: "503 is transient",
			setup: func(f *fakeAPI) { f.fail(http.StatusServiceUnavailable, nil) },
			check: func(t *testing.T, f *fakeAPI, res readback.Result, err error) {
				if class, _ := readback.Classify(err); err == nil || class != readback.Transient {
					t.Fatalf("got %v (%s), want transient", err, class)
				}
			}},
	}
	for _, pc := range presetCases() {
		for _, sc := range scenarios {
			t.Run(pc.preset+"/"+sc.name, func(t *testing.T) {
				f := newFakeAPI(t, pc.preset, token)
				sc.setup(f)
				extra := pc.extra
				if sc.listAll && pc.listAll != "" {
					extra = pc.listAll
				}
				a := mustLoad(t, adapterFile("create", pc.preset, f.srv.URL, extra))
				res, err := a.Check(context.Background(), testReceipt(pc.target))
				sc.check(t, f, res, err)
				assertNoSecret(t, res, err)
				if _, auths := f.seen(); len(auths) == 0 || auths[0] != "Bearer "+token {
					t.Errorf("credentials not sent: %q", auths)
				}
			})
		}
	}
}

// assertNoSecret fails if the token shows in anything the reconciler
// records or logs.
func assertNoSecret(t *testing.T, res readback.Result, err error) {
	t.Helper()
	ev, _ := json.Marshal(res.Evidence)
	for what, s := range map[string]string{"query": res.Query, "evidence": string(ev), "error": fmt.Sprint(err)} {
		if strings.Contains(s, token) {
			t.Errorf("the secret leaks into the %s: %s", what, s)
		}
	}
}

func TestStripeSearchQuotesTheKey(t *testing.T) {
	// A key holding a quote or a backslash must reach Stripe's search
	// escaped, or the search asks for something else: a false absence.
	const key = `task-'9':step\2:charges.create`
	f := newFakeAPI(t, "stripe", token)
	f.add(fakeItem{ID: "ch_quoted", Created: inWindow(1), Marker: key},
		fakeItem{ID: "ch_other", Created: inWindow(2), Marker: "task-"})
	a := mustLoad(t, adapterFile("create", "stripe", f.srv.URL, ""))
	r := testReceipt("/v1/charges")
	r.IdempotencyKey = key
	res, err := a.Check(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ch_quoted" {
		t.Fatalf("got %+v, want present with ch_quoted", res)
	}
	uris, _ := f.seen()
	u, err := url.Parse(uris[0])
	if err != nil {
		t.Fatal(err)
	}
	// Issue 7, adversarial review: the key alone, no created>= clause (a
	// server-side time filter would drop a marked charge made while
	// Stripe's clock was off by more than window_skew).
	want := `metadata['idempotency_key']:'task-\'9\':step\\2:charges.create'`
	if q := u.Query().Get("query"); q != want {
		t.Fatalf("query %q, want %q", q, want)
	}
}

func TestPresetsFindARetryByItsLogicalKey(t *testing.T) {
	// Client.Retry keys attempt 2 "<key>#2", but the agent built the
	// request before knowing the attempt, with <key> as the marker: every
	// preset must find the retry's effect by the key without the suffix.
	const logical = "task:step:op"
	for _, pc := range presetCases() {
		for _, listAll := range []bool{false, true} {
			if listAll && pc.listAll == "" {
				continue
			}
			name := pc.preset
			if listAll {
				name += "/listing all"
			}
			t.Run(name, func(t *testing.T) {
				f := newFakeAPI(t, pc.preset, token)
				f.add(fakeItem{ID: "other", Created: inWindow(1), Marker: "task:step:op2"},
					fakeItem{ID: "marked_with_a_full_key", Created: inWindow(2), Marker: logical + "#3"},
					fakeItem{ID: "ours", Created: inWindow(3), Marker: logical})
				extra := pc.extra
				if listAll {
					extra = pc.listAll
				}
				a := mustLoad(t, adapterFile("create", pc.preset, f.srv.URL, extra))
				r := testReceipt(pc.target)
				r.IdempotencyKey = logical + "#2"
				res, err := a.Check(context.Background(), r)
				if err != nil {
					t.Fatal(err)
				}
				ev := res.Evidence.(*httpadapter.Evidence)
				if res.Verdict != readback.VerdictPresent || !res.Authoritative || ev.MatchedBy != "marker" {
					t.Fatalf("got %+v %+v, want present by marker", res, ev)
				}
				// Only the resource marked with the logical key: not another
				// step's, nor one marked with an attempt's full key. (The
				// GitHub fake numbers its ids 1000 + the item's index.)
				want := "ours"
				if pc.preset == "github" {
					want = "1002"
				}
				if len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != want {
					t.Fatalf("matched %q, want only %q, the item marked %q", res.ExternalIDs, want, logical)
				}
			})
		}
	}
}

func TestLogicalKeyPlaceholder(t *testing.T) {
	// ledger.Key escapes a '#' inside a part, so only the attempt suffix
	// is stripped.
	logical := ledger.Key("task#1", "step:3", "op%x")
	for _, tt := range []struct{ key, want string }{
		{logical + "#2", logical},
		{logical + "#13", logical},
		{logical, logical}, // the first attempt: the key itself
	} {
		t.Run(tt.key, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
				"search:\n  query: {marker: \"{receipt.logical_key}\", full: \"{receipt.idempotency_key}\"}"))
			r := testReceipt("/items")
			r.IdempotencyKey = tt.key
			if _, err := a.Check(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			uris, _ := f.seen()
			u, err := url.Parse(uris[0])
			if err != nil {
				t.Fatal(err)
			}
			if got := u.Query().Get("marker"); got != tt.want {
				t.Errorf("{receipt.logical_key} = %q, want %q", got, tt.want)
			}
			if got := u.Query().Get("full"); got != tt.key {
				t.Errorf("{receipt.idempotency_key} = %q, want %q", got, tt.key)
			}
		})
	}
}

func TestMarkerByReceiptID(t *testing.T) {
	// An agent that plans first knows the receipt id before building the
	// request: {receipt.id} stays available to mark by it.
	f := newFakeAPI(t, "rest", token)
	f.add(fakeItem{ID: "not_ours", Created: inWindow(1), Marker: otherKey, ReceiptID: "41"},
		fakeItem{ID: "ours", Created: inWindow(2), Marker: otherKey, ReceiptID: "42"})
	a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
		"match:\n  marker: {pointer: /metadata/receipt_id, equals: \"{receipt.id}\"}"))
	res, err := a.Check(context.Background(), testReceipt("/items"))
	if err != nil {
		t.Fatal(err)
	}
	ev := res.Evidence.(*httpadapter.Evidence)
	if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ours" || ev.MatchedBy != "marker" {
		t.Fatalf("got %+v %+v, want the item marked with receipt id 42", res, ev)
	}
}

func TestGitHubRateLimit403IsTransient(t *testing.T) {
	f := newFakeAPI(t, "github", token)
	reset := testNow.Add(90 * time.Second).Unix()
	f.fail(http.StatusForbidden, http.Header{"X-Ratelimit-Remaining": {"0"}, "X-Ratelimit-Reset": {fmt.Sprint(reset)}})
	a := mustLoad(t, adapterFile("create", "github", f.srv.URL, ""))
	_, err := a.Check(context.Background(), testReceipt("/repos/acme/widgets/issues"))
	class, wait := readback.Classify(err)
	if class != readback.Transient || wait < 89*time.Second {
		t.Fatalf("got %v (%s, %s), want transient until the reset", err, class, wait)
	}
}

func TestSearchEndpoint404IsPermanent(t *testing.T) {
	f := newFakeAPI(t, "rest", token)
	a := mustLoad(t, adapterFile("create", "rest", f.srv.URL, "search:\n  path: /itemz"))
	_, err := a.Check(context.Background(), testReceipt("/items"))
	if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
		t.Fatalf("got %v (%s), want permanent", err, class)
	}
}

func TestPageBoundMakesAbsenceNonAuthoritative(t *testing.T) {
	f := newFakeAPI(t, "rest", token)
	for i := range 6 {
		f.add(fakeItem{ID: fmt.Sprint(i), Created: inWindow(i), Marker: otherKey})
	}
	a := mustLoad(t, adapterFile("create", "rest", f.srv.URL, "search:\n  pagination: {max_pages: 2}"))
	res, err := a.Check(context.Background(), testReceipt("/items"))
	if err != nil {
		t.Fatal(err)
	}
	if res.Verdict != readback.VerdictAbsent || res.Authoritative || !res.Evidence.(*httpadapter.Evidence).Truncated {
		t.Fatalf("got %+v, want a non-authoritative truncated absence", res)
	}
	if uris, _ := f.seen(); len(uris) != 2 {
		t.Fatalf("%d requests, want 2 (the page bound)", len(uris))
	}
}

func TestFingerprintMatch(t *testing.T) {
	f := newFakeAPI(t, "rest", token)
	f.add(fakeItem{ID: "wrong", Created: inWindow(1), Amount: 501, Title: "Hello"},
		fakeItem{ID: "right", Created: inWindow(2), Amount: 500, Title: "Hello"})
	a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
		"match:\n  marker: null\n  fingerprint:\n    fields: {/amount: /amount, /title: /title}"))
	r := testReceipt("/items")
	r.Fingerprint = fingerprintOf(t, r)
	res, err := a.Check(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "right" {
		t.Fatalf("got %+v, want the item with the same fields", res)
	}
}

func TestLinkToAnotherHostIsRefused(t *testing.T) {
	// A Link header pointing elsewhere must not receive the credentials.
	f := newFakeAPI(t, "github", token)
	evil := newFakeAPI(t, "github", token)
	f.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "<"+evil.srv.URL+"/repos/a/b/issues?page=2>; rel=\"next\"")
		writeJSON(w, http.StatusOK, []any{})
	})
	a := mustLoad(t, adapterFile("create", "github", f.srv.URL, ""))
	_, err := a.Check(context.Background(), testReceipt("/repos/acme/widgets/issues"))
	if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
		t.Fatalf("got %v, want a permanent refusal", err)
	}
	if uris, _ := evil.seen(); len(uris) != 0 {
		t.Fatal("the other host was called")
	}
}

func TestUpdateAndDelete(t *testing.T) {
	const path = "/items/7"
	preImage := json.RawMessage(`{"id":"7","title":"Old","amount":100}`)
	updateYAML := "fetch: {path: \"{receipt.target}\", id: /id}\ncompare:\n  fields: {/title: /title, /amount: /amount}"
	deleteYAML := "fetch: {path: \"{receipt.target}\", id: /id}\nguard:\n  fields: [/title]"
	tests := []struct {
		name     string
		kind     string
		resource map[string]any // nil: 404
		noPre    bool
		want     readback.Verdict
	}{
		{"update done", "update", map[string]any{"id": "7", "title": "Hello", "amount": 500.0}, false, readback.VerdictPresent},
		{"update not done", "update", map[string]any{"id": "7", "title": "Old", "amount": 100}, false, readback.VerdictAbsent},
		{"update changed by someone else", "update", map[string]any{"id": "7", "title": "Other", "amount": 100}, false, readback.VerdictDiverged},
		{"update target deleted", "update", nil, false, readback.VerdictDiverged},
		{"update without pre-image", "update", map[string]any{"id": "7", "title": "Old", "amount": 100}, true, readback.VerdictDiverged},
		{"delete done", "delete", nil, false, readback.VerdictAbsent},
		{"delete not done", "delete", map[string]any{"id": "7", "title": "Old"}, false, readback.VerdictPresent},
		{"delete target changed by someone else", "delete", map[string]any{"id": "7", "title": "Renamed"}, false, readback.VerdictDiverged},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.setResource(path, tt.resource)
			extra := deleteYAML
			if tt.kind == "update" {
				extra = updateYAML
			}
			a := mustLoad(t, adapterFile(tt.kind, "", f.srv.URL, extra))
			r := testReceipt(path)
			if !tt.noPre {
				r.PreImage = preImage
			}
			res, err := a.Check(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != tt.want || !res.Authoritative {
				t.Fatalf("got %+v, want an authoritative %s", res, tt.want)
			}
			assertNoSecret(t, res, err)
		})
	}
}

func TestConfigErrors(t *testing.T) {
	tests := []struct {
		name, kind, preset, extra string
		field                     string
	}{
		{"unknown field", "create", "rest", "serach: {}", "http.serach"},
		{"unknown nested field", "create", "rest", "search:\n  pagination: {stlye: page}", "http.search.pagination.stlye"},
		{"bad JSON pointer", "create", "rest", "search:\n  items: data", "http.search.items"},
		{"missing id field", "create", "rest", "search:\n  id: \"\"", "http.search.id"},
		{"unknown intent field", "create", "rest",
			"intent_fields: {amount: /amount}\nsearch:\n  query: {min: \"{intent.amont}\"}", "http.search.query.min"},
		{"unknown placeholder", "create", "rest", "search:\n  path: \"/items/{receipt.nope}\"", "http.search.path"},
		{"bad intent pointer", "create", "rest", "intent_fields: {amount: amount}", "http.intent_fields.amount"},
		{"unknown preset", "create", "shopify", "", "http.preset"},
		{"credential in headers", "create", "rest", "headers: {Authorization: Bearer x}", "http.headers.Authorization"},
		{"kind does not fit the block", "update", "rest", "", "kind"},
		{"delete with a search", "delete", "github", "", "kind"},
		{"missing secret", "create", "rest", "auth: {env: NOT_SET}", "http.auth.env"},
		{"no match", "create", "", "search: {path: /x, items: /data, id: /id, created_at: /c}", "http.match"},
		{"stable on a page list", "create", "rest", "search:\n  pagination: {stable: true}", "http.search.pagination.stable"},
		{"unknown style", "create", "rest", "search:\n  pagination: {style: pages}", "http.search.pagination.style"},
		{"negative start", "create", "rest", "search:\n  pagination: {style: offset, start: -1}", "http.search.pagination.start"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := load(t, adapterFile(tt.kind, tt.preset, "https://api.example.com", tt.extra))
			if err == nil {
				t.Fatal("loaded; want an error")
			}
			var ce *readback.ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, readback.ErrInvalidConfig) {
				t.Fatalf("%v: want a *readback.ConfigError", err)
			}
			msg := err.Error()
			if ce.File != "adapters.yaml" || ce.Adapter != "under-test" || ce.Field != tt.field ||
				!strings.Contains(msg, "adapters.yaml") || !strings.Contains(msg, "under-test") {
				t.Fatalf("got %q (field %q), want the file, the adapter and field %q", msg, ce.Field, tt.field)
			}
			if strings.Contains(msg, token) {
				t.Fatalf("the secret leaks into %q", msg)
			}
		})
	}
}
