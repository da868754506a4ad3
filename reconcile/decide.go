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
	// ReasonAgentResponse: the agent recorded the API's 2xx response as a
	// late outcome after the orphan sweep had moved the receipt.
	ReasonAgentResponse = "agent_response"
	// ReasonLifetimeExceeded: the agent recorded an answer to the original
	// request (a late outcome of any kind) after the receipt's absence
	// window: the request outlived its dependency's declared lifetime, so
	// no absence settles the receipt (SPEC §5a, "late answers void the
	// window"). Evidence.LifetimeExceeded says which answer and when.
	ReasonLifetimeExceeded = "lifetime_exceeded"
)

// Evidence is what a settlement rests on: what was queried, what matched,
// how many checks over how long, and which guarantee made absence safe.
type Evidence struct {
	Adapter       string        `json:"adapter,omitempty"`
	AdapterType   string        `json:"adapter_type,omitempty"`
	Kind          readback.Kind `json:"kind,omitempty"`
	Operation     string        `json:"operation"`
	Dependency    string        `json:"dependency"`
	Query         string        `json:"query,omitempty"`
	Verdict       string        `json:"verdict,omitempty"`
	Authoritative bool          `json:"authoritative,omitempty"`
	Matched       []string      `json:"matched,omitempty"`
	// Checks counts the reads that count against max_checks: those that
	// returned an answer or a classified error, since the receipt (last)
	// became outcome_unknown.
	Checks int `json:"checks"`
	// Waits counts the times the receipt was handed back without such a
	// read: deferred by its dependency's protection (breaker open, budget
	// spent, rate or concurrency limit), held back for a positive control,
	// or released because its lease was too short or the reconciler was
	// stopping. Waiting is not checking: waits never use up max_checks.
	Waits int `json:"waits"`
	// SinceSubmissionSec is the time from submission to the moment the read
	// began (SPEC §5a: never the moment its answer arrived).
	SinceSubmissionSec float64 `json:"since_submission_s"`
	// ReadAt is when the read began, on the database's clock.
	ReadAt *time.Time `json:"read_at,omitempty"`
	// SendDeadline is the latest moment the original could have been sent.
	SendDeadline       *time.Time `json:"send_deadline,omitempty"`
	ConsistencyWindow  string     `json:"consistency_window,omitempty"`
	MaxRequestLifetime string     `json:"max_request_lifetime,omitempty"`
	// EffectiveWindow is set when a window alarm widened the declared
	// window (max_request_lifetime + consistency_window): the window the
	// absence waited for instead (docs/verdict-audits.md).
	EffectiveWindow string `json:"effective_window,omitempty"`
	// ConsistencyWindowSec and MaxRequestLifetimeSec are the same
	// declarations in seconds, for the database: its trigger refuses a
	// safe_to_retry whose receipt has a late outcome after send deadline +
	// both, and keeps an alarm for such a late outcome on any settlement
	// that states them (reconciler.absence_window_end).
	ConsistencyWindowSec  *float64 `json:"consistency_window_s,omitempty"`
	MaxRequestLifetimeSec *float64 `json:"max_request_lifetime_s,omitempty"`
	// LifetimeExceeded is set when the agent recorded an answer to the
	// original request after the absence window (ReasonLifetimeExceeded;
	// also on a succeeded settlement, whose proof stands).
	LifetimeExceeded *LifetimeExceeded  `json:"lifetime_exceeded,omitempty"`
	Guarantee        readback.Guarantee `json:"guarantee,omitempty"`
	AbsenceSafeAt    *time.Time         `json:"absence_safe_at,omitempty"`
	// ReuseKeyBefore is set when absence relied on the API's native
	// idempotency keys: the retry must reuse the original key before then.
	ReuseKeyBefore *time.Time `json:"reuse_idempotency_key_before,omitempty"`
	// Bound names the bound that ended a bound_reached settlement:
	// max_checks (Checks reads were made) or deadline (the receipt could
	// not be proven before Policy.Deadline, however many waits).
	Bound           string          `json:"bound,omitempty"`
	AdapterEvidence json.RawMessage `json:"adapter_evidence,omitempty"`
	// Control says which positive control made the adapter's absence
	// authoritative, or why none did (SPEC §5a, "positive control").
	Control string `json:"positive_control,omitempty"`
	// Source is "agent_response" for a settlement from a late outcome.
	Source string `json:"source,omitempty"`
	// LateOutcomes are the outcomes the agent recorded after the orphan
	// sweep moved the receipt (reconciler.late_outcomes).
	LateOutcomes []LateOutcome `json:"late_outcomes,omitempty"`
	// UntrustedExternalID describes an external id the adapter matched that
	// could not be stored as is (not valid UTF-8, a NUL or other control
	// character, or longer than MaxExternalIDBytes): the receipt's external
	// id is left unset, since an altered id names nothing the API knows.
	UntrustedExternalID *UntrustedID `json:"untrusted_external_id,omitempty"`
	// Sanitized is set when any text from outside (the query, a matched id,
	// the adapter's evidence, an error) was altered to be stored (issue 8).
	Sanitized bool `json:"sanitized,omitempty"`
	// WriteError is set on the minimal settlement written in place of one
	// the database refused (its SQLSTATE and message, sanitized).
	WriteError string `json:"write_error,omitempty"`
}

