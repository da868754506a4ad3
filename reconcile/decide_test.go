package reconcile

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

func TestDecide(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	policy := readback.Policy{
		ConsistencyWindow: 10 * time.Second, MaxRequestLifetime: 20 * time.Second,
		MaxChecks: 5, Deadline: time.Hour, BackoffBase: time.Second, BackoffCap: time.Minute,
	}
	keyed := policy
	keyed.IdempotencyKeys, keyed.IdempotencyRetention = true, 24*time.Hour
	// The send deadline is 5 s after submission (the default max_send_delay):
	// absence is conclusive at 5 s + lifetime 20 s + window 10 s.
	send := submitted.Add(5 * time.Second)
	before := submitted.Add(15 * time.Second) // inside send+lifetime+window (35s)
	after := submitted.Add(36 * time.Second)
	present := readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"ext-1"}, Authoritative: true}
	absent := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}
	absentWeak := readback.Result{Verdict: readback.VerdictAbsent}

	tests := []struct {
		name      string
		kind      readback.Kind
		policy    readback.Policy
		now       time.Time
		checks    int
		res       readback.Result
		err       error
		to        statemachine.State
		reason    string
		guarantee readback.Guarantee
		extID     string
		dups      int
	}{
		{"present settles at once", readback.Create, policy, before, 0, present, nil, statemachine.Succeeded, ReasonPresent, "", "ext-1", 0},
		{"two matches: succeeded with alarm", readback.Create, policy, before, 0,
			readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"a", "b"}}, nil,
			statemachine.Succeeded, ReasonPresentDuplicates, "", "a", 2},
		{"absent after window", readback.Create, policy, after, 0, absent, nil, statemachine.SafeToRetry, ReasonAbsentAfterWindow, readback.RequestLifetimeElapsed, "", 0},
		{"absent before window, authoritative: wait", readback.Create, policy, before, 0, absent, nil, statemachine.Reconciling, "", "", "", 0},
		{"absent after window, not authoritative: wait", readback.Create, policy, after, 0, absentWeak, nil, statemachine.Reconciling, "", "", "", 0},
		{"absent after consistency window with native keys", readback.Create, keyed, before, 0, absent, nil, statemachine.SafeToRetry, ReasonAbsentAfterWindow, readback.NativeIdempotencyKey, "", 0},
		{"keys do not help inside the consistency window", readback.Create, keyed, submitted.Add(5 * time.Second), 0, absent, nil, statemachine.Reconciling, "", "", "", 0},
		{"inconclusive: wait", readback.Create, policy, after, 0, readback.Result{Verdict: readback.VerdictInconclusive}, nil, statemachine.Reconciling, "", "", "", 0},
		{"inconclusive at the check bound", readback.Create, policy, after, 4, readback.Result{Verdict: readback.VerdictInconclusive}, nil, statemachine.ManualReview, ReasonBoundReached, "", "", 0},
		{"absent at the deadline before proof", readback.Create, policy, submitted.Add(2 * time.Hour), 0, absentWeak, nil, statemachine.ManualReview, ReasonBoundReached, "", "", 0},
		{"proof beats the bound", readback.Create, policy, after, 4, absent, nil, statemachine.SafeToRetry, ReasonAbsentAfterWindow, readback.RequestLifetimeElapsed, "", 0},
		{"update diverged", readback.Update, policy, before, 0, readback.Result{Verdict: readback.VerdictDiverged}, nil, statemachine.ManualReview, ReasonDiverged, "", "", 0},
		{"update holds pre-image after window", readback.Update, policy, after, 0, absent, nil, statemachine.SafeToRetry, ReasonAbsentAfterWindow, readback.RequestLifetimeElapsed, "", 0},
		{"delete: gone", readback.Delete, policy, before, 0, absent, nil, statemachine.Succeeded, ReasonDeleted, "", "", 0},
		{"delete: still there before window", readback.Delete, policy, before, 0, present, nil, statemachine.Reconciling, "", "", "", 0},
		{"delete: still there after window", readback.Delete, policy, after, 0, present, nil, statemachine.SafeToRetry, ReasonPresentAfterDelay, readback.RequestLifetimeElapsed, "", 0},
		{"transient error: wait", readback.Create, policy, after, 0, readback.Result{}, readback.TransientError(errors.New("503"), 0), statemachine.Reconciling, "", "", "", 0},
		{"unclassified error is transient", readback.Create, policy, after, 0, readback.Result{}, errors.New("boom"), statemachine.Reconciling, "", "", "", 0},
		{"transient error at the bound", readback.Create, policy, after, 4, readback.Result{}, readback.TransientError(errors.New("503"), 0), statemachine.ManualReview, ReasonBoundReached, "", "", 0},
		{"permanent error", readback.Create, policy, before, 0, readback.Result{}, readback.PermanentError(errors.New("401")), statemachine.ManualReview, ReasonReadbackError, "", "", 0},
		{"invalid verdict", readback.Create, policy, before, 0, readback.Result{Verdict: "maybe"}, nil, statemachine.ManualReview, ReasonInvalidAnswer, "", "", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := &readback.Binding{Name: "a", Kind: tt.kind, Dependency: "d", Policy: tt.policy}
			c := Claimed{Receipt: readback.Receipt{ID: 7, Operation: "o", Dependency: "d", SubmittedAt: submitted,
				SendDeadline: send, UnknownSince: submitted, Checks: tt.checks}, Lease: "l"}
			d := decider{int63n: func(n int64) int64 { return n - 1 }}
			out := d.decide(tt.now, tt.now, c, b, tt.res, tt.err, time.Millisecond, controlVerdict{ok: true, note: "test"})
			if out.To != tt.to {
				t.Fatalf("to = %s, want %s (detail %+v)", out.To, tt.to, out.Detail)
			}
			if out.Check == nil || out.Check.CheckNo != tt.checks+1 {
				t.Fatalf("check record = %+v, want check_no %d", out.Check, tt.checks+1)
			}
			if !out.Settles() {
				if !out.NextCheck.After(tt.now) || out.NextCheck.After(submitted.Add(tt.policy.Deadline)) {
					t.Fatalf("next check %s not in (now, deadline]", out.NextCheck)
				}
				return
			}
			if out.Detail.Reason != tt.reason {
				t.Fatalf("reason = %q, want %q", out.Detail.Reason, tt.reason)
			}
			if out.Detail.Evidence == nil || out.Detail.Evidence.Checks != tt.checks+1 {
				t.Fatalf("evidence = %+v", out.Detail.Evidence)
			}
			if out.Detail.Evidence.Guarantee != tt.guarantee {
				t.Fatalf("guarantee = %q, want %q", out.Detail.Evidence.Guarantee, tt.guarantee)
			}
			if tt.guarantee == readback.NativeIdempotencyKey && out.Detail.Evidence.ReuseKeyBefore == nil {
				t.Fatal("a settlement relying on idempotency keys must say until when the key must be reused")
			}
			if out.ExternalID != tt.extID {
				t.Fatalf("external id = %q, want %q", out.ExternalID, tt.extID)
			}
			if len(out.Duplicates) != tt.dups {
				t.Fatalf("duplicates = %v, want %d", out.Duplicates, tt.dups)
			}
		})
	}
}

