package reconcile

import (
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
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
	c := f.Ceiling(n)
	if c <= 0 {
		return 0
	}
	draw := f.Int63n
	if draw == nil {
		draw = rand.Int64N
	}
	return time.Duration(draw(int64(c)))
}

// NextBackOff returns the next wait and advances the attempt counter.
func (f *FullJitter) NextBackOff() time.Duration {
	d := f.Delay(f.attempt)
	f.attempt++
	return d
}

// Reset starts the schedule over.
func (f *FullJitter) Reset() { f.attempt = 0 }