// UntrustedID stands for an external id that could not be stored as is.
type UntrustedID struct {
	// Excerpt is the id sanitized and bounded, for a human.
	Excerpt string `json:"excerpt"`
	// SHA256 is "sha256:<hex>" of the id's raw bytes.
	SHA256 string `json:"sha256"`
	// Bytes is the raw id's length.
	Bytes int `json:"bytes"`
}

// LateOutcome is an outcome an agent observed after the orphan sweep had
// already moved its receipt to outcome_unknown (reconciler.late_outcomes).
type LateOutcome struct {
	At         time.Time       `json:"at"`
	Actor      string          `json:"actor"`
	Outcome    string          `json:"outcome"`
	HTTPStatus *int            `json:"http_status,omitempty"`
	ExternalID string          `json:"external_id,omitempty"`
	Detail     json.RawMessage `json:"detail,omitempty"`
}

// LifetimeExceeded is the late answer that voids a receipt's absence
// window, and the window it voids.
type LifetimeExceeded struct {
	// WindowEnd is send deadline + max_request_lifetime +
	// consistency_window: the end of the absence window.
	WindowEnd  time.Time `json:"window_end"`
	LateAt     time.Time `json:"late_at"`
	Outcome    string    `json:"late_outcome"`
	HTTPStatus *int      `json:"http_status,omitempty"`
}

// lifetimeExceeded returns the first late outcome of c recorded after its
// absence window under b's declaration. A blind adapter declares no window,
// so nothing contradicts it.
func lifetimeExceeded(c Claimed, b *readback.Binding) (*LifetimeExceeded, bool) {
	if b == nil || b.Kind == readback.Blind {
		return nil, false
	}
	end := readback.SendDeadlineOf(c.Receipt).Add(b.Policy.MaxRequestLifetime + b.Policy.ConsistencyWindow)
	for _, lo := range c.LateOutcomes {
		if lo.At.After(end) {
			return &LifetimeExceeded{WindowEnd: end, LateAt: lo.At, Outcome: lo.Outcome, HTTPStatus: lo.HTTPStatus}, true
		}
	}
	return nil, false
}

// voided applies "late answers void the window" (SPEC §5a) to out, the
// outcome of c's claim: when the agent recorded an answer after c's
// absence window, out stands only as a positive proof (succeeded: the
// effect exists, whatever the window); anything else (an absence, a wait
// for one, a check error) becomes manual_review, reason lifetime_exceeded.
// Either way the evidence records the late answer, and the pool raises the
// alarm.
func (d decider) voided(now time.Time, c Claimed, b *readback.Binding, out Outcome) Outcome {
	lx, ok := lifetimeExceeded(c, b)
	if !ok {
		return out
	}
	ev := out.Detail.Evidence
	if ev == nil {
		checks := c.Checks
		if out.Check != nil && !out.Waited {
			checks++
		}
		ev = d.evidence(now, c, b, checks)
	}
	ev.LifetimeExceeded = lx
	out.Detail.Evidence = ev
	if out.To == statemachine.Succeeded {
		return out
	}
	out.To, out.NextCheck, out.Duplicates = statemachine.ManualReview, time.Time{}, nil
	out.Detail.Reason = ReasonLifetimeExceeded
	return out
}

