package readback

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Errors of the registry and the adapters file. Refusals wrap one of them.
var (
	// ErrInvalidConfig means an adapter's declaration is malformed; see
	// ConfigError for the file, adapter and field.
	ErrInvalidConfig = errors.New("invalid adapter configuration")
	// ErrConflict means two adapters claim the same operation or the same
	// whole dependency.
	ErrConflict = errors.New("conflicting adapter registration")
)

// Guarantee names what made an absent answer safe to act on; the
// settlement records it (SPEC §5, "a late original must not land").
type Guarantee string

// The guarantees.
const (
	// RequestLifetimeElapsed: the longest request lifetime plus the
	// consistency window has passed since submission, so the original can
	// no longer take effect and would already be visible.
	RequestLifetimeElapsed Guarantee = "request_lifetime_elapsed"
	// NativeIdempotencyKey: the consistency window has passed and the API
	// deduplicates by idempotency key; the retry must reuse the original key
	// before the retention runs out so a straggler is absorbed server-side.
	NativeIdempotencyKey Guarantee = "native_idempotency_key"
)

// Policy is the timing contract of one dependency as seen by one adapter,
// and the bounds of the check schedule.
type Policy struct {
	// ConsistencyWindow is how long a committed effect may stay invisible
	// to reads (replication lag, search indexing).
	ConsistencyWindow time.Duration
	// MaxRequestLifetime is the longest time a request can still take
	// effect after it was sent (server-side timeout, queues, proxies).
	MaxRequestLifetime time.Duration
	// IdempotencyKeys is set when the API deduplicates requests by key
	// natively, for IdempotencyRetention after the first use.
	IdempotencyKeys      bool
	IdempotencyRetention time.Duration
	// MaxChecks bounds the checks of one receipt; Deadline bounds the time
	// since it became outcome_unknown (its unknown_since: a requeue starts
	// both afresh). Hitting either without proof means manual review.
	MaxChecks int
	Deadline  time.Duration
	// BackoffBase and BackoffCap shape the full-jitter schedule between
	// checks: rand(0, min(cap, base·2^n)).
	BackoffBase time.Duration
	BackoffCap  time.Duration
}

// DefaultPolicy is the policy of an adapter that declares nothing.
// Conservative on purpose: a minute of request lifetime and half a minute of
// lag cover common HTTP APIs behind a proxy; a day of checks before a human.
func DefaultPolicy() Policy {
	return Policy{
		ConsistencyWindow:  30 * time.Second,
		MaxRequestLifetime: 60 * time.Second,
		MaxChecks:          20,
		Deadline:           24 * time.Hour,
		BackoffBase:        time.Second,
		BackoffCap:         5 * time.Minute,
	}
}

// DefaultMaxSendDelay is the send deadline's delay after submission for a
// receipt that records none (the schema's default, SPEC §5a).
const DefaultMaxSendDelay = 5 * time.Second

// SendDeadlineOf returns r's send deadline: r.SendDeadline, or
// SubmittedAt + DefaultMaxSendDelay for a receipt that records none.
func SendDeadlineOf(r Receipt) time.Time {
	if !r.SendDeadline.IsZero() {
		return r.SendDeadline
	}
	return r.SubmittedAt.Add(DefaultMaxSendDelay)
}

// AbsenceWindowFor returns the earliest time at which an authoritative
// absence of r's effect proves that it did not happen, the guarantee that
// makes it so, and whether a read that BEGAN at readAt is past it (SPEC
// §5a: the time the answer arrived never counts). The original request was
// written by the send deadline or not at all, may take effect up to
// MaxRequestLifetime later, and is visible ConsistencyWindow after that:
// safeAt = send deadline + MaxRequestLifetime + ConsistencyWindow. With
// native idempotency keys the consistency window after the send deadline
// suffices while the key is retained (counted from submission, the earliest
// the API can have seen it), since a straggler is deduplicated by the API.
func (p Policy) AbsenceWindowFor(r Receipt, readAt time.Time) (safeAt time.Time, g Guarantee, ok bool) {
	send := SendDeadlineOf(r)
	lifetime := send.Add(p.MaxRequestLifetime + p.ConsistencyWindow)
	if !readAt.Before(lifetime) {
		return lifetime, RequestLifetimeElapsed, true
	}
	if p.IdempotencyKeys {
		keyed := send.Add(p.ConsistencyWindow)
		retained := r.SubmittedAt.Add(p.IdempotencyRetention)
		if keyed.Before(retained) && readAt.Before(retained) {
			return keyed, NativeIdempotencyKey, !readAt.Before(keyed)
		}
	}
	return lifetime, RequestLifetimeElapsed, false
}

// absenceDelay is how long after the send deadline an absence becomes
// conclusive in the best case.
func (p Policy) absenceDelay() time.Duration {
	if p.IdempotencyKeys && p.IdempotencyRetention > p.ConsistencyWindow {
		return p.ConsistencyWindow
	}
	return p.MaxRequestLifetime + p.ConsistencyWindow
}

// validate returns the name of the first bad field and why.
func (p Policy) validate(kind Kind) (field string, err error) {
	switch {
	case p.ConsistencyWindow < 0:
		return "consistency_window", errors.New("must not be negative")
	case p.MaxRequestLifetime < 0:
		return "max_request_lifetime", errors.New("must not be negative")
	case p.IdempotencyKeys && p.IdempotencyRetention <= 0:
		return "idempotency.retention", errors.New("must be positive when idempotency keys are native")
	case p.MaxChecks < 1:
		return "max_checks", errors.New("must be at least 1")
	case p.BackoffBase <= 0:
		return "backoff.base", errors.New("must be positive")
	case p.BackoffCap < p.BackoffBase:
		return "backoff.cap", fmt.Errorf("must be at least backoff.base (%s)", p.BackoffBase)
	case kind != Blind && p.Deadline <= p.absenceDelay():
		// A deadline inside the window could never see a conclusive
		// absence: every absent receipt would end in manual review.
		return "deadline", fmt.Errorf("must exceed the time before an absence is conclusive (%s)", p.absenceDelay())
	}
	return "", nil
}

