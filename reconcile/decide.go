package reconcile

import (
	"encoding/json"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// Reasons recorded with settlements (Detail.Reason) and used as the
// `reason` label of the settlement metric: a closed set.
const (
	ReasonPresent           = "present"
	ReasonPresentDuplicates = "present_duplicates"
	ReasonDeleted           = "deleted"
	ReasonAbsentAfterWindow = "absent_after_window"
	ReasonPresentAfterDelay = "still_present_after_window"
	ReasonBlind             = "blind"
	ReasonNoAdapter         = "no_adapter"
	ReasonDiverged          = "diverged"
	ReasonReadbackError     = "readback_error"
	ReasonBoundReached      = "bound_reached"
	ReasonInvalidAnswer     = "invalid_adapter_answer"
)

// Evidence is what a settlement rests on: what was queried, what matched,
// how many checks over how long, and which guarantee made absence safe.
type Evidence struct {
	Adapter            string             `json:"adapter,omitempty"`
	AdapterType        string             `json:"adapter_type,omitempty"`
	Kind               readback.Kind      `json:"kind,omitempty"`
	Operation          string             `json:"operation"`
	Dependency         string             `json:"dependency"`
	Query              string             `json:"query,omitempty"`
	Verdict            string             `json:"verdict,omitempty"`
	Authoritative      bool               `json:"authoritative,omitempty"`
	Matched            []string           `json:"matched,omitempty"`
	Checks             int                `json:"checks"`
	SinceSubmissionSec float64            `json:"since_submission_s"`
	ConsistencyWindow  string             `json:"consistency_window,omitempty"`
	MaxRequestLifetime string             `json:"max_request_lifetime,omitempty"`
	Guarantee          readback.Guarantee `json:"guarantee,omitempty"`
	AbsenceSafeAt      *time.Time         `json:"absence_safe_at,omitempty"`
	// ReuseKeyBefore is set when absence relied on the API's native
	// idempotency keys: the retry must reuse the original key before then.
	ReuseKeyBefore *time.Time `json:"reuse_idempotency_key_before,omitempty"`
	// Bound names the bound that was hit: max_checks or deadline.
	Bound           string          `json:"bound,omitempty"`
	AdapterEvidence json.RawMessage `json:"adapter_evidence,omitempty"`
}

// decider turns one check into an outcome. It is a pure function of its
// inputs (the clock and the jitter source are injected), so the settlement
// rules of SPEC §5 are tested without a database.
type decider struct {
	int63n func(int64) int64
}

// manual settles c to manual_review with reason, without a check.
func (d decider) manual(now time.Time, c Claimed, b *readback.Binding, reason string) Outcome {
	ev := d.evidence(now, c, b, c.Checks)
	return Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.ManualReview,
		Detail: Detail{Reason: reason, Evidence: ev}, Adapter: ev.Adapter, Dependency: c.Dependency}
}

// release puts c back, due at next, without counting a check.
func (d decider) release(c Claimed, next time.Time) Outcome {
	return Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.Reconciling, NextCheck: next, Dependency: c.Dependency}
}

func (d decider) evidence(now time.Time, c Claimed, b *readback.Binding, checks int) *Evidence {
	ev := &Evidence{Operation: c.Operation, Dependency: c.Dependency, Checks: checks,
		SinceSubmissionSec: now.Sub(c.SubmittedAt).Seconds()}
	if b != nil {
		ev.Adapter, ev.AdapterType, ev.Kind = b.Name, b.Type, b.Kind
		if b.Kind != readback.Blind {
			ev.ConsistencyWindow = b.Policy.ConsistencyWindow.String()
			ev.MaxRequestLifetime = b.Policy.MaxRequestLifetime.String()
		}
	}
	return ev
}

// Decide applies the settlement rules of SPEC §5 to one check of r, made at
// now with adapter binding b, that answered res or failed with checkErr. It
// returns what the reconciler would record — a settlement (To succeeded,
// safe_to_retry or manual_review, with the reason and evidence in Detail) or
// a release until NextCheck (To reconciling) — and changes nothing.
// `reconciler adapters check` uses it to explain a decision with the very
// rules the pool applies.
func Decide(now time.Time, r readback.Receipt, b *readback.Binding, res readback.Result, checkErr error) Outcome {
	return decider{}.decide(now, Claimed{Receipt: r}, b, res, checkErr, 0)
}

