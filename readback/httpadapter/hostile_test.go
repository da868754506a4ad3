package httpadapter_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/receiptledger/reconciler/readback"
)

// receiptWith is testReceipt with another payload.
func receiptWith(target string, payload map[string]any) readback.Receipt {
	r := testReceipt(target)
	b, _ := json.Marshal(map[string]any{"method": "POST", "payload": payload, "target": target})
	r.Intent = b
	return r
}

// pathAPI is an API that answers 200 with body at exactly one request
// path (as sent, escapes included) and 404 everywhere else, recording what
// it was asked.
type pathAPI struct {
	srv  *httptest.Server
	mu   sync.Mutex
	uris []string
}

func newPathAPI(t *testing.T, okPath string, body any) *pathAPI {
	rec := &pathAPI{}
	rec.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec.mu.Lock()
		rec.uris = append(rec.uris, r.RequestURI)
		rec.mu.Unlock()
		if r.URL.EscapedPath() == okPath {
			writeJSON(w, http.StatusOK, body)
			return
		}
		writeJSON(w, http.StatusNotFound, map[string]any{"error": "not found"})
	}))
	t.Cleanup(rec.srv.Close)
	return rec
}

func (rec *pathAPI) seen() []string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]string(nil), rec.uris...)
}

// Issue 8, item 2: a substituted value stays one path segment, always. The
// storage object `reports/2024.csv` is fetched at /o/reports%2F2024.csv,
// where it still exists: the delete did not happen (present), and a 404 on
// a wrong path (/o/reports/2024.csv) can never settle it succeeded. Same for
// values that would walk up the path or hide an escape.
func TestStorageObjectNameStaysOneSegment(t *testing.T) {
	for _, name := range []string{"reports/2024.csv", "../secrets", "../../b/other/o/x", "%2e%2e", "..%2F..%2Fcreds",
		"a%2Fb", "rapport/été 2024.csv", "名前/ファイル", "..", ".", "a?b#c"} {
		t.Run(name, func(t *testing.T) {
			want := "/storage/v1/b/bucket/o/" + url.PathEscape(name)
			rec := newPathAPI(t, want, map[string]any{"id": "bucket/" + name, "name": name})
			a := mustLoad(t, adapterFile("delete", "", rec.srv.URL+"/storage/v1/",
				"intent_fields: {object: /name}\nfetch: {path: \"/b/bucket/o/{intent.object}\", id: /id}"))
			res, err := a.Check(context.Background(), receiptWith("/b/bucket/o", map[string]any{"name": name}))
			if name == "." || name == ".." {
				// A dot segment would name another resource: refused.
				if class, _ := readback.Classify(err); err == nil || class != readback.Permanent || len(rec.seen()) != 0 {
					t.Fatalf("got %+v, %v, requests %q; want a permanent refusal and no request", res, err, rec.seen())
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictPresent || !res.Authoritative {
				t.Fatalf("got %+v after requests %q, want present (the object is still at %s)", res, rec.seen(), want)
			}
			if uris := rec.seen(); len(uris) != 1 || strings.SplitN(uris[0], "?", 2)[0] != want {
				t.Fatalf("requests %q, want one to %s", uris, want)
			}
		})
	}
}

// Issue 8, item 4: {receipt.target} is escaped as a path. A '?' or '#' in an
// agent's target never adds query parameters (the github preset's labels=,
// creator=) or a fragment: the escaped path names no collection (404 on the
// search endpoint: permanent), so an injected filter can never produce an
// authoritative absence. A dot segment in the target is refused.
func TestTargetCannotInjectAQuery(t *testing.T) {
	for _, target := range []string{
		"/repos/acme/widgets/issues?labels=nonexistent",
		"/repos/acme/widgets/issues?creator=nobody&labels=x",
		"/repos/acme/widgets/issues#fragment",
		"/repos/acme/widgets/issues%3Fcreator=nobody",
		"/repos/acme/widgets/../widgets/issues",
		"/repos/acme/widgets/./issues",
	} {
		t.Run(target, func(t *testing.T) {
			f := newFakeAPI(t, "github", token)
			f.add(fakeItem{ID: "ours", Created: inWindow(1), Marker: testKey})
			a := mustLoad(t, adapterFile("create", "github", f.srv.URL, "search:\n  query: {creator: agent-bot}"))
			res, err := a.Check(context.Background(), testReceipt(target))
			if err == nil && res.Verdict == readback.VerdictAbsent && res.Authoritative {
				t.Fatalf("got an authoritative absence %+v from target %q", res, target)
			}
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
				t.Fatalf("got %+v, %v; want a permanent error", res, err)
			}
			uris, _ := f.seen()
			for _, u := range uris {
				parsed, perr := url.ParseRequestURI(u)
				if perr != nil {
					t.Fatal(perr)
				}
				q := parsed.Query()
				if q.Has("labels") || q.Get("creator") != "agent-bot" || strings.Contains(u, "#") {
					t.Fatalf("request %q carries a parameter or fragment from the target", u)
				}
			}
		})
	}
	// The same preset reads a plain target as before.
	f := newFakeAPI(t, "github", token)
	f.add(fakeItem{ID: "ours", Created: inWindow(1), Marker: testKey})
	a := mustLoad(t, adapterFile("create", "github", f.srv.URL, "search:\n  query: {creator: agent-bot}"))
	if res, err := a.Check(context.Background(), testReceipt("/repos/acme/widgets/issues")); err != nil || res.Verdict != readback.VerdictPresent {
		t.Fatalf("plain target: got %+v, %v; want present", res, err)
	}
}

// secretMarkers are the two forms a secret field takes in a stored intent:
// the redaction marker, and the keyed value of the secrets stream.
var secretMarkers = []string{"[redacted]", "hmac-sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}

// Issue 8, item 3: a template over a secret field never searches for the
// marker: the check fails with a permanent error (manual_review), never an
// absence, and nothing is sent.
func TestSecretFieldInATemplateIsPermanent(t *testing.T) {
	for _, marker := range secretMarkers {
		t.Run(marker, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
				"intent_fields: {email: /email}\nsearch:\n  query: {email: \"{intent.email}\"}\n  pagination: {style: none, whole_list: true}"))
			res, err := a.Check(context.Background(), receiptWith("/items", map[string]any{"email": marker, "amount": 5}))
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent || !strings.Contains(err.Error(), "secret") {
				t.Fatalf("got %+v, %v; want a permanent error naming the secret field", res, err)
			}
			if uris, _ := f.seen(); len(uris) != 0 {
				t.Fatalf("requests sent: %q", uris)
			}
		})
	}
}

