package ledger_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

func newClient(t *testing.T) *ledger.Client {
	t.Helper()
	c, err := ledger.New(pgtest.NewPool(t), "agent:writer-1")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func article(key string) ledger.Intent {
	return ledger.Intent{
		IdempotencyKey: key,
		Operation:      "articles.create",
		Dependency:     "blog-api",
		Method:         "post",
		Target:         "/api/articles",
		Payload:        json.RawMessage(`{"title":"Outcome unknown","body":"...","request_id":"r-1"}`),
	}
}

func TestPlanSameKeyConcurrently(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	const n = 50
	ids := make([]int64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.Plan(ctx, article(ledger.Key("task-1", "step-3", "articles.create")))
			errs[i] = err
			if err == nil {
				ids[i] = r.ID
			}
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("plan %d: %v", i, errs[i])
		}
		if ids[i] != ids[0] {
			t.Fatalf("plan %d got receipt %d, plan 0 got %d: duplicate receipts", i, ids[i], ids[0])
		}
	}
	var count int
	if err := c.Pool().QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&count); err != nil {
		t.Fatal(err)
	}
	if count != 1 {
		t.Fatalf("%d receipts, want 1", count)
	}
}

func TestPlanKeyReusedForAnotherIntent(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	if _, err := c.Plan(ctx, article("k1")); err != nil {
		t.Fatal(err)
	}
	other := article("k1")
	other.Payload = json.RawMessage(`{"title":"Something else"}`)
	if _, err := c.Plan(ctx, other); !errors.Is(err, ledger.ErrKeyConflict) {
		t.Fatalf("got %v, want ErrKeyConflict", err)
	}
}

// PlanAndSubmit submits a new key only: a known key (planned, submitted or
// settled) comes back as it is with ErrKnownKey and nothing recorded, and a
// known key reused for another intent is ErrKeyConflict.
func TestPlanAndSubmitKnownKey(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	events := func(id int64) int {
		t.Helper()
		h, err := c.History(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return len(h)
	}
	sub, err := c.PlanAndSubmit(ctx, article("fresh"))
	if err != nil || sub.State != statemachine.Submitted || sub.Version != 2 || events(sub.ID) != 2 {
		t.Fatalf("new key: %+v, %v; want submitted, version 2, two events", sub, err)
	}
	again, err := c.PlanAndSubmit(ctx, article("fresh"))
	if !errors.Is(err, ledger.ErrKnownKey) || again == nil || again.ID != sub.ID || again.Version != 2 || events(sub.ID) != 2 {
		t.Fatalf("submitted key again: %+v, %v; want receipt %d unchanged with ErrKnownKey", again, err, sub.ID)
	}
	// The same intent planned under another key (opted out of the guard):
	// whether the INSERT is refused by the key's uniqueness (no guard) or
	// by the guard (the intent is unresolved in "fresh"), the known key is
	// returned, still planned, not submitted nor refused as a duplicate.
	in := article("planned")
	in.AllowDuplicate = true
	planned, err := c.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	for _, guarded := range []bool{false, true} {
		in.AllowDuplicate = !guarded
		got, err := c.PlanAndSubmit(ctx, in)
		if !errors.Is(err, ledger.ErrKnownKey) || got == nil || got.ID != planned.ID || got.State != statemachine.Planned {
			t.Fatalf("planned key (guarded %v): %+v, %v; want receipt %d still planned with ErrKnownKey", guarded, got, err, planned.ID)
		}
	}
	other := article("planned")
	other.Payload = json.RawMessage(`{"title":"Something else"}`)
	if _, err := c.PlanAndSubmit(ctx, other); !errors.Is(err, ledger.ErrKeyConflict) {
		t.Fatalf("planned key, other intent: %v, want ErrKeyConflict", err)
	}
	var n int
	if err := c.Pool().QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d receipts (%v), want 2", n, err)
	}
}

