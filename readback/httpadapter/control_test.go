package httpadapter_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// Issue 7, "a misconfigured adapter must not produce proof": the rest
// preset lists the collection the receipt's call was made to, not a fixed
// /items; a target the API does not have is a permanent error, never an
// absence.
func TestRestPresetSearchesTheTarget(t *testing.T) {
	f := newFakeAPI(t, "rest", token)
	f.add(fakeItem{ID: "ours", Created: inWindow(1), Marker: testKey})
	a := mustLoad(t, adapterFile("create", "rest", f.srv.URL, ""))
	res, err := a.Check(context.Background(), testReceipt("/items"))
	if err != nil || res.Verdict != readback.VerdictPresent {
		t.Fatalf("target /items: got %+v, %v; want present", res, err)
	}
	_, err = a.Check(context.Background(), testReceipt("/orders"))
	if class, _ := readback.Classify(err); err == nil || class != readback.Permanent || !strings.Contains(err.Error(), "/orders") {
		t.Fatalf("target /orders: got %v, want a permanent 404 on /orders", err)
	}
}

// Issue 7, "a misconfigured adapter must not produce proof": a declared
// control (a resource known to exist) passes with a correct configuration
// and fails with a wrong server, path, filter or marker, each of which reads
// exactly like "absent" on a receipt.
func TestDeclaredControlCatchesMisconfiguration(t *testing.T) {
	const controlKey = "bootstrap:rest-control:items.create"
	made := testNow.Add(-2 * time.Hour)
	f := newFakeAPI(t, "rest", token)
	f.add(append(others(3), fakeItem{ID: "control-item", Created: made, Marker: controlKey})...)
	empty := newFakeAPI(t, "rest", token) // the wrong server: an empty collection
	control := fmt.Sprintf("control: {idempotency_key: %q, target: /items, submitted_at: %s, intent: {title: lamp}, operation: items.create}",
		controlKey+"#2", made.Format(time.RFC3339))
	tests := []struct {
		name, base, extra string
		pass              bool
		why               string
	}{
		{"correct", f.srv.URL, "", true, ""},
		{"correct, narrowed by the key", f.srv.URL, "search:\n  query: {key: \"{receipt.logical_key}\"}", true, ""},
		{"wrong server", empty.srv.URL, "", false, "answered absent"},
		{"wrong path", f.srv.URL, "search:\n  path: /item", false, "HTTP 404"},
		{"wrong filter", f.srv.URL, "search:\n  query: {key: \"{receipt.idempotency_key}\"}", false, "answered absent"},
		{"wrong marker", f.srv.URL, "match:\n  marker: {pointer: /metadata/idempotency, equals: \"{receipt.logical_key}\"}", false, "answered absent"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := adapterFile("create", "rest", tt.base, tt.extra) + "    " + control + "\n"
			reg, err := readback.Load("adapters.yaml", strings.NewReader(file),
				httpadapter.Types(httpadapter.WithLookupEnv(env), httpadapter.WithClock(func() time.Time { return testNow })))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := reg.Lookup("any", "api")
			if b.Control == nil {
				t.Fatal("no control on the binding")
			}
			res, err := b.Adapter.Check(context.Background(), b.Control.Receipt)
			cerr := readback.EvaluateControl(b, res, err)
			if tt.pass && cerr != nil {
				t.Fatalf("control failed: %v", cerr)
			}
			if !tt.pass && (cerr == nil || !strings.Contains(cerr.Error(), tt.why)) {
				t.Fatalf("control: %v; want a failure saying %q", cerr, tt.why)
			}
		})
	}
}
