package reconcile

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// top draws the top of every jitter range, so waits are deterministic.
func top(n int64) int64 { return n - 1 }

func TestSchedules(t *testing.T) {
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	policy := readback.Policy{BackoffBase: time.Second, BackoffCap: 10 * time.Second}
	at := func(d time.Duration) time.Time { return submitted.Add(d) }
	// learned has seen effects of "api" appear 2 s after submission.
	learned := func() *LearnedLag {
		s := &LearnedLag{Int63n: top}
		for range lagMinSamples {
			s.ObservePresent("api", 2*time.Second)
		}
		return s
	}
	tests := []struct {
		name     string
		sched    Schedule
		dep      string
		answered time.Duration // since submission
		attempt  int
		absence  time.Duration // since submission; 0: none given
		want     time.Duration // the wait
	}{
		{"policy jitter, first", PolicyJitter{Int63n: top}, "api", 0, 0, 0, time.Second - 1},
		{"policy jitter doubles", PolicyJitter{Int63n: top}, "api", 0, 2, 0, 4*time.Second - 1},
		{"policy jitter capped", PolicyJitter{Int63n: top}, "api", 0, 9, 0, 10*time.Second - 1},
		{"exponential has no jitter", Exponential{}, "api", 0, 3, 0, 8 * time.Second},
		{"exponential capped", Exponential{}, "api", 0, 30, 0, 10 * time.Second},
		{"fixed", Fixed{Interval: 300 * time.Millisecond}, "api", 0, 7, 0, 300 * time.Millisecond},
		{"learned, too few samples: policy jitter", &LearnedLag{Int63n: top}, "api", 0, 1, 0, 2*time.Second - 1},
		{"learned, other dependency: policy jitter", learned(), "other", 0, 1, 0, 2*time.Second - 1},
		// Lag 2 s: span 500 ms starting 125 ms before the lag, from submission.
		{"learned, aimed at the lag", learned(), "api", 100 * time.Millisecond, 0, 0,
			2*time.Second - 125*time.Millisecond - 100*time.Millisecond + 500*time.Millisecond - 1},
		{"learned, aim bounded by the absence window", learned(), "api", 0, 0, time.Second,
			time.Second - 62500*time.Microsecond + 250*time.Millisecond - 1},
		{"learned, just missed: one span", learned(), "api", 2100 * time.Millisecond, 1, 0, 500*time.Millisecond - 1},
		{"learned, late: the time past the lag", learned(), "api", 5 * time.Second, 2, 0, 3*time.Second - 1},
		{"learned, late: capped", learned(), "api", time.Minute, 9, 0, 10*time.Second - 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := Waiting{Dependency: tt.dep, Policy: policy, SubmittedAt: submitted,
				ReadAt: at(tt.answered), AnsweredAt: at(tt.answered), Attempt: tt.attempt}
			if tt.absence > 0 {
				w.AbsenceAt = at(tt.absence)
			}
			if got := tt.sched.Wait(w); got != tt.want {
				t.Fatalf("wait %s, want %s", got, tt.want)
			}
		})
	}
}

// The learned lag is a low quantile of first-present times, so one early
// outlier does not pull it down, and a dependency that slows down is
// followed once its recent samples say so.
func TestLearnedLagEstimate(t *testing.T) {
	tests := []struct {
		name    string
		samples []time.Duration
		want    time.Duration
		ok      bool
	}{
		{"none", nil, 0, false},
		{"too few", []time.Duration{time.Second, time.Second, time.Second}, 0, false},
		{"steady", []time.Duration{2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second}, 2 * time.Second, true},
		{"one early outlier among many", append([]time.Duration{10 * time.Millisecond},
			slices.Repeat([]time.Duration{2 * time.Second}, 20)...), 2 * time.Second, true},
		{"slowed down: the old samples age out", append(slices.Repeat([]time.Duration{time.Second}, 30),
			slices.Repeat([]time.Duration{3 * time.Second}, lagSamples)...), 3 * time.Second, true},
		{"negative times are ignored", []time.Duration{-time.Second, -time.Second, -time.Second, -time.Second}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s LearnedLag
			for _, d := range tt.samples {
				s.ObservePresent("api", d)
			}
			got, ok := s.Lag("api")
			if got != tt.want || ok != tt.ok {
				t.Fatalf("Lag = %s, %v; want %s, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

// simulate reconciles waves of receipts submitted together, whose effects
// become visible lag after submission, on simulated time: each receipt is
// read at once (it became outcome_unknown), then whenever sched says,
// until a read begins at or after the lag. It returns, for the last wave,
// the median and p95 time from submission to the settling read, and reads
// per receipt.
func simulate(sched Schedule, lag time.Duration, waves, receipts int) (median, p95 time.Duration, reads float64) {
	policy := readback.DefaultPolicy()
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	d := decider{sched: sched}
	b := &readback.Binding{Name: "sim", Kind: readback.Create, Dependency: "api", Policy: policy}
	var settle []time.Duration
	total := 0
	for range waves {
		settle, total = settle[:0], 0
		for i := range receipts {
			c := Claimed{Receipt: readback.Receipt{ID: int64(i), Dependency: "api", SubmittedAt: submitted}}
			read := submitted
			for {
				total++
				res := readback.Result{Verdict: readback.VerdictAbsent}
				if read.Sub(submitted) >= lag {
					res = readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"x"}}
				}
				out := d.decide(read, read, c, b, res, nil, 0, controlAssumed)
				if out.To != statemachine.Reconciling {
					settle = append(settle, read.Sub(submitted))
					break
				}
				c.Checks++
				read = out.NextCheck
			}
		}
		submitted = submitted.Add(time.Hour)
	}
	slices.Sort(settle)
	return settle[len(settle)/2], settle[len(settle)*95/100], float64(total) / float64(receipts)
}

// The daemon's default schedule meets the consistency target once it has
// seen a wave of effects (simulated time, so nothing here depends on the
// machine): median at most 1.25 × the lag, p95 at most 2 ×, and fewer reads
// than fixed polling that settles as fast.
func TestLearnedLagMeetsTheTarget(t *testing.T) {
	for _, lag := range []time.Duration{500 * time.Millisecond, 2 * time.Second, 8 * time.Second} {
		t.Run(lag.String(), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(lag)))
			med, p95, reads := simulate(&LearnedLag{Int63n: rng.Int64N}, lag, 3, 100)
			if med > lag*5/4 || p95 > 2*lag {
				t.Errorf("learned: median %s, p95 %s; want at most %s and %s", med, p95, lag*5/4, 2*lag)
			}
			fmed, _, freads := simulate(Fixed{Interval: lag / 4}, lag, 1, 100)
			if fmed > lag*5/4 || reads >= freads {
				t.Errorf("learned: %.2f reads per receipt against fixed polling's %.2f (median %s)", reads, freads, fmed)
			}
			t.Logf("learned: median %.2f×, p95 %.2f×, %.2f reads; fixed lag/4: median %.2f×, %.2f reads",
				float64(med)/float64(lag), float64(p95)/float64(lag), reads, float64(fmed)/float64(lag), freads)
		})
	}
}
