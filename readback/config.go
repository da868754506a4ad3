package readback

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// ConfigError names what is wrong in an adapter declaration: the file, the
// adapter, the field and (when known) the line. It matches ErrInvalidConfig.
type ConfigError struct {
	File    string
	Adapter string
	// Dependency names the entry of the top-level dependencies mapping at
	// fault (Adapter is empty then).
	Dependency string
	Field      string
	Line       int
	Err        error
}

// Error describes the ConfigError in one line.
func (e *ConfigError) Error() string {
	var b strings.Builder
	if e.File != "" {
		b.WriteString(e.File)
		if e.Line > 0 {
			fmt.Fprintf(&b, ":%d", e.Line)
		}
		b.WriteString(": ")
	}
	if e.Adapter != "" {
		fmt.Fprintf(&b, "adapter %q: ", e.Adapter)
	}
	if e.Dependency != "" {
		fmt.Fprintf(&b, "dependency %q: ", e.Dependency)
	}
	if e.Field != "" {
		fmt.Fprintf(&b, "%s: ", e.Field)
	}
	fmt.Fprintf(&b, "%v", e.Err)
	return b.String()
}

// Unwrap returns the cause.
func (e *ConfigError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrInvalidConfig) true.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// FieldError lets a Factory name the field of its settings block that is
// wrong; the loader prefixes it with the block's name.
type FieldError struct {
	Field string
	Err   error
}

// Error describes the FieldError in one line.
func (e *FieldError) Error() string { return e.Field + ": " + e.Err.Error() }

// Unwrap returns the cause.
func (e *FieldError) Unwrap() error { return e.Err }

// Factory builds an adapter of one type from its settings block: the YAML
// mapping under the key named like the type (nil when absent). It should
// decode strictly and report a bad setting as a *FieldError.
type Factory func(name string, settings *yaml.Node) (Adapter, error)

// Types maps the `type` discriminator of the adapters file to factories.
// A type whose factory is nil has no implementation (blind).
type Types map[string]Factory

// BuiltinTypes returns the adapter types available without configuration
// beyond the file: "blind" (no readback possible; manual review at once) and
// "static" (answers a fixed verdict; for demos, benchmarks and tests).
// Programs add their own types, e.g. the declarative "http" adapter.
func BuiltinTypes() Types {
	return Types{"blind": nil, "static": newStatic}
}

// The file format. Durations are Go duration strings ("30s", "24h").
type fileConfig struct {
	Version  int         `yaml:"version"`
	Defaults policyYAML  `yaml:"defaults"`
	Adapters []yaml.Node `yaml:"adapters"`
	// Dependencies is decoded by hand (loadDependencies), field by field,
	// so every error names its line.
	Dependencies yaml.Node `yaml:"dependencies"`
	// Retention too (loadRetention).
	Retention yaml.Node `yaml:"retention"`
}

type policyYAML struct {
	ConsistencyWindow  *duration        `yaml:"consistency_window"`
	MaxRequestLifetime *duration        `yaml:"max_request_lifetime"`
	MaxChecks          *int             `yaml:"max_checks"`
	Deadline           *duration        `yaml:"deadline"`
	Backoff            *backoffYAML     `yaml:"backoff"`
	Idempotency        *idempotencyYAML `yaml:"idempotency"`
}

type backoffYAML struct {
	Base *duration `yaml:"base"`
	Cap  *duration `yaml:"cap"`
}

type idempotencyYAML struct {
	Native    bool      `yaml:"native"`
	Retention *duration `yaml:"retention"`
}

type adapterYAML struct {
	Name       string   `yaml:"name"`
	Type       string   `yaml:"type"`
	Kind       Kind     `yaml:"kind"`
	Dependency string   `yaml:"dependency"`
	Operations []string `yaml:"operations"`
	policyYAML `yaml:",inline"`
}

