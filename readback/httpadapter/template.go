package httpadapter

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
)

// A template is a string with {placeholders} over the receipt, its time
// window and the declared intent fields. It is compiled at load time so a
// reference to an unknown placeholder or an undeclared intent field is a
// configuration error, not a failed check at 3 a.m.
type template struct {
	parts []tmplPart
}

type tmplPart struct {
	lit    string
	ref    string // "" for a literal
	filter string // "" or "squote"
}

// receiptRefs are the placeholders that need no declaration.
func receiptRefs() []string {
	return []string{"receipt.id", "receipt.idempotency_key", "receipt.logical_key", "receipt.external_id", "receipt.target",
		"receipt.operation", "receipt.dependency", "receipt.fingerprint",
		"window.start", "window.end", "window.start_unix", "window.end_unix"}
}

// compileTemplate parses s; intentFields are the declared intent field names.
// "{{" and "}}" stand for literal braces.
func compileTemplate(s string, intentFields map[string]string) (template, error) {
	var t template
	var lit strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '{' && i+1 < len(s) && s[i+1] == '{':
			lit.WriteByte('{')
			i++
		case c == '}' && i+1 < len(s) && s[i+1] == '}':
			lit.WriteByte('}')
			i++
		case c == '}':
			return template{}, fmt.Errorf("unmatched } at offset %d (write }} for a literal brace)", i)
		case c == '{':
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return template{}, fmt.Errorf("unclosed { at offset %d", i)
			}
			ref := strings.TrimSpace(s[i+1 : i+end])
			filter := ""
			if j := strings.IndexByte(ref, '|'); j >= 0 {
				ref, filter = strings.TrimSpace(ref[:j]), strings.TrimSpace(ref[j+1:])
				if filter != "squote" {
					return template{}, fmt.Errorf("unknown filter %q in {%s} (known: squote)", filter, s[i+1:i+end])
				}
			}
			if err := checkRef(ref, intentFields); err != nil {
				return template{}, err
			}
			if lit.Len() > 0 {
				t.parts = append(t.parts, tmplPart{lit: lit.String()})
				lit.Reset()
			}
			t.parts = append(t.parts, tmplPart{ref: ref, filter: filter})
			i += end
		default:
			lit.WriteByte(c)
		}
	}
	if lit.Len() > 0 {
		t.parts = append(t.parts, tmplPart{lit: lit.String()})
	}
	return t, nil
}

func checkRef(ref string, intentFields map[string]string) error {
	if name, ok := strings.CutPrefix(ref, "intent."); ok {
		if _, declared := intentFields[name]; declared {
			return nil
		}
		names := make([]string, 0, len(intentFields))
		for k := range intentFields {
			names = append(names, k)
		}
		sort.Strings(names)
		return fmt.Errorf("unknown intent field %q in {%s} (declared in intent_fields: %s)",
			name, ref, strings.Join(names, ", "))
	}
	for _, r := range receiptRefs() {
		if r == ref {
			return nil
		}
	}
	return fmt.Errorf("unknown placeholder {%s} (known: %s, intent.<name>)", ref, strings.Join(receiptRefs(), ", "))
}

// namesKey reports whether t names the receipt's key or id: a search
// narrowed to the receipt's own resources.
func (t template) namesKey() bool {
	for _, p := range t.parts {
		switch p.ref {
		case "receipt.logical_key", "receipt.idempotency_key", "receipt.id":
			return true
		}
	}
	return false
}

// scope is what a template is rendered against: one receipt at one check.
type scope struct {
	r           readback.Receipt
	start, end  time.Time
	payload     map[string]any // nil when the intent has no object payload
	intentField map[string]string
}

// errMissingField means the receipt lacks a value a template needs: the
// configuration does not fit the operation's intent (permanent).
var errMissingField = errors.New("value missing from the receipt")

// value returns the string value of one placeholder.
func (s *scope) value(ref string) (string, error) {
	switch ref {
	case "receipt.id":
		return strconv.FormatInt(s.r.ID, 10), nil
	case "receipt.idempotency_key":
		return s.r.IdempotencyKey, nil
	case "receipt.logical_key":
		return ledger.LogicalKey(s.r.IdempotencyKey), nil
	case "receipt.external_id":
		if s.r.ExternalID == "" {
			return "", fmt.Errorf("{receipt.external_id}: %w (no external id recorded)", errMissingField)
		}
		return s.r.ExternalID, nil
	case "receipt.target":
		return s.r.Target, nil
	case "receipt.operation":
		return s.r.Operation, nil
	case "receipt.dependency":
		return s.r.Dependency, nil
	case "receipt.fingerprint":
		return s.r.Fingerprint, nil
	case "window.start":
		return s.start.UTC().Format(time.RFC3339), nil
	case "window.end":
		return s.end.UTC().Format(time.RFC3339), nil
	case "window.start_unix":
		return strconv.FormatInt(s.start.Unix(), 10), nil
	case "window.end_unix":
		return strconv.FormatInt(s.end.Unix(), 10), nil
	}
	name, _ := strings.CutPrefix(ref, "intent.")
	ptr := s.intentField[name]
	v, ok := lookup(s.payload, ptr)
	if !ok {
		return "", fmt.Errorf("{%s}: %w (no %s in the intent's payload)", ref, errMissingField, ptr)
	}
	if isSecretMarker(v) {
		// The stored intent holds a stand-in for a secret field, not the
		// value the call sent: searching for it finds nothing, and that
		// nothing would read as an absence.
		return "", fmt.Errorf("{%s}: %w", ref, errSecretField)
	}
	return scalarString(v)
}

