// Package fingerprint computes intent fingerprints: a stable identity for
// "what a side-effecting call means to do", used to recognize a re-planned
// duplicate of a call whose outcome is still unknown.
//
// A fingerprint is "sha256:" followed by 64 lowercase hexadecimal digits: the
// SHA-256 of the RFC 8785 (JSON Canonicalization Scheme) form of
//
//	{"method": UPPER(method), "target": target, "payload": normalized payload}
//
// Any language with an RFC 8785 implementation reproduces it. Normalization
// drops volatile fields (timestamps, nonces, request ids) named by JSON
// pointers. Secret fields, also named by JSON pointers, are covered by the
// fingerprint with their real value but replaced by RedactedMarker in the
// intent returned for storage.
//
// Fingerprinting is stricter than RFC 8785. JSON numbers are IEEE 754 doubles
// under RFC 8785, so 9007199254740993 canonicalizes to 9007199254740992 and
// 0.10000000000000001 to 0.1; two different amounts would then share a
// fingerprint. Compute refuses every number whose canonical form denotes a
// different value than its text (ErrNumberPrecision), while 1.0, 1e2 and -0
// are accepted because their canonical forms 1, 100 and 0 denote the same
// values.
//
// Canonicalize is plain RFC 8785 and refuses only what the RFC refuses. The
// canonical transform itself is github.com/gowebpki/jcs; this package parses
// the input first with encoding/json to report refusals as typed errors with
// the JSON pointer of the offending value, and to apply normalization.
package fingerprint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/gowebpki/jcs"
)

// DefaultMaxBytes is the payload size limit Compute applies unless
// WithMaxBytes sets another: 1 MiB.
const DefaultMaxBytes = 1 << 20

// RedactedMarker is the JSON string that replaces the value of every secret
// field in Result.Intent.
const RedactedMarker = "[redacted]"

// Prefix starts every fingerprint; 64 lowercase hexadecimal digits follow.
const Prefix = "sha256:"

// Result is the outcome of Compute.
type Result struct {
	// Fingerprint is Prefix followed by the lowercase hexadecimal SHA-256 of
	// the canonical intent with real secret values.
	Fingerprint string

	// Intent is the RFC 8785 canonical JSON of the normalized intent,
	// {"method":…,"payload":…,"target":…}, with volatile fields dropped and
	// secret fields replaced by RedactedMarker. It is what may be stored.
	// When no secret field is present, its SHA-256 is the fingerprint.
	Intent []byte
}

// Option configures Compute.
type Option func(*settings)

// settings is what the options of one Compute call configure.
type settings struct {
	drop     []string
	secret   []string
	maxBytes int
}

// WithDrop names volatile fields, by RFC 6901 JSON pointer into the payload
// (for example "/request_id", "/meta/nonce", "/items/0/ts"), to leave out of
// both the fingerprint and the stored intent. A pointer that resolves to
// nothing is ignored; a malformed one, or "" (the whole payload), makes
// Compute fail with ErrInvalidPointer. Dropping an array element removes it;
// all pointers are resolved against the payload as received, so their order
// does not matter. The option may be given several times.
func WithDrop(pointers ...string) Option {
	return func(s *settings) { s.drop = append(s.drop, pointers...) }
}

// WithSecret names secret fields, by RFC 6901 JSON pointer into the payload.
// The fingerprint covers their real value; Result.Intent holds RedactedMarker
// in their place. "" redacts the whole payload. A pointer that resolves to
// nothing is ignored; a malformed one makes Compute fail with
// ErrInvalidPointer. A field both dropped and secret is dropped. The option
// may be given several times.
func WithSecret(pointers ...string) Option {
	return func(s *settings) { s.secret = append(s.secret, pointers...) }
}

// WithMaxBytes sets the largest payload, in bytes, that Compute accepts
// (DefaultMaxBytes otherwise). n <= 0 removes the limit.
func WithMaxBytes(n int) Option {
	return func(s *settings) { s.maxBytes = n }
}