func TestDecideLastCheckAimsAtTheWindow(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	p := readback.Policy{ConsistencyWindow: time.Minute, MaxRequestLifetime: time.Minute,
		MaxChecks: 3, Deadline: time.Hour, BackoffBase: time.Millisecond, BackoffCap: time.Millisecond}
	b := &readback.Binding{Name: "a", Kind: readback.Create, Dependency: "d", Policy: p}
	c := Claimed{Receipt: readback.Receipt{SubmittedAt: submitted, SendDeadline: submitted.Add(time.Second), Checks: 1}}
	now := submitted.Add(time.Second)
	out := decider{}.decide(now, now, c, b, readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, nil, 0, controlAssumed)
	if want := submitted.Add(time.Second + 2*time.Minute); !out.NextCheck.Equal(want) {
		t.Fatalf("the last allowed check is at %s, want the end of the window %s", out.NextCheck, want)
	}
}

func TestFullJitter(t *testing.T) {
	tests := []struct {
		n    int
		want time.Duration
	}{{0, time.Second}, {1, 2 * time.Second}, {3, 8 * time.Second}, {10, time.Minute}, {1000, time.Minute}}
	for _, tt := range tests {
		f := FullJitter{Base: time.Second, Cap: time.Minute, Int63n: func(n int64) int64 { return n - 1 }}
		if got := f.Ceiling(tt.n); got != tt.want {
			t.Errorf("Ceiling(%d) = %s, want %s", tt.n, got, tt.want)
		}
		if got := f.Delay(tt.n); got >= tt.want || got < 0 {
			t.Errorf("Delay(%d) = %s, want in [0, %s)", tt.n, got, tt.want)
		}
	}
	f := FullJitter{Base: time.Second, Cap: time.Minute}
	for range 1000 {
		if d := f.NextBackOff(); d < 0 || d >= time.Minute {
			t.Fatalf("NextBackOff = %s, out of [0, cap)", d)
		}
	}
	f.Reset()
	if d := f.NextBackOff(); d >= time.Second {
		t.Fatalf("after Reset the first wait is %s, want < base", d)
	}
}

