package reconcile

import (
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/receiptledger/reconciler/readback"
)

// FullJitter is the check schedule of SPEC §5: the n-th wait is drawn
// uniformly from [0, min(Cap, Base·2^n)). Plain exponential backoff makes a
// fleet of rows that failed together retry together; drawing from the whole
// range spreads them (AWS "Exponential Backoff And Jitter").
//
// It implements backoff.BackOff so it composes with the cenkalti/backoff
// helpers; the reconciler itself calls Delay with the row's persisted
// check count, because the wait lives in the database, not in a goroutine.
type FullJitter struct {
	Base time.Duration
	Cap  time.Duration
	// Int63n draws from [0, n); nil means math/rand/v2 (safe for
	// concurrent use). Tests inject a deterministic source.
	Int63n func(n int64) int64

	attempt int
}

var _ backoff.BackOff = (*FullJitter)(nil)

// Ceiling returns min(Cap, Base·2^n), the upper bound of the n-th wait.
func (f *FullJitter) Ceiling(n int) time.Duration {
	if f.Base <= 0 {
		return 0
	}
	c := f.Cap
	if c < f.Base {
		c = f.Base
	}
	d := f.Base
	for i := 0; i < n && d < c; i++ {
		d *= 2 // doubling stops at the cap, so it cannot overflow
	}
	return min(d, c)
}

// Delay returns the n-th wait (n counts from 0): rand(0, min(Cap, Base·2^n)).
func (f *FullJitter) Delay(n int) time.Duration {
	return draw(f.Int63n, f.Ceiling(n))
}

// NextBackOff returns the next wait and advances the attempt counter.
func (f *FullJitter) NextBackOff() time.Duration {
	d := f.Delay(f.attempt)
	f.attempt++
	return d
}

// Reset starts the schedule over.
func (f *FullJitter) Reset() { f.attempt = 0 }

// draw returns rand(0, c) from int63n (nil: math/rand/v2), 0 when c ≤ 0.
func draw(int63n func(int64) int64, c time.Duration) time.Duration {
	if c <= 0 {
		return 0
	}
	if int63n == nil {
		int63n = rand.Int64N
	}
	return time.Duration(int63n(int64(c)))
}

// Schedule decides when a receipt that a check did not settle is read
// again. It only ever chooses a time: what settles a receipt is the
// evidence of a read (SPEC §5a), never the schedule. The pool applies the
// bounds around it: a Retry-After is honoured, and no check is put after
// the deadline (nor the last allowed one before the absence window).
// Implementations must be safe for concurrent use.
type Schedule interface {
	// Wait returns how long after w.AnsweredAt the next check is due.
	Wait(w Waiting) time.Duration
}

// Observer is a Schedule that learns from what reads find. The pool calls
// ObservePresent for every read of a create or update that found the
// effect present, with the time from submission to the moment the read
// began: an upper bound of that effect's visibility lag.
type Observer interface {
	ObservePresent(dependency string, sinceSubmission time.Duration)
}

// Waiting describes the receipt being rescheduled. Every time is on the
// database's clock.
type Waiting struct {
	Dependency string
	Policy     readback.Policy
	// SubmittedAt is when the receipt was submitted: visibility is
	// measured from it.
	SubmittedAt time.Time
	// ReadAt is when the read that did not settle began; AnsweredAt is
	// when its answer arrived (the wait runs from it).
	ReadAt, AnsweredAt time.Time
	// Attempt counts the checks before this one since the receipt became
	// outcome_unknown (0 after the first): the n of base·2^n.
	Attempt int
	// AbsenceAt is when an absence becomes conclusive (SPEC §5a): an
	// effect that happened is visible by then, so no schedule needs to aim
	// later.
	AbsenceAt time.Time
}

// PolicyJitter is the schedule the reconciler used before it learned
// visibility lags: full jitter over the binding's BackoffBase and
// BackoffCap, rand(0, min(cap, base·2^n)), from the moment the answer
// arrived. A receipt with no binding-specific knowledge falls back to it.
type PolicyJitter struct {
	// Int63n draws the jitter (nil: math/rand/v2).
	Int63n func(n int64) int64
}

// Wait implements Schedule.
func (s PolicyJitter) Wait(w Waiting) time.Duration {
	j := FullJitter{Base: w.Policy.BackoffBase, Cap: w.Policy.BackoffCap, Int63n: s.Int63n}
	return j.Delay(w.Attempt)
}

// Exponential is plain exponential backoff, min(cap, base·2^n) over the
// binding's BackoffBase and BackoffCap, with no jitter: the stampede of
// seed 004, kept as a point of comparison for `reconciler bench
// consistency`.
type Exponential struct{}

// Wait implements Schedule.
func (Exponential) Wait(w Waiting) time.Duration {
	j := FullJitter{Base: w.Policy.BackoffBase, Cap: w.Policy.BackoffCap}
	return j.Ceiling(w.Attempt)
}

