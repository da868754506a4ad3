package rolestest

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

func loginName(t *testing.T, p *pgxpool.Pool) string {
	t.Helper()
	var name string
	if err := p.QueryRow(context.Background(), `SELECT current_user`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// TestOnlySubmittingAgentLoginSettlesItsCall: an agent's login moves a
// receipt out of submitted only if it is the login that submitted it
// (receipts.submitted_by); the reconciler's login (the orphan sweep) may.
//
// Issue 7, adversarial review: the database let any reconciler_agent login
// make the agent's moves on ANY receipt, whoever submitted it, with any
// recorded error. Sequence (SPEC §5a: "Agents record their own calls"):
//
//  1. agent A (its own login) submits receipt R and is writing the request;
//  2. agent B (another login in reconciler_agent, another actor) moves R
//     submitted -> rejected with {"error": {"code": "not_sent",
//     "retryable": true}}: it was accepted, although B never made the call;
//  3. B retries R (attempt 2, accepted since R is a retryable rejection)
//     and submits it: the effect is sent twice, with no readback and no
//     window. The duplicate guard does not help: R is no longer
//     unresolved.
//
// Now step 2 is refused (RL001, naming A's login), whatever actor B writes,
// by UPDATE or through reconciler.transition, for every move out of
// submitted; A's own moves and the worker's sweep still work.
func TestOnlySubmittingAgentLoginSettlesItsCall(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	a, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	other := loginPool(t, e.owner, e.url, "reconciler_agent")
	b, err := ledger.New(other, "agent:other")
	if err != nil {
		t.Fatal(err)
	}
	aLogin := loginName(t, e.agent)
	in := intent("adv:in-flight", "blog-api")
	r, err := a.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = a.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	// 2. Agent B records A's in-flight call as "not sent": refused.
	rej, err := b.Reject(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: ledger.CodeNotSent, Retryable: true}})
	if !errors.Is(err, statemachine.ErrIllegalTransition) || !strings.Contains(err.Error(), aLogin) {
		t.Fatalf("agent:other rejected agent:billing's in-flight receipt %d as not_sent: got %+v, %v; "+
			"want ErrIllegalTransition naming login %s", r.ID, rej, err, aLogin)
	}
	// 3. ... so there is nothing to retry.
	if r2, err := b.Retry(ctx, r, in); err == nil {
		t.Fatalf("retry of the in-flight receipt %d planned: %+v", r.ID, r2)
	}

	// Every move out of submitted, by UPDATE and by reconciler.transition,
	// with B's actor or A's forged: RL001, and nothing changes.
	const (
		update   = `UPDATE reconciler.receipts SET state = $2, state_actor = $3, state_detail = $4 WHERE id = $1`
		function = `SELECT reconciler.transition($1, $2, $3, $4)`
	)
	notSent := `{"error":{"code":"not_sent","retryable":true}}`
	for _, to := range []string{"succeeded", "rejected", "outcome_unknown"} {
		for via, q := range map[string]string{"update": update, "transition": function} {
			for _, actor := range []string{"agent:other", agentID} {
				before := history(t, e.owner, r.ID)
				_, err := other.Exec(ctx, q, r.ID, to, actor, notSent)
				wantCode(t, "agent:other's login: submitted -> "+to+" as "+actor+" via "+via, err, illegal)
				if err != nil && !strings.Contains(err.Error(), aLogin) {
					t.Errorf("refusal does not name the submitting login %s: %v", aLogin, err)
				}
				if after := history(t, e.owner, r.ID); len(after) != len(before) {
					t.Errorf("refused move changed the history of receipt %d", r.ID)
				}
			}
		}
	}
	// A settles its own call (one comparison: its login is submitted_by).
	if _, err := a.Succeed(ctx, r, "thing-1", ledger.Detail{}); err != nil {
		t.Fatalf("agent:billing settles its own call: %v", err)
	}
	// The worker's orphan sweep moves a receipt it did not submit.
	swept, err := a.Plan(ctx, intent("adv:swept", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if swept, err = a.Submit(ctx, swept); err != nil {
		t.Fatal(err)
	}
	if _, err := e.worker.Exec(ctx, `UPDATE reconciler.receipts SET state = 'outcome_unknown',
		state_actor = 'reconciler:sweep' WHERE id = $1 AND state = 'submitted'`, swept.ID); err != nil {
		t.Errorf("worker: orphan sweep of agent:billing's receipt: %v", err)
	}
}

// TestSubmittingLoginOwnsTheCall: a planned receipt has never been sent (an
// agent submits before the first byte leaves), and plan is idempotent per
// key, so any agent login holding the key may submit it: a restarted
// agent's replacement, under another login, re-plans the step and gets the
// same planned receipt, and must not be wedged. The submission is a
// compare-and-set on state = planned, so exactly one login submits: that
// login is the call's owner from then on, the only agent login that sends
// the request, settles it, or records its late outcome; the planner's
// Submit finds the receipt already submitted and sends nothing. So the
// request goes out at most once, whoever planned it.
//
// Issue 7, adversarial review: may agent B submit agent A's planned
// receipt? Yes (decided above); then B, not A, is the submitter.
func TestSubmittingLoginOwnsTheCall(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	a, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	other := loginPool(t, e.owner, e.url, "reconciler_agent")
	b, err := ledger.New(other, "agent:other")
	if err != nil {
		t.Fatal(err)
	}
	bLogin := loginName(t, other)
	planned, err := a.Plan(ctx, intent("adv:planned", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	sub, err := b.Submit(ctx, planned)
	if err != nil {
		t.Fatalf("agent:other submits agent:billing's planned receipt: %v", err)
	}
	var by string
	if err := e.owner.QueryRow(ctx, `SELECT submitted_by FROM reconciler.receipts WHERE id = $1`, sub.ID).Scan(&by); err != nil || by != bLogin {
		t.Fatalf("submitted_by = %q (%v), want %q", by, err, bLogin)
	}
	// A's own Submit finds it submitted: A sends nothing.
	if _, err := a.Submit(ctx, planned); !errors.Is(err, ledger.ErrStateConflict) {
		t.Errorf("agent:billing submits the receipt agent:other submitted: got %v, want ErrStateConflict", err)
	}
	// A may not settle B's call; B may.
	if _, err := a.Reject(ctx, sub, ledger.Detail{Error: &ledger.CallError{Code: ledger.CodeNotSent, Retryable: true}}); !errors.Is(err, statemachine.ErrIllegalTransition) {
		t.Errorf("agent:billing rejects agent:other's call: got %v, want ErrIllegalTransition", err)
	}
	if _, err := b.Succeed(ctx, sub, "thing-2", ledger.Detail{}); err != nil {
		t.Errorf("agent:other settles the call it submitted: %v", err)
	}
}

// TestLateOutcomeOnlyBySubmittingLogin: reconciler.record_late_outcome
// (SECURITY DEFINER) takes a late outcome from an agent-only login only if
// it submitted the receipt, whatever actor it writes.
//
// Issue 7, adversarial review: another agent's login, writing the
// submitter's actor, could record a late success with a made-up external
// id for a receipt the orphan sweep moved, and the reconciler settles a
// receipt with a late success as succeeded with that id.
func TestLateOutcomeOnlyBySubmittingLogin(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	a, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	other := loginPool(t, e.owner, e.url, "reconciler_agent")
	r, err := a.Plan(ctx, intent("adv:late", "blog-api"))
	if err != nil {
		t.Fatal(err)
	}
	if r, err = a.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if _, err := e.worker.Exec(ctx, `UPDATE reconciler.receipts SET state = 'outcome_unknown',
		state_actor = 'reconciler:sweep' WHERE id = $1`, r.ID); err != nil {
		t.Fatal(err)
	}
	const rec = `SELECT reconciler.record_late_outcome($1, $2, $3, 201, 'forged-id')`
	for _, outcome := range []string{"succeeded", "rejected", "outcome_unknown"} {
		_, err := other.Exec(ctx, rec, r.ID, agentID, outcome)
		wantCode(t, "agent:other's login records a late "+outcome+" as "+agentID, err, "RL002")
	}
	var n int
	if err := e.owner.QueryRow(ctx, `SELECT count(*) FROM reconciler.late_outcomes WHERE receipt_id = $1`, r.ID).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d late outcomes after refusals (%v), want 0", n, err)
	}
	if _, err := e.agent.Exec(ctx, rec, r.ID, agentID, "succeeded"); err != nil {
		t.Errorf("the submitting login records its late outcome: %v", err)
	}
}
