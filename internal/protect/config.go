package protect

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"golang.org/x/time/rate"
)

// Config is the configuration of a Guard. Start from DefaultConfig and
// change what a deployment needs: a zero Config is not valid, because zero
// is a meaningful value for some fields (a retry budget of 0, for one).
type Config struct {
	// Instance names this process in the shared breaker row (opened_by),
	// e.g. the reconciler's instance id. Empty means "<hostname>:<pid>".
	Instance string

	// SharedRefresh is how often, at most, Acquire re-reads a dependency's
	// shared "open until" row; between reads the cached value is used, so
	// the hot path does not query the database per call. Another instance's
	// opening is therefore seen at most SharedRefresh late. Default 1s.
	SharedRefresh time.Duration

	// StoreTimeout bounds each Store call made by the Guard on its own
	// behalf (the write when a breaker opens happens in Permit.Done, which
	// has no context). Default 2s.
	StoreTimeout time.Duration

	// Default is the policy of every dependency not named in Dependencies.
	Default Policy

	// Dependencies holds complete per-dependency policies that replace
	// Default for that dependency (copy Default and change fields). A
	// dependency is one backend that fails independently, never a tool name.
	Dependencies map[string]Policy
}

// Policy is the protection policy of one dependency.
type Policy struct {
	Breaker     BreakerPolicy
	Concurrency ConcurrencyPolicy
	Rate        RatePolicy
	RetryBudget RetryBudgetPolicy
	Degraded    DegradedPolicy
}

// BreakerPolicy configures the circuit breaker.
//
// The breaker is the guard against a hard outage: it opens when the share
// of transient failures among the calls with a health signal (successes and
// transient failures; permanent and abandoned outcomes are neutral) over
// Window reaches FailureRate, with at least MinCalls such calls in the
// window. A partial outage (failures interleaved with successes, below
// FailureRate) is the degraded mode's job: it lowers the concurrency
// instead of stopping the dependency.
type BreakerPolicy struct {
	// Window is the sliding window the failure rate is computed over.
	// Default 30s.
	Window time.Duration
	// MinCalls is the smallest sample the breaker opens on. Default 20.
	MinCalls int
	// FailureRate is the transient-failure rate over Window that opens the
	// breaker, in (0, 1]. Default 0.5.
	FailureRate float64
	// FailureThreshold, when > 0, also opens the breaker after that many
	// consecutive transient failures (a success resets the count). Default
	// 0: off, since a streak of a few failures is frequent under a partial
	// outage; set it for a dependency called too rarely to reach MinCalls.
	FailureThreshold int
	// Cooldown is how long the breaker stays open before it lets one probe
	// through (half-open). Default 30s.
	Cooldown time.Duration
	// CooldownGrowth multiplies the cool-down after each failed probe in a
	// row (1 keeps it constant). Default 2.
	CooldownGrowth float64
	// MaxCooldown caps the grown cool-down. Default 5m.
	MaxCooldown time.Duration
}

// ConcurrencyPolicy limits the calls in flight to the dependency.
type ConcurrencyPolicy struct {
	// MaxInFlight is the most calls in flight at once from this process.
	// Callers beyond it are deferred, never blocked. Default 8.
	MaxInFlight int
	// BusyDelay is how far a call is deferred when the reason has no known
	// end: all slots taken, or a half-open probe still in flight. Default 1s.
	BusyDelay time.Duration
}

// RatePolicy limits the rate of calls and caps Retry-After.
type RatePolicy struct {
	// Limit is the steady rate in calls per second; rate.Inf disables rate
	// limiting. Default 10/s: below the documented read limits of common
	// public APIs (Stripe 25/s in test mode, 100/s live; HubSpot 10/s;
	// Shopify's REST bucket refills at 2/s with a burst of 40, so it needs
	// its own entry), and fast enough to clear a backlog of 3,000 receipts
	// in about 6 minutes (deferred rows are booked at 80 % of the rate;
	// at 5/s it took 12).
	Limit rate.Limit
	// Burst is the most calls allowed at once above the steady rate.
	// Default 20 (two seconds of the default rate).
	Burst int
	// MaxRetryAfter caps a Retry-After reported through Permit.Done, so a
	// bogus header cannot stop a dependency for days. Default 1h.
	MaxRetryAfter time.Duration
}

// RetryBudgetPolicy limits retries (calls made because an earlier call of
// the same work failed transiently) to a share of first calls over a
// sliding window, so retries cannot multiply the load of a sick dependency.
// A retry is allowed while retries < max(MinRetries, Ratio × first calls)
// over the last Window.
type RetryBudgetPolicy struct {
	// Ratio of retries to first calls. Default 0.5: it covers the retries
	// of a partial outage up to a third of requests failing (f/(1−f)
	// retries per first call), so a paginated read retries a flaky page
	// (one request) instead of failing and being re-read from its first
	// page; a hard outage opens the breaker before the budget matters.
	// Each request a call makes after its first counts as a first call
	// (Retrier.Sent).
	Ratio float64
	// MinRetries is allowed per Window whatever the traffic, so a quiet
	// dependency can still retry. Default 10.
	MinRetries int
	// Window is the sliding window. Default 1m.
	Window time.Duration
}

