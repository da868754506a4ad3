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
// rescheduled at the Guard's "until", never settled. A check refused only
// because the dependency's concurrency limit is in use first waits, up to
// that "until", for a slot (protect.Guard.AcquireWait): the pool may run
// more workers than a dependency allows calls, and releasing each surplus
// row for a whole busy delay would cap a healthy dependency's throughput at
// its limit per delay, not per call.
func ProtectGate(g *protect.Guard) Gate { return guardGate{g: g} }

type guardGate struct{ g *protect.Guard }

func (gg guardGate) Enter(ctx context.Context, dependency string, retry bool) (Pass, error) {
	kind := protect.First
	if retry {
		kind = protect.Retry
	}
	p, err := gg.g.AcquireWait(ctx, dependency, kind)
	if err != nil {
		var d *protect.Deferral
		if errors.As(err, &d) {
			reason := string(d.Reason)
			if d.Detail != "" {
				reason += ": " + d.Detail
			}
			return nil, &Deferral{Reason: reason, Until: d.Until}
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
