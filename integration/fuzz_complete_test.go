package integration

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// Issue 8, acceptance 2: the batched settle over hostile text from an API
// (check errors, adapter evidence bytes, external ids, queries, matched
// ids), against real Postgres: Complete never returns a database error, and
// no row stays leased. A healthy row in the same batch always settles.
// Run: go test -run '^$' -fuzz FuzzComplete -fuzztime 60s ./integration
func FuzzComplete(f *testing.F) {
	f.Add("busy\x00", []byte(`{"note":"x\u0000"}`), "art_1\x00", "q=\xff", byte(0))
	f.Add("ok", []byte(`{"raw":"\ud800"}`), "id", "q", byte(1))
	f.Add("\xe2\x82", []byte("not json\x00"), string(make([]byte, 300)), "\u202e", byte(2))
	f.Add("", []byte(`{"n":1e999999}`), "\x1b[2J", "", byte(3))
	f.Add("e", []byte(`[1,2,"\u0000"]`), "x", "y", byte(4))
	db := pgtest.NewPool(f)
	store, err := reconcile.NewStore(db, "fuzz")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, errText string, evidence []byte, extID, query string, mode byte) {
		ctx := context.Background()
		ids := seed(t, db, 2, "things.create", "fake-api", "outcome_unknown")
		now := time.Now()
		claimed, err := store.ClaimAt(ctx, now.Add(time.Second), now, 10, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if len(claimed) != 2 {
			t.Fatalf("claimed %d rows, want the 2 seeded", len(claimed))
		}
		var outs []reconcile.Outcome
		for i, c := range claimed {
			check := &reconcile.CheckRecord{CheckNo: c.Checks + 1, At: now, Adapter: "fuzz", Dependency: c.Dependency,
				Verdict: "present", Authoritative: true, Matches: 1}
			o := reconcile.Outcome{ID: c.ID, Lease: c.Lease, Check: check, Adapter: "fuzz", Dependency: c.Dependency}
			ev := &reconcile.Evidence{Operation: c.Operation, Dependency: c.Dependency, Checks: 1}
			if i == 0 { // hostile
				ev.Query, ev.Matched = query, []string{extID, errText}
				if json.Valid(evidence) {
					ev.AdapterEvidence = evidence
				}
				check.Evidence = evidence
				switch mode % 4 {
				case 0:
					o.To, o.ExternalID = statemachine.Succeeded, extID
					o.Duplicates = []string{extID, errText}
				case 1:
					o.To = statemachine.ManualReview
					check.Verdict, check.ErrorClass, check.Error = "error", "permanent", errText
					o.Detail.Error = &reconcile.DetailError{Code: errText, Message: errText}
				case 2:
					o.To, o.NextCheck = statemachine.Reconciling, now.Add(time.Hour)
					check.Verdict, check.ErrorClass, check.Error = "error", "transient", errText
				case 3:
					o.To = statemachine.SafeToRetry
				}
			} else {
				o.To, o.ExternalID = statemachine.Succeeded, "healthy"
			}
			if o.To != statemachine.Reconciling {
				o.Detail.Reason, o.Detail.Evidence = reconcile.ReasonPresent, ev
			}
			outs = append(outs, o)
		}
		applied, err := store.Complete(ctx, outs)
		if err != nil {
			t.Fatalf("Complete: %v", err)
		}
		if len(applied) != 2 {
			t.Fatalf("applied %v, want both rows", applied)
		}
		for _, id := range ids {
			r := receipt(t, db, id)
			if r.LeaseOwner != "" || r.Checks != 1 {
				t.Fatalf("receipt %d = %+v: still leased or its check not counted", id, r)
			}
		}
		if r := receipt(t, db, claimed[1].ID); r.State != "succeeded" {
			t.Fatalf("healthy receipt = %+v", r)
		}
	})
}
