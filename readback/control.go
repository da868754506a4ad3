package readback

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/fingerprint"
)

// Control is a positive control (SPEC §5a): an effect known to exist that a
// correctly configured adapter must find. Until an adapter has passed a
// control recently, none of its absences is authoritative, because a wrong
// path, filter or marker reads exactly like "absent".
//
// A control is either declared in the adapters file (a known resource, for
// a new deployment that has no succeeded receipts yet) or drawn from the
// ledger (a receipt of the same operation that settled succeeded from the
// API's own 2xx response).
//
// A control vouches only for its operation (Receipt.Operation, never empty
// for a control loaded from a file): the other operations of an adapter
// that reads several, or a whole dependency, are vouched for by their own
// receipts that settled succeeded from a 2xx response.
//
// A delete adapter needs two controls, because either misconfiguration
// reads like an answer: "present" (a resource known to exist must read
// present; the declared control is such a resource) gates settling an
// absence as succeeded, and "gone" (the newest receipt of the same delete
// operation that settled succeeded from a 2xx response must read absent,
// authoritatively; drawn from the ledger by the reconciler) gates settling
// a resource still present after the window as safe_to_retry.
type Control struct {
	// Receipt describes the known effect as the adapter sees a receipt:
	// idempotency key (its logical key is the marker), target, intent,
	// external id, the operation it vouches for and the time it was made.
	Receipt Receipt
	// Source says where the control came from: "declared" or "receipt:<id>".
	Source string
}

// ErrControlFailed means an adapter did not find the effect of a control.
var ErrControlFailed = errors.New("positive control failed")

// EvaluateControl says whether the answer res (or the failure err) of b's
// adapter to a control passes it: the known effect must be found. For
// create and update a present answer passes; for delete, whose control is a
// resource that exists, a present answer passes too (an adapter that reads
// "absent" for a resource that exists would settle deletes that never
// happened). Anything else fails with an error matching ErrControlFailed
// that says what the adapter answered.
func EvaluateControl(b *Binding, res Result, err error) error {
	if err != nil {
		return fmt.Errorf("%w: adapter %s: the check failed: %w", ErrControlFailed, b.Name, err)
	}
	if res.Verdict != VerdictPresent {
		return fmt.Errorf("%w: adapter %s answered %s (query %s) for an effect known to exist",
			ErrControlFailed, b.Name, res.Verdict, res.Query)
	}
	return nil
}

// controlKeys are the keys of an adapter's `control` block. A function, not
// a variable, so no caller can widen it.
func controlKeys() []string {
	return []string{"idempotency_key", "target", "intent", "external_id", "submitted_at", "operation", "method"}
}

// maxKeyBytes is the longest idempotency key the ledger accepts.
const maxKeyBytes = 255