// Keys allowed in each mapping; anything else is a typo the loader names.
// Functions, not variables, so no caller can widen them.
func topKeys() []string {
	return []string{"version", "defaults", "adapters", "dependencies", "retention"}
}

func policyKeys() []string {
	return []string{"consistency_window", "max_request_lifetime", "max_checks", "deadline", "backoff", "idempotency"}
}

func adapterKeys() []string {
	return append([]string{"name", "type", "kind", "dependency", "operations", "control"}, policyKeys()...)
}

type duration time.Duration

func (d *duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return errors.New("want a duration such as 30s or 24h")
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("want a duration such as 30s or 24h, got %q", n.Value)
	}
	*d = duration(v)
	return nil
}

func (p policyYAML) apply(base Policy) Policy {
	set := func(dst *time.Duration, src *duration) {
		if src != nil {
			*dst = time.Duration(*src)
		}
	}
	set(&base.ConsistencyWindow, p.ConsistencyWindow)
	set(&base.MaxRequestLifetime, p.MaxRequestLifetime)
	set(&base.Deadline, p.Deadline)
	if p.MaxChecks != nil {
		base.MaxChecks = *p.MaxChecks
	}
	if p.Backoff != nil {
		set(&base.BackoffBase, p.Backoff.Base)
		set(&base.BackoffCap, p.Backoff.Cap)
	}
	if p.Idempotency != nil {
		base.IdempotencyKeys = p.Idempotency.Native
		set(&base.IdempotencyRetention, p.Idempotency.Retention)
	}
	return base
}

// LoadFile reads the adapters file at path into a new registry, with the
// built-in types plus extra (which may override them). Every error is a
// *ConfigError naming the file, the adapter and the field.
func LoadFile(path string, extra Types) (*Registry, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, &ConfigError{File: path, Err: err}
	}
	return Load(path, bytes.NewReader(data), extra)
}

// ErrNoAdapters is the error of a file that declares no adapter: a daemon
// with none sends every receipt to manual_review, which must be asked for
// explicitly (`reconciler run --no-adapters`), not reached by an empty or
// truncated file.
var ErrNoAdapters = errors.New("no adapters declared (a reconciler without adapters sends every receipt to manual_review; run it with --no-adapters instead)")

