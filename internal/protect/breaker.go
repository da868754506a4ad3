package protect

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"time"
)

// Done reports the call's outcome and, if the dependency sent one (e.g. with
// a 429 or 503), its Retry-After: no permit for the dependency is granted
// before now+retryAfter (capped by Rate.MaxRetryAfter). Only the first call
// of Done on a permit counts.
//
// When the outcome opens the breaker, Done records the opening in the Store
// (bounded by Config.StoreTimeout) before it returns.
func (p *Permit) Done(outcome Outcome, retryAfter time.Duration) {
	if p == nil || !p.done.CompareAndSwap(false, true) {
		return
	}
	g, d := p.g, p.d
	now := g.clock.Now()
	var ev events
	var publish *SharedOpen

	d.mu.Lock()
	d.inFlight--
	if d.freed != nil {
		close(d.freed)
		d.freed = nil
	}
	if retryAfter > 0 {
		ra := min(retryAfter, d.policy.Rate.MaxRetryAfter)
		if until := now.Add(ra); until.After(d.retryAfterUntil) {
			d.retryAfterUntil = until
			ev.add(slog.LevelInfo, "protect: honouring Retry-After",
				slog.Duration("retry_after", ra), slog.Time("until", until))
		}
	}
	switch outcome {
	case Success:
		d.health.add(now, cSuccess)
	case Transient:
		d.health.add(now, cTransient)
	}
	g.advance(d, now, &ev) // also re-evaluates degraded mode with this outcome
	g.adapt(d, now, outcome, &ev)
	if p.gen == d.gen {
		switch {
		case p.probe:
			d.probing = false
			switch outcome {
			case Success:
				g.closeLocked(d, &ev)
			case Transient:
				d.failedProbes++
				publish = g.openLocked(d, now, "half-open probe failed", &ev)
			}
			// Permanent, Abandoned: no verdict; the next caller probes.
		case d.state == Closed:
			switch outcome {
			case Success:
				d.failures = 0
			case Transient:
				d.failures++
			}
			b := d.policy.Breaker
			switch outcome {
			case Success:
				d.brk.add(now, cSuccess)
			case Transient:
				d.brk.add(now, cTransient)
				c := d.brk.sum(now)
				calls, failed := c[cSuccess]+c[cTransient], c[cTransient]
				switch {
				case calls >= b.MinCalls && float64(failed) >= b.FailureRate*float64(calls):
					publish = g.openLocked(d, now, fmt.Sprintf(
						"%.0f%% transient failures (%d of %d calls in the last %v) >= %.0f%%",
						100*float64(failed)/float64(calls), failed, calls, b.Window, 100*b.FailureRate), &ev)
				case b.FailureThreshold > 0 && d.failures >= b.FailureThreshold:
					publish = g.openLocked(d, now,
						fmt.Sprintf("%d consecutive transient failures", d.failures), &ev)
				}
			}
		}
	}
	d.mu.Unlock()
	g.emit(d, ev)

	if publish != nil {
		g.publish(d, *publish)
	}
}

// publish shares an opening through the Store. If another instance holds a
// later opening, it is cached and adopted at the next Acquire.
func (g *Guard) publish(d *dependency, o SharedOpen) {
	ctx, cancel := context.WithTimeout(context.Background(), g.cfg.StoreTimeout)
	defer cancel()
	row, err := g.store.Open(ctx, d.name, o.Until, o.By, o.Reason)
	if err != nil {
		g.log.Warn("protect: cannot share circuit breaker opening; other instances will not see it",
			"dependency", d.name, "open_until", o.Until, "error", err)
		return
	}
	d.mu.Lock()
	d.keepShared(row)
	d.mu.Unlock()
}

// advance applies what time alone changes: adopting a shared opening,
// open → half-open when the cool-down is over, degraded-mode recovery.
func (g *Guard) advance(d *dependency, now time.Time, ev *events) {
	if s := d.shared; s.Until.After(now) {
		switch {
		case d.state != Open:
			d.state = Open
			d.gen++
			d.probing = false
			d.failures = 0
			d.openUntil = s.Until
			d.openReason = fmt.Sprintf("opened by %s: %s", s.By, s.Reason)
			ev.add(slog.LevelWarn, "protect: circuit breaker opened by another instance",
				slog.Time("open_until", s.Until), slog.String("opened_by", s.By), slog.String("reason", s.Reason))
		case s.Until.After(d.openUntil):
			d.openUntil = s.Until
			d.openReason = fmt.Sprintf("opened by %s: %s", s.By, s.Reason)
			ev.add(slog.LevelInfo, "protect: circuit breaker opening extended by another instance",
				slog.Time("open_until", s.Until), slog.String("opened_by", s.By), slog.String("reason", s.Reason))
		}
	}
	if d.state == Open && !now.Before(d.openUntil) {
		d.state = HalfOpen
		d.gen++
		d.probing = false
		ev.add(slog.LevelInfo, "protect: circuit breaker half-open")
	}
	g.evalDegraded(d, now, ev)
}

