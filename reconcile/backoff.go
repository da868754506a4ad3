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
// Observe once for every read of a create or update that answered present
// or absent.
type Observer interface {
	Observe(o Observation)
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

// The learned schedule's constants.
const (
	// lagMinSamples first-present times of a dependency seed its estimate
	// (their lagSeedQuantile); before that, the declared schedule applies.
	lagMinSamples   = 4
	lagSeedQuantile = 0.10
	// lagHitRate is the share of aimed reads meant to find the effect: the
	// estimate moves down by lagStep·(1−lagHitRate) of itself after a
	// hit and up by lagStep·lagHitRate after a miss, which balances when
	// one aimed read in ten comes too early (stochastic approximation of a
	// quantile). A read comes too early for many reasons besides the lag
	// (the pool's claim latency, the call that records the effect after
	// submission), and all of them are in what this calibrates.
	lagHitRate = 0.9
	lagStep    = 0.02
	// The aimed check is drawn from [L, L + L/lagSpanDiv): reads of a
	// batch submitted together spread over the span instead of arriving
	// at once.
	lagSpanDiv = 4
	// lagMaxMisses bounds the receipts remembered as missed.
	lagMaxMisses = 100000
	// lagMax bounds the estimate, so that nothing overflows.
	lagMax = 24 * time.Hour
)

// LearnedLag is the daemon's default schedule. For each dependency it
// learns the visibility lag L (how long after submission the effect of a
// call becomes visible to reads) from its own reads, and aims a receipt's
// next check just past it instead of backing off blindly:
//
//   - until lagMinSamples effects of the dependency were found (a new
//     dependency, a restarted daemon), PolicyJitter: full jitter over the
//     binding's base and cap; the 10th percentile of those first-present
//     times seeds L;
//   - while the receipt is younger than L, the next check is drawn from
//     [L, L + L/4), measured from submission: full jitter over a span of
//     L/4, so a batch submitted together is not read again at one instant;
//   - once the receipt is older (its aimed read found nothing: its effect
//     is late, or never happened), full jitter again, rand(0, c) with c the
//     time already spent past L (at least L/4, at most the binding's cap):
//     the ceiling doubles as fast as plain backoff would, from L on.
//
// L then follows what the aimed reads find: it moves down a little after
// each effect found, and up more after each effect found only after a read
// at or past L had missed it, so that about one aimed read in ten misses.
// A receipt that is never found present moves nothing: calls that never
// took effect cannot drag L out, nor can its later reads.
//
// L is bounded by the receipt's absence window (send deadline, request
// lifetime and the declared consistency window): an effect that happened
// is visible by then, so no check is aimed later. Soundness does not rest
// on the estimate (SPEC §5a): a wrong one only makes checks early (an
// absence before the window settles nothing) or late (bounded as above).
type LearnedLag struct {
	// Int63n draws the jitter (nil: math/rand/v2).
	Int63n func(n int64) int64

	mu   sync.Mutex
	deps map[string]*lagState
	// missed holds the receipts a read at or past L found absent, until
	// their absence window: if one is found later, L was too short.
	missed map[int64]missed
	// missedFrom is at or before every window in missed (the earliest
	// after each full scan, lowered by each miss remembered since): a full
	// memory that holds no window before a new miss's is not scanned again.
	missedFrom time.Time
}

// missed is a read at or past the learned lag that found nothing.
type missed struct {
	at    time.Duration // since submission
	until time.Time     // the receipt's absence window
}

// lagState is what is known of one dependency's lag.
type lagState struct {
	seed []time.Duration // first-present times, until the estimate exists
	lag  time.Duration   // the estimate; 0 until seeded
}

// Observation is what one read of a create or update found.
type Observation struct {
	Receipt    int64
	Dependency string
	// SinceSubmission is the time from submission to the moment the read
	// began.
	SinceSubmission time.Duration
	// Present is set when the read found the effect; otherwise it found
	// it absent.
	Present bool
	// AbsenceAt is when an absence of the receipt becomes conclusive.
	AbsenceAt time.Time
}

// Lag returns the visibility lag learned for dependency, and false while
// too few effects of it have been found.
func (s *LearnedLag) Lag(dependency string) (time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.deps[dependency]; st != nil && st.lag > 0 {
		return st.lag, true
	}
	return 0, false
}

// Observe implements Observer.
func (s *LearnedLag) Observe(o Observation) {
	if o.SinceSubmission < 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.deps == nil {
		s.deps, s.missed = map[string]*lagState{}, map[int64]missed{}
	}
	st := s.deps[o.Dependency]
	if st == nil {
		st = &lagState{}
		s.deps[o.Dependency] = st
	}
	miss, wasMissed := s.missed[o.Receipt]
	switch {
	case st.lag == 0:
		if o.Present {
			st.seed = append(st.seed, o.SinceSubmission)
			if len(st.seed) >= lagMinSamples {
				slices.Sort(st.seed)
				st.lag = max(st.seed[int(lagSeedQuantile*float64(len(st.seed)-1))], time.Millisecond)
				st.seed = nil
			}
		}
	case !o.Present:
		if o.SinceSubmission >= st.lag && !wasMissed {
			s.rememberMiss(o.Receipt, missed{at: o.SinceSubmission, until: o.AbsenceAt})
		}
	case wasMissed:
		delete(s.missed, o.Receipt)
		// This effect became visible between the read that missed it and
		// this one: never past the middle of that, or a batch missed
		// together would compound its steps far beyond its lag.
		mid := miss.at + (o.SinceSubmission-miss.at)/2
		st.lag = min(st.lag+time.Duration(float64(st.lag)*lagStep*lagHitRate), max(st.lag, mid), lagMax)
	case o.SinceSubmission < st.lag+st.lag/lagSpanDiv:
		st.lag = max(st.lag-time.Duration(float64(st.lag)*lagStep*(1-lagHitRate)), time.Millisecond)
	}
}

// rememberMiss records the miss m of receipt id. When the memory is full
// it first forgets the receipts whose absence window comes before m's
// (settled by then, or never to be found); if it is still full, the miss
// is not remembered.
func (s *LearnedLag) rememberMiss(id int64, m missed) {
	if len(s.missed) >= lagMaxMisses {
		if !s.missedFrom.Before(m.until) {
			return // no window in memory comes before m's: nothing to forget
		}
		earliest := m.until
		for k, old := range s.missed {
			switch {
			case old.until.Before(m.until):
				delete(s.missed, k)
			case old.until.Before(earliest):
				earliest = old.until
			}
		}
		s.missedFrom = earliest
		if len(s.missed) >= lagMaxMisses {
			return
		}
	}
	if len(s.missed) == 0 || m.until.Before(s.missedFrom) {
		s.missedFrom = m.until
	}
	s.missed[id] = m
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
	if w.AnsweredAt.Before(visible) {
		return visible.Sub(w.AnsweredAt) + draw(s.Int63n, span)
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