// controlVerdict is whether an adapter's absences may count (its positive
// control passed recently), and what to record about it.
type controlVerdict struct {
	ok   bool
	note string
}

// controlAssumed is the verdict of Decide, which has no pool and so no
// record of controls: it explains the settlement rules as if the adapter's
// control had passed (ControlNeeded says when that matters).
var controlAssumed = controlVerdict{ok: true, note: "assumed passed (no control state)"}

// decider turns one check into an outcome. It is a pure function of its
// inputs (the clock and the jitter source are injected), so the settlement
// rules of SPEC §5 are tested without a database.
type decider struct {
	int63n func(int64) int64
	// sched picks the next check; nil means PolicyJitter over int63n.
	sched Schedule
	// windows are the effective windows: absences wait for them (nil:
	// the declared ones).
	windows *Windows
}

// observe tells a learning schedule what a read of c that began at readAt
// found. It is called once per read: a decision made twice (first with the
// positive control assumed) settles the first time, so only the second
// observes.
func (d decider) observe(c Claimed, readAt, absenceAt time.Time, present bool) {
	if o, ok := d.sched.(Observer); ok {
		o.Observe(Observation{Receipt: c.ID, Dependency: c.Dependency,
			SinceSubmission: readAt.Sub(c.SubmittedAt), Present: present, AbsenceAt: absenceAt})
	}
}

func (d decider) schedule() Schedule {
	if d.sched == nil {
		return PolicyJitter{Int63n: d.int63n}
	}
	return d.sched
}

// manual settles c to manual_review with reason, without a check.
func (d decider) manual(now time.Time, c Claimed, b *readback.Binding, reason string) Outcome {
	ev := d.evidence(now, c, b, c.Checks)
	return Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.ManualReview,
		Detail: Detail{Reason: reason, Evidence: ev}, Adapter: ev.Adapter, Dependency: c.Dependency}
}

// lateSucceeded returns c's late succeeded outcome, if the agent recorded
// one (the latest).
func lateSucceeded(c Claimed) (LateOutcome, bool) {
	for i := len(c.LateOutcomes) - 1; i >= 0; i-- {
		if c.LateOutcomes[i].Outcome == string(statemachine.Succeeded) {
			return c.LateOutcomes[i], true
		}
	}
	return LateOutcome{}, false
}

// late settles c succeeded from the agent's late outcome lo: the API
// answered the original request with a 2xx after the orphan sweep moved the
// receipt. No adapter is called; the evidence says where the proof came
// from.
func (d decider) late(now time.Time, c Claimed, b *readback.Binding, lo LateOutcome) Outcome {
	ev := d.evidence(now, c, b, c.Checks)
	ev.Source = ReasonAgentResponse
	out := Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.Succeeded,
		Detail: Detail{Reason: ReasonAgentResponse, Evidence: ev}, ExternalID: lo.ExternalID,
		Adapter: ev.Adapter, Dependency: c.Dependency}
	return out
}

// release puts c back, due at next, without counting a check: a wait.
func (d decider) release(c Claimed, next time.Time) Outcome {
	return Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.Reconciling, NextCheck: next, Dependency: c.Dependency,
		Waited: true}
}

// waitOrDeadline puts c back until next without counting a check, unless
// the receipt's deadline (b's policy, from the moment it became
// outcome_unknown) has passed at now: then it settles manual_review with
// bound_reached, bound "deadline". A receipt whose dependency can never be
// read (its breaker stays open, its budget stays spent) is ended by its
// deadline, never by max_checks. The next check is not put after the
// deadline, so the receipt ends on time.
func (d decider) waitOrDeadline(now time.Time, c Claimed, b *readback.Binding, next time.Time) Outcome {
	deadline := deadlineOf(c, b.Policy)
	if !now.Before(deadline) {
		ev := d.evidence(now, c, b, c.Checks)
		ev.Waits++
		ev.Bound = "deadline"
		return Outcome{ID: c.ID, Lease: c.Lease, To: statemachine.ManualReview, Waited: true,
			Detail: Detail{Reason: ReasonBoundReached, Evidence: ev}, Adapter: b.Name, Dependency: c.Dependency}
	}
	if next.After(deadline) {
		next = deadline
	}
	return d.release(c, next)
}