// Compute returns the fingerprint of the intent (method, target, payload) and
// the normalized, redacted intent to store. payload must be one JSON text
// (send "null" for a call without a body).
//
// Compute refuses, with errors wrapping the sentinels of this package:
// invalid JSON (ErrInvalidJSON), invalid UTF-8 or lone surrogates
// (ErrInvalidUTF8), duplicate object keys at any depth (ErrDuplicateKey),
// numbers that are out of range or not exactly representable
// (ErrNumberRange, ErrNumberPrecision), payloads over the size limit
// (ErrTooLarge) or nested too deeply (ErrTooDeep), malformed pointers
// (ErrInvalidPointer), a method that is not an HTTP token
// (ErrInvalidMethod), and an empty or non-UTF-8 target (ErrInvalidTarget).
func Compute(method, target string, payload []byte, opts ...Option) (Result, error) {
	cfg := settings{maxBytes: DefaultMaxBytes}
	for _, opt := range opts {
		if opt != nil {
			opt(&cfg)
		}
	}

	upper, err := normalizeMethod(method)
	if err != nil {
		return Result{}, err
	}
	if target == "" {
		return Result{}, fmt.Errorf("%w: empty", ErrInvalidTarget)
	}
	if !utf8.ValidString(target) {
		return Result{}, fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidTarget, quoteForError(target))
	}
	if cfg.maxBytes > 0 && len(payload) > cfg.maxBytes {
		return Result{}, fmt.Errorf("%w: %d bytes, the limit is %d", ErrTooLarge, len(payload), cfg.maxBytes)
	}
	drops, err := parsePointers(cfg.drop, false)
	if err != nil {
		return Result{}, err
	}
	secrets, err := parsePointers(cfg.secret, true)
	if err != nil {
		return Result{}, err
	}

	root, err := parse(payload, true)
	if err != nil {
		return Result{}, err
	}
	for _, tokens := range drops {
		if n := resolve(root, tokens); n != nil {
			n.drop = true
		}
	}
	redacted := false
	for _, tokens := range secrets {
		if n := resolve(root, tokens); n != nil && !n.drop {
			n.secret = true
			redacted = true
		}
	}

	// One buffer is reused for both serializations; capacity grows once.
	buf := bytes.NewBuffer(make([]byte, 0, len(payload)+len(upper)+len(target)+48))
	full, err := canonicalIntent(buf, upper, target, root, false)
	if err != nil {
		return Result{}, err
	}
	sum := sha256.Sum256(full)
	res := Result{Fingerprint: Prefix + hex.EncodeToString(sum[:]), Intent: full}
	if redacted {
		buf.Reset()
		if res.Intent, err = canonicalIntent(buf, upper, target, root, true); err != nil {
			return Result{}, err
		}
	}
	return res, nil
}

// Canonicalize returns the RFC 8785 canonical form of the JSON text data.
//
// It refuses what RFC 8785 refuses, with errors wrapping this package's
// sentinels: text that is not one well-formed JSON value (ErrInvalidJSON),
// invalid UTF-8 or a \u escape of a lone surrogate (ErrInvalidUTF8, required
// by §3.1 through I-JSON), duplicate property names (ErrDuplicateKey, also
// §3.1), and numbers beyond the range of a double (ErrNumberRange, which have
// no ECMAScript form). Numbers that merely lose precision are canonicalized
// as the RFC says (9007199254740993 becomes 9007199254740992); only Compute
// refuses them. Unicode noncharacters such as U+FFFF are accepted: §3.1 asks
// only that strings be expressible as Unicode. Nesting deeper than MaxDepth is
// refused as an implementation limit (ErrTooDeep). There is no size limit;
// bound untrusted input before calling.
//
// The output has no insignificant whitespace and no trailing newline.
func Canonicalize(data []byte) ([]byte, error) {
	if _, err := parse(data, false); err != nil {
		return nil, err
	}
	return transform(data)
}