// errSecretField means a template names an intent field that the ledger
// stored redacted or keyed ("[redacted]", "hmac-sha256:<hex>"): the value
// the call sent is not in the receipt, so the check cannot render it
// (permanent: manual_review, never an absence).
var errSecretField = errors.New("the intent field is secret: the receipt holds a redaction marker, not its value " +
	"(a readback cannot search for it; name a non-secret field or a marker instead)")

// isSecretMarker reports whether v is a secret field's stand-in in a
// stored intent: fingerprint.RedactedMarker, or a keyed "hmac-sha256:<hex>".
func isSecretMarker(v any) bool {
	s, ok := v.(string)
	return ok && (s == fingerprint.RedactedMarker || strings.HasPrefix(s, fingerprint.KeyedPrefix))
}

// holdsSecretMarker reports whether any value in doc is a secret stand-in.
func holdsSecretMarker(doc any) bool {
	switch x := doc.(type) {
	case map[string]any:
		for _, v := range x {
			if holdsSecretMarker(v) {
				return true
			}
		}
	case []any:
		for _, v := range x {
			if holdsSecretMarker(v) {
				return true
			}
		}
	default:
		return isSecretMarker(x)
	}
	return false
}

// scalarString renders a JSON scalar as template text.
func scalarString(v any) (string, error) {
	switch x := v.(type) {
	case string:
		return x, nil
	case json.Number:
		return x.String(), nil
	case bool:
		return strconv.FormatBool(x), nil
	}
	return "", fmt.Errorf("%w: want a string, number or boolean, got %s", errMissingField, jsonType(v))
}

// escapeTarget returns the receipt's target (chosen by the agent) as the
// URL path it was recorded as: the ledger records a request's escaped path
// (net/url's EscapedPath), so the target reaches the API exactly as
// recorded, neither decoded nor escaped again. An escaped separator stays
// one: "acme%2Fwidgets" is read at "acme%2Fwidgets", never at
// "acme%252Fwidgets" (whose 404 a delete would take for an absence). Only
// what a path cannot hold as it is gets escaped: a '%' that starts no
// escape, and any other byte outside RFC 3986's pchar. A target holding a
// query or a fragment ('?', '#': the gateway records a call's query in its
// target) is refused: read as a path it names another resource (a 404, an
// absence to a delete), and its parameters must never reach a search (a
// filter the configuration did not set finds nothing). So is a "." or ".."
// segment, also escaped ("%2e%2e"), which would name another resource.
func escapeTarget(target string) (string, error) {
	if i := strings.IndexAny(target, "?#"); i >= 0 {
		return "", fmt.Errorf("{receipt.target} %q holds a query or a fragment (%q): it is not a path that can be read as recorded", target, target[i])
	}
	segs := strings.Split(target, "/")
	for i, seg := range segs {
		seg = escapePathSegment(seg)
		if dec, err := url.PathUnescape(seg); err == nil && (dec == "." || dec == "..") {
			return "", fmt.Errorf("{receipt.target} %q has a %q segment: it would name another resource", target, dec)
		}
		segs[i] = seg
	}
	return strings.Join(segs, "/"), nil
}

// escapePathSegment keeps seg's escapes and pchar bytes (RFC 3986 §3.3)
// as they are and percent-encodes every other byte.
func escapePathSegment(seg string) string {
	var b strings.Builder
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		switch {
		case c == '%' && i+2 < len(seg) && isHex(seg[i+1]) && isHex(seg[i+2]):
			b.WriteString(seg[i : i+3])
			i += 2
		case pchar(c):
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// pchar reports whether c may appear unescaped in a path segment: an
// unreserved character, a sub-delimiter, ':' or '@'.
func pchar(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		strings.IndexByte("-._~!$&'()*+,;=:@", c) >= 0
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// render expands t. pathEscape escapes every value for a URL path: each one
// is exactly one segment, but receipt.target, which is a path itself, keeps
// its '/' separators (escapeTarget).
func (t template) render(s *scope, pathEscape bool) (string, error) {
	var b strings.Builder
	for _, p := range t.parts {
		if p.ref == "" {
			b.WriteString(p.lit)
			continue
		}
		v, err := s.value(p.ref)
		if err != nil {
			return "", err
		}
		if p.filter == "squote" {
			// Search languages quoting with '...' (Stripe) need the quote
			// and the backslash escaped, or a key holding one would turn a
			// search for it into a search for nothing: a false absence.
			v = strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v)
		}
		switch {
		case pathEscape && p.ref == "receipt.target":
			if v, err = escapeTarget(v); err != nil {
				return "", err
			}
		case pathEscape:
			v = url.PathEscape(v)
		}
		b.WriteString(v)
	}
	return b.String(), nil
}

func jsonType(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "an object"
	case []any:
		return "an array"
	case string:
		return "a string"
	case json.Number:
		return "a number"
	case bool:
		return "a boolean"
	}
	return fmt.Sprintf("%T", v)
}
