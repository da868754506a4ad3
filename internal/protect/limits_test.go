package protect

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

func TestRetryAfterIsHonoured(t *testing.T) {
	tests := []struct {
		name       string
		retryAfter []time.Duration // reported by concurrent calls at the same instant
		want       time.Duration   // no permit before t0+want
	}{
		{"simple", []time.Duration{10 * time.Second}, 10 * time.Second},
		{"capped by MaxRetryAfter", []time.Duration{48 * time.Hour}, time.Hour},
		{"a shorter one does not shorten a longer one", []time.Duration{20 * time.Second, 5 * time.Second}, 20 * time.Second},
		{"a longer one extends", []time.Duration{5 * time.Second, 20 * time.Second}, 20 * time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			// Calls in flight together, reporting one after another.
			var ps []*Permit
			for range tc.retryAfter {
				ps = append(ps, h.permit("api", First))
			}
			for i, ra := range tc.retryAfter {
				// Success or not, a Retry-After is a Retry-After.
				ps[i].Done(Success, ra)
			}
			d := h.deferral("api", First, ReasonRateLimited)
			wantUntil(t, d, t0.Add(tc.want))
			if st := h.g.Status("api"); !st.RetryAfterUntil.Equal(t0.Add(tc.want)) {
				t.Fatalf("status RetryAfterUntil %v", st.RetryAfterUntil)
			}
			h.clock.Advance(tc.want - time.Millisecond)
			wantUntil(t, h.deferral("api", Retry, ReasonRateLimited), t0.Add(tc.want))
			h.clock.Advance(time.Millisecond)
			h.permit("api", First)
		})
	}

	t.Run("zero and negative are ignored", func(t *testing.T) {
		h := newHarness(t, nil)
		h.permit("api", First).Done(Transient, 0)
		h.permit("api", First).Done(Transient, -time.Second)
		h.permit("api", First)
	})
}

func TestConcurrencyLimit(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Default.Concurrency.MaxInFlight = 3 })
	var ps []*Permit
	for range 3 {
		ps = append(ps, h.permit("api", First))
	}
	d := h.deferral("api", First, ReasonConcurrency)
	wantUntil(t, d, t0.Add(h.g.cfg.Default.Concurrency.BusyDelay))
	h.deferral("api", Retry, ReasonConcurrency)
	if st := h.g.Status("api"); st.InFlight != 3 || st.MaxInFlight != 3 {
		t.Fatalf("status %+v", st)
	}

	ps[0].Done(Success, 0)
	ps[0].Done(Success, 0) // a second report frees nothing
	ps = append(ps[1:], h.permit("api", First))
	h.deferral("api", First, ReasonConcurrency)

	// Every outcome frees its slot.
	for i, o := range []Outcome{Transient, Permanent, Abandoned} {
		ps[i].Done(o, 0)
	}
	for range 3 {
		h.permit("api", First)
	}
	h.deferral("api", First, ReasonConcurrency)
}