// Load is LoadFile for a reader; name is used in errors. A file that
// declares no adapter is refused with an error matching ErrNoAdapters.
func Load(name string, r io.Reader, extra Types) (*Registry, error) {
	types := BuiltinTypes()
	for k, f := range extra {
		types[k] = f
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, &ConfigError{File: name, Err: err}
	}
	fail := func(adapter, field string, line int, err error) error {
		return &ConfigError{File: name, Adapter: adapter, Field: field, Line: line, Err: err}
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fail("", "", 0, err)
	}
	reg := NewRegistry()
	if len(doc.Content) == 0 {
		return nil, fail("", "adapters", 0, ErrNoAdapters)
	}
	root := doc.Content[0]
	if err := checkKeys(root, topKeys()); err != nil {
		return nil, fail("", err.field, err.line, err.err)
	}
	// The defaults are checked before the file is decoded, so that a bad
	// duration there names its field and line, not the document's.
	if n := mapValue(root, "defaults"); n != nil {
		if err := checkKeys(n, policyKeys()); err != nil {
			return nil, fail("", "defaults."+err.field, err.line, err.err)
		}
		if err := checkPolicyKeys(n, "defaults."); err != nil {
			return nil, fail("", err.field, err.line, err.err)
		}
	}
	var fc fileConfig
	if err := root.Decode(&fc); err != nil {
		return nil, fail("", "", root.Line, err)
	}
	if fc.Version != 1 {
		return nil, fail("", "version", lineOf(root, "version"), fmt.Errorf("must be 1, got %d", fc.Version))
	}
	if len(fc.Adapters) == 0 {
		return nil, fail("", "adapters", lineOf(root, "adapters"), ErrNoAdapters)
	}
	defaults := fc.Defaults.apply(DefaultPolicy())
	var deps map[string]DependencyLimits
	if n := mapValue(root, "dependencies"); n != nil {
		var de *dependencyError
		if deps, de = loadDependencies(n); de != nil {
			return nil, &ConfigError{File: name, Dependency: de.dependency, Field: de.field, Line: de.line, Err: de.err}
		}
	}
	for i := range fc.Adapters {
		n := &fc.Adapters[i]
		label := fmt.Sprintf("#%d", i+1)
		if v := mapValue(n, "name"); v != nil && v.Kind == yaml.ScalarNode && v.Value != "" {
			label = v.Value
		}
		b, err := decodeAdapter(n, types, defaults)
		if err != nil {
			var fe *keyError
			if errors.As(err, &fe) {
				return nil, fail(label, fe.field, fe.line, fe.err)
			}
			return nil, fail(label, "", n.Line, err)
		}
		if err := reg.Register(b); err != nil {
			var ce *ConfigError
			if errors.As(err, &ce) {
				line := n.Line
				if v := mapKey(n, ce.Field); v != nil {
					line = v.Line
				}
				return nil, fail(label, ce.Field, line, ce.Err)
			}
			return nil, fail(label, "", n.Line, err)
		}
	}
	// A limit for a dependency no adapter reads would never apply: it is
	// almost always a misspelt name, which would silently leave the real
	// dependency on the defaults. Refuse it, like an unknown field.
	for _, dep := range sortedKeys(deps) {
		if !reg.readsDependency(dep) {
			return nil, &ConfigError{File: name, Dependency: dep, Line: deps[dep].Line,
				Err: fmt.Errorf("no adapter reads this dependency (adapters read: %s); fix the name or remove the entry",
					reg.dependencyNames())}
		}
	}
	reg.deps = deps
	if n := mapValue(root, "retention"); n != nil {
		ret, ke := loadRetention(n)
		if ke != nil {
			return nil, fail("", ke.field, ke.line, ke.err)
		}
		reg.retention = ret
	}
	return reg, nil
}

func decodeAdapter(n *yaml.Node, types Types, defaults Policy) (Binding, error) {
	if n.Kind != yaml.MappingNode {
		return Binding{}, &keyError{line: n.Line, err: errors.New("an adapter must be a mapping")}
	}
	var a adapterYAML
	typ := ""
	if v := mapValue(n, "type"); v != nil {
		typ = v.Value
	}
	factory, known := types[typ]
	if !known {
		names := make([]string, 0, len(types))
		for k := range types {
			names = append(names, k)
		}
		sort.Strings(names)
		line := n.Line
		if v := mapValue(n, "type"); v != nil {
			line = v.Line
		}
		if typ == "" {
			return Binding{}, &keyError{field: "type", line: line, err: fmt.Errorf("is required (one of %s)", strings.Join(names, ", "))}
		}
		return Binding{}, &keyError{field: "type", line: line, err: fmt.Errorf("unknown type %q (want one of %s)", typ, strings.Join(names, ", "))}
	}
	// The type's own settings live under a key named like the type, so the
	// common fields stay flat and every type validates only its own block.
	if err := checkKeys(n, append(adapterKeys(), typ)); err != nil {
		return Binding{}, err
	}
	if err := checkPolicyKeys(n, ""); err != nil {
		return Binding{}, err
	}
	if err := n.Decode(&a); err != nil {
		return Binding{}, &keyError{line: n.Line, err: err}
	}
	if a.Kind == "" && typ == "blind" {
		a.Kind = Blind
	}
	if typ == "blind" && a.Kind != Blind {
		return Binding{}, &keyError{field: "kind", line: lineOf(n, "kind"), err: fmt.Errorf("a blind adapter has kind blind, not %q", a.Kind)}
	}
	if a.Kind == "" {
		return Binding{}, &keyError{field: "kind", line: n.Line, err: errors.New("is required (create, update, delete or blind)")}
	}
	b := Binding{
		Name: a.Name, Type: typ, Kind: a.Kind, Dependency: a.Dependency,
		Operations: a.Operations, Policy: a.policyYAML.apply(defaults),
	}
	if factory != nil {
		adapter, err := factory(a.Name, mapValue(n, typ))
		if err != nil {
			field := typ
			var fe *FieldError
			if errors.As(err, &fe) {
				field += "." + fe.Field
				err = fe.Err
			}
			// The line of the field itself (e.g. search.bogus on line
			// 11), else of the deepest key of its path found, else of
			// the settings block.
			line := lineOf(n, typ)
			if fe != nil {
				if k := mapKey(mapValue(n, typ), fe.Field); k != nil {
					line = k.Line
				}
			}
			return Binding{}, &keyError{field: field, line: line, err: err}
		}
		b.Adapter = adapter
	}
	if n := mapValue(n, "control"); n != nil {
		c, err := decodeControl(n, b)
		if err != nil {
			return Binding{}, err
		}
		b.Control = c
	}
	return b, nil
}

