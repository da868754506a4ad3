package rolestest

import (
	"context"
	"testing"

	"github.com/receiptledger/reconciler/ledger"
)

// BREAK (who may settle, SPEC §5a: "Agents record their own calls"): the
// database lets any reconciler_agent login make the agent's moves on ANY
// receipt, whoever submitted it, with any recorded error. Sequence:
//
//  1. agent A (its own login) submits receipt R and is writing the request;
//  2. agent B (another login in reconciler_agent, another actor) moves R
//     submitted -> rejected with {"error": {"code": "not_sent",
//     "retryable": true}}: accepted, although B never made the call;
//  3. B retries R (attempt 2, accepted since R is a retryable rejection)
//     and submits it: the effect is sent twice, with no readback and no
//     window. The duplicate guard does not help: R is no longer
//     unresolved.
//
// This is path 8 (an agent settling without readback) through the one
// door left open. Fix (migrations, receipts_before_update): for an
// agent-only login, a move out of submitted must be made by the actor
// (and the database login: record session_user in the submit event) that
// made planned -> submitted, as reconciler.record_late_outcome already
// requires of late outcomes.
func TestAdversarialAgentSettlesAnotherAgentsInFlightCall(t *testing.T) {
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
	in := intent("adv:in-flight", "blog-api")
	r, err := a.Plan(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if r, err = a.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	// 2. Agent B records A's in-flight call as "not sent".
	rej, err := b.Reject(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: ledger.CodeNotSent, Retryable: true}})
	if err != nil {
		t.Logf("refused, as it should be: %v", err)
		return
	}
	// 3. ... and sends it again.
	r2, err := b.Retry(ctx, rej, in)
	if err != nil {
		t.Logf("retry refused: %v", err)
		return
	}
	if r2, err = b.Submit(ctx, r2); err == nil {
		t.Fatalf("agent:other rejected agent:billing's in-flight receipt %d as not_sent and submitted its retry %d (%s): "+
			"the same call goes out twice with no readback", r.ID, r2.ID, r2.State)
	}
}
