package httpadapter

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/readback"
)

// retryYAML is the block's `retry:`: how a request that fails transiently
// within a check (one page of a paginated read, or the fetch) is repeated
// before the whole check is declared failed.
type retryYAML struct {
	// Attempts is how many times one request is retried (0: never).
	// Default 2.
	Attempts *int `yaml:"attempts"`
	// MaxPerCheck bounds the retries of one check, all pages and passes
	// together. Default 6.
	MaxPerCheck *int `yaml:"max_per_check"`
	// Initial and Max bound the full-jitter backoff: the n-th retry waits
	// a random time in [0, min(Max, Initial×2^(n-1))). Defaults 100ms, 1s.
	Initial string `yaml:"initial"`
	Max     string `yaml:"max"`
	// MaxRetryAfter is the longest Retry-After (or rate-limit reset) the
	// check waits out itself; a longer one fails the check at once, with
	// the wait, for the reconciler to honour. Default 1s.
	MaxRetryAfter string `yaml:"max_retry_after"`
}

// retryPolicy is a compiled retryYAML.
type retryPolicy struct {
	attempts, maxPerCheck   int
	initial, max, maxWaitRA time.Duration
}

func defaultRetryPolicy() retryPolicy {
	return retryPolicy{attempts: 2, maxPerCheck: 6, initial: 100 * time.Millisecond, max: time.Second, maxWaitRA: time.Second}
}

func compileRetry(y *retryYAML) (retryPolicy, error) {
	p := defaultRetryPolicy()
	if y == nil {
		return p, nil
	}
	if y.Attempts != nil {
		if *y.Attempts < 0 || *y.Attempts > 10 {
			return p, fieldErr("retry.attempts", "want 0 to 10, got %d", *y.Attempts)
		}
		p.attempts = *y.Attempts
	}
	if y.MaxPerCheck != nil {
		if *y.MaxPerCheck < 0 || *y.MaxPerCheck > 100 {
			return p, fieldErr("retry.max_per_check", "want 0 to 100, got %d", *y.MaxPerCheck)
		}
		p.maxPerCheck = *y.MaxPerCheck
	}
	for _, d := range []struct {
		field, v string
		to       *time.Duration
	}{{"retry.initial", y.Initial, &p.initial}, {"retry.max", y.Max, &p.max}, {"retry.max_retry_after", y.MaxRetryAfter, &p.maxWaitRA}} {
		if d.v == "" {
			continue
		}
		v, err := time.ParseDuration(d.v)
		if err != nil || v <= 0 || v > time.Minute {
			return p, fieldErr(d.field, "want a duration in (0, 1m] such as 200ms, got %q", d.v)
		}
		*d.to = v
	}
	if p.max < p.initial {
		return p, fieldErr("retry.max", "must be at least retry.initial (%v), got %v", p.initial, p.max)
	}
	return p, nil
}

// RetryNote is one in-check retry, recorded in Evidence.Retries.
type RetryNote struct {
	// Pass and Page locate the request (1-based; Pass 0 is a fetch).
	Pass int `json:"pass,omitempty"`
	Page int `json:"page,omitempty"`
	// Cause is the failure retried: "HTTP 503", "transport", "not JSON".
	Cause string `json:"cause"`
	// WaitMS is how long the check waited before the retry.
	WaitMS int64 `json:"wait_ms"`
}

// retrier runs one check's requests with in-check retries.
type retrier struct {
	a    *Adapter
	pol  retryPolicy
	gate protect.Retrier // nil: no retry budget to charge (e.g. adapters check)
	ev   *Evidence
	bo   *backoff.ExponentialBackOff
	used int
	// sent counts the requests begun (retries aside): the first is the
	// check's own, permitted with it; each later one is told to gate.
	sent   int
	notes  []RetryNote
	budget string // why the last retry was refused by the gate
}

func (a *Adapter) retrier(ctx context.Context, ev *Evidence) *retrier {
	return &retrier{a: a, pol: a.cfg.retry, gate: protect.RetrierFrom(ctx), ev: ev}
}