// Issue 9: a call refused only for want of a slot waits for one, up to the
// busy delay, rather than being deferred at once; a call refused for any
// other reason (here the rate limit) is deferred at once, as by Acquire.
func TestAcquireWaitTakesTheNextFreeSlot(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Concurrency.MaxInFlight = 1
		c.Default.Concurrency.BusyDelay = 50 * time.Millisecond // on the fake clock: a real 50 ms timer
	})
	held := h.permit("api", First)
	got := make(chan error, 1)
	go func() {
		p, err := h.g.AcquireWait(context.Background(), "api", First)
		if err == nil {
			p.Done(Success, 0)
		}
		got <- err
	}()
	// The waiter cannot have its permit while held is in flight; once held
	// is done, it takes the slot (however late it got to wait: its channel
	// is taken before it asks).
	held.Done(Success, 0)
	if err := <-got; err != nil {
		t.Fatalf("waiter: %v, want the freed slot", err)
	}

	held = h.permit("api", First)
	_, err := h.g.AcquireWait(context.Background(), "api", First)
	var d *Deferral
	if !errors.As(err, &d) || d.Reason != ReasonConcurrency {
		t.Fatalf("no slot freed within the busy delay: %v, want a concurrency deferral", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := h.g.AcquireWait(ctx, "api", First); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	held.Done(Success, 0)

	r := newHarness(t, func(c *Config) {
		c.Default.Rate.Limit = 1
		c.Default.Rate.Burst = 1
	})
	r.permit("api", First).Done(Success, 0)
	if _, err := r.g.AcquireWait(context.Background(), "api", First); !errors.As(err, &d) || d.Reason != ReasonRateLimited {
		t.Fatalf("rate limited: %v, want a rate deferral at once", err)
	}
}

func TestRateLimit(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Rate.Limit = 2 // one token per 500ms
		c.Default.Rate.Burst = 3
	})
	for range 3 {
		h.permit("api", First).Done(Success, 0)
	}
	d := h.deferral("api", First, ReasonRateLimited)
	wantUntil(t, d, t0.Add(500*time.Millisecond))
	// Deferred calls consume no tokens: the deferral's time still holds.
	for range 10 {
		wantUntil(t, h.deferral("api", Retry, ReasonRateLimited), t0.Add(500*time.Millisecond))
	}
	h.clock.Advance(500 * time.Millisecond)
	h.permit("api", First).Done(Success, 0)
	wantUntil(t, h.deferral("api", First, ReasonRateLimited), t0.Add(time.Second))

	// Refill to the burst, not beyond.
	h.clock.Advance(time.Hour)
	for range 3 {
		h.permit("api", First).Done(Success, 0)
	}
	h.deferral("api", First, ReasonRateLimited)
}

func TestRateLimitConsumesNothingWhenAnotherCheckDefers(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Rate.Limit = 1
		c.Default.Rate.Burst = 1
		c.Default.Concurrency.MaxInFlight = 1
	})
	p := h.permit("api", First) // the only token
	h.clock.Advance(time.Second)
	// One token is back, but the slot is taken: the token must survive.
	h.deferral("api", First, ReasonConcurrency)
	p.Done(Success, 0)
	h.permit("api", First)
}

func TestRetryBudget(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.RetryBudget = RetryBudgetPolicy{Ratio: 0.2, MinRetries: 2, Window: time.Minute}
	})

	// With no first calls, MinRetries retries are allowed.
	for range 2 {
		h.permit("api", Retry).Done(Transient, 0)
		h.call("api", Success) // keep the breaker closed
	}
	// 2 first calls so far (the successes): allowance is max(2, 0.4) = 2.
	d := h.deferral("api", Retry, ReasonBudgetExhausted)
	if !strings.Contains(d.Detail, "2 retries for 2 first calls") {
		t.Fatalf("detail %q", d.Detail)
	}
	// Every retry so far happened at t0, in one bucket: the budget frees
	// when that bucket leaves the window.
	wantUntil(t, d, t0.Add(time.Minute))

	// First calls are never refused by the budget, and they grow it:
	// 20 first calls allow max(2, 0.2×20) = 4 retries.
	h.clock.Advance(10 * time.Second)
	for range 18 {
		h.call("api", Success)
	}
	for range 2 {
		h.permit("api", Retry).Done(Success, 0)
	}
	d = h.deferral("api", Retry, ReasonBudgetExhausted)
	// At t0+60s the t0 bucket (2 firsts, 2 retries) leaves: 2 retries for
	// 18 firsts, allowance max(2, 3) = 3 > 2.
	wantUntil(t, d, t0.Add(time.Minute))
	h.permit("api", First).Done(Success, 0)

	h.clock.Advance(50*time.Second - time.Millisecond)
	h.deferral("api", Retry, ReasonBudgetExhausted)
	h.clock.Advance(time.Millisecond)
	h.permit("api", Retry).Done(Success, 0)
}