// Fixed polls every Interval, whatever happened before.
type Fixed struct {
	Interval time.Duration
}

// Wait implements Schedule.
func (f Fixed) Wait(Waiting) time.Duration { return f.Interval }

// The learned schedule's constants. The estimate is a low quantile of the
// times at which recent reads first found an effect: each such time is an
// upper bound of that receipt's lag, so a high quantile of them would only
// ever grow (every read is aimed past the estimate, and finds the effect
// later still); the 10th percentile settles just above a steady lag, while
// one early outlier among ten samples does not move it.
const (
	lagSamples    = 64 // recent first-present times kept per dependency
	lagMinSamples = 4  // below this, the dependency's declared schedule applies
	lagQuantile   = 0.10
	// The aimed check is drawn from a span of estimate/lagSpanDiv that
	// starts a quarter of the span before the estimate: reads spread over
	// the span instead of arriving at once, and the few landing just
	// before the estimate are what lets it come down when the lag does.
	lagSpanDiv = 4
)

// LearnedLag is the daemon's default schedule. For each dependency it
// learns the visibility lag (how long after submission the effect of a
// call becomes visible to reads) from the times at which its own reads
// first found effects present, and aims a receipt's next check just past
// that lag instead of backing off blindly:
//
//   - before lagMinSamples effects of the dependency were seen (a new
//     dependency, a restarted daemon), PolicyJitter: full jitter over the
//     binding's base and cap;
//   - while the receipt is younger than the learned lag L, the next check
//     is drawn from [L − L/16, L + 3L/16), measured from submission: full
//     jitter over a span of L/4, so a batch submitted together is not read
//     again at one instant;
//   - once the receipt is older (its aimed read found nothing: its effect
//     is late, or never happened), full jitter again, rand(0, c) with c the
//     time already spent past L (at least L/4, at most the binding's cap):
//     the ceiling doubles as fast as plain backoff would, from the lag on.
//
// The lag is bounded by the absence window (send deadline, request
// lifetime and the declared consistency window): an effect that happened
// is visible by then, so no check is aimed later. Soundness does not rest
// on the estimate (SPEC §5a): a wrong one only makes checks early (an
// absence before the window settles nothing) or late (bounded as above).
// Absent receipts teach it nothing, so calls that never took effect cannot
// drag it out.
type LearnedLag struct {
	// Int63n draws the jitter (nil: math/rand/v2).
	Int63n func(n int64) int64

	mu   sync.Mutex
	deps map[string]*lagRing
}

// lagRing holds a dependency's recent first-present times.
type lagRing struct {
	at   [lagSamples]time.Duration
	n    int // samples held, at most lagSamples
	next int // where the next sample goes
}

func (r *lagRing) add(d time.Duration) {
	r.at[r.next] = d
	r.next = (r.next + 1) % lagSamples
	r.n = min(r.n+1, lagSamples)
}

func (r *lagRing) quantile(q float64) time.Duration {
	s := slices.Clone(r.at[:r.n])
	slices.Sort(s)
	return s[int(q*float64(len(s)-1))]
}

// Lag returns the visibility lag learned for dependency, and false while
// too few effects of it have been seen.
func (s *LearnedLag) Lag(dependency string) (time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.deps[dependency]
	if r == nil || r.n < lagMinSamples {
		return 0, false
	}
	return r.quantile(lagQuantile), true
}

// ObservePresent implements Observer.
func (s *LearnedLag) ObservePresent(dependency string, sinceSubmission time.Duration) {
	if sinceSubmission < 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.deps == nil {
		s.deps = map[string]*lagRing{}
	}
	r := s.deps[dependency]
	if r == nil {
		r = &lagRing{}
		s.deps[dependency] = r
	}
	r.add(sinceSubmission)
}

// Wait implements Schedule.
func (s *LearnedLag) Wait(w Waiting) time.Duration {
	lag, ok := s.Lag(w.Dependency)
	if !ok {
		return PolicyJitter{Int63n: s.Int63n}.Wait(w)
	}
	if !w.AbsenceAt.IsZero() {
		lag = min(lag, max(w.AbsenceAt.Sub(w.SubmittedAt), 0))
	}
	span := lag / lagSpanDiv
	visible := w.SubmittedAt.Add(lag)
	if start := visible.Add(-span / 4); w.AnsweredAt.Before(start) {
		return start.Sub(w.AnsweredAt) + draw(s.Int63n, span)
	}
	c := max(span, w.AnsweredAt.Sub(visible))
	if w.Policy.BackoffCap > 0 {
		c = min(c, w.Policy.BackoffCap)
	}
	return draw(s.Int63n, c)
}

var (
	_ Schedule = PolicyJitter{}
	_ Schedule = Exponential{}
	_ Schedule = Fixed{}
	_ Schedule = (*LearnedLag)(nil)
	_ Observer = (*LearnedLag)(nil)
)