type keyError struct {
	field string
	line  int
	err   error
}

// Error describes the keyError in one line.
func (e *keyError) Error() string { return e.field + ": " + e.err.Error() }

func checkPolicyKeys(n *yaml.Node, prefix string) *keyError {
	if b := mapValue(n, "backoff"); b != nil {
		if err := checkKeys(b, []string{"base", "cap"}); err != nil {
			err.field = prefix + "backoff." + err.field
			return err
		}
	}
	if b := mapValue(n, "idempotency"); b != nil {
		if err := checkKeys(b, []string{"native", "retention"}); err != nil {
			err.field = prefix + "idempotency." + err.field
			return err
		}
	}
	// Durations are checked here, not by Decode, so the error names the field.
	for _, path := range []string{"consistency_window", "max_request_lifetime", "deadline",
		"backoff.base", "backoff.cap", "idempotency.retention"} {
		v := mapValue(n, path)
		if v == nil {
			continue
		}
		var d duration
		if err := d.UnmarshalYAML(v); err != nil {
			return &keyError{field: prefix + path, line: v.Line, err: err}
		}
	}
	return nil
}

// checkKeys refuses a mapping key outside allowed, naming it.
func checkKeys(n *yaml.Node, allowed []string) *keyError {
	if n.Kind != yaml.MappingNode {
		return &keyError{line: n.Line, err: errors.New("must be a mapping")}
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		ok := false
		for _, a := range allowed {
			if k.Value == a {
				ok = true
				break
			}
		}
		if !ok {
			return &keyError{field: k.Value, line: k.Line, err: errors.New("unknown field")}
		}
	}
	return nil
}

func mapKey(n *yaml.Node, key string) *yaml.Node {
	// Field names from Register may be dotted ("backoff.cap"): find the
	// innermost mapping key for the best line number.
	parts := strings.Split(key, ".")
	var found *yaml.Node
	for _, p := range parts {
		if n == nil || n.Kind != yaml.MappingNode {
			return found
		}
		var next *yaml.Node
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == p {
				found, next = n.Content[i], n.Content[i+1]
				break
			}
		}
		n = next
	}
	return found
}

// mapValue returns the value at a (possibly dotted) key path, or nil.
func mapValue(n *yaml.Node, key string) *yaml.Node {
	for _, p := range strings.Split(key, ".") {
		if n == nil || n.Kind != yaml.MappingNode {
			return nil
		}
		var next *yaml.Node
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == p {
				next = n.Content[i+1]
				break
			}
		}
		n = next
	}
	return n
}

func lineOf(n *yaml.Node, key string) int {
	if k := mapKey(n, key); k != nil {
		return k.Line
	}
	return n.Line
}