func TestRetryBudgetWithoutMinimumWaitsForFirstCalls(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.RetryBudget = RetryBudgetPolicy{Ratio: 0.5, MinRetries: 0, Window: time.Minute}
	})
	d := h.deferral("api", Retry, ReasonBudgetExhausted)
	if !d.Until.After(t0) {
		t.Fatalf("until %v", d.Until)
	}
	h.call("api", Success)
	h.call("api", Success)
	h.permit("api", Retry).Done(Success, 0) // 1 < 0.5×2
	h.deferral("api", Retry, ReasonBudgetExhausted)
}

func TestDegradedModeEntersAndRecovers(t *testing.T) {
	edit := func(c *Config) {
		c.Default.Breaker.FailureThreshold = 1000 // this test is about the rate, not the streak
		c.Default.Concurrency.MaxInFlight = 8
		c.Default.Degraded.EnterRate, c.Default.Degraded.ExitRate = 0.5, 0.25
	}

	t.Run("not below MinCalls", func(t *testing.T) {
		h := newHarness(t, edit)
		for range 19 {
			h.call("api", Transient)
		}
		if st := h.g.Status("api"); st.Degraded || st.ErrorRate != 1 || st.Calls != 19 {
			t.Fatalf("status %+v", st)
		}
		h.call("api", Transient)
		if st := h.g.Status("api"); !st.Degraded {
			t.Fatalf("not degraded at 20 calls, 100%% failures: %+v", st)
		}
	})

	t.Run("permanent failures do not degrade", func(t *testing.T) {
		h := newHarness(t, edit)
		for range 100 {
			h.call("api", Permanent)
		}
		if st := h.g.Status("api"); st.Degraded || st.Calls != 0 {
			t.Fatalf("status %+v", st)
		}
	})

	t.Run("enters at the threshold, limits concurrency, recovers below the exit rate", func(t *testing.T) {
		h := newHarness(t, edit)
		// An intermittent failure: never 5 in a row, so the breaker stays closed.
		for i := range 19 {
			if i%2 == 0 {
				h.call("api", Transient)
			} else {
				h.call("api", Success)
			}
		}
		if st := h.g.Status("api"); st.Degraded {
			t.Fatalf("degraded at 19 calls: %+v", st)
		}
		h.call("api", Success) // 10 of 20 = 50% >= 50%
		st := h.g.Status("api")
		if !st.Degraded || st.MaxInFlight != 8 || st.Breaker != Closed {
			t.Fatalf("entering alone should lower nothing: %+v", st)
		}
		if !strings.Contains(st.DegradedReason, "50% transient failures (10 of 20 calls") {
			t.Fatalf("stop reason %q", st.DegradedReason)
		}
		h.call("api", Transient) // 11 of 21: a failure while degraded halves the limit
		h.call("api", Transient) // 12 of 22: same burst (DecreaseInterval), no second decrease
		if st := h.g.Status("api"); st.MaxInFlight != 4 {
			t.Fatalf("limit after a burst of failures: %+v", st)
		}

		var ps []*Permit
		for range 4 {
			ps = append(ps, h.permit("api", First))
		}
		d := h.deferral("api", First, ReasonDegraded)
		wantUntil(t, d, t0.Add(h.g.cfg.Default.Degraded.Delay))
		if d.Detail != st.DegradedReason {
			t.Fatalf("deferral detail %q, want the stop reason %q", d.Detail, st.DegradedReason)
		}
		for _, p := range ps {
			p.Done(Success, 0) // 12 of 26
		}

		// 12 of 48 = 25% is not below the exit rate; 12 of 49 is.
		for range 22 {
			h.call("api", Success)
		}
		if st := h.g.Status("api"); !st.Degraded {
			t.Fatalf("recovered at 25%%: %+v", st)
		}
		h.call("api", Success)
		st = h.g.Status("api")
		if st.Degraded || st.DegradedReason != "" || st.MaxInFlight != 8 {
			t.Fatalf("not recovered at 12 of 49, or the limit did not climb back: %+v", st)
		}
		ps = []*Permit{h.permit("api", First), h.permit("api", First)} // concurrency is back
		for _, p := range ps {
			p.Done(Success, 0)
		}
		msgs := h.logs.messages("api")
		if !containsAll(msgs, "protect: dependency degraded", "protect: dependency recovered from degraded mode") {
			t.Fatalf("logs %q", msgs)
		}
	})

	t.Run("recovers when a whole window passes without a failure", func(t *testing.T) {
		h := newHarness(t, edit)
		for range 20 {
			h.call("api", Transient)
		}
		h.clock.Advance(30 * time.Second)
		h.call("api", Success) // too few to decide
		if st := h.g.Status("api"); !st.Degraded {
			t.Fatalf("status %+v", st)
		}
		h.clock.Advance(30 * time.Second) // the failures leave the window
		if st := h.g.Status("api"); st.Degraded {
			t.Fatalf("still degraded after a clean window: %+v", st)
		}
	})
}