// DegradedPolicy configures degraded mode and the adaptive concurrency
// limit (AIMD) it drives.
//
// When the share of transient failures among calls with a health signal
// (successes and transient failures) over Window reaches EnterRate with at
// least MinCalls calls, the dependency is degraded. While degraded, a
// transient failure multiplies the concurrency limit by Decrease, at most
// once per DecreaseInterval (a burst of failures counts once), down to
// MaxInFlight. Every success adds Increase/limit to the limit (about
// Increase per round of calls), up to Concurrency.MaxInFlight, degraded or
// not: concurrency climbs back after a partial outage ends, and after the
// breaker closes (an opening drops the limit to MaxInFlight). The mode is
// left when the rate falls below ExitRate with at least MinCalls calls, or
// when a whole Window passes without a transient failure.
type DegradedPolicy struct {
	// Window is the sliding window the rate is computed over. Default 1m.
	Window time.Duration
	// MinCalls is the smallest sample a decision is made on. Default 20.
	MinCalls int
	// EnterRate is the transient-failure rate that degrades. Default 0.2.
	EnterRate float64
	// ExitRate is the rate below which the dependency recovers; lower than
	// EnterRate so the mode does not flap. Default 0.1.
	ExitRate float64
	// MaxInFlight is the floor of the adaptive concurrency limit: the
	// fewest calls in flight degraded mode goes down to. Default 1.
	MaxInFlight int
	// Decrease multiplies the limit on a transient failure while degraded,
	// in (0, 1). Default 0.5.
	Decrease float64
	// DecreaseInterval is the least time between two decreases. Default 2s.
	DecreaseInterval time.Duration
	// Increase is added to the limit per round of successful calls (each
	// success adds Increase/limit), > 0. Default 1.
	Increase float64
	// Delay is how far a call is deferred when the lowered limit is full.
	// Default 1s.
	Delay time.Duration
}

// DefaultConfig returns the defaults documented on each field.
func DefaultConfig() Config {
	return Config{
		SharedRefresh: time.Second,
		StoreTimeout:  2 * time.Second,
		Default:       DefaultPolicy(),
	}
}

// DefaultPolicy returns the default policy of a dependency.
func DefaultPolicy() Policy {
	return Policy{
		Breaker: BreakerPolicy{
			Window:           30 * time.Second,
			MinCalls:         20,
			FailureRate:      0.5,
			FailureThreshold: 0,
			Cooldown:         30 * time.Second,
			CooldownGrowth:   2,
			MaxCooldown:      5 * time.Minute,
		},
		Concurrency: ConcurrencyPolicy{
			MaxInFlight: 8,
			BusyDelay:   time.Second,
		},
		Rate: RatePolicy{
			Limit:         10,
			Burst:         20,
			MaxRetryAfter: time.Hour,
		},
		RetryBudget: RetryBudgetPolicy{
			Ratio:      0.5,
			MinRetries: 10,
			Window:     time.Minute,
		},
		Degraded: DegradedPolicy{
			Window:           time.Minute,
			MinCalls:         20,
			EnterRate:        0.2,
			ExitRate:         0.1,
			MaxInFlight:      1,
			Decrease:         0.5,
			DecreaseInterval: 2 * time.Second,
			Increase:         1,
			Delay:            time.Second,
		},
	}
}

// Validate reports every invalid field of c, each named by its path.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("protect: config: %s %s", field, fmt.Sprintf(format, args...)))
	}
	if c.SharedRefresh <= 0 {
		bad("SharedRefresh", "must be > 0, got %v", c.SharedRefresh)
	}
	if c.StoreTimeout <= 0 {
		bad("StoreTimeout", "must be > 0, got %v", c.StoreTimeout)
	}
	c.Default.validate("Default", bad)
	deps := make([]string, 0, len(c.Dependencies))
	for dep := range c.Dependencies {
		deps = append(deps, dep)
	}
	sort.Strings(deps)
	for _, dep := range deps {
		if dep == "" {
			bad("Dependencies", "has an empty dependency name")
			continue
		}
		p := c.Dependencies[dep]
		p.validate(fmt.Sprintf("Dependencies[%q]", dep), bad)
	}
	return errors.Join(errs...)
}

// Validate reports every invalid field of p.
func (p Policy) Validate() error {
	var errs []error
	p.validate("Policy", func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("protect: config: %s %s", field, fmt.Sprintf(format, args...)))
	})
	return errors.Join(errs...)
}