// decide applies the settlement rules to one check of c made at now.
func (d decider) decide(now time.Time, c Claimed, b *readback.Binding, res readback.Result, checkErr error, latency time.Duration) Outcome {
	p := b.Policy
	checks := c.Checks + 1
	rec := &CheckRecord{CheckNo: checks, At: now, Adapter: b.Name, Dependency: c.Dependency, Latency: latency}
	ev := d.evidence(now, c, b, checks)
	out := Outcome{ID: c.ID, Lease: c.Lease, Check: rec, Adapter: b.Name, Dependency: c.Dependency}
	settle := func(to statemachine.State, reason string) Outcome {
		out.To = to
		out.Detail = Detail{Reason: reason, Evidence: ev}
		return out
	}
	deadline := c.SubmittedAt.Add(p.Deadline)
	bound := ""
	switch {
	case checks >= p.MaxChecks:
		bound = "max_checks"
	case !now.Before(deadline):
		bound = "deadline"
	}
	safeAt, guarantee, absenceProves := p.AbsenceWindow(c.SubmittedAt, now)
	// again reschedules, or gives up when a bound is reached.
	again := func(minWait time.Duration) Outcome {
		if bound != "" {
			ev.Bound = bound
			return settle(statemachine.ManualReview, ReasonBoundReached)
		}
		j := FullJitter{Base: p.BackoffBase, Cap: p.BackoffCap, Int63n: d.int63n}
		next := now.Add(max(j.Delay(checks-1), minWait))
		// The last check allowed should be one that can conclude: not
		// before the absence window, and not after the deadline.
		if checks == p.MaxChecks-1 && next.Before(safeAt) {
			next = safeAt
		}
		if next.After(deadline) {
			next = deadline
		}
		out.To, out.NextCheck = statemachine.Reconciling, next
		return out
	}

	if checkErr != nil {
		class, retryAfter := readback.Classify(checkErr)
		rec.Verdict, rec.ErrorClass, rec.Error = "error", class, checkErr.Error()
		if class == readback.Permanent {
			out.To = statemachine.ManualReview
			out.Detail = Detail{Reason: ReasonReadbackError, Evidence: ev,
				Error: &DetailError{Code: "readback_permanent", Message: checkErr.Error()}}
			return out
		}
		return again(retryAfter)
	}
	if !res.Verdict.Valid() {
		rec.Verdict, rec.ErrorClass, rec.Error = "error", readback.Permanent, "invalid verdict "+string(res.Verdict)
		out.To = statemachine.ManualReview
		out.Detail = Detail{Reason: ReasonInvalidAnswer, Evidence: ev,
			Error: &DetailError{Code: "invalid_verdict", Message: string(res.Verdict)}}
		return out
	}
	rec.Verdict, rec.Authoritative, rec.Matches = string(res.Verdict), res.Authoritative, len(res.ExternalIDs)
	if res.Evidence != nil {
		if j, err := json.Marshal(res.Evidence); err == nil {
			rec.Evidence, ev.AdapterEvidence = j, j
		}
	}
	ev.Query, ev.Verdict, ev.Authoritative = res.Query, string(res.Verdict), res.Authoritative
	ev.Matched = res.ExternalIDs
	conclusiveAbsence := func() bool {
		if !absenceProves || !res.Authoritative {
			return false
		}
		ev.Guarantee = guarantee
		t := safeAt
		ev.AbsenceSafeAt = &t
		if guarantee == readback.NativeIdempotencyKey {
			k := c.SubmittedAt.Add(p.IdempotencyRetention)
			ev.ReuseKeyBefore = &k
		}
		return true
	}

	if res.Verdict == readback.VerdictDiverged {
		return settle(statemachine.ManualReview, ReasonDiverged)
	}
	if b.Kind == readback.Delete {
		switch res.Verdict {
		case readback.VerdictAbsent:
			// The delete's target state is visible: positive proof, no
			// window needed, as long as the source is authoritative.
			if res.Authoritative {
				return settle(statemachine.Succeeded, ReasonDeleted)
			}
		case readback.VerdictPresent:
			if conclusiveAbsence() {
				return settle(statemachine.SafeToRetry, ReasonPresentAfterDelay)
			}
		}
		return again(0)
	}
	switch res.Verdict {
	case readback.VerdictPresent:
		if len(res.ExternalIDs) > 0 {
			out.ExternalID = res.ExternalIDs[0]
		}
		if b.Kind == readback.Create && len(res.ExternalIDs) > 1 {
			out.Duplicates = res.ExternalIDs
			return settle(statemachine.Succeeded, ReasonPresentDuplicates)
		}
		return settle(statemachine.Succeeded, ReasonPresent)
	case readback.VerdictAbsent:
		// Absent before the window is never settled, whatever the adapter
		// says about its authority: a late original may still land.
		if conclusiveAbsence() {
			return settle(statemachine.SafeToRetry, ReasonAbsentAfterWindow)
		}
	}
	return again(0)
}
