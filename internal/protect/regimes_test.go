package protect

import (
	"errors"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// regimeConfig is the default policy with no rate limit, so a simulated
// worker pool meets only the breaker and the adaptive concurrency.
func regimeConfig() Config {
	cfg := DefaultConfig()
	cfg.Instance = "test-1"
	cfg.Default.Rate.Limit = rate.Inf
	return cfg
}

// sim is a pool of workers calling one dependency on a fake clock: every
// tick it acquires as many permits as the guard grants, then completes
// them with the outcomes fail decides (by call number, so the run is
// deterministic).
type sim struct {
	h        *harness
	calls    int
	fail     func(call int) bool
	granted  int
	deferred map[Reason]int
	minLimit int
	maxLimit int
	opened   int
	probes   int
}

func newSim(t *testing.T, fail func(int) bool) *sim {
	h := newHarness(t, func(c *Config) { *c = regimeConfig() })
	return &sim{h: h, fail: fail, deferred: map[Reason]int{}, minLimit: 1 << 30}
}

// run simulates d of traffic, 20 workers, one round every tick; each
// round's calls complete before the next round.
func (s *sim) run(d, tick time.Duration) (successes int) {
	for end := s.h.clock.Now().Add(d); s.h.clock.Now().Before(end); s.h.clock.Advance(tick) {
		var ps []*Permit
		for range 20 {
			p, err := s.h.g.Acquire(t0Ctx, "api", First)
			var def *Deferral
			if errors.As(err, &def) {
				s.deferred[def.Reason]++
				continue
			}
			if err != nil {
				s.h.t.Fatal(err)
			}
			if p.Probe() {
				s.probes++
			}
			ps = append(ps, p)
		}
		st := s.h.g.Status("api")
		s.minLimit, s.maxLimit = min(s.minLimit, st.MaxInFlight), max(s.maxLimit, st.MaxInFlight)
		for _, p := range ps {
			s.granted++
			s.calls++
			before := s.h.g.Status("api").Breaker
			if s.fail(s.calls) {
				p.Done(Transient, 0)
			} else {
				p.Done(Success, 0)
				successes++
			}
			if before != Open && s.h.g.Status("api").Breaker == Open {
				s.opened++
			}
		}
	}
	return successes
}

// thirty fails 3 calls in 10.
func thirty(call int) bool { return call%10 == 1 || call%10 == 4 || call%10 == 7 }

func TestRegimes(t *testing.T) {
	const tick = 100 * time.Millisecond
	t.Run("healthy: no throttling", func(t *testing.T) {
		s := newSim(t, func(int) bool { return false })
		ok := s.run(time.Minute, tick)
		if s.opened != 0 || s.minLimit != 8 || ok != 8*600 {
			t.Fatalf("opened %d, min limit %d, %d successes (want 0, 8, %d)", s.opened, s.minLimit, ok, 8*600)
		}
		if st := s.h.g.Status("api"); st.Degraded || st.Breaker != Closed {
			t.Fatalf("status %+v", st)
		}
	})

	t.Run("partial outage, 30% errors: closed, throttled, continuing", func(t *testing.T) {
		s := newSim(t, thirty)
		var perWindow []int
		for range 12 {
			perWindow = append(perWindow, s.run(5*time.Second, tick))
		}
		if s.opened != 0 {
			t.Fatalf("the breaker opened %d times under a 30%% error rate", s.opened)
		}
		st := s.h.g.Status("api")
		if !st.Degraded || s.minLimit >= 8 || s.deferred[ReasonDegraded] == 0 {
			t.Fatalf("not throttled: min limit %d, deferrals %v, status %+v", s.minLimit, s.deferred, st)
		}
		for i, n := range perWindow {
			if n == 0 {
				t.Fatalf("no success in the %dth 5s window: throughput stopped (%v)", i, perWindow)
			}
		}
		if s.deferred[ReasonBreakerOpen] != 0 {
			t.Fatalf("deferred by the breaker: %v", s.deferred)
		}
	})

	t.Run("hard down: opens, one probe per cooldown; recovering: closes, concurrency climbs back", func(t *testing.T) {
		down := true
		s := newSim(t, func(int) bool { return down })
		s.run(time.Second, tick)
		st := s.h.g.Status("api")
		// The 20th outcome opens it; calls of that round already in flight
		// complete, and are stale: they move nothing.
		if s.opened != 1 || st.Breaker != Open || s.calls > 24 {
			t.Fatalf("opened %d after %d calls; status %+v (want open after MinCalls=20)", s.opened, s.calls, st)
		}
		n := s.calls
		if want := "100% transient failures (20 of 20 calls in the last 30s) >= 50%"; st.OpenReason != want {
			t.Fatalf("open reason %q, want %q", st.OpenReason, want)
		}
		openUntil := st.OpenUntil
		// Until the cool-down ends: no call, every caller told to come back
		// at its end, when exactly one probe goes.
		d := s.h.deferral("api", First, ReasonBreakerOpen)
		wantUntil(t, d, openUntil)
		s.run(openUntil.Sub(s.h.clock.Now()), tick)
		if s.calls != n || s.probes != 0 {
			t.Fatalf("%d calls, %d probes during the cool-down", s.calls, s.probes)
		}
		s.run(tick, tick) // the cool-down ends in this round: one probe, it fails
		if s.calls != n+1 || s.probes != 1 || s.h.g.Status("api").Breaker != Open {
			t.Fatalf("%d calls, %d probes at the end of the cool-down; %+v", s.calls, s.probes, s.h.g.Status("api"))
		}

		down = false // recovering
		s.h.clock.Advance(cooldown(s.h.g.cfg.Default.Breaker, 1))
		s.minLimit, s.maxLimit = 1<<30, 0
		s.run(tick, tick)
		st = s.h.g.Status("api")
		if s.probes != 2 || st.Breaker != Closed || st.MaxInFlight > 2 {
			t.Fatalf("after a good probe: %d probes, status %+v (want closed, limit back from the floor: at most 2)", s.probes, st)
		}
		var limits []int
		for range 30 {
			s.run(tick, tick)
			limits = append(limits, s.h.g.Status("api").MaxInFlight)
		}
		for i := 1; i < len(limits); i++ {
			if limits[i] < limits[i-1] {
				t.Fatalf("limit fell while recovering: %v", limits)
			}
		}
		if limits[len(limits)-1] != 8 {
			t.Fatalf("concurrency did not climb back to 8: %v", limits)
		}
	})
}

func TestPermitRetryChargesTheBudget(t *testing.T) {
	h := newHarness(t, func(c *Config) {
		c.Default.RetryBudget.MinRetries = 2
		c.Default.RetryBudget.Ratio = 0
	})
	p := h.permit("api", First)
	var r Retrier = p
	if err := r.Retry(); err != nil {
		t.Fatal(err)
	}
	if err := r.Retry(); err != nil {
		t.Fatal(err)
	}
	var d *Deferral
	if err := r.Retry(); !errors.As(err, &d) || d.Reason != ReasonBudgetExhausted {
		t.Fatalf("third retry: %v, want a budget deferral", err)
	}
	if p.Retries() != 2 {
		t.Fatalf("Retries() = %d, want 2", p.Retries())
	}
	p.Done(Success, 0)
	if err := p.Retry(); err == nil {
		t.Fatal("Retry after Done allowed")
	}
	// The in-call retries spent the budget of retries acquired as such.
	h.deferral("api", Retry, ReasonBudgetExhausted)

	t.Run("refused once the breaker opened during the call", func(t *testing.T) {
		h := newHarness(t, nil)
		p := h.permit("api", First)
		h.open("api")
		if err := p.Retry(); !errors.As(err, &d) || d.Reason != ReasonBreakerOpen {
			t.Fatalf("Retry: %v, want a breaker deferral", err)
		}
		p.Done(Transient, 0)
	})

	t.Run("context carries the retrier", func(t *testing.T) {
		if RetrierFrom(t0Ctx) != nil {
			t.Fatal("a bare context carries a retrier")
		}
		p := newHarness(t, nil).permit("api", First)
		if RetrierFrom(WithRetrier(t0Ctx, p)) != Retrier(p) {
			t.Fatal("RetrierFrom does not return the permit")
		}
	})
}