// Issue 8, item 3: fingerprint matching cannot recompute the fingerprint of
// an intent whose secret fields are stored as markers; an update cannot
// compare a secret field. Both fail permanently instead of answering
// absent.
func TestSecretFieldCannotBeMatchedOrCompared(t *testing.T) {
	for _, marker := range secretMarkers {
		t.Run("fingerprint "+marker, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.add(fakeItem{ID: "someone", Created: inWindow(1), Amount: 500, Title: "Hello"})
			a := mustLoad(t, adapterFile("create", "rest", f.srv.URL,
				"match:\n  marker: null\n  fingerprint:\n    fields: {/amount: /amount, /title: /title}"))
			r := receiptWith("/items", map[string]any{"amount": 500, "title": "Hello", "card": marker})
			res, err := a.Check(context.Background(), r)
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
				t.Fatalf("got %+v, %v; want a permanent error", res, err)
			}
		})
		t.Run("compare "+marker, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.setResource("/items/7", map[string]any{"id": "7", "pin": "1234"})
			a := mustLoad(t, adapterFile("update", "", f.srv.URL, "fetch: {id: /id}\ncompare:\n  fields: {/pin: /pin}"))
			r := receiptWith("/items/7", map[string]any{"pin": marker})
			r.PreImage = json.RawMessage(`{"id":"7","pin":"1234"}`)
			res, err := a.Check(context.Background(), r)
			if class, _ := readback.Classify(err); err == nil || class != readback.Permanent {
				t.Fatalf("got %+v, %v; want a permanent error", res, err)
			}
		})
	}
}

// Issue 8, item 3: when the adapters file declares the operation's secret
// fields (secret_fields), a template, compare or fingerprint field over one
// is refused when the file loads.
func TestSecretFieldsAreRefusedAtLoad(t *testing.T) {
	for _, tt := range []struct{ name, kind, extra, field string }{
		{"intent field", "create", "secret_fields: [/email]\nintent_fields: {email: /email}\nsearch:\n  query: {email: \"{intent.email}\"}",
			"intent_fields.email"},
		{"intent field inside a secret object", "create", "secret_fields: [/card]\nintent_fields: {last4: /card/last4}", "intent_fields.last4"},
		{"compare", "update", "secret_fields: [/pin]\nfetch: {id: /id}\ncompare:\n  fields: {/pin: /pin}", "compare.fields./pin"},
		{"fingerprint", "create", "secret_fields: [/card]\nmatch:\n  fingerprint:\n    fields: {/card: /card}", "match.fingerprint.fields./card"},
		{"bad pointer", "create", "secret_fields: [card]", "secret_fields[0]"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			preset := "rest"
			if tt.kind != "create" {
				preset = ""
			}
			_, err := load(t, adapterFile(tt.kind, preset, "http://127.0.0.1:1", tt.extra))
			var ce *readback.ConfigError
			if !errors.As(err, &ce) || ce.Field != "http."+tt.field {
				t.Fatalf("got %v, want a config error at %s", err, tt.field)
			}
		})
	}
	// A secret field that no template names is fine.
	if _, err := load(t, adapterFile("create", "rest", "http://127.0.0.1:1", "secret_fields: [/card]")); err != nil {
		t.Fatal(err)
	}
}
