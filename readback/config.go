package readback

import (
	"bytes"
	"errors"
	"fmt"
	"io"
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
	Field   string
	Line    int
	Err     error
}

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
func topKeys() []string { return []string{"version", "defaults", "adapters"} }

func policyKeys() []string {
	return []string{"consistency_window", "max_request_lifetime", "max_checks", "deadline", "backoff", "idempotency"}
}

func adapterKeys() []string {
	return append([]string{"name", "type", "kind", "dependency", "operations"}, policyKeys()...)
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

// Load is LoadFile for a reader; name is used in errors.
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
		return reg, nil // an empty file declares no adapters
	}
	root := doc.Content[0]
	if err := checkKeys(root, topKeys()); err != nil {
		return nil, fail("", err.field, err.line, err.err)
	}
	var fc fileConfig
	if err := root.Decode(&fc); err != nil {
		return nil, fail("", "", root.Line, err)
	}
	if fc.Version != 1 {
		return nil, fail("", "version", root.Line, fmt.Errorf("must be 1, got %d", fc.Version))
	}
	if n := mapValue(root, "defaults"); n != nil {
		if err := checkKeys(n, policyKeys()); err != nil {
			return nil, fail("", "defaults."+err.field, err.line, err.err)
		}
		if err := checkPolicyKeys(n, "defaults."); err != nil {
			return nil, fail("", err.field, err.line, err.err)
		}
	}
	defaults := fc.Defaults.apply(DefaultPolicy())
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
			return Binding{}, &keyError{field: field, line: lineOf(n, typ), err: err}
		}
		b.Adapter = adapter
	}
	return b, nil
}

type keyError struct {
	field string
	line  int
	err   error
}

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