// openLocked opens d's breaker for the current cool-down and returns the
// opening to share.
func (g *Guard) openLocked(d *dependency, now time.Time, reason string, ev *events) *SharedOpen {
	cool := cooldown(d.policy.Breaker, d.failedProbes)
	d.state = Open
	d.gen++
	d.probing = false
	d.failures = 0
	d.openUntil = now.Add(cool)
	d.openReason = reason
	d.brk = newWindow(d.policy.Breaker.Window)
	// Recovery starts from the floor and climbs back with successes.
	d.limit = float64(d.policy.Degraded.MaxInFlight)
	ev.add(slog.LevelWarn, "protect: circuit breaker opened",
		slog.String("reason", reason), slog.Duration("cooldown", cool), slog.Time("open_until", d.openUntil))
	return &SharedOpen{Until: d.openUntil, By: g.instance, Reason: reason}
}

func (g *Guard) closeLocked(d *dependency, ev *events) {
	d.state = Closed
	d.gen++
	d.probing = false
	d.failures = 0
	d.failedProbes = 0
	d.openUntil = time.Time{}
	d.openReason = ""
	d.brk = newWindow(d.policy.Breaker.Window)
	ev.add(slog.LevelInfo, "protect: circuit breaker closed")
}

// cooldown is Cooldown × CooldownGrowth^failedProbes, capped by MaxCooldown.
func cooldown(b BreakerPolicy, failedProbes int) time.Duration {
	c := float64(b.Cooldown) * math.Pow(b.CooldownGrowth, float64(failedProbes))
	if c >= float64(b.MaxCooldown) || math.IsNaN(c) {
		return b.MaxCooldown
	}
	return time.Duration(c)
}

// adapt moves the adaptive concurrency limit with a call's outcome:
// additive increase on success, multiplicative decrease on a transient
// failure while degraded, at most once per DecreaseInterval.
func (g *Guard) adapt(d *dependency, now time.Time, outcome Outcome, ev *events) {
	pol := d.policy
	floor, ceil := float64(pol.Degraded.MaxInFlight), float64(pol.Concurrency.MaxInFlight)
	switch outcome {
	case Success:
		if d.limit < ceil {
			d.limit = min(ceil, d.limit+pol.Degraded.Increase/max(d.limit, 1))
		}
	case Transient:
		if !d.degraded || d.limit <= floor {
			return
		}
		if !d.lastDecrease.IsZero() && now.Before(d.lastDecrease.Add(pol.Degraded.DecreaseInterval)) {
			return
		}
		before := d.maxInFlight()
		d.limit = max(floor, d.limit*pol.Degraded.Decrease)
		d.lastDecrease = now
		if after := d.maxInFlight(); after != before {
			ev.add(slog.LevelInfo, "protect: concurrency limit lowered",
				slog.Int("from", before), slog.Int("to", after))
		}
	}
}

// healthAt returns the degraded-mode window's calls and transient-failure rate.
func (d *dependency) healthAt(now time.Time) (calls, transient int, rate float64) {
	c := d.health.sum(now)
	calls, transient = c[cSuccess]+c[cTransient], c[cTransient]
	if calls > 0 {
		rate = float64(transient) / float64(calls)
	}
	return calls, transient, rate
}

func (g *Guard) evalDegraded(d *dependency, now time.Time, ev *events) {
	pol := d.policy.Degraded
	calls, transient, rate := d.healthAt(now)
	if !d.degraded {
		if calls >= pol.MinCalls && rate >= pol.EnterRate {
			d.degraded = true
			d.degradedReason = fmt.Sprintf(
				"degraded: %.0f%% transient failures (%d of %d calls in the last %v) >= %.0f%%; concurrency adapts between %d and %d",
				100*rate, transient, calls, pol.Window, 100*pol.EnterRate, pol.MaxInFlight, d.policy.Concurrency.MaxInFlight)
			ev.add(slog.LevelWarn, "protect: dependency degraded", slog.String("stop_reason", d.degradedReason),
				slog.Float64("error_rate", rate), slog.Int("calls", calls))
		}
		return
	}
	if (calls >= pol.MinCalls && rate < pol.ExitRate) || transient == 0 {
		d.degraded = false
		d.degradedReason = ""
		ev.add(slog.LevelInfo, "protect: dependency recovered from degraded mode",
			slog.Float64("error_rate", rate), slog.Int("calls", calls))
	}
}