func TestDependenciesAreIsolated(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Concurrency.MaxInFlight = 2
		slow := c.Default
		slow.Concurrency.MaxInFlight = 1
		c.Dependencies = map[string]Policy{"slow-api": slow}
	})

	h.open("a")
	h.deferral("a", First, ReasonBreakerOpen)
	h.permit("b", First).Done(Success, 0)
	h.wantState("b", Closed)

	h.permit("b", First).Done(Success, time.Hour)
	h.deferral("b", First, ReasonRateLimited)
	h.permit("c", First).Done(Success, 0)

	c1, c2 := h.permit("c", First), h.permit("c", First)
	h.deferral("c", First, ReasonConcurrency)
	h.permit("d", First)
	h.permit("d", First)
	c1.Done(Success, 0)
	c2.Done(Success, 0)

	// Per-dependency policy.
	h.permit("slow-api", First)
	h.deferral("slow-api", First, ReasonConcurrency)

	states := h.g.States()
	want := map[string]BreakerState{"a": Open, "b": Closed, "c": Closed, "d": Closed, "slow-api": Closed}
	if len(states) != len(want) {
		t.Fatalf("states %v", states)
	}
	for dep, s := range want {
		if states[dep] != s {
			t.Fatalf("states %v, want %v", states, want)
		}
	}
	// Logs name their dependency.
	if msgs := h.logs.messages("a"); !containsAll(msgs, "protect: circuit breaker opened") {
		t.Fatalf("logs of a: %q", msgs)
	}
	if msgs := h.logs.messages("c"); containsAll(msgs, "protect: circuit breaker opened") {
		t.Fatalf("logs of c: %q", msgs)
	}
}

func TestAcquireRefusesBadInput(t *testing.T) {
	h := newHarness(t, nil)
	if _, err := h.g.Acquire(context.Background(), "", First); err == nil || errors.Is(err, ErrDeferred) {
		t.Fatalf("empty dependency: %v", err)
	}
	if _, err := h.g.Acquire(context.Background(), "api", Kind(7)); err == nil || errors.Is(err, ErrDeferred) {
		t.Fatalf("bad kind: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := h.g.Acquire(ctx, "api", First); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context: %v", err)
	}
	if st := h.g.Status("never-used"); st.Breaker != Closed || st.InFlight != 0 {
		t.Fatalf("unused dependency status %+v", st)
	}
}

func TestRateInfIgnoresBurst(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Rate = RatePolicy{Limit: rate.Inf, Burst: 0, MaxRetryAfter: time.Minute}
	})
	for range 100 {
		h.permit("api", First).Done(Success, 0)
	}
}