// Issue 7, paths 2 and 3 (and §5a): every judgement of time uses the moment
// the read began; the window runs from the send deadline; the bounds from
// unknown_since; and without a passing positive control no absence settles.
func TestDecideTimeAndControl(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	p := readback.Policy{ConsistencyWindow: 4 * time.Second, MaxRequestLifetime: 6 * time.Second,
		MaxChecks: 5, Deadline: time.Hour, BackoffBase: time.Second, BackoffCap: time.Minute}
	send := submitted.Add(2 * time.Second)
	window := send.Add(10 * time.Second) // send deadline + lifetime + consistency window
	absent := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}
	present := readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: []string{"x"}}
	passed := controlVerdict{ok: true, note: "declared found"}
	failed := controlVerdict{note: "control declared: adapter answered absent"}
	r := readback.Receipt{ID: 1, SubmittedAt: submitted, SendDeadline: send, UnknownSince: submitted}
	requeued := r
	requeued.UnknownSince = submitted.Add(3 * time.Hour) // a reviewer requeued it; the trigger reset check_count
	tests := []struct {
		name             string
		kind             readback.Kind
		r                readback.Receipt
		readAt, answered time.Time
		res              readback.Result
		ctl              controlVerdict
		to               statemachine.State
		reason           string
	}{
		// Issue 7, path 2: a read that began at window−1s and answered at window+1s.
		{"read began before the window, answered after", readback.Create, r, window.Add(-time.Second), window.Add(time.Second), absent, passed, statemachine.Reconciling, ""},
		{"read began at the window", readback.Create, r, window, window.Add(time.Second), absent, passed, statemachine.SafeToRetry, ReasonAbsentAfterWindow},
		// §5a: the window counts from the send deadline, not submission.
		{"submitted+lifetime+window is not enough", readback.Create, r, submitted.Add(11 * time.Second), submitted.Add(11 * time.Second), absent, passed, statemachine.Reconciling, ""},
		// Issue 7, "a misconfigured adapter must not produce proof".
		{"absence without a passing control waits", readback.Create, r, window.Add(time.Minute), window.Add(time.Minute), absent, failed, statemachine.Reconciling, ""},
		{"delete: absent without a control is no proof", readback.Delete, r, window.Add(time.Minute), window.Add(time.Minute), absent, failed, statemachine.Reconciling, ""},
		{"delete: absent with a control", readback.Delete, r, window.Add(-5 * time.Second), window, absent, passed, statemachine.Succeeded, ReasonDeleted},
		{"delete: still present without a control waits", readback.Delete, r, window.Add(time.Minute), window.Add(time.Minute), present, failed, statemachine.Reconciling, ""},
		{"presence needs no control", readback.Create, r, window.Add(-5 * time.Second), window, present, failed, statemachine.Succeeded, ReasonPresent},
		// Issue 7, requeue: the deadline runs from unknown_since.
		{"deadline from submission reached", readback.Create, r, submitted.Add(2 * time.Hour), submitted.Add(2 * time.Hour), readback.Result{Verdict: readback.VerdictInconclusive}, passed, statemachine.ManualReview, ReasonBoundReached},
		{"requeued: deadline from unknown_since", readback.Create, requeued, submitted.Add(3*time.Hour + time.Minute), submitted.Add(3*time.Hour + time.Minute), readback.Result{Verdict: readback.VerdictInconclusive}, passed, statemachine.Reconciling, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := &readback.Binding{Name: "a", Kind: tt.kind, Dependency: "d", Policy: p}
			out := decider{}.decide(tt.readAt, tt.answered, Claimed{Receipt: tt.r}, b, tt.res, nil, 0, tt.ctl)
			if out.To != tt.to || out.Detail.Reason != tt.reason {
				t.Fatalf("to %s (%q), want %s (%q); evidence %+v", out.To, out.Detail.Reason, tt.to, tt.reason, out.Detail.Evidence)
			}
			if !out.Check.At.Equal(tt.readAt) {
				t.Fatalf("check recorded at %s, want the read's start %s", out.Check.At, tt.readAt)
			}
			if !out.Settles() && out.NextCheck.Before(tt.answered) {
				t.Fatalf("next check %s before the answer %s", out.NextCheck, tt.answered)
			}
			if !tt.ctl.ok && tt.res.Verdict == readback.VerdictAbsent && tt.to == statemachine.Reconciling &&
				!strings.Contains(string(out.Check.Evidence), "positive control not passed") {
				t.Fatalf("the check record does not say why the absence was held back: %s", out.Check.Evidence)
			}
			if ControlNeeded(out) != "" && out.Detail.Evidence.Control == "" {
				t.Fatal("a settlement on an absence does not name its positive control")
			}
		})
	}
}