func (p Policy) validate(at string, bad func(field, format string, args ...any)) {
	b := p.Breaker
	if b.FailureThreshold < 0 {
		bad(at+".Breaker.FailureThreshold", "must be >= 0 (0: off), got %d", b.FailureThreshold)
	}
	if b.Window < windowBuckets*time.Millisecond {
		bad(at+".Breaker.Window", "must be >= %v, got %v", windowBuckets*time.Millisecond, b.Window)
	}
	if b.MinCalls < 1 {
		bad(at+".Breaker.MinCalls", "must be >= 1, got %d", b.MinCalls)
	}
	if !(b.FailureRate > 0 && b.FailureRate <= 1) {
		bad(at+".Breaker.FailureRate", "must be in (0, 1], got %v", b.FailureRate)
	}
	if b.Cooldown <= 0 {
		bad(at+".Breaker.Cooldown", "must be > 0, got %v", b.Cooldown)
	}
	if !(b.CooldownGrowth >= 1) || math.IsInf(b.CooldownGrowth, 0) {
		bad(at+".Breaker.CooldownGrowth", "must be >= 1 and finite, got %v", b.CooldownGrowth)
	}
	if b.MaxCooldown < b.Cooldown {
		bad(at+".Breaker.MaxCooldown", "must be >= Cooldown (%v), got %v", b.Cooldown, b.MaxCooldown)
	}

	c := p.Concurrency
	if c.MaxInFlight < 1 {
		bad(at+".Concurrency.MaxInFlight", "must be >= 1, got %d", c.MaxInFlight)
	}
	if c.BusyDelay <= 0 {
		bad(at+".Concurrency.BusyDelay", "must be > 0, got %v", c.BusyDelay)
	}

	r := p.Rate
	if !(r.Limit > 0) {
		bad(at+".Rate.Limit", "must be > 0 calls/s (rate.Inf for no limit), got %v", float64(r.Limit))
	}
	if r.Limit != rate.Inf && r.Burst < 1 {
		bad(at+".Rate.Burst", "must be >= 1, got %d", r.Burst)
	}
	if r.MaxRetryAfter <= 0 {
		bad(at+".Rate.MaxRetryAfter", "must be > 0, got %v", r.MaxRetryAfter)
	}

	rb := p.RetryBudget
	if !(rb.Ratio >= 0) || math.IsInf(rb.Ratio, 0) {
		bad(at+".RetryBudget.Ratio", "must be >= 0 and finite, got %v", rb.Ratio)
	}
	if rb.MinRetries < 0 {
		bad(at+".RetryBudget.MinRetries", "must be >= 0, got %d", rb.MinRetries)
	}
	if rb.Window < windowBuckets*time.Millisecond {
		bad(at+".RetryBudget.Window", "must be >= %v, got %v", windowBuckets*time.Millisecond, rb.Window)
	}

	d := p.Degraded
	if d.Window < windowBuckets*time.Millisecond {
		bad(at+".Degraded.Window", "must be >= %v, got %v", windowBuckets*time.Millisecond, d.Window)
	}
	if d.MinCalls < 1 {
		bad(at+".Degraded.MinCalls", "must be >= 1, got %d", d.MinCalls)
	}
	if !(d.EnterRate > 0 && d.EnterRate <= 1) {
		bad(at+".Degraded.EnterRate", "must be in (0, 1], got %v", d.EnterRate)
	}
	if !(d.ExitRate >= 0 && d.ExitRate <= d.EnterRate) {
		bad(at+".Degraded.ExitRate", "must be in [0, EnterRate=%v], got %v", d.EnterRate, d.ExitRate)
	}
	if d.MaxInFlight < 1 {
		bad(at+".Degraded.MaxInFlight", "must be >= 1, got %d", d.MaxInFlight)
	}
	if d.MaxInFlight > c.MaxInFlight && c.MaxInFlight >= 1 {
		bad(at+".Degraded.MaxInFlight", "must be <= Concurrency.MaxInFlight (%d), got %d", c.MaxInFlight, d.MaxInFlight)
	}
	if d.Delay <= 0 {
		bad(at+".Degraded.Delay", "must be > 0, got %v", d.Delay)
	}
	if !(d.Decrease > 0 && d.Decrease < 1) {
		bad(at+".Degraded.Decrease", "must be in (0, 1), got %v", d.Decrease)
	}
	if d.DecreaseInterval < 0 {
		bad(at+".Degraded.DecreaseInterval", "must be >= 0, got %v", d.DecreaseInterval)
	}
	if !(d.Increase > 0) || math.IsInf(d.Increase, 0) {
		bad(at+".Degraded.Increase", "must be > 0 and finite, got %v", d.Increase)
	}
}

// policy returns the policy of dep.
func (c Config) policy(dep string) Policy {
	if p, ok := c.Dependencies[dep]; ok {
		return p
	}
	return c.Default
}
