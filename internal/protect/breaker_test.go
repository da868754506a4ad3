package protect

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

func TestBreakerCountsOnlyTransientFailures(t *testing.T) {
	const T, S, P, A = Transient, Success, Permanent, Abandoned
	tests := []struct {
		name     string
		outcomes []Outcome
		want     BreakerState
	}{
		{"threshold transient failures open", []Outcome{T, T, T, T, T}, Open},
		{"one short of the threshold stays closed", []Outcome{T, T, T, T}, Closed},
		{"permanent failures never open", slices.Repeat([]Outcome{P}, 50), Closed},
		{"abandoned calls never open", slices.Repeat([]Outcome{A}, 50), Closed},
		{"a success resets the count", []Outcome{T, T, T, T, S, T, T, T, T}, Closed},
		{"permanent is neutral: neither counts nor resets", []Outcome{T, T, P, T, P, T, A, T}, Open},
		{"successes and permanents only", []Outcome{S, P, S, P, S, P}, Closed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			for _, o := range tc.outcomes {
				h.call("api", o)
			}
			h.wantState("api", tc.want)
		})
	}
}

func TestBreakerOpenDefersUntilCooldownThenHalfOpen(t *testing.T) {
	h := newHarness(t, nil)
	h.open("api")
	openedAt := h.clock.Now()
	cool := h.g.cfg.Default.Breaker.Cooldown

	d := h.deferral("api", First, ReasonBreakerOpen)
	wantUntil(t, d, openedAt.Add(cool))
	if st := h.g.Status("api"); !st.OpenUntil.Equal(openedAt.Add(cool)) || st.OpenReason != "5 consecutive transient failures" {
		t.Fatalf("status = %+v", st)
	}

	h.clock.Advance(cool - time.Nanosecond)
	wantUntil(t, h.deferral("api", First, ReasonBreakerOpen), openedAt.Add(cool))
	wantUntil(t, h.deferral("api", Retry, ReasonBreakerOpen), openedAt.Add(cool))

	h.clock.Advance(time.Nanosecond)
	h.wantState("api", HalfOpen)
	p := h.permit("api", First)
	if !p.Probe() {
		t.Fatal("the first permit after the cool-down is not the probe")
	}
	d = h.deferral("api", First, ReasonBreakerOpen)
	wantUntil(t, d, h.clock.Now().Add(h.g.cfg.Default.Concurrency.BusyDelay))
	p.Done(Success, 0)
	h.wantState("api", Closed)

	want := []string{
		"protect: circuit breaker opened",
		"protect: circuit breaker half-open",
		"protect: circuit breaker probe sent",
		"protect: circuit breaker closed",
	}
	if got := h.logs.messages("api"); !slices.Equal(got, want) {
		t.Fatalf("logs for api:\n got %q\nwant %q", got, want)
	}
}

func TestHalfOpenGrantsExactlyOneProbeToConcurrentCallers(t *testing.T) {
	for _, probeOutcome := range []Outcome{Success, Transient} {
		t.Run(probeOutcome.String(), func(t *testing.T) {
			h := newHarness(t, nil)
			h.open("api")
			h.clock.Advance(h.g.cfg.Default.Breaker.Cooldown)

			const callers = 50
			var (
				wg        sync.WaitGroup
				start     = make(chan struct{})
				mu        sync.Mutex
				permits   []*Permit
				deferrals []*Deferral
				others    []error
			)
			for range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					p, err := h.g.Acquire(context.Background(), "api", First)
					mu.Lock()
					defer mu.Unlock()
					var d *Deferral
					switch {
					case err == nil:
						permits = append(permits, p)
					case errors.As(err, &d):
						deferrals = append(deferrals, d)
					default:
						others = append(others, err)
					}
				}()
			}
			close(start)
			wg.Wait()

			if len(permits) != 1 || len(deferrals) != callers-1 || len(others) != 0 {
				t.Fatalf("%d permits, %d deferrals, other errors %v; want 1 and %d", len(permits), len(deferrals), others, callers-1)
			}
			if !permits[0].Probe() {
				t.Fatal("the single permit is not marked as the probe")
			}
			for _, d := range deferrals {
				if d.Reason != ReasonBreakerOpen {
					t.Fatalf("deferred for %s, want %s", d.Reason, ReasonBreakerOpen)
				}
			}

			permits[0].Done(probeOutcome, 0)
			if probeOutcome == Success {
				h.wantState("api", Closed)
				for range 10 {
					p := h.permit("api", First)
					if p.Probe() {
						t.Fatal("a permit of a closed breaker is marked as a probe")
					}
					p.Done(Success, 0)
				}
			} else {
				h.wantState("api", Open)
				h.deferral("api", First, ReasonBreakerOpen)
			}
		})
	}
}