// DependencyLimits are the protection limits the adapters file sets for one
// dependency (the top-level `dependencies` mapping). A nil field is not set
// in the file: the program's default applies (for `reconciler run`, its
// flags). Package readback only carries the values; the program maps them
// onto its protection (e.g. internal/protect) and checks them there against
// its defaults.
type DependencyLimits struct {
	// Line is the line of the dependency's key in the file, for errors
	// found once the limits are combined with the defaults.
	Line int

	// Concurrency is the most calls in flight (>= 1).
	Concurrency *int
	// Rate is the steady rate in calls per second (> 0; +Inf, `.inf` in
	// YAML, for no rate limit); Burst the calls allowed at once above it.
	Rate  *float64
	Burst *int

	// BreakerFailures is the consecutive transient failures that open the
	// breaker; BreakerCooldown how long it stays open before one probe;
	// BreakerMaxCooldown caps the cool-down grown by failed probes.
	BreakerFailures    *int
	BreakerCooldown    *time.Duration
	BreakerMaxCooldown *time.Duration
	// BreakerWindow, BreakerMinCalls and BreakerRate open the breaker on
	// the transient-failure rate: at least BreakerRate (0, 1] of at least
	// BreakerMinCalls calls over BreakerWindow.
	BreakerWindow   *time.Duration
	BreakerMinCalls *int
	BreakerRate     *float64

	// RetryRatio and RetryMin shape the retry budget: a retry is allowed
	// while retries < max(RetryMin, RetryRatio × first calls) over the
	// budget's window. A ratio of 0 with a min of 0 forbids retries.
	RetryRatio *float64
	RetryMin   *int

	// DegradedEnter is the transient-failure rate (0, 1] that degrades the
	// dependency; DegradedExit the rate [0, enter] below which it recovers;
	// DegradedConcurrency the calls in flight while degraded.
	DegradedEnter       *float64
	DegradedExit        *float64
	DegradedConcurrency *int
	// DegradedDecrease (0, 1) multiplies the adaptive concurrency limit on
	// a transient failure while degraded; DegradedIncrease (> 0) is added
	// to it per round of successful calls. DegradedConcurrency is then the
	// floor of the limit.
	DegradedDecrease *float64
	DegradedIncrease *float64
}

func (l DependencyLimits) clone() DependencyLimits {
	c := l
	c.Concurrency = clonePtr(l.Concurrency)
	c.Rate = clonePtr(l.Rate)
	c.Burst = clonePtr(l.Burst)
	c.BreakerFailures = clonePtr(l.BreakerFailures)
	c.BreakerCooldown = clonePtr(l.BreakerCooldown)
	c.BreakerMaxCooldown = clonePtr(l.BreakerMaxCooldown)
	c.BreakerWindow = clonePtr(l.BreakerWindow)
	c.BreakerMinCalls = clonePtr(l.BreakerMinCalls)
	c.BreakerRate = clonePtr(l.BreakerRate)
	c.RetryRatio = clonePtr(l.RetryRatio)
	c.RetryMin = clonePtr(l.RetryMin)
	c.DegradedEnter = clonePtr(l.DegradedEnter)
	c.DegradedExit = clonePtr(l.DegradedExit)
	c.DegradedConcurrency = clonePtr(l.DegradedConcurrency)
	c.DegradedDecrease = clonePtr(l.DegradedDecrease)
	c.DegradedIncrease = clonePtr(l.DegradedIncrease)
	return c
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

type dependencyError struct {
	dependency, field string
	line              int
	err               error
}

// Error describes the dependencyError in one line.
func (e *dependencyError) Error() string {
	return fmt.Sprintf("dependency %q: %s: %v", e.dependency, e.field, e.err)
}

// Keys of a dependencies entry and of its nested blocks.
func dependencyKeys() []string {
	return []string{"concurrency", "rate", "burst", "breaker", "retry_budget", "degraded"}
}

func breakerKeys() []string {
	return []string{"failures", "cooldown", "max_cooldown", "window", "min_calls", "rate"}
}
func retryBudgetKeys() []string { return []string{"ratio", "min"} }
func degradedKeys() []string {
	return []string{"enter", "exit", "concurrency", "decrease", "increase"}
}

// loadDependencies decodes and checks the top-level dependencies mapping.
// Each value is checked on its own, and against the other values of the
// same entry; checks against the program's defaults are the program's.
func loadDependencies(n *yaml.Node) (map[string]DependencyLimits, *dependencyError) {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil, nil // `dependencies:` with nothing under it
	}
	if n.Kind != yaml.MappingNode {
		return nil, &dependencyError{field: "dependencies", line: n.Line,
			err: errors.New("must be a mapping of dependency name to limits")}
	}
	out := map[string]DependencyLimits{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		dep := k.Value
		if k.Kind != yaml.ScalarNode || dep == "" {
			return nil, &dependencyError{field: "dependencies", line: k.Line, err: errors.New("a dependency name is empty")}
		}
		if prev, dup := out[dep]; dup {
			return nil, &dependencyError{dependency: dep, line: k.Line,
				err: fmt.Errorf("declared twice (first at line %d)", prev.Line)}
		}
		l, err := decodeDependency(v)
		if err != nil {
			err.dependency = dep
			return nil, err
		}
		l.Line = k.Line
		out[dep] = l
	}
	return out, nil
}

