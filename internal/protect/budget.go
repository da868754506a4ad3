package protect

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"
)

// budgetDeferral returns the deferral of a retry the retry budget refuses
// now, or nil if the budget allows one.
func (d *dependency) budgetDeferral(now time.Time) *Deferral {
	b := d.policy.RetryBudget
	allowed := func(c counts) int {
		return max(b.MinRetries, int(math.Floor(b.Ratio*float64(c[cFirst]))))
	}
	ok := func(c counts) bool { return c[cRetry] < allowed(c) }
	if c := d.budget.sum(now); !ok(c) {
		until := d.budget.firstTrue(now, ok)
		return &Deferral{Dependency: d.name, Reason: ReasonBudgetExhausted, Until: until, Slot: until,
			Detail: fmt.Sprintf("retry budget exhausted: %d retries for %d first calls in the last %v (allowed max(%d, %.2f × first calls) = %d)",
				c[cRetry], c[cFirst], b.Window, b.MinRetries, b.Ratio, allowed(c))}
	}
	return nil
}

// Retrier is how a permitted call that makes several requests (a readback
// adapter reading a paginated list) tells the retry budget about them.
// *Permit implements it.
//
// Retry is asked before the call repeats a request that failed
// transiently: it returns nil if the request may be sent again now,
// charging the retry to the dependency's retry budget, or a *Deferral
// saying why not (the budget is spent, or the breaker changed state since
// the call was permitted), in which case the call should fail with its
// transient error.
//
// Sent is called for each new request after the call's first (the next
// page, not a repeat): it counts as a first call for the budget, so the
// budget grows with the requests a call makes, and a check of eight pages
// earns the retries of eight requests rather than of one.
type Retrier interface {
	Retry() error
	Sent()
}

type retrierKey struct{}

// WithRetrier returns ctx carrying r, for an adapter to find with
// RetrierFrom: the reconciler passes the permit of the check it makes.
func WithRetrier(ctx context.Context, r Retrier) context.Context {
	return context.WithValue(ctx, retrierKey{}, r)
}

// RetrierFrom returns the Retrier ctx carries, or nil.
func RetrierFrom(ctx context.Context) Retrier {
	r, _ := ctx.Value(retrierKey{}).(Retrier)
	return r
}

// Retry asks to repeat, within the permitted call, a request that failed
// transiently (see Retrier). An allowed retry counts against the retry
// budget like a call acquired with kind Retry; it takes no concurrency
// slot (the call holds one already). Retry is refused once Done was called,
// and when the breaker moved since the permit was granted (it opened, or
// the probe's verdict is in). Safe for concurrent use.
func (p *Permit) Retry() error {
	if p == nil {
		return errors.New("protect: Retry on a nil permit")
	}
	if p.done.Load() {
		return errors.New("protect: Retry after Done")
	}
	g, d := p.g, p.d
	now := g.clock.Now()
	var ev events
	d.mu.Lock()
	g.advance(d, now, &ev)
	var def *Deferral
	switch {
	case p.gen != d.gen && d.state == Open:
		def = &Deferral{Dependency: d.name, Reason: ReasonBreakerOpen, Until: d.openUntil, Slot: d.openUntil,
			Detail: "circuit breaker opened during the call: " + d.openReason}
	case p.gen != d.gen:
		until := now.Add(d.policy.Concurrency.BusyDelay)
		def = &Deferral{Dependency: d.name, Reason: ReasonBreakerOpen, Until: until, Slot: until,
			Detail: "circuit breaker changed state during the call"}
	default:
		def = d.budgetDeferral(now)
	}
	if def == nil {
		d.budget.add(now, cRetry)
		p.retries.Add(1)
	}
	d.mu.Unlock()
	g.emit(d, ev)
	if def != nil {
		return def
	}
	return nil
}

// Sent counts a request the permitted call makes after its first, other
// than a retry, as a first call for the retry budget (see Retrier). It is
// ignored once Done was called: the call is over.
func (p *Permit) Sent() {
	if p == nil || p.done.Load() {
		return
	}
	d := p.d
	now := p.g.clock.Now()
	d.mu.Lock()
	d.budget.add(now, cFirst)
	d.mu.Unlock()
}

// Retries returns how many retries Retry granted to the permit's call.
func (p *Permit) Retries() int {
	if p == nil {
		return 0
	}
	return int(p.retries.Load())
}