// deadlineOf is c's deadline under p: the bounds run from the moment the
// receipt (last) became outcome_unknown (a requeue by a reviewer starts them
// afresh, and resets check_count and wait_count with it).
func deadlineOf(c Claimed, p readback.Policy) time.Time {
	since := c.UnknownSince
	if since.IsZero() {
		since = c.SubmittedAt
	}
	return since.Add(p.Deadline)
}

func (d decider) evidence(now time.Time, c Claimed, b *readback.Binding, checks int) *Evidence {
	send := readback.SendDeadlineOf(c.Receipt)
	ev := &Evidence{Operation: c.Operation, Dependency: c.Dependency, Checks: checks, Waits: c.Waits,
		SinceSubmissionSec: now.Sub(c.SubmittedAt).Seconds(), SendDeadline: &send,
		LateOutcomes: c.LateOutcomes}
	if b != nil {
		ev.Adapter, ev.AdapterType, ev.Kind = b.Name, b.Type, b.Kind
		if b.Kind != readback.Blind {
			ev.ConsistencyWindow = b.Policy.ConsistencyWindow.String()
			ev.MaxRequestLifetime = b.Policy.MaxRequestLifetime.String()
			cw, lt := b.Policy.ConsistencyWindow.Seconds(), b.Policy.MaxRequestLifetime.Seconds()
			ev.ConsistencyWindowSec, ev.MaxRequestLifetimeSec = &cw, &lt
		}
	}
	return ev
}

// Decide applies the settlement rules of SPEC §5 and §5a to one check of r
// whose read began at now, with adapter binding b, that answered res or
// failed with checkErr. It returns what the reconciler would record — a
// settlement (To succeeded, safe_to_retry or manual_review, with the reason
// and evidence in Detail) or a release until NextCheck (To reconciling) —
// and changes nothing. `reconciler adapters check` uses it to explain a
// decision with the very rules the pool applies.
//
// Decide has no record of the adapter's positive controls: it decides as if
// they had passed. The pool settles an outcome for which ControlNeeded is
// not empty only while that control of the adapter, for the receipt's
// operation, has passed recently; otherwise the receipt waits.
func Decide(now time.Time, r readback.Receipt, b *readback.Binding, res readback.Result, checkErr error) Outcome {
	return decider{}.decide(now, now, Claimed{Receipt: r}, b, res, checkErr, 0, controlAssumed)
}

// ControlKind names a positive control (SPEC §5a), kept per adapter and
// operation.
type ControlKind string

// The positive controls.
const (
	// ControlPresent: an effect known to exist (a declared control, or a
	// receipt of the operation that settled succeeded from the API's 2xx
	// response) reads present. It shows the adapter's ABSENT is real: it
	// gates a create's or update's safe_to_retry and a delete's succeeded.
	ControlPresent ControlKind = "present"
	// ControlGone: the newest receipt of the same delete operation that
	// settled succeeded from the API's 2xx response (its resource is gone)
	// reads absent, authoritatively. It shows a delete adapter's PRESENT is
	// real: it gates a delete's safe_to_retry ("still present after the
	// window"), which an adapter answering present for everything would
	// otherwise settle.
	ControlGone ControlKind = "gone"
)

// ControlNeeded returns the positive control the settlement o rests on, or
// "" when o needs none (a present answer of a create or update, a manual
// review, a release). An absence (safe_to_retry of a create or update, a
// delete's succeeded) needs ControlPresent; a delete's safe_to_retry from a
// present answer needs ControlGone. Such an outcome stands only while that
// control of the adapter, for o's operation, has passed recently.
func ControlNeeded(o Outcome) ControlKind {
	if !o.Settles() {
		return ""
	}
	switch o.Detail.Reason {
	case ReasonAbsentAfterWindow, ReasonDeleted:
		return ControlPresent
	case ReasonPresentAfterDelay:
		return ControlGone
	}
	return ""
}