// Issue 7, adversarial review: each settlement names the control it needs:
// an absence (a create's or update's safe_to_retry, a delete's succeeded)
// needs "present"; a delete's "still present after the window" needs
// "gone"; a presence, a release or a manual review needs none.
func TestControlNeeded(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	p := readback.Policy{ConsistencyWindow: 4 * time.Second, MaxRequestLifetime: 6 * time.Second,
		MaxChecks: 5, Deadline: time.Hour, BackoffBase: time.Second, BackoffCap: time.Minute}
	r := readback.Receipt{ID: 1, SubmittedAt: submitted, UnknownSince: submitted}
	late := submitted.Add(time.Minute)
	early := submitted.Add(time.Second)
	absent := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}
	present := readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: []string{"x"}}
	for _, tt := range []struct {
		name string
		kind readback.Kind
		at   time.Time
		res  readback.Result
		want ControlKind
	}{
		{"create absent after the window", readback.Create, late, absent, ControlPresent},
		{"update absent after the window", readback.Update, late, absent, ControlPresent},
		{"delete absent", readback.Delete, early, absent, ControlPresent},
		{"delete still present after the window", readback.Delete, late, present, ControlGone},
		{"delete present inside the window", readback.Delete, early, present, ""},
		{"create present", readback.Create, late, present, ""},
		{"create absent inside the window", readback.Create, early, absent, ""},
		{"update diverged", readback.Update, late, readback.Result{Verdict: readback.VerdictDiverged}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := &readback.Binding{Name: "a", Kind: tt.kind, Dependency: "d", Policy: p}
			out := Decide(tt.at, r, b, tt.res, nil)
			if got := ControlNeeded(out); got != tt.want {
				t.Fatalf("ControlNeeded = %q, want %q (outcome %s %s)", got, tt.want, out.To, out.Detail.Reason)
			}
		})
	}
}

// An absence held back because the adapter's positive control has not
// passed is recorded, but it is a wait: it does not use up max_checks, and
// only the deadline ends the receipt.
func TestHeldBackReadIsAWait(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	policy := readback.Policy{ConsistencyWindow: 10 * time.Second, MaxRequestLifetime: 20 * time.Second,
		MaxChecks: 2, Deadline: time.Hour, BackoffBase: time.Second, BackoffCap: time.Minute}
	b := &readback.Binding{Name: "a", Kind: readback.Create, Dependency: "d", Policy: policy}
	r := readback.Receipt{ID: 1, Operation: "op", Dependency: "d", SubmittedAt: submitted,
		SendDeadline: submitted.Add(5 * time.Second), UnknownSince: submitted, Checks: 1}
	c := Claimed{Receipt: r, Waits: 4}
	absent := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}
	notPassed := controlVerdict{note: "deferred"}
	at := submitted.Add(time.Minute)
	out := decider{}.decide(at, at, c, b, absent, nil, 0, notPassed)
	if out.Settles() || !out.Waited || out.Check == nil {
		t.Fatalf("held back: %+v, want a recorded wait", out)
	}
	at = submitted.Add(time.Hour)
	out = decider{}.decide(at, at, c, b, absent, nil, 0, notPassed)
	if out.To != statemachine.ManualReview || out.Detail.Evidence.Bound != "deadline" ||
		out.Detail.Evidence.Checks != 1 || out.Detail.Evidence.Waits != 5 {
		t.Fatalf("at the deadline: %+v %+v, want bound deadline, 1 read, 5 waits", out, out.Detail.Evidence)
	}
}
