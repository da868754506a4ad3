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
		for i := range lagMinSamples {
			s.Observe(Observation{Receipt: int64(i), Dependency: "api", SinceSubmission: 2 * time.Second, Present: true})
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
		// Lag 2 s: drawn from [2 s, 2.5 s) after submission.
		{"learned, aimed at the lag", learned(), "api", 100 * time.Millisecond, 0, 0,
			1900*time.Millisecond + 500*time.Millisecond - 1},
		{"learned, aim bounded by the absence window", learned(), "api", 0, 0, time.Second,
			time.Second + 250*time.Millisecond - 1},
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

// The learned lag is seeded by the 10th percentile of the first effects
// found, then moves down a little with each effect an aimed read finds and
// up more with each one found only after a read at or past it missed it.
// Receipts never found move nothing.
func TestLearnedLagEstimate(t *testing.T) {
	present := func(id int64, d time.Duration) Observation {
		return Observation{Receipt: id, Dependency: "api", SinceSubmission: d, Present: true}
	}
	absent := func(id int64, d time.Duration) Observation {
		return Observation{Receipt: id, Dependency: "api", SinceSubmission: d}
	}
	seed := []Observation{present(1, 2*time.Second), present(2, 3*time.Second), present(3, 2500*time.Millisecond),
		present(4, 4*time.Second)}
	const lag = 2 * time.Second // the seed's 10th percentile
	down := lag - time.Duration(float64(lag)*lagStep*(1-lagHitRate))
	up := lag + time.Duration(float64(lag)*lagStep*lagHitRate)
	tests := []struct {
		name string
		obs  []Observation
		want time.Duration // 0: not learned
	}{
		{"nothing seen", nil, 0},
		{"too few effects", seed[:3], 0},
		{"absences do not seed", append([]Observation{absent(9, time.Second), absent(9, 2*time.Second)}, seed[:3]...), 0},
		{"negative times are ignored", []Observation{present(1, -time.Second), present(2, -time.Second),
			present(3, -time.Second), present(4, -time.Second)}, 0},
		{"seeded", seed, lag},
		{"an aimed read finds it: down", append(seed[:4:4], present(5, 2100*time.Millisecond)), down},
		{"found before the lag: down", append(seed[:4:4], absent(5, time.Second), present(5, 1500*time.Millisecond)), down},
		{"missed at the lag, found later: up", append(seed[:4:4], absent(5, 2100*time.Millisecond),
			present(5, 2600*time.Millisecond)), up},
		{"missed twice, found later: up once", append(seed[:4:4], absent(5, 2100*time.Millisecond),
			absent(5, 2500*time.Millisecond), present(5, 3*time.Second)), up},
		{"never found: no move", append(seed[:4:4], absent(5, 2100*time.Millisecond), absent(5, 9*time.Second)), lag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s LearnedLag
			for _, o := range tt.obs {
				s.Observe(o)
			}
			got, ok := s.Lag("api")
			if got != tt.want || ok != (tt.want > 0) {
				t.Fatalf("Lag = %s, %v; want %s", got, ok, tt.want)
			}
			if other, ok := s.Lag("other"); ok {
				t.Fatalf("another dependency learned %s from api's reads", other)
			}
		})
	}
}

// The memory of missed receipts is bounded: when full, receipts whose
// absence window has passed are forgotten first.
func TestLearnedLagMissMemory(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	s := LearnedLag{missed: map[int64]missed{}}
	for i := range lagMaxMisses {
		s.rememberMiss(int64(i), missed{until: now.Add(time.Duration(i%2) * time.Hour)}) // half expire at now
	}
	s.rememberMiss(-1, missed{until: now.Add(time.Minute)})
	if len(s.missed) != lagMaxMisses/2+1 {
		t.Fatalf("%d remembered, want the %d whose window is later, and the new one", len(s.missed), lagMaxMisses/2)
	}
	for i := range lagMaxMisses {
		s.rememberMiss(int64(lagMaxMisses+i), missed{until: now.Add(2 * time.Hour)})
	}
	if len(s.missed) != lagMaxMisses {
		t.Fatalf("%d remembered, want at most %d", len(s.missed), lagMaxMisses)
	}
}