// ceiling returns the backoff ceiling of the next retry of one request.
func (r *retrier) ceiling(n int) time.Duration {
	if n == 0 || r.bo == nil {
		r.bo = &backoff.ExponentialBackOff{
			InitialInterval: r.pol.initial, Multiplier: 2, MaxInterval: r.pol.max,
			RandomizationFactor: 0, MaxElapsedTime: 0, Stop: backoff.Stop, Clock: backoff.SystemClock,
		}
		r.bo.Reset()
	}
	return r.bo.NextBackOff()
}

// do runs fn, the request for page page of pass pass (0, 0 for a fetch),
// retrying it while it fails transiently and the policy, the retry budget
// and ctx's deadline allow. Every request after the check's first is
// reported to the retry budget (protect.Retrier.Sent). The pages read before it are the caller's and
// stay as they are: the retry resumes at the failed request.
func (r *retrier) do(ctx context.Context, pass, page int, fn func() error) error {
	r.sent++
	if r.sent > 1 && r.gate != nil {
		// A next page is a first call for the retry budget, which then
		// grows with the pages read: counted as one call per check, an
		// eight-page check at 30 % failures earned a fifth of one retry
		// where it needs more than three.
		r.gate.Sent()
	}
	for n := 0; ; n++ {
		err := fn()
		if err == nil {
			return nil
		}
		wait, why := r.next(ctx, n, err)
		if why != "" {
			return r.giveUp(err, n, why)
		}
		if r.gate != nil {
			if gerr := r.gate.Retry(); gerr != nil {
				var d *protect.Deferral
				reason := gerr.Error()
				if errors.As(gerr, &d) {
					reason = string(d.Reason)
				}
				return r.giveUp(err, n, "the dependency refused a retry ("+reason+")")
			}
		}
		if err := r.a.opts.sleep(ctx, wait); err != nil {
			return r.giveUp(err, n, "the check's context ended while waiting to retry")
		}
		r.used++
		note := RetryNote{Pass: pass, Page: page, Cause: cause(err), WaitMS: wait.Milliseconds()}
		r.ev.Retries = append(r.ev.Retries, note)
		r.ev.PageRetries = r.used
	}
}

// next returns how long to wait before retry n+1 of a request that failed
// with err, or why it is not retried.
func (r *retrier) next(ctx context.Context, n int, err error) (time.Duration, string) {
	class, ra := readback.Classify(err)
	switch {
	case class != readback.Transient:
		return 0, "permanent"
	case ctx.Err() != nil:
		return 0, "the check's context ended"
	case n >= r.pol.attempts:
		return 0, fmt.Sprintf("%d retries of the request", n)
	case r.used >= r.pol.maxPerCheck:
		return 0, fmt.Sprintf("the check's %d retries are spent (retry.max_per_check)", r.pol.maxPerCheck)
	case ra > r.pol.maxWaitRA:
		return 0, fmt.Sprintf("the API asked to wait %v, longer than retry.max_retry_after (%v)", ra, r.pol.maxWaitRA)
	}
	wait := max(ra, r.a.opts.jitter(r.ceiling(n)))
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= wait+r.pol.initial {
		return 0, "the check's deadline leaves no time for a retry"
	}
	return wait, ""
}

// giveUp returns err, classified as before, saying how many retries it
// had when it had any (the reconciler records the text).
func (r *retrier) giveUp(err error, n int, why string) error {
	if n == 0 {
		return err
	}
	class, ra := readback.Classify(err)
	return &readback.Error{Class: class, RetryAfter: ra,
		Err: fmt.Errorf("%w (after %d in-check retries; not retried again: %s)", err, n, why)}
}

// cause names err for a RetryNote, without any text from the API.
func cause(err error) string {
	var se *StatusError
	if errors.As(err, &se) {
		return fmt.Sprintf("HTTP %d", se.Status)
	}
	if errors.Is(err, errNotJSON) {
		return "not JSON"
	}
	return "transport"
}

// errNotJSON marks a page that did not decode (a proxy may have cut it).
var errNotJSON = errors.New("response is not JSON")

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// fullJitter returns a uniformly random duration in [0, ceiling).
func fullJitter(ceiling time.Duration) time.Duration {
	if ceiling <= 0 {
		return 0
	}
	return rand.N(ceiling)
}
