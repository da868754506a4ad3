package reconcile

import (
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// A batched receipt is read again just after the learned lag, then just
// after its absence window, never in between; past the window, or before
// any lag is learned, the base schedule decides (never past the window
// while it is ahead).
func TestAimedReadsAtTheLagThenAtTheWindow(t *testing.T) {
	sub := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	window := sub.Add(2250 * time.Millisecond)
	pol := readback.Policy{BackoffBase: 10 * time.Second, BackoffCap: time.Minute}
	learned := &LearnedLag{Int63n: func(n int64) int64 { return n - 1 }}
	for i := range lagMinSamples {
		learned.Observe(Observation{Receipt: int64(i), Dependency: "api", SinceSubmission: 2 * time.Second, Present: true})
	}
	cold := &LearnedLag{Int63n: func(n int64) int64 { return n - 1 }}
	for _, tc := range []struct {
		name     string
		base     *LearnedLag
		answered time.Duration // after submission
		want     time.Duration
	}{
		{"before the lag: at the lag", learned, 500 * time.Millisecond, 1500*time.Millisecond + aimPast},
		{"past the lag: at the window", learned, 2100 * time.Millisecond, 150*time.Millisecond + aimPast},
		{"no lag learned: not past the window", cold, 0, 2250*time.Millisecond + aimPast},
		{"past the window: the base schedule", learned, 3 * time.Second, time.Second - time.Nanosecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := Waiting{Dependency: "api", Policy: pol, SubmittedAt: sub, AnsweredAt: sub.Add(tc.answered), AbsenceAt: window}
			if got := (aimed{base: tc.base}).Wait(w); got != tc.want {
				t.Fatalf("wait %s, want %s", got, tc.want)
			}
		})
	}
}
