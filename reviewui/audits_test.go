package reviewui

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// settledAbsent plans a receipt, loses its answer, claims it and settles
// it safe_to_retry as a reconciler would after an authoritative absence; it
// returns its id.
func (e *ledgerEnv) settledAbsent(t *testing.T, op, dep string) int64 {
	t.Helper()
	ctx := context.Background()
	e.n++
	r, err := e.agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(t.Name(), fmt.Sprint(e.n), op),
		Operation: op, Dependency: dep, Method: "POST", Target: "/v1/" + dep, Payload: json.RawMessage(`{"amount":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = e.agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = e.agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	rc, err := ledger.New(e.owner, "reconciler:r1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown,
		To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.Reconciling,
		To: statemachine.SafeToRetry, Detail: ledger.Detail{Evidence: map[string]any{"matches": 0}}}); err != nil {
		t.Fatal(err)
	}
	return r.ID
}

// audit records an audit of receipt id's settled absence and, when it is
// contradicted, the window alarm it raises, as the reconciler's audit
// writes them.
func (e *ledgerEnv) audit(t *testing.T, id int64, verdict string, matches int, evidence any) {
	t.Helper()
	ctx := context.Background()
	ev, err := json.Marshal(evidence)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.owner.Exec(ctx, `INSERT INTO reconciler.verdict_audits
		(receipt_id, dependency, operation, adapter, settled_state, settled_at, at, instance, verdict, matches, evidence)
		SELECT id, dependency, operation, 'payments-http', state, updated_at, now(), 'r1', $2, $3, $4
		FROM reconciler.receipts WHERE id = $1`, id, verdict, matches, ev); err != nil {
		t.Fatal(err)
	}
	if verdict != "contradicted" {
		return
	}
	if _, err := e.owner.Exec(ctx, `INSERT INTO reconciler.window_alarms
		(at, instance, dependency, adapter, operation, receipt_id, kind, declared, observed, effective_before, effective_after)
		SELECT now(), 'r1', dependency, 'payments-http', operation, id, 'false_absence',
		       '30 seconds', '5 minutes', '30 seconds', '5 minutes'
		FROM reconciler.receipts WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
}

// A settled absence a later audit contradicted is counted on the summary
// bar, listed by the queue under false_absence, and its page says the
// verdict was wrong while the receipt stays terminal, with the audit's
// evidence escaped like all stored text.
func TestContradictedVerdictShown(t *testing.T) {
	e := newLedger(t)
	wrong := e.settledAbsent(t, "charges.create", "payments")
	right := e.settledAbsent(t, "charges.create", "payments")
	e.audit(t, wrong, "contradicted", 1, map[string]any{
		"found": "<script>alert(1)</script>", "external_ids": []string{`ch_1"><img src=x onerror=alert(2)>`}})
	e.audit(t, right, "confirmed", 0, map[string]any{"matches": 0})
	e.held(t, "refunds.create", "payments", "blind", nil, `{"amount":2}`)

	ts := serve(t, e.login(t, "reconciler_reviewer"))
	c := ts.Client()
	alice := map[string][]string{"X-Forwarded-User": {"alice"}}

	code, queue := do(t, c, "GET", ts.URL+"/", nil, alice)
	if code != 200 {
		t.Fatalf("queue: %d\n%s", code, queue)
	}
	for _, want := range []string{`<span class="n">1</span> false absences`, `<span class="n">1</span> window alarms`} {
		if !strings.Contains(queue, want) {
			t.Errorf("the summary bar lacks %q:\n%s", want, queue)
		}
	}
	for name, q := range map[string]struct {
		query       string
		wrong, held bool
	}{
		"unfiltered":           {"", true, true},
		"reason false_absence": {"?reason=false_absence", true, false},
		"reason blind":         {"?reason=blind", false, true},
		"other dependency":     {"?dependency=mail", false, false},
	} {
		code, body := do(t, c, "GET", ts.URL+"/"+q.query, nil, alice)
		if code != 200 {
			t.Fatalf("%s: %d\n%s", name, code, body)
		}
		if got := strings.Contains(body, fmt.Sprintf(`href="/receipts/%d"`, wrong)); got != q.wrong {
			t.Errorf("%s: contradicted receipt %d listed %v, want %v", name, wrong, got, q.wrong)
		}
		if strings.Contains(body, fmt.Sprintf(`href="/receipts/%d"`, right)) {
			t.Errorf("%s: a confirmed verdict is listed", name)
		}
		if got := strings.Contains(body, `id="queue"`); got != q.held {
			t.Errorf("%s: held table shown %v, want %v", name, got, q.held)
		}
	}

	code, page := do(t, c, "GET", fmt.Sprintf("%s/receipts/%d", ts.URL, wrong), nil, alice)
	if code != 200 {
		t.Fatalf("receipt page: %d\n%s", code, page)
	}
	for _, want := range []string{
		"a later read found the effect: this safe_to_retry verdict was wrong",
		`id="state">safe_to_retry<`,
		`class="audit verdict-contradicted"`,
		"<strong>contradicted</strong> · 1 match(es)",
		"&lt;script&gt;alert(1)&lt;/script&gt;",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the receipt page lacks %q:\n%s", want, page)
		}
	}
	for _, bad := range []string{"<script>alert", "<img src=x", `id="decide"`} {
		if strings.Contains(page, bad) {
			t.Errorf("the receipt page has %q", bad)
		}
	}
	if _, page := do(t, c, "GET", fmt.Sprintf("%s/receipts/%d", ts.URL, right), nil, alice); strings.Contains(page, `id="contradicted"`) ||
		!strings.Contains(page, "<strong>confirmed</strong>") {
		t.Errorf("a confirmed audit's page:\n%s", page)
	}
}