func TestDuplicateBlockedThenRetry(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	in := article("task-1:step-1:articles.create")
	in.Drop = []string{"/request_id"}
	first, err := c.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if first, err = c.Submit(ctx, first); err != nil {
		t.Fatal(err)
	}
	if first, err = c.MarkUnknown(ctx, first, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}

	// The model re-plans the same article under a new step, with keys in
	// another order and a new volatile request id: refused while the first
	// outcome is unknown.
	again := article("task-1:step-2:articles.create")
	again.Payload = json.RawMessage(`{"request_id":"r-2","body":"...","title":"Outcome unknown"}`)
	again.Drop = []string{"/request_id"}
	_, err = c.Plan(ctx, again)
	var dup *ledger.DuplicateError
	if !errors.As(err, &dup) || !errors.Is(err, ledger.ErrDuplicateIntent) {
		t.Fatalf("re-plan while outcome_unknown: got %v, want *DuplicateError", err)
	}
	if dup.Existing.ID != first.ID || dup.Existing.State != statemachine.OutcomeUnknown {
		t.Fatalf("DuplicateError carries receipt %d (%s), want %d (outcome_unknown)", dup.Existing.ID, dup.Existing.State, first.ID)
	}

	// Opting out plans it anyway.
	forced := again
	forced.IdempotencyKey = "task-1:step-2b:articles.create"
	forced.AllowDuplicate = true
	if _, err := c.Plan(ctx, forced); err != nil {
		t.Fatalf("AllowDuplicate: %v", err)
	}

	// Retry before the outcome is known is refused.
	if _, err := c.Retry(ctx, first, in); !errors.Is(err, ledger.ErrStateConflict) {
		t.Fatalf("retry of outcome_unknown: got %v, want ErrStateConflict", err)
	}

	// The reconciler proves absence; now a retry is attempt 2, linked.
	rc := c.As("reconciler:r1")
	if first, err = rc.Transition(ctx, ledger.Move{ID: first.ID, From: first.State, To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if first, err = rc.Transition(ctx, ledger.Move{ID: first.ID, From: first.State, To: statemachine.SafeToRetry,
		Detail: ledger.Detail{Evidence: map[string]any{"matches": 0}}}); err != nil {
		t.Fatal(err)
	}
	second, err := c.Retry(ctx, first, in)
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	if second.Attempt != 2 || second.RetryOf != first.ID || second.State != statemachine.Planned ||
		second.Fingerprint != first.Fingerprint || second.IdempotencyKey != first.IdempotencyKey+"#2" {
		t.Fatalf("retry = %+v, want attempt 2 linked to %d", second, first.ID)
	}
	// The marker the agent put in the request (the first attempt's key) is
	// the retry's logical key: readback finds the retry's effect by it.
	if got := ledger.LogicalKey(second.IdempotencyKey); got != first.IdempotencyKey {
		t.Fatalf("LogicalKey(%q) = %q, want %q", second.IdempotencyKey, got, first.IdempotencyKey)
	}
	// Retrying the same attempt twice gives the same receipt back, not a third.
	again2, err := c.Retry(ctx, first, in)
	if err != nil || again2.ID != second.ID {
		t.Fatalf("second Retry = %v, %v; want receipt %d", again2, err, second.ID)
	}
}

func TestConcurrentWritersOneWins(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	for i := range 20 {
		in := article(ledger.Key("t", string(rune('a'+i)), "op"))
		in.AllowDuplicate = true
		r, err := c.Plan(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		if r, err = c.Submit(ctx, r); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		results := make([]error, 2)
		wg.Add(2)
		go func() { defer wg.Done(); _, results[0] = c.Succeed(ctx, r, "ext-1", ledger.Detail{}) }()
		go func() {
			defer wg.Done()
			_, results[1] = c.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}})
		}()
		wg.Wait()
		wins := 0
		for _, err := range results {
			var ce *ledger.ConflictError
			switch {
			case err == nil:
				wins++
			case errors.As(err, &ce) && ce.Expected == statemachine.Submitted:
			default:
				t.Fatalf("loser got %v, want *ConflictError", err)
			}
		}
		if wins != 1 {
			t.Fatalf("%d writers won, want exactly 1 (%v)", wins, results)
		}
		h, err := c.History(ctx, r.ID)
		if err != nil || len(h) != 3 {
			t.Fatalf("history has %d events (%v), want 3", len(h), err)
		}
	}
}