// transform runs the jcs canonicalizer on JSON text that parse accepted.
func transform(data []byte) ([]byte, error) {
	out, err := jcs.Transform(data)
	if err != nil {
		// Unreachable unless jcs refuses text that encoding/json and this
		// package's I-JSON checks accept; reported rather than hidden.
		return nil, fmt.Errorf("%w: canonicalizer refused validated input: %v", ErrInvalidJSON, err)
	}
	return out, nil
}

// normalizeMethod upper-cases an HTTP method after checking that it is a
// token (RFC 9110 §5.6.2). Tokens are ASCII, so the result is the same in
// every language.
func normalizeMethod(method string) (string, error) {
	if method == "" {
		return "", fmt.Errorf("%w: empty", ErrInvalidMethod)
	}
	for i := 0; i < len(method); i++ {
		if !isTokenChar(method[i]) {
			return "", fmt.Errorf("%w: %s is not an HTTP token", ErrInvalidMethod, quoteForError(method))
		}
	}
	return strings.ToUpper(method), nil
}

// isTokenChar reports whether c is an RFC 9110 tchar.
func isTokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// parsePointers parses every pointer, refusing the whole-payload pointer ""
// unless allowRoot.
func parsePointers(pointers []string, allowRoot bool) ([][]string, error) {
	out := make([][]string, 0, len(pointers))
	for _, ptr := range pointers {
		if ptr == "" && !allowRoot {
			return nil, fmt.Errorf("%w: \"\" would drop the whole payload", ErrInvalidPointer)
		}
		tokens, err := parsePointer(ptr)
		if err != nil {
			return nil, err
		}
		out = append(out, tokens)
	}
	return out, nil
}

// canonicalIntent serializes the intent envelope into buf (compact, members
// in any order) and returns its RFC 8785 canonical form.
func canonicalIntent(buf *bytes.Buffer, method, target string, payload *node, redact bool) ([]byte, error) {
	buf.WriteString(`{"method":`)
	writeString(buf, method)
	buf.WriteString(`,"target":`)
	writeString(buf, target)
	buf.WriteString(`,"payload":`)
	writeNode(buf, payload, redact)
	buf.WriteByte('}')
	return transform(buf.Bytes())
}

// writeNode writes n as compact JSON, leaving out dropped members and
// elements, and writing RedactedMarker for secret values when redact is set.
// Numbers are written with their input text: the canonicalizer formats them.
func writeNode(buf *bytes.Buffer, n *node, redact bool) {
	if redact && n.secret {
		writeString(buf, RedactedMarker)
		return
	}
	switch n.kind {
	case kindNull:
		buf.WriteString("null")
	case kindBool, kindNumber:
		buf.WriteString(n.text)
	case kindString:
		writeString(buf, n.text)
	case kindArray:
		buf.WriteByte('[')
		first := true
		for _, e := range n.elems {
			if e.drop {
				continue
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			writeNode(buf, e, redact)
		}
		buf.WriteByte(']')
	case kindObject:
		buf.WriteByte('{')
		first := true
		for _, m := range n.members {
			if m.value.drop {
				continue
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			writeString(buf, m.name)
			buf.WriteByte(':')
			writeNode(buf, m.value, redact)
		}
		buf.WriteByte('}')
	}
}

// writeString writes s (valid UTF-8) as a JSON string literal, escaping only
// what JSON requires.
func writeString(buf *bytes.Buffer, s string) {
	const hexDigits = "0123456789abcdef"
	buf.WriteByte('"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		buf.WriteString(s[start:i])
		switch c {
		case '"', '\\':
			buf.WriteByte('\\')
			buf.WriteByte(c)
		default:
			buf.WriteString(`\u00`)
			buf.WriteByte(hexDigits[c>>4])
			buf.WriteByte(hexDigits[c&0xF])
		}
		start = i + 1
	}
	buf.WriteString(s[start:])
	buf.WriteByte('"')
}