func decodeDependency(n *yaml.Node) (DependencyLimits, *dependencyError) {
	var l DependencyLimits
	if err := checkKeys(n, dependencyKeys()); err != nil {
		return l, &dependencyError{field: err.field, line: err.line, err: err.err}
	}
	d := fieldDecoder{n: n}
	l.Concurrency = d.int("concurrency", 1)
	l.Rate = d.float("rate", func(f float64) error {
		if !(f > 0) {
			return errors.New("must be positive (calls per second; .inf for no limit)")
		}
		return nil
	})
	l.Burst = d.int("burst", 1)
	d.block("breaker", breakerKeys(), func() {
		l.BreakerFailures = d.int("breaker.failures", 1)
		l.BreakerCooldown = d.duration("breaker.cooldown")
		l.BreakerMaxCooldown = d.duration("breaker.max_cooldown")
		l.BreakerWindow = d.duration("breaker.window")
		l.BreakerMinCalls = d.int("breaker.min_calls", 1)
		l.BreakerRate = d.float("breaker.rate", func(f float64) error {
			if !(f > 0 && f <= 1) {
				return errors.New("must be a rate in (0, 1]")
			}
			return nil
		})
	})
	d.block("retry_budget", retryBudgetKeys(), func() {
		l.RetryRatio = d.float("retry_budget.ratio", func(f float64) error {
			if !(f >= 0) || math.IsInf(f, 0) {
				return errors.New("must be a finite number >= 0")
			}
			return nil
		})
		l.RetryMin = d.int("retry_budget.min", 0)
	})
	d.block("degraded", degradedKeys(), func() {
		l.DegradedEnter = d.float("degraded.enter", func(f float64) error {
			if !(f > 0 && f <= 1) {
				return errors.New("must be a rate in (0, 1]")
			}
			return nil
		})
		l.DegradedExit = d.float("degraded.exit", func(f float64) error {
			if !(f >= 0 && f <= 1) {
				return errors.New("must be a rate in [0, 1]")
			}
			return nil
		})
		l.DegradedConcurrency = d.int("degraded.concurrency", 1)
		l.DegradedDecrease = d.float("degraded.decrease", func(f float64) error {
			if !(f > 0 && f < 1) {
				return errors.New("must be a factor in (0, 1)")
			}
			return nil
		})
		l.DegradedIncrease = d.float("degraded.increase", func(f float64) error {
			if !(f > 0) || math.IsInf(f, 0) {
				return errors.New("must be a finite number > 0")
			}
			return nil
		})
	})
	if d.err != nil {
		return l, d.err
	}
	// Checks between the values of this entry; the program checks the
	// combination with its defaults.
	switch {
	case l.BreakerCooldown != nil && l.BreakerMaxCooldown != nil && *l.BreakerMaxCooldown < *l.BreakerCooldown:
		return l, d.fail("breaker.max_cooldown", fmt.Errorf("must be at least breaker.cooldown (%s)", *l.BreakerCooldown))
	case l.DegradedEnter != nil && l.DegradedExit != nil && *l.DegradedExit > *l.DegradedEnter:
		return l, d.fail("degraded.exit", fmt.Errorf("must not exceed degraded.enter (%v)", *l.DegradedEnter))
	case l.Concurrency != nil && l.DegradedConcurrency != nil && *l.DegradedConcurrency > *l.Concurrency:
		return l, d.fail("degraded.concurrency", fmt.Errorf("must not exceed concurrency (%d)", *l.Concurrency))
	}
	return l, nil
}

