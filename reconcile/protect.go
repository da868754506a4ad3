package reconcile

import (
	"context"
	"errors"
	"time"

	"github.com/receiptledger/reconciler/internal/protect"
)

// ProtectGate adapts a protect.Guard (per-dependency circuit breaker shared
// through the database, concurrency and rate limits, retry budget, degraded
// mode) to the pool's Gate. Its refusals become *Deferral: the row is
// rescheduled at the time the Guard books for it (protect.Deferral.Slot: a
// rate limit spreads the rows it defers over the times it admits them),
// never settled. A check refused only because the dependency's concurrency
// limit is in use first waits, up to the busy delay, for a call to end
// (protect.Guard.AcquireWait): the pool may run more workers than a
// dependency allows calls, and releasing each surplus row for a whole busy
// delay would cap a healthy dependency's throughput at its limit per delay,
// not per call.
func ProtectGate(g *protect.Guard) Gate { return guardGate{g: g} }

type guardGate struct{ g *protect.Guard }

func (gg guardGate) Enter(ctx context.Context, dependency string, _ bool) (Pass, error) {
	// A row's re-check after a transient failure is a first call, not a
	// retry, whatever the pool says: it comes after the row's full-jitter
	// backoff, paced by the rate limit, the degraded limit and the breaker.
	// The retry budget bounds the immediate repeats inside a check (an
	// adapter's page retries, Permit.Retry). Charged to the budget, the
	// re-checks of a partial outage exhausted it once every row had failed
	// once, and its floor (10 a minute) set the pace: 30 % of reads failing
	// left 47 of 200 receipts open after 40 s; counted as first calls, all
	// 200 settle in 7 s (issue 9).
	p, err := gg.g.AcquireWait(ctx, dependency, protect.First)
	if err != nil {
		var d *protect.Deferral
		if errors.As(err, &d) {
			reason := string(d.Reason)
			if d.Detail != "" {
				reason += ": " + d.Detail
			}
			return nil, &Deferral{Reason: reason, Until: d.Slot}
		}
		return nil, err
	}
	return guardPass{p: p}, nil
}

// BreakerStates reports each used dependency's breaker state.
func (gg guardGate) BreakerStates() map[string]string {
	out := map[string]string{}
	for dep, st := range gg.g.States() {
		out[dep] = st.String()
	}
	return out
}

type guardPass struct{ p *protect.Permit }

// Retry charges a retry made inside the check (an adapter retrying a page)
// to the dependency's retry budget: protect.Retrier.
func (gp guardPass) Retry() error { return gp.p.Retry() }

// Sent counts a request the check makes after its first (the next page)
// as a first call for the retry budget: protect.Retrier.
func (gp guardPass) Sent() { gp.p.Sent() }

func (gp guardPass) Exit(result CheckResult, retryAfter time.Duration) {
	outcome := protect.Abandoned
	switch result {
	case Answered:
		outcome = protect.Success
	case FailedTransient:
		outcome = protect.Transient
	case FailedPermanent:
		outcome = protect.Permanent
	}
	gp.p.Done(outcome, retryAfter)
}