func TestProbeOutcomes(t *testing.T) {
	tests := []struct {
		name      string
		outcome   Outcome
		wantState BreakerState
		// wantNextProbe: right after the report, the next caller is a probe.
		wantNextProbe bool
	}{
		{"success closes", Success, Closed, false},
		{"transient failure reopens", Transient, Open, false},
		{"permanent is no verdict: still half-open, next caller probes", Permanent, HalfOpen, true},
		{"abandoned is no verdict: still half-open, next caller probes", Abandoned, HalfOpen, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.open("api")
			h.clock.Advance(h.g.cfg.Default.Breaker.Cooldown)
			h.permit("api", First).Done(tc.outcome, 0)
			h.wantState("api", tc.wantState)
			switch {
			case tc.wantNextProbe:
				if p := h.permit("api", First); !p.Probe() {
					t.Fatal("next permit is not a probe")
				}
			case tc.wantState == Open:
				h.deferral("api", First, ReasonBreakerOpen)
			default:
				h.permit("api", First).Done(Success, 0)
			}
		})
	}
}

func TestFailedProbesGrowTheCooldown(t *testing.T) {
	h := newHarness(t, nil) // Cooldown 30s, growth 2, max 5m
	h.open("api")
	wantCooldowns := []time.Duration{
		60 * time.Second, 120 * time.Second, 240 * time.Second,
		5 * time.Minute, 5 * time.Minute, // capped
	}
	cool := 30 * time.Second
	for i, want := range wantCooldowns {
		h.clock.Advance(cool)
		p := h.permit("api", First)
		if !p.Probe() {
			t.Fatalf("failed probe %d: permit is not a probe", i)
		}
		p.Done(Transient, 0)
		d := h.deferral("api", First, ReasonBreakerOpen)
		wantUntil(t, d, h.clock.Now().Add(want))
		cool = want
	}
	// A successful probe resets the cool-down for the next opening.
	h.clock.Advance(cool)
	h.permit("api", First).Done(Success, 0)
	h.wantState("api", Closed)
	h.open("api")
	wantUntil(t, h.deferral("api", First, ReasonBreakerOpen), h.clock.Now().Add(30*time.Second))
}

func TestStalePermitsDoNotMoveTheBreaker(t *testing.T) {
	h := newHarness(t, nil)
	// Calls granted while closed, still in flight when the breaker opens.
	var late []*Permit
	for range 3 {
		late = append(late, h.permit("api", First))
	}
	h.open("api")
	late[0].Done(Success, 0) // reported while open: must not close it
	h.wantState("api", Open)

	h.clock.Advance(h.g.cfg.Default.Breaker.Cooldown)
	late[1].Done(Success, 0) // reported while half-open: not the probe
	h.wantState("api", HalfOpen)
	probe := h.permit("api", First)
	if !probe.Probe() {
		t.Fatal("no probe after a stale success")
	}
	late[2].Done(Transient, 0) // a stale failure must not reopen it either
	h.wantState("api", HalfOpen)
	probe.Done(Success, 0)
	h.wantState("api", Closed)
	if st := h.g.Status("api"); st.InFlight != 0 {
		t.Fatalf("in flight = %d after every permit is done", st.InFlight)
	}
}

func TestDoneIsIdempotentAndNilSafe(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.Default.Concurrency.MaxInFlight = 1 })
	p := h.permit("api", First)
	p.Done(Transient, 0)
	p.Done(Transient, 0) // ignored
	p.Done(Success, 0)   // ignored
	if st := h.g.Status("api"); st.ConsecutiveFailures != 1 || st.InFlight != 0 {
		t.Fatalf("after one report counted thrice: failures %d, in flight %d", st.ConsecutiveFailures, st.InFlight)
	}
	// The deferred safety net after a real report does nothing.
	func() {
		p := h.permit("api", First)
		defer p.Done(Abandoned, 0)
		p.Done(Success, 0)
	}()
	if st := h.g.Status("api"); st.ConsecutiveFailures != 0 || st.InFlight != 0 {
		t.Fatalf("status %+v", st)
	}
	var nilPermit *Permit
	nilPermit.Done(Success, 0)
}
