package httpadapter_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// recorder is a server that records the headers of every request it gets.
type recorder struct {
	mu      sync.Mutex
	headers []http.Header
}

func (rec *recorder) record(r *http.Request) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.headers = append(rec.headers, r.Header.Clone())
}

func (rec *recorder) seen() []http.Header {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]http.Header(nil), rec.headers...)
}

// restItems answers the rest preset's shape: one item marked testKey on
// page 1, then an empty page.
func restItems(w http.ResponseWriter, r *http.Request) {
	if p := r.URL.Query().Get("page"); p != "" && p != "1" {
		writeJSON(w, http.StatusOK, map[string]any{"items": []any{}})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"items": []any{map[string]any{
		"id": "ours", "created_at": inWindow(1).Format(time.RFC3339),
		"metadata": map[string]any{"idempotency_key": testKey}}}})
}

// authSchemes are the ways the credential is sent: a custom header follows
// any redirect in Go's client; Authorization is dropped only for another
// domain, and a different port on the same address is not one.
var authSchemes = []struct {
	name, yaml, header, value string
}{
	{"header", "auth: {scheme: header, header: X-Api-Key, env: API_TOKEN}", "X-Api-Key", token},
	{"bearer", "auth: {env: API_TOKEN}", "Authorization", "Bearer " + token},
}

func TestRedirectToAnotherHostIsNotFollowed(t *testing.T) {
	for _, as := range authSchemes {
		for _, status := range []int{http.StatusFound, http.StatusTemporaryRedirect} {
			t.Run(as.name+"/"+http.StatusText(status), func(t *testing.T) {
				other := &recorder{}
				otherSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					other.record(r)
					restItems(w, r)
				}))
				t.Cleanup(otherSrv.Close)
				api := &recorder{}
				apiSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					api.record(r)
					http.Redirect(w, r, otherSrv.URL+r.URL.RequestURI(), status)
				}))
				t.Cleanup(apiSrv.Close)

				a := mustLoad(t, adapterFile("create", "rest", apiSrv.URL, as.yaml))
				res, err := a.Check(context.Background(), testReceipt("/items"))

				if got := other.seen(); len(got) != 0 {
					t.Fatalf("the other host was called %d times, with %s: %q", len(got), as.header, got[0].Get(as.header))
				}
				if got := api.seen(); len(got) != 1 || got[0].Get(as.header) != as.value {
					t.Fatalf("the API got %d requests (%s %q), want one with the credential", len(got), as.header, got)
				}
				// A redirect off the configured host is a misconfiguration
				// (base_url moved, or a proxy in the way): asking again cannot
				// help, so it is permanent (manual_review with the error), never
				// an absence.
				class, _ := readback.Classify(err)
				var se *httpadapter.StatusError
				if err == nil || class != readback.Permanent || !errors.As(err, &se) || se.Status != status {
					t.Fatalf("got %+v, %v (%s); want a permanent *StatusError with HTTP %d", res, err, class, status)
				}
				if res.Verdict != "" || len(res.ExternalIDs) != 0 {
					t.Fatalf("got a verdict %+v with the error", res)
				}
				assertNoSecret(t, res, err)
			})
		}
	}
}

func TestRedirectOnTheSameHostIsFollowed(t *testing.T) {
	for _, as := range authSchemes {
		t.Run(as.name, func(t *testing.T) {
			api := &recorder{}
			mux := http.NewServeMux()
			mux.HandleFunc("/items", func(w http.ResponseWriter, r *http.Request) {
				api.record(r)
				http.Redirect(w, r, "/v2/items?"+r.URL.RawQuery, http.StatusMovedPermanently)
			})
			mux.HandleFunc("/v2/items", func(w http.ResponseWriter, r *http.Request) {
				api.record(r)
				if r.Header.Get(as.header) != as.value {
					writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "unauthorized"})
					return
				}
				restItems(w, r)
			})
			srv := httptest.NewServer(mux)
			t.Cleanup(srv.Close)

			a := mustLoad(t, adapterFile("create", "rest", srv.URL, as.yaml))
			res, err := a.Check(context.Background(), testReceipt("/items"))
			if err != nil {
				t.Fatal(err)
			}
			if res.Verdict != readback.VerdictPresent || len(res.ExternalIDs) != 1 || res.ExternalIDs[0] != "ours" {
				t.Fatalf("got %+v, want present with the item behind the redirect", res)
			}
			got := api.seen()
			if len(got) < 2 {
				t.Fatalf("%d requests, want the redirect followed", len(got))
			}
			// The first page was asked at /items and answered behind the
			// redirect, with its query (the window, the page) intact.
			if got[1].Get(as.header) != as.value {
				t.Errorf("the redirected request lost the credential")
			}
			assertNoSecret(t, res, err)
		})
	}
}
