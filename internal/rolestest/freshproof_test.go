package rolestest

import (
	"context"
	"errors"
	"testing"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Issue 19, item 2, under the roles: an agent's login may send a receipt it
// submitted back to the reconciler for a fresh proof (safe_to_retry ->
// outcome_unknown), another agent's login may not (RL001), and the worker
// settles it again through the trigger that checks the window.
func TestFreshProofUnderRoles(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	owner, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	other, err := ledger.New(loginPool(t, e.owner, e.url, "reconciler_agent"), agentID)
	if err != nil {
		t.Fatal(err)
	}
	r := unknown(t, owner, "fresh:1", "blog-api")
	const update = `UPDATE reconciler.receipts SET state = $2, state_actor = 'reconciler:w',
		state_detail = '{"evidence": {"max_request_lifetime_s": 60, "consistency_window_s": 30}}' WHERE id = $1`
	for _, to := range []string{"reconciling", "safe_to_retry"} {
		if _, err := e.worker.Exec(ctx, update, r.ID, to); err != nil {
			t.Fatalf("worker: -> %s: %v", to, err)
		}
	}
	if r, err = owner.Get(ctx, r.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := other.RequestFreshProof(ctx, r, "not mine"); !errors.Is(err, statemachine.ErrIllegalTransition) {
		t.Errorf("another agent's login asks for a fresh proof: %v, want ErrIllegalTransition", err)
	}
	got, err := owner.RequestFreshProof(ctx, r, "retention passed")
	if err != nil || got.State != statemachine.OutcomeUnknown {
		t.Fatalf("the submitting login asks for a fresh proof: %+v, %v; want outcome_unknown", got, err)
	}
	for _, to := range []string{"reconciling", "safe_to_retry"} {
		if _, err := e.worker.Exec(ctx, update, r.ID, to); err != nil {
			t.Fatalf("worker, settling again: -> %s: %v", to, err)
		}
	}
}