func TestTransitionErrors(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	r, err := c.Plan(ctx, article("k"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transition(ctx, ledger.Move{ID: r.ID, From: r.State, To: statemachine.Succeeded}); !errors.Is(err, statemachine.ErrIllegalTransition) {
		t.Errorf("planned -> succeeded: got %v, want ErrIllegalTransition", err)
	}
	if _, err := c.Transition(ctx, ledger.Move{ID: 999999, From: statemachine.Planned, To: statemachine.Submitted}); !errors.Is(err, ledger.ErrNotFound) {
		t.Errorf("unknown receipt: got %v, want ErrNotFound", err)
	}
	if _, err := c.Get(ctx, 999999); !errors.Is(err, ledger.ErrNotFound) {
		t.Errorf("Get unknown: got %v, want ErrNotFound", err)
	}
	if _, err := c.History(ctx, 999999); !errors.Is(err, ledger.ErrNotFound) {
		t.Errorf("History unknown: got %v, want ErrNotFound", err)
	}
	bad := article("k2")
	bad.Payload = json.RawMessage(`{"amount": 9007199254740993}`)
	if _, err := c.Plan(ctx, bad); !errors.Is(err, ledger.ErrInvalidIntent) {
		t.Errorf("lossy number: got %v, want ErrInvalidIntent", err)
	}
	if _, err := ledger.New(c.Pool(), "bob"); !errors.Is(err, statemachine.ErrInvalidActor) {
		t.Errorf("bad actor: got %v, want ErrInvalidActor", err)
	}
}

// TestHistory walks the example receipt of the 002 article: planned,
// submitted, outcome_unknown (504), reconciling, succeeded with evidence.
func TestHistory(t *testing.T) {
	c := newClient(t)
	ctx := context.Background()
	r, err := c.Plan(ctx, article("20260818T190000Z-a1b2c3d4e5"))
	if err != nil {
		t.Fatal(err)
	}
	steps := []func() (*ledger.Receipt, error){
		func() (*ledger.Receipt, error) { return c.Submit(ctx, r) },
		func() (*ledger.Receipt, error) {
			return c.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout", Message: "Gateway Timeout 504", HTTPStatus: 504}})
		},
		func() (*ledger.Receipt, error) {
			return c.As("reconciler:r1").Transition(ctx, ledger.Move{ID: r.ID, From: r.State, To: statemachine.Reconciling})
		},
		func() (*ledger.Receipt, error) {
			return c.As("reconciler:r1").Transition(ctx, ledger.Move{ID: r.ID, From: r.State, To: statemachine.Succeeded,
				ExternalID: "4407310", Detail: ledger.Detail{Evidence: map[string]any{"query": "/api/articles", "matched": "fingerprint"}}})
		},
	}
	for _, step := range steps {
		if r, err = step(); err != nil {
			t.Fatal(err)
		}
	}
	h, err := c.History(ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		from, to statemachine.State
		actor    statemachine.Actor
	}{
		{"", "planned", "agent:writer-1"},
		{"planned", "submitted", "agent:writer-1"},
		{"submitted", "outcome_unknown", "agent:writer-1"},
		{"outcome_unknown", "reconciling", "reconciler:r1"},
		{"reconciling", "succeeded", "reconciler:r1"},
	}
	if len(h) != len(want) {
		t.Fatalf("history has %d events, want %d", len(h), len(want))
	}
	for i, w := range want {
		e := h[i]
		if e.Seq != i+1 || e.From != w.from || e.To != w.to || e.Actor != w.actor {
			t.Errorf("event %d = %d %s -> %s by %s, want %s -> %s by %s", i, e.Seq, e.From, e.To, e.Actor, w.from, w.to, w.actor)
		}
		if i > 0 && e.At.Before(h[i-1].At) {
			t.Errorf("event %d at %v is before event %d", i, e.At, i-1)
		}
	}
	var callErr ledger.CallError
	if err := json.Unmarshal(h[2].Error, &callErr); err != nil || callErr.Code != "timeout" || callErr.HTTPStatus != 504 {
		t.Errorf("outcome_unknown event error = %s, want the 504 timeout", h[2].Error)
	}
	if h[4].ExternalID != "4407310" || !json.Valid(h[4].Evidence) || len(h[4].Evidence) < 10 {
		t.Errorf("succeeded event = ext %q evidence %s", h[4].ExternalID, h[4].Evidence)
	}
	if len(h[3].Error) != 0 || len(h[3].Evidence) != 0 {
		t.Errorf("reconciling event inherited detail: error %s evidence %s", h[3].Error, h[3].Evidence)
	}
	if r.ExternalID != "4407310" || r.Version != 5 {
		t.Errorf("receipt = %+v", r)
	}
}

func TestKeyEscapesSeparators(t *testing.T) {
	// Triples that would collide if ':', '%' or '#' were copied as is.
	triples := [][3]string{
		{"a", "b", "c"},
		{"a:b", "c", "d"},
		{"a", "b:c", "d"},
		{"a#2", "b", "c"},
		{"a", "b", "c#2"},
		{"a", "b", "c%23"},
		{"a", "b", "c%2"},
		{"a%3Ab", "c", "d"},
		{"a", "b#", "#c"},
		{"a", "b", "c#"},
		{"", "", ""},
		{"%", "#", ":"},
	}
	seen := map[string][3]string{}
	for _, p := range triples {
		k := ledger.Key(p[0], p[1], p[2])
		if prev, dup := seen[k]; dup {
			t.Errorf("Key%q and Key%q are both %q", prev, p, k)
		}
		seen[k] = p
		if strings.Contains(k, "#") {
			t.Errorf("Key%q = %q holds a '#', the attempt separator", p, k)
		}
		if got := ledger.LogicalKey(k); got != k {
			t.Errorf("LogicalKey(Key%q) = %q, want the key unchanged %q", p, got, k)
		}
		if got := ledger.LogicalKey(k + "#2"); got != k {
			t.Errorf("LogicalKey(%q) = %q, want %q", k+"#2", got, k)
		}
	}
	if k, want := ledger.Key("t#1", "s:2", "op%"), "t%231:s%3A2:op%25"; k != want {
		t.Errorf("Key = %q, want %q", k, want)
	}
}

func TestLogicalKey(t *testing.T) {
	for in, want := range map[string]string{
		"a:b:c#3":  "a:b:c",
		"a:b:c#2":  "a:b:c",
		"a:b:c#12": "a:b:c",
		"a:b:c":    "a:b:c",
		"":         "",
	} {
		if got := ledger.LogicalKey(in); got != want {
			t.Errorf("LogicalKey(%q) = %q, want %q", in, got, want)
		}
	}
}
