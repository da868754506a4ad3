package reconcile

import (
	"errors"
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
	before := submitted.Add(15 * time.Second) // inside lifetime+window (30s)
	after := submitted.Add(31 * time.Second)
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
			c := Claimed{Receipt: readback.Receipt{ID: 7, Operation: "o", Dependency: "d", SubmittedAt: submitted, Checks: tt.checks}, Lease: "l"}
			d := decider{int63n: func(n int64) int64 { return n - 1 }}
			out := d.decide(tt.now, c, b, tt.res, tt.err, time.Millisecond)
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
	c := Claimed{Receipt: readback.Receipt{SubmittedAt: submitted, Checks: 1}}
	out := decider{}.decide(submitted.Add(time.Second), c, b, readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}, nil, 0)
	if want := submitted.Add(2 * time.Minute); !out.NextCheck.Equal(want) {
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
