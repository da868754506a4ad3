package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// bodyAdapter answers as an HTTP adapter that quotes the API's answer: a
// 5xx is a transient error carrying the body's first 200 bytes (which may
// split a character or hold a NUL), a 200 is present with the ids and the
// evidence the body gives, unchecked.
type bodyAdapter struct{ url string }

func (a bodyAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.url+"?key="+r.IdempotencyKey, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 500 {
		return readback.Result{}, readback.TransientError(fmt.Errorf("status %d: %s", resp.StatusCode, body[:min(len(body), 200)]), 0)
	}
	var b struct {
		IDs      []string
		Evidence map[string]any
		Query    string
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	return readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: b.IDs,
		Evidence: b.Evidence, Query: b.Query}, nil
}

// Issue 8, item 1: one receipt on an API whose 503 body is "busy\x00" no
// longer stops the receipts of an unrelated healthy API settled in the same
// batch: the healthy ones settle, the bad one's check is recorded (its
// error sanitized) and its check_count grows until a bound settles it.
// Hostile 200 answers (a NUL in the id, \u0000 and a lone surrogate in the
// evidence, invalid UTF-8 in the query) settle too, marked sanitized, and
// an id that had to change is not stored as the external id.
func TestHostileTextDoesNotWedgeBatch(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte("busy\x00" + strings.Repeat("é", 100)))
	}))
	t.Cleanup(busy.Close)
	hostile := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"ids":["art_1\u0000"],"query":"q=\u0000`+"\xff"+`",`+
			`"evidence":{"note":"x\u0000","raw":"\ud800","n":1}}`)
	}))
	t.Cleanup(hostile.Close)

	api := newFakeAPI(t, clk.Now, 0)
	healthy := seed(t, db, 3, "things.create", "fake-api", "outcome_unknown")
	for i, id := range healthy {
		api.Create(idempotencyKey(t, db, id), fmt.Sprintf("thing-%d", i))
	}
	bad := seed(t, db, 1, "busy.create", "busy-api", "outcome_unknown")[0]
	odd := seed(t, db, 1, "odd.create", "odd-api", "outcome_unknown")[0]
	p := shortPolicy()
	p.MaxChecks = 4
	reg := registry(t, api, p,
		readback.Binding{Name: "busy-search", Kind: readback.Create, Dependency: "busy-api",
			Adapter: bodyAdapter{url: busy.URL}, Policy: p},
		readback.Binding{Name: "odd-search", Kind: readback.Create, Dependency: "odd-api",
			Adapter: bodyAdapter{url: hostile.URL}, Policy: p})
	pool := newPool(t, db, reconcile.Config{Registry: reg, Now: clk.Now})

	clk.Advance(time.Second)
	if _, err := pool.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range healthy {
		if got := receipt(t, db, id); got.State != "succeeded" {
			t.Fatalf("healthy receipt %d = %+v, want succeeded beside a hostile one", id, got)
		}
	}
	got := receipt(t, db, bad)
	if got.State != "reconciling" || got.LeaseOwner != "" || got.Checks != 1 {
		t.Fatalf("busy receipt = %+v, want released with one check counted", got)
	}
	var errText string
	if err := db.QueryRow(ctx, `SELECT error FROM reconciler.readback_checks WHERE receipt_id = $1`, bad).Scan(&errText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(errText, "status 503: busy\uFFFDé") || !strings.HasSuffix(errText, "\uFFFD") || !utf8.ValidString(errText) {
		t.Fatalf("recorded error = %q", errText)
	}

	o := receipt(t, db, odd)
	if o.State != "succeeded" || o.ExternalID != "" {
		t.Fatalf("hostile 200 = %+v, want succeeded without the altered id", o)
	}
	ev := settlements(t, db, odd)[0]["evidence"].(map[string]any)
	if ev["sanitized"] != true || ev["untrusted_external_id"] == nil {
		t.Fatalf("evidence = %v, want sanitized with the untrusted id described", ev)
	}
	if ae := ev["adapter_evidence"].(map[string]any); ae["sanitized"] != true || ae["note"] != "x\uFFFD" {
		t.Fatalf("adapter evidence = %v", ae)
	}

	// The busy receipt's checks keep counting until max_checks settles it.
	for i := 0; i < 40 && receipt(t, db, bad).State == "reconciling"; i++ {
		clk.Advance(10 * time.Second)
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := receipt(t, db, bad); got.State != string(statemachine.ManualReview) || got.Checks != 4 {
		t.Fatalf("busy receipt after its bound = %+v, want manual_review after 4 checks", got)
	}
}

// Issue 8, item 1: a batch the database refuses for one row's sake is split:
// the other rows are written, and the refused row is released with a check
// error recorded (check_count grows), never left leased.
func TestCompleteIsolatesRefusedRow(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	ids := seed(t, db, 5, "things.create", "fake-api", "outcome_unknown")
	store, err := reconcile.NewStore(db, "split")
	if err != nil {
		t.Fatal(err)
	}
	claimed, err := store.Claim(ctx, clk.Now().Add(time.Second), 10, time.Minute)
	if err != nil || len(claimed) != 5 {
		t.Fatalf("claim = %d, %v", len(claimed), err)
	}
	now := clk.Now()
	var outs []reconcile.Outcome
	for i, c := range claimed {
		o := reconcile.Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.Succeeded, ExternalID: fmt.Sprintf("x-%d", i),
			Detail:     reconcile.Detail{Reason: reconcile.ReasonPresent, Evidence: &reconcile.Evidence{Operation: c.Operation, Dependency: c.Dependency, Checks: 1}},
			Check:      &reconcile.CheckRecord{CheckNo: 1, At: now, Adapter: "a", Dependency: c.Dependency, Verdict: "present", Authoritative: true, Matches: 1},
			Adapter:    "a",
			Dependency: c.Dependency}
		if c.ID == ids[2] {
			// The trigger refuses reconciling -> rejected (RL001) even
			// minimally: the row must be released with a check error.
			o.To = statemachine.Rejected
		}
		outs = append(outs, o)
	}
	applied, err := store.Complete(ctx, outs)
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != 5 {
		t.Fatalf("applied = %v, want all 5 (4 settled, 1 released)", applied)
	}
	for _, id := range ids {
		got := receipt(t, db, id)
		want := "succeeded"
		if id == ids[2] {
			want = "reconciling"
		}
		if got.State != want || got.LeaseOwner != "" || got.Checks != 1 {
			t.Fatalf("receipt %d = %+v, want %s, unleased, one check", id, got, want)
		}
	}
	var e string
	if err := db.QueryRow(ctx, `SELECT error FROM reconciler.readback_checks WHERE receipt_id = $1`, ids[2]).Scan(&e); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e, "refused by the database") {
		t.Fatalf("check error = %q", e)
	}
}
