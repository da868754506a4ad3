package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// Gate protects the external APIs: before each check the pool asks it for a
// pass for the receipt's dependency (circuit breaker, concurrency limit,
// rate limit, retry budget, degraded mode), and reports how the check went.
// A refusal is a *Deferral: the row is rescheduled, never settled.
type Gate interface {
	// Enter asks to check a receipt of dependency now; retry is set when
	// the receipt's previous check failed transiently.
	Enter(ctx context.Context, dependency string, retry bool) (Pass, error)
}

// Pass is one admitted check.
type Pass interface {
	// Exit reports how the check went; retryAfter is the server's
	// requested pause (Retry-After), or zero.
	Exit(result CheckResult, retryAfter time.Duration)
}

// CheckResult is how a check went, as far as the protection cares.
type CheckResult string

// The check results reported to a Pass.
const (
	// Answered: the adapter answered (any verdict): the dependency works.
	Answered CheckResult = "answered"
	// FailedTransient: timeout, 429, 5xx, connection: counts against the
	// breaker and the retry budget.
	FailedTransient CheckResult = "transient"
	// FailedPermanent: auth, configuration: says nothing about the
	// dependency's health.
	FailedPermanent CheckResult = "permanent"
	// Cancelled: the reconciler stopped the check (shutdown); neutral.
	Cancelled CheckResult = "cancelled"
)

// checkResult is what a check that ended with err reports to its Pass:
// Answered without an error, else its class and the Retry-After it asked.
func checkResult(err error) (CheckResult, time.Duration) {
	if err == nil {
		return Answered, 0
	}
	class, retryAfter := readback.Classify(err)
	if class == readback.Permanent {
		return FailedPermanent, retryAfter
	}
	return FailedTransient, retryAfter
}

// Deferral is a Gate's refusal: do not call the dependency before Until.
type Deferral struct {
	Reason string
	Until  time.Time
}

// Error describes the Deferral in one line.
func (d *Deferral) Error() string {
	return fmt.Sprintf("deferred until %s: %s", d.Until.Format(time.RFC3339Nano), d.Reason)
}

// ErrDeferred is matched by every *Deferral under errors.Is.
var ErrDeferred = errors.New("check deferred")

// Is makes errors.Is(err, ErrDeferred) true.
func (d *Deferral) Is(target error) bool { return target == ErrDeferred }

// DependencyStates is optionally implemented by a Gate that can report its
// breaker state per dependency ("closed", "half_open", "open") for the
// breaker-state metric.
type DependencyStates interface {
	BreakerStates() map[string]string
}

// openGate admits every check: the behaviour without protection.
type openGate struct{}

func (openGate) Enter(context.Context, string, bool) (Pass, error) { return noPass{}, nil }

type noPass struct{}

func (noPass) Exit(CheckResult, time.Duration) {}