// decodeControl reads the `control` block of an adapter declaration: a
// resource known to exist, described as the receipt of the call that made
// it, which the adapter must find. Every error names the field and line.
func decodeControl(n *yaml.Node, b Binding) (*Control, *keyError) {
	fail := func(field string, line int, err error) *keyError {
		return &keyError{field: "control." + field, line: line, err: err}
	}
	if n.Kind != yaml.MappingNode {
		return nil, &keyError{field: "control", line: n.Line, err: errors.New("must be a mapping (idempotency_key, target, intent, external_id, submitted_at, operation, method)")}
	}
	if b.Kind == Blind {
		return nil, &keyError{field: "control", line: n.Line, err: errors.New("a blind adapter reads nothing back: no control applies")}
	}
	if err := checkKeys(n, controlKeys()); err != nil {
		err.field = "control." + err.field
		return nil, err
	}
	scalar := func(key string, required bool) (string, int, *keyError) {
		v := mapValue(n, key)
		if v == nil {
			if required {
				return "", n.Line, fail(key, n.Line, errors.New("is required"))
			}
			return "", n.Line, nil
		}
		if v.Kind != yaml.ScalarNode || v.Tag == "!!null" {
			return "", v.Line, fail(key, v.Line, errors.New("must be a single value"))
		}
		if required && v.Value == "" {
			return "", v.Line, fail(key, v.Line, errors.New("must not be empty"))
		}
		return v.Value, v.Line, nil
	}
	c := &Control{Source: "declared"}
	r := &c.Receipt
	var line int
	var ke *keyError
	if r.IdempotencyKey, line, ke = scalar("idempotency_key", true); ke != nil {
		return nil, ke
	}
	if len(r.IdempotencyKey) > maxKeyBytes {
		return nil, fail("idempotency_key", line, fmt.Errorf("is %d bytes; the ledger accepts at most %d", len(r.IdempotencyKey), maxKeyBytes))
	}
	if r.Target, _, ke = scalar("target", true); ke != nil {
		return nil, ke
	}
	if r.ExternalID, _, ke = scalar("external_id", false); ke != nil {
		return nil, ke
	}
	var at string
	if at, line, ke = scalar("submitted_at", true); ke != nil {
		return nil, ke
	}
	t, err := time.Parse(time.RFC3339Nano, at)
	if err != nil {
		return nil, fail("submitted_at", line, fmt.Errorf("want an RFC 3339 time such as 2026-01-02T15:04:05Z, got %q", at))
	}
	r.SubmittedAt, r.CreatedAt, r.SendDeadline = t, t, t
	if r.Operation, line, ke = scalar("operation", false); ke != nil {
		return nil, ke
	}
	// A control vouches only for the operation whose call made its
	// resource: a path, filter or marker right for one operation may be
	// wrong for another. So the control names one operation, always: the
	// binding's only one, else the file must say which (the reconciler
	// keeps control state per adapter and operation).
	switch {
	case r.Operation != "" && len(b.Operations) > 0 && !slices.Contains(b.Operations, r.Operation):
		return nil, fail("operation", line, fmt.Errorf("%q is not one of the adapter's operations (%s)", r.Operation, strings.Join(b.Operations, ", ")))
	case r.Operation != "":
		// Explicit: one of the binding's operations, or any operation of
		// the dependency for a dependency-wide adapter.
	case len(b.Operations) == 1:
		r.Operation = b.Operations[0]
	case len(b.Operations) == 0:
		return nil, fail("operation", n.Line, fmt.Errorf("is required: the adapter reads every operation of dependency %q, "+
			"and a control vouches only for the operation whose call made its resource; name it "+
			"(the other operations are vouched for by their receipts that settled succeeded from a 2xx response)", b.Dependency))
	default:
		return nil, fail("operation", n.Line, fmt.Errorf("is required: the adapter reads several operations (%s), "+
			"and a control vouches only for the operation whose call made its resource; name it "+
			"(the other operations are vouched for by their receipts that settled succeeded from a 2xx response)",
			strings.Join(b.Operations, ", ")))
	}
	if r.Method, line, ke = scalar("method", false); ke != nil {
		return nil, ke
	}
	if r.Method == "" {
		r.Method = map[Kind]string{Create: "POST", Update: "PATCH", Delete: "DELETE"}[b.Kind]
	}
	// The intent is the payload of the call that made the resource; it is
	// stored as the ledger stores intents, with its fingerprint.
	payload := []byte("null")
	iline := n.Line
	if v := mapValue(n, "intent"); v != nil && v.Tag != "!!null" {
		iline = v.Line
		var doc any
		switch {
		case v.Kind == yaml.MappingNode:
			if err := v.Decode(&doc); err != nil {
				return nil, fail("intent", v.Line, err)
			}
		case v.Kind == yaml.ScalarNode && v.Tag == "!!str":
			// A JSON object written as a string.
			if err := json.Unmarshal([]byte(v.Value), &doc); err != nil {
				return nil, fail("intent", v.Line, fmt.Errorf("want a JSON or YAML object: %w", err))
			}
			if _, ok := doc.(map[string]any); !ok {
				return nil, fail("intent", v.Line, errors.New("want a JSON or YAML object"))
			}
		default:
			return nil, fail("intent", v.Line, errors.New("want a JSON or YAML object (the payload of the call)"))
		}
		if payload, err = json.Marshal(doc); err != nil {
			return nil, fail("intent", v.Line, fmt.Errorf("cannot be written as JSON: %w", err))
		}
	}
	fp, err := fingerprint.Compute(r.Method, r.Target, payload)
	if err != nil {
		field, l := "intent", iline
		if errors.Is(err, fingerprint.ErrInvalidMethod) {
			field, l = "method", lineOf(n, "method")
		} else if errors.Is(err, fingerprint.ErrInvalidTarget) {
			field, l = "target", lineOf(n, "target")
		}
		return nil, fail(field, l, err)
	}
	r.Fingerprint, r.Intent = fp.Fingerprint, json.RawMessage(fp.Intent)
	r.Dependency, r.Attempt = b.Dependency, 1
	return c, nil
}