// Binding is one registered adapter with its scope and policy.
type Binding struct {
	// Name identifies the adapter in check records, metrics and logs.
	Name string
	// Type is the adapter's implementation ("blind", "static", a type
	// registered by the program, or "go" for Register).
	Type string
	Kind Kind
	// Dependency is the backend the adapter reads.
	Dependency string
	// Operations narrows the adapter to these operation names; empty means
	// every operation of the dependency without a narrower adapter.
	Operations []string
	// Adapter answers the checks; nil for Kind Blind.
	Adapter Adapter
	Policy  Policy
	// Control is the known effect the adapters file declares for this
	// adapter (nil when none): a correctly configured adapter must find it.
	Control *Control
}

type opKey struct{ dependency, operation string }

// Registry finds the adapter for a receipt: by its operation first, then by
// its dependency. It is built before the reconciler starts and read-only
// afterwards, so concurrent lookups need no lock.
type Registry struct {
	byOp  map[opKey]*Binding
	byDep map[string]*Binding
	all   []*Binding
	// deps holds the protection limits of the adapters file, by dependency.
	deps map[string]DependencyLimits
	// retention is the adapters file's retention policy, nil without one.
	retention *Retention
}

// NewRegistry returns an empty registry: every receipt is adapter-less.
func NewRegistry() *Registry {
	return &Registry{byOp: map[opKey]*Binding{}, byDep: map[string]*Binding{}}
}

// Register adds b. It refuses a malformed binding, and a second adapter for
// the same operation or the same whole dependency, with a *ConfigError
// naming the field (matching ErrInvalidConfig, and ErrConflict for the
// latter).
func (r *Registry) Register(b Binding) error {
	if b.Type == "" {
		b.Type = "go"
	}
	bad := func(field string, err error) error {
		return &ConfigError{Adapter: b.Name, Field: field, Err: err}
	}
	switch {
	case b.Name == "":
		return bad("name", errors.New("is required"))
	case b.Dependency == "":
		return bad("dependency", errors.New("is required"))
	case !b.Kind.Valid():
		return bad("kind", fmt.Errorf("%q is not one of create, update, delete, blind", b.Kind))
	case b.Kind != Blind && b.Adapter == nil:
		return bad("type", fmt.Errorf("a %s adapter needs an implementation", b.Kind))
	}
	if field, err := b.Policy.validate(b.Kind); err != nil {
		return bad(field, err)
	}
	for _, op := range b.Operations {
		if op == "" {
			return bad("operations", errors.New("an operation name is empty"))
		}
		if prev, ok := r.byOp[opKey{b.Dependency, op}]; ok {
			return bad("operations", fmt.Errorf("%w: operation %q of %q is already read by %q",
				ErrConflict, op, b.Dependency, prev.Name))
		}
	}
	if len(b.Operations) == 0 {
		if prev, ok := r.byDep[b.Dependency]; ok {
			return bad("dependency", fmt.Errorf("%w: dependency %q is already read by %q",
				ErrConflict, b.Dependency, prev.Name))
		}
	}
	for _, prev := range r.all {
		if prev.Name == b.Name {
			return bad("name", fmt.Errorf("%w: adapter %q is declared twice", ErrConflict, b.Name))
		}
	}
	stored := b
	stored.Operations = append([]string(nil), b.Operations...)
	r.all = append(r.all, &stored)
	for _, op := range stored.Operations {
		r.byOp[opKey{b.Dependency, op}] = &stored
	}
	if len(stored.Operations) == 0 {
		r.byDep[b.Dependency] = &stored
	}
	return nil
}

// Lookup returns the binding that reads operation of dependency: the one
// naming the operation, else the one covering the whole dependency.
func (r *Registry) Lookup(operation, dependency string) (*Binding, bool) {
	if r == nil {
		return nil, false
	}
	if b, ok := r.byOp[opKey{dependency, operation}]; ok {
		return b, true
	}
	b, ok := r.byDep[dependency]
	return b, ok
}

// Bindings returns the registered bindings sorted by name.
func (r *Registry) Bindings() []Binding {
	if r == nil {
		return nil
	}
	out := make([]Binding, 0, len(r.all))
	for _, b := range r.all {
		out = append(out, *b)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Dependencies returns the protection limits the adapters file sets, by
// dependency name (a copy: the registry stays read-only). A dependency
// absent from the map, or a nil field, takes the program's defaults. Every
// dependency in it is read by at least one adapter of the file.
func (r *Registry) Dependencies() map[string]DependencyLimits {
	if r == nil || len(r.deps) == 0 {
		return map[string]DependencyLimits{}
	}
	out := make(map[string]DependencyLimits, len(r.deps))
	for k, v := range r.deps {
		out[k] = v.clone()
	}
	return out
}

// readsDependency reports whether an adapter reads dep.
func (r *Registry) readsDependency(dep string) bool {
	for _, b := range r.all {
		if b.Dependency == dep {
			return true
		}
	}
	return false
}

// dependencyNames lists, sorted, the dependencies the adapters read, for
// errors.
func (r *Registry) dependencyNames() string {
	seen := map[string]bool{}
	for _, b := range r.all {
		seen[b.Dependency] = true
	}
	if len(seen) == 0 {
		return "none: no adapter is declared"
	}
	return strings.Join(sortedKeys(seen), ", ")
}