// decide applies the settlement rules to one check of c (decideCheck),
// then the rule that a late answer after the window voids it (voided).
func (d decider) decide(readAt, answeredAt time.Time, c Claimed, b *readback.Binding, res readback.Result, checkErr error, latency time.Duration, ctl controlVerdict) Outcome {
	return d.voided(readAt, c, b, d.decideCheck(readAt, answeredAt, c, b, res, checkErr, latency, ctl))
}

// decideCheck applies the settlement rules to one check of c whose read began
// at readAt and whose answer arrived at answeredAt (both on the database's
// clock). Every judgement of time (window, bounds, evidence) uses readAt: a
// read that began before the window closed proves nothing, however late its
// answer came. Only the next check is scheduled from answeredAt. An absence
// settles only if ctl says the adapter's positive control passed.
func (d decider) decideCheck(readAt, answeredAt time.Time, c Claimed, b *readback.Binding, res readback.Result, checkErr error, latency time.Duration, ctl controlVerdict) Outcome {
	now := readAt
	p := d.windows.Policy(b)
	checks := c.Checks + 1
	rec := &CheckRecord{CheckNo: checks, At: readAt, Adapter: b.Name, Dependency: c.Dependency, Latency: latency}
	ev := d.evidence(now, c, b, checks)
	if p.ConsistencyWindow != b.Policy.ConsistencyWindow {
		ev.EffectiveWindow = DeclaredWindow(p).String()
	}
	ra := readAt
	ev.ReadAt = &ra
	out := Outcome{ID: c.ID, Lease: c.Lease, Check: rec, Adapter: b.Name, Dependency: c.Dependency}
	settle := func(to statemachine.State, reason string) Outcome {
		out.To = to
		out.Detail = Detail{Reason: reason, Evidence: ev}
		return out
	}
	// The bounds run from the moment the receipt (last) became
	// outcome_unknown: a requeue by a reviewer starts them afresh, and the
	// trigger resets check_count with it.
	deadline := deadlineOf(c, p)
	safeAt, guarantee, absenceProves := p.AbsenceWindowFor(c.Receipt, readAt)
	// held is set when an answer would have settled the receipt but the
	// adapter's positive control has not passed: the read is recorded, but
	// it is a wait, not a check (it does not use up max_checks).
	held := false
	// again reschedules, or gives up when a bound is reached.
	again := func(minWait time.Duration) Outcome {
		counted := checks
		if held {
			counted = c.Checks
			ev.Checks, ev.Waits = c.Checks, c.Waits+1
			out.Waited = true
		}
		bound := ""
		switch {
		case counted >= p.MaxChecks:
			bound = "max_checks"
		case !now.Before(deadline):
			bound = "deadline"
		}
		if bound != "" {
			ev.Bound = bound
			return settle(statemachine.ManualReview, ReasonBoundReached)
		}
		from := later(answeredAt, readAt)
		wait := d.schedule().Wait(Waiting{Dependency: c.Dependency, Policy: p, SubmittedAt: c.SubmittedAt,
			ReadAt: readAt, AnsweredAt: from, Attempt: max(counted-1, 0), AbsenceAt: safeAt})
		next := from.Add(max(wait, minWait))
		// The last check allowed should be one that can conclude: not
		// before the absence window, and not after the deadline.
		if counted == p.MaxChecks-1 && next.Before(safeAt) {
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
	// heldBack records that an absence would have settled the receipt but
	// the adapter's positive control has not passed: the receipt waits.
	heldBack := func() bool {
		held = true
		ev.Control = "not passed: " + ctl.note
		note := map[string]any{"absence_not_authoritative": "positive control not passed: " + ctl.note}
		if len(rec.Evidence) > 0 {
			note["adapter_evidence"] = rec.Evidence
		}
		if j, err := json.Marshal(note); err == nil {
			rec.Evidence = j
		}
		return false
	}
	authoritativeAbsence := func() bool {
		if !res.Authoritative {
			return false
		}
		if !ctl.ok {
			return heldBack()
		}
		ev.Control = ctl.note
		return true
	}
	conclusiveAbsence := func() bool {
		if !absenceProves || !authoritativeAbsence() {
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
			// window needed, as long as the source is authoritative and
			// the adapter is known to find what exists (its control).
			if authoritativeAbsence() {
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
		d.observe(c, readAt, safeAt, true)
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
		d.observe(c, readAt, safeAt, false)
	}
	return again(0)
}