// BenchmarkLearnedLagFullMemory measures remembering a miss while the
// memory is full of receipts whose windows all end after it, where nothing
// can be forgotten: before the earliest window was kept, every such miss
// scanned all lagMaxMisses entries under the schedule's lock.
//
//	go test ./reconcile -run '^$' -bench LearnedLagFullMemory
func BenchmarkLearnedLagFullMemory(b *testing.B) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	s := LearnedLag{missed: map[int64]missed{}}
	for i := range lagMaxMisses {
		s.rememberMiss(int64(i), missed{until: now.Add(time.Hour)})
	}
	b.ResetTimer()
	for i := range b.N {
		s.rememberMiss(int64(lagMaxMisses+i), missed{until: now.Add(time.Hour)})
	}
	if len(s.missed) != lagMaxMisses {
		b.Fatalf("%d remembered, want %d", len(s.missed), lagMaxMisses)
	}
}

// simulate reconciles waves of receipts submitted together, whose effects
// become visible lag after submission, on simulated time: each receipt is
// read once it became outcome_unknown, then whenever sched says, each read
// beginning overhead after it is due (the pool's claim), in time order
// across the wave, until a read finds the effect. It returns, for the last
// wave, the median and p95 time from submission to the settling read, and
// reads per receipt.
func simulate(sched Schedule, lag, overhead time.Duration, waves, receipts int) (median, p95 time.Duration, reads float64) {
	policy := readback.DefaultPolicy()
	submitted := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	d := decider{sched: sched}
	b := &readback.Binding{Name: "sim", Kind: readback.Create, Dependency: "api", Policy: policy}
	var settle []time.Duration
	total := 0
	for w := range waves {
		settle, total = settle[:0], 0
		pending := make([]Claimed, receipts)
		due := make([]time.Time, receipts)
		for i := range pending {
			pending[i] = Claimed{Receipt: readback.Receipt{ID: int64(w*receipts + i), Dependency: "api", SubmittedAt: submitted}}
			due[i] = submitted
		}
		for len(pending) > 0 {
			i := 0
			for j := range due {
				if due[j].Before(due[i]) {
					i = j
				}
			}
			c, read := pending[i], due[i].Add(overhead)
			total++
			res := readback.Result{Verdict: readback.VerdictAbsent}
			if read.Sub(submitted) >= lag {
				res = readback.Result{Verdict: readback.VerdictPresent, ExternalIDs: []string{"x"}}
			}
			out := d.decide(read, read, c, b, res, nil, 0, controlAssumed)
			if out.To != statemachine.Reconciling {
				settle = append(settle, read.Sub(submitted))
				pending, due = slices.Delete(pending, i, i+1), slices.Delete(due, i, i+1)
				continue
			}
			pending[i].Checks++
			due[i] = out.NextCheck
		}
		submitted = submitted.Add(time.Hour)
	}
	slices.Sort(settle)
	return settle[len(settle)/2], settle[len(settle)*95/100], float64(total) / float64(receipts)
}

// The daemon's default schedule meets the consistency target once it has
// seen a few waves of effects (simulated time, so nothing here depends on
// the machine), with reads beginning a tenth of the lag after they are due:
// median at most 1.25 × the lag, p95 at most 2 ×, and fewer reads than
// fixed polling that settles as fast.
func TestLearnedLagMeetsTheTarget(t *testing.T) {
	for _, lag := range []time.Duration{500 * time.Millisecond, 2 * time.Second, 8 * time.Second} {
		t.Run(lag.String(), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(lag)))
			med, p95, reads := simulate(&LearnedLag{Int63n: rng.Int64N}, lag, lag/10, 3, 100)
			if med > lag*5/4 || p95 > 2*lag {
				t.Errorf("learned: median %s, p95 %s; want at most %s and %s", med, p95, lag*5/4, 2*lag)
			}
			fmed, _, freads := simulate(Fixed{Interval: lag / 4}, lag, lag/10, 1, 100)
			if fmed > lag*5/4 || reads >= freads {
				t.Errorf("learned: %.2f reads per receipt against fixed polling's %.2f (median %s)", reads, freads, fmed)
			}
			t.Logf("learned: median %.2f×, p95 %.2f×, %.2f reads; fixed lag/4: median %.2f×, %.2f reads",
				float64(med)/float64(lag), float64(p95)/float64(lag), reads, float64(fmed)/float64(lag), freads)
		})
	}
}
