package reconcile

import "time"

// aimPast is how far past the moment it aims at an aimed read is due, so
// that the read begins after that moment, never at it.
const aimPast = time.Millisecond

// lagReader is a schedule that knows a dependency's visibility lag
// (LearnedLag).
type lagReader interface {
	Lag(dependency string) (time.Duration, bool)
}

// aimed is the schedule of receipts read in batches (issue 22). A shared
// read costs a fraction of a request per receipt, and a read between the
// two moments that can settle a receipt settles nothing, so it reads a
// receipt just after the visibility lag its base schedule learned (when
// its effect, if any, should be visible) and again just after its absence
// window (when an absence concludes), instead of backing off in between:
//
//   - lag known and not yet reached: at submission + lag, no jitter (the
//     receipts of a burst are due together and read together);
//   - past the lag (or no lag known yet), before the absence window: at the
//     absence window, or earlier if the base schedule says so while the
//     lag is still unknown (it is learned from what those reads find);
//   - past the absence window: the base schedule.
//
// It tells its base what the reads found (Observer), so the lag keeps
// being learned.
type aimed struct {
	base Schedule
}

// Wait implements Schedule.
func (a aimed) Wait(w Waiting) time.Duration {
	if w.AbsenceAt.IsZero() || !w.AnsweredAt.Before(w.AbsenceAt) {
		return a.base.Wait(w)
	}
	toWindow := w.AbsenceAt.Sub(w.AnsweredAt) + aimPast
	l, ok := a.base.(lagReader)
	if !ok {
		return min(a.base.Wait(w), toWindow)
	}
	lag, known := l.Lag(w.Dependency)
	if !known {
		return min(a.base.Wait(w), toWindow)
	}
	if visible := w.SubmittedAt.Add(lag); w.AnsweredAt.Before(visible) && visible.Before(w.AbsenceAt) {
		return visible.Sub(w.AnsweredAt) + aimPast
	}
	return toWindow
}

// Observe implements Observer: the base learns from the aimed reads.
func (a aimed) Observe(o Observation) {
	if ob, ok := a.base.(Observer); ok {
		ob.Observe(o)
	}
}

var (
	_ Schedule = aimed{}
	_ Observer = aimed{}
)
