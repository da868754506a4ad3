package reconcile

import (
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

func TestJudgeAudit(t *testing.T) {
	present := func(ids ...string) readback.Result {
		return readback.Result{Verdict: readback.VerdictPresent, Authoritative: true, ExternalIDs: ids}
	}
	absent := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true}
	cached := readback.Result{Verdict: readback.VerdictAbsent}
	tests := []struct {
		name    string
		kind    readback.Kind
		settled statemachine.State
		res     readback.Result
		retries int
		want    string
	}{
		{"create still absent", readback.Create, statemachine.SafeToRetry, absent, 0, AuditConfirmed},
		{"create absent from a cache", readback.Create, statemachine.SafeToRetry, cached, 0, AuditInconclusive},
		{"create found, no retry", readback.Create, statemachine.SafeToRetry, present("a"), 0, AuditContradicted},
		{"create found without an id", readback.Create, statemachine.SafeToRetry, present(), 0, AuditContradicted},
		{"create found once, one retry", readback.Create, statemachine.SafeToRetry, present("a"), 1, AuditConfirmed},
		{"create found twice, one retry", readback.Create, statemachine.SafeToRetry, present("a", "b"), 1, AuditContradicted},
		{"update diverged", readback.Update, statemachine.SafeToRetry, readback.Result{Verdict: readback.VerdictDiverged}, 0, AuditInconclusive},
		{"inconclusive", readback.Create, statemachine.SafeToRetry, readback.Result{Verdict: readback.VerdictInconclusive}, 0, AuditInconclusive},
		{"deleted, still gone", readback.Delete, statemachine.Succeeded, absent, 0, AuditConfirmed},
		{"deleted, present again", readback.Delete, statemachine.Succeeded, present("a"), 0, AuditContradicted},
		{"delete not done, still present", readback.Delete, statemachine.SafeToRetry, present("a"), 0, AuditConfirmed},
		{"delete not done, gone without a retry", readback.Delete, statemachine.SafeToRetry, absent, 0, AuditContradicted},
		{"delete not done, gone by the retry", readback.Delete, statemachine.SafeToRetry, absent, 1, AuditConfirmed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _, why := judgeAudit(tt.kind, tt.settled, tt.res, tt.retries)
			if got != tt.want {
				t.Errorf("judgeAudit = %s (%s), want %s", got, why, tt.want)
			}
		})
	}
}

func TestSampled(t *testing.T) {
	for _, rate := range []float64{0.1, 0.5, 1} {
		n := 0
		for id := int64(1); id <= 10000; id++ {
			if sampled(id, rate) {
				n++
			}
		}
		if want := rate * 10000; float64(n) < want*0.9 || float64(n) > want*1.1 {
			t.Errorf("rate %v: %d of 10000 sampled, want about %v", rate, n, want)
		}
	}
}

func TestWindowsWidenTheAbsenceWindow(t *testing.T) {
	b := &readback.Binding{Name: "a", Dependency: "api", Kind: readback.Create,
		Policy: readback.Policy{MaxRequestLifetime: time.Second, ConsistencyWindow: time.Second}}
	var w Windows
	if p := w.Policy(b); p != b.Policy {
		t.Fatalf("no widening: %+v", p)
	}
	w.Know([]Window{{Dependency: "api", Adapter: "a", Declared: 2 * time.Second, Effective: 30 * time.Second}})
	r := readback.Receipt{SubmittedAt: time.Unix(1000, 0)}
	safeAt, _, _ := w.Policy(b).AbsenceWindowFor(r, r.SubmittedAt)
	if want := r.SubmittedAt.Add(readback.DefaultMaxSendDelay + 30*time.Second); !safeAt.Equal(want) {
		t.Errorf("absence safe at %s, want %s", safeAt, want)
	}
	// The operator changed the declaration: the widening no longer applies.
	b.Policy.ConsistencyWindow = 5 * time.Second
	if win := w.For(b); win.Widened() || win.Effective != 6*time.Second {
		t.Errorf("after a changed declaration: %+v", win)
	}
	var none *Windows
	if p := none.Policy(b); p != b.Policy {
		t.Errorf("nil windows changed the policy: %+v", p)
	}
}