func containsAll(have []string, want ...string) bool {
	for _, w := range want {
		found := false
		for _, h := range have {
			if h == w {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// Issue 9: a backlog deferred by the rate limit at one moment comes back
// spread over the times the limit admits it. Until stays the earliest time
// a call can pass (deferrals consume nothing); Slot books the deferrals
// one interval apart (a token at 80 % of the rate) after the slots already
// booked, and once the booked slots have passed the next deferral starts
// afresh at its Until.
func TestRateLimitedDeferralsAreBookedOneTokenApart(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.Rate.Limit = 2 // one token per 500ms
		c.Default.Rate.Burst = 3
	})
	gap := 625 * time.Millisecond // 1/(0.8 × 2/s)
	for range 3 {
		h.permit("api", First).Done(Success, 0)
	}
	for k := range 5 {
		d := h.deferral("api", First, ReasonRateLimited)
		wantUntil(t, d, t0.Add(500*time.Millisecond))
		if want := t0.Add(500*time.Millisecond + time.Duration(k)*gap); !d.Slot.Equal(want) {
			t.Fatalf("deferral %d: slot t0+%v, want t0+%v", k, d.Slot.Sub(t0), want.Sub(t0))
		}
	}
	// The first booked caller comes back at its slot and passes; the
	// others still hold theirs, so a newcomer queues after them.
	h.clock.Advance(500 * time.Millisecond)
	h.permit("api", First).Done(Success, 0)
	if d, want := h.deferral("api", First, ReasonRateLimited), t0.Add(500*time.Millisecond+5*gap); !d.Slot.Equal(want) {
		t.Fatalf("newcomer slot t0+%v, want t0+%v (after the five booked)", d.Slot.Sub(t0), want.Sub(t0))
	}
	// Every slot has passed: a deferral's slot is its Until again.
	h.clock.Advance(time.Minute)
	for range 3 {
		h.permit("api", First).Done(Success, 0)
	}
	d := h.deferral("api", First, ReasonRateLimited)
	if !d.Slot.Equal(d.Until) {
		t.Fatalf("slot %v, until %v: want equal once the booking has passed", d.Slot, d.Until)
	}

	// A Retry-After books from its end: the burst the limiter will hold
	// then is not trusted, the calls return one token apart.
	h.clock.Advance(time.Second)
	h.permit("api", First).Done(Success, 10*time.Second)
	end := h.clock.Now().Add(10 * time.Second)
	for k := range 3 {
		d := h.deferral("api", First, ReasonRateLimited)
		wantUntil(t, d, end)
		if want := end.Add(time.Duration(k) * gap); !d.Slot.Equal(want) {
			t.Fatalf("Retry-After deferral %d: slot %v after its end, want %v", k, d.Slot.Sub(end), want.Sub(end))
		}
	}

	// Other reasons are not booked: the slot is the Until.
	o := newHarness(t, func(c *Config) { c.Default.Concurrency.MaxInFlight = 1 })
	o.permit("api", First)
	if d := o.deferral("api", First, ReasonConcurrency); !d.Slot.Equal(d.Until) {
		t.Fatalf("concurrency deferral: slot %v, until %v", d.Slot, d.Until)
	}
}

// Issue 9: each request a call makes after its first (the next page)
// counts as a first call for the retry budget, so the budget grows with
// the pages read; once the call is done, Sent counts nothing.
func TestSentGrowsTheRetryBudget(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.RetryBudget = RetryBudgetPolicy{Ratio: 0.5, MinRetries: 0, Window: time.Minute}
	})
	p := h.permit("api", First) // 1 first call: allowance floor(0.5) = 0
	var d *Deferral
	if err := p.Retry(); !errors.As(err, &d) || d.Reason != ReasonBudgetExhausted {
		t.Fatalf("retry with one first call: %v, want the budget to refuse", err)
	}
	if !d.Slot.Equal(d.Until) {
		t.Fatalf("budget deferral: slot %v, until %v", d.Slot, d.Until)
	}
	for range 3 {
		p.Sent() // pages 2 to 4: 4 first calls, allowance 2
	}
	for range 2 {
		if err := p.Retry(); err != nil {
			t.Fatalf("retry within a budget of 2: %v", err)
		}
	}
	if err := p.Retry(); !errors.As(err, &d) || d.Reason != ReasonBudgetExhausted {
		t.Fatalf("third retry: %v, want the budget to refuse", err)
	}
	p.Done(Success, 0)
	p.Sent()
	p.Sent()
	if d := h.deferral("api", Retry, ReasonBudgetExhausted); !strings.Contains(d.Detail, "2 retries for 4 first calls") {
		t.Fatalf("Sent after Done counted: %s", d.Detail)
	}
	var nilPermit *Permit
	nilPermit.Sent() // a nil permit's Sent does nothing, like its Done
}
