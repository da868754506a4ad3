package gateway_test

import (
	"maps"
	"net/http"
	"strings"
	"testing"
)

// An operator reading reconciler_gateway_requests_total sees every request
// under the labels its help text (and docs/reconciler.md) names: a forwarded call
// under its route's prefix, a receipt read under route "receipts" with
// outcome "read", and a path no route serves under route "none".
func TestRequestMetricsNameWhatWasServed(t *testing.T) {
	e := newEnv(t, newFakeUpstream(), "")
	a := e.post(t, "/blog/articles", "t:1:articles.create", `{"title":"metrics"}`)
	if a.status != http.StatusCreated {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	id := a.header.Get("Receipt-Id")
	if r := e.do(t, "GET", "/receipts/"+id, "", "Authorization", "Bearer "+tokenA); r.status != http.StatusOK {
		t.Fatalf("GET /receipts/%s: %d %s", id, r.status, r.body)
	}
	if r := e.do(t, "POST", "/nowhere/x", `{}`, "Authorization", "Bearer "+tokenA, "Idempotency-Key", "k"); r.status != http.StatusNotFound {
		t.Fatalf("unknown route: %d %s", r.status, r.body)
	}
	families, err := e.metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "reconciler_gateway_requests_total" {
			continue
		}
		for _, word := range []string{"receipts", "none", "read"} {
			if !strings.Contains(f.GetHelp(), word) {
				t.Errorf("the help text does not name %q: %s", word, f.GetHelp())
			}
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			got[labels["route"]+" "+labels["outcome"]] = m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{"/blog succeeded": 1, "receipts read": 1, "none refused": 1}
	if !maps.Equal(got, want) {
		t.Errorf("reconciler_gateway_requests_total by route and outcome: %v, want %v", got, want)
	}
}