// fieldDecoder decodes the scalar fields of one dependencies entry,
// keeping the first error with the field's name and line.
type fieldDecoder struct {
	n   *yaml.Node
	err *dependencyError
}

func (d *fieldDecoder) fail(field string, err error) *dependencyError {
	line := d.n.Line
	if k := mapKey(d.n, field); k != nil {
		line = k.Line
	}
	return &dependencyError{field: field, line: line, err: err}
}

// scalar returns the value at field, or nil when absent or after an error.
func (d *fieldDecoder) scalar(field string) *yaml.Node {
	if d.err != nil {
		return nil
	}
	v := mapValue(d.n, field)
	if v == nil {
		return nil
	}
	if v.Kind != yaml.ScalarNode || v.Tag == "!!null" {
		d.err = d.fail(field, errors.New("must be a single value"))
		return nil
	}
	return v
}

func (d *fieldDecoder) block(field string, keys []string, decode func()) {
	if d.err != nil {
		return
	}
	v := mapValue(d.n, field)
	if v == nil {
		return
	}
	if err := checkKeys(v, keys); err != nil {
		if err.field == "" {
			d.err = d.fail(field, err.err)
		} else {
			d.err = &dependencyError{field: field + "." + err.field, line: err.line, err: err.err}
		}
		return
	}
	decode()
}

func (d *fieldDecoder) int(field string, least int) *int {
	v := d.scalar(field)
	if v == nil {
		return nil
	}
	var i int
	if v.Tag != "!!int" || v.Decode(&i) != nil {
		d.err = d.fail(field, fmt.Errorf("want an integer, got %q", v.Value))
		return nil
	}
	if i < least {
		if least == 1 {
			d.err = d.fail(field, fmt.Errorf("must be positive, got %d", i))
		} else {
			d.err = d.fail(field, fmt.Errorf("must be at least %d, got %d", least, i))
		}
		return nil
	}
	return &i
}

func (d *fieldDecoder) float(field string, check func(float64) error) *float64 {
	v := d.scalar(field)
	if v == nil {
		return nil
	}
	var f float64
	if (v.Tag != "!!int" && v.Tag != "!!float") || v.Decode(&f) != nil {
		d.err = d.fail(field, fmt.Errorf("want a number, got %q", v.Value))
		return nil
	}
	if err := check(f); err != nil {
		d.err = d.fail(field, err)
		return nil
	}
	return &f
}

func (d *fieldDecoder) duration(field string) *time.Duration {
	v := d.scalar(field)
	if v == nil {
		return nil
	}
	var du duration
	if err := du.UnmarshalYAML(v); err != nil {
		d.err = d.fail(field, err)
		return nil
	}
	if du <= 0 {
		d.err = d.fail(field, fmt.Errorf("must be positive, got %s", time.Duration(du)))
		return nil
	}
	t := time.Duration(du)
	return &t
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
