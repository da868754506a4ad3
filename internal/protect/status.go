package protect

// Status returns dep's state. A dependency never used reports the zero
// (closed, healthy) state.
func (g *Guard) Status(dep string) Status {
	g.mu.Lock()
	d, ok := g.deps[dep]
	g.mu.Unlock()
	if !ok {
		p := g.cfg.policy(dep)
		return Status{Dependency: dep, Breaker: Closed, MaxInFlight: p.Concurrency.MaxInFlight}
	}
	return g.status(d)
}

// Statuses returns the state of every dependency used so far.
func (g *Guard) Statuses() map[string]Status {
	out := map[string]Status{}
	for _, d := range g.all() {
		out[d.name] = g.status(d)
	}
	return out
}

// States returns the breaker state of every dependency used so far, for
// metrics.
func (g *Guard) States() map[string]BreakerState {
	out := map[string]BreakerState{}
	for _, d := range g.all() {
		out[d.name] = g.status(d).Breaker
	}
	return out
}

func (g *Guard) all() []*dependency {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]*dependency, 0, len(g.deps))
	for _, d := range g.deps {
		out = append(out, d)
	}
	return out
}

func (g *Guard) status(d *dependency) Status {
	now := g.clock.Now()
	var ev events
	d.mu.Lock()
	g.advance(d, now, &ev)
	calls, _, rate := d.healthAt(now)
	s := Status{
		Dependency:          d.name,
		Breaker:             d.state,
		OpenReason:          d.openReason,
		ConsecutiveFailures: d.failures,
		Degraded:            d.degraded,
		DegradedReason:      d.degradedReason,
		Calls:               calls,
		ErrorRate:           rate,
		InFlight:            d.inFlight,
		MaxInFlight:         d.policy.Concurrency.MaxInFlight,
	}
	if d.state == Open {
		s.OpenUntil = d.openUntil
	}
	s.MaxInFlight = d.maxInFlight()
	if now.Before(d.retryAfterUntil) {
		s.RetryAfterUntil = d.retryAfterUntil
	}
	d.mu.Unlock()
	g.emit(d, ev)
	return s
}
