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
// pointers. Secret fields, also named by JSON pointers, are replaced before
// canonicalization by "hmac-sha256:<key id>:<hex>", an HMAC-SHA256 of their
// canonical value under a key the deployment holds (WithSecretKey), in the
// fingerprint and in the intent returned for storage alike; an intent
// without secret fields keeps the plain RFC 8785 fingerprint. See
// WithSecretKey and secretkey.go for what another language must do.
//
// Fingerprinting is stricter than RFC 8785. JSON numbers are IEEE 754 doubles
// under RFC 8785, so 9007199254740993 canonicalizes to 9007199254740992 and
// 0.10000000000000001 to 0.1; two different amounts would then share a
// fingerprint. Compute refuses every number whose canonical form denotes a
// different value than its text (ErrNumberPrecision), while 1.0, 1e2 and -0
// are accepted because their canonical forms 1, 100 and 0 denote the same
// values.
//
// Canonicalize is plain RFC 8785 and refuses only what the RFC refuses.
// Parsing and canonical serialization are this package's own, in one pass
// each over the bytes, so that refusals are typed errors with the JSON pointer
// of the offending value and normalization applies to the parsed tree; the
// tests check the output against github.com/gowebpki/jcs, a reference RFC
// 8785 implementation.
package fingerprint

import (
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

// RedactedMarker is the JSON string that replaced the value of every secret
// field in the stored intent of receipts planned before secret values were
// keyed (see WithSecretKey). Compute no longer produces it; HasSecrets
// recognizes it.
const RedactedMarker = "[redacted]"

// Prefix starts every fingerprint; 64 lowercase hexadecimal digits follow.
const Prefix = "sha256:"

// Result is the outcome of Compute.
type Result struct {
	// Fingerprint is Prefix followed by the lowercase hexadecimal SHA-256 of
	// Intent.
	Fingerprint string

	// Intent is the RFC 8785 canonical JSON of the normalized intent,
	// {"method":…,"payload":…,"target":…}, with volatile fields dropped and
	// the value of each secret field replaced by its keyed string
	// "hmac-sha256:<key id>:<hex>". It is what may be stored, and its
	// SHA-256 is the fingerprint.
	Intent []byte
}

// Option configures Compute.
type Option func(*settings)

// settings is what the options of one Compute call configure.
type settings struct {
	drop     []string
	secret   []string
	maxBytes int
	// keyID and key are set by WithSecretKey (keySet).
	keyID  string
	key    []byte
	keySet bool
	// pointers is the initial storage of drop and secret: cfg escapes to
	// the heap through the option calls, so a few pointers cost nothing more.
	pointers [8]string
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
// Each one's value is replaced, in the fingerprint and in Result.Intent, by
// its keyed string "hmac-sha256:<key id>:<hex>" (see WithSecretKey, which
// is then required: ErrSecretKeyRequired). "" makes the whole payload
// secret. A pointer that resolves to nothing makes Compute fail with
// ErrSecretNotFound (a misspelled pointer must not leave the value in
// clear); a malformed one with ErrInvalidPointer. A field both dropped and
// secret is dropped; a secret field inside another is covered by the outer
// one's HMAC. The option may be given several times. Errors about a value
// at or inside a secret field never quote the value.
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
// (ErrInvalidPointer), a secret pointer that matches nothing
// (ErrSecretNotFound), a secret field without a key (ErrSecretKeyRequired)
// or a malformed key (ErrInvalidSecretKey), a method that is not an HTTP
// token (ErrInvalidMethod), and an empty or non-UTF-8 target
// (ErrInvalidTarget).
func Compute(method, target string, payload []byte, opts ...Option) (Result, error) {
	cfg := settings{maxBytes: DefaultMaxBytes}
	cfg.drop, cfg.secret = cfg.pointers[:0:4], cfg.pointers[4:4:8]
	for _, opt := range opts {
		if opt != nil {
			opt(&cfg)
		}
	}

	if err := checkMethod(method); err != nil {
		return Result{}, err
	}
	if cfg.keySet {
		if err := checkSecretKey(cfg.keyID, cfg.key); err != nil {
			return Result{}, err
		}
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
	for _, ptr := range cfg.drop {
		if ptr == "" {
			return Result{}, fmt.Errorf("%w: \"\" would drop the whole payload", ErrInvalidPointer)
		}
		if err := validatePointer(ptr); err != nil {
			return Result{}, err
		}
	}
	for _, ptr := range cfg.secret {
		if err := validatePointer(ptr); err != nil {
			return Result{}, err
		}
	}

	p := getParser()
	defer p.release()
	p.secretPointers = cfg.secret
	root, err := p.parse(payload, true)
	if err != nil {
		return Result{}, err
	}
	// All pointers are resolved before anything is dropped.
	for _, ptr := range cfg.drop {
		if n := resolvePointer(root, ptr); n != nil {
			n.drop = true
		}
	}
	for _, ptr := range cfg.secret {
		n := resolvePointer(root, ptr)
		if n == nil {
			return Result{}, fmt.Errorf("%w: %s matches nothing in the payload; fix the pointer, or leave it out for calls without that field",
				ErrSecretNotFound, quoteForError(ptr))
		}
		if !n.drop {
			n.secret = true
		}
	}

	// The canonical intent, written once; each secret value is written,
	// HMAC'd and replaced by its keyed string on the way.
	w := writer{buf: make([]byte, 0, len(payload)+len(method)+len(target)+32)}
	if cfg.keySet {
		w.keyID = cfg.keyID
		w.mac = newMAC(cfg.key)
	}
	w.buf = append(w.buf, `{"method":"`...)
	for i := 0; i < len(method); i++ {
		c := method[i]
		if c >= 'a' && c <= 'z' {
			c -= 'a' - 'A'
		}
		w.buf = append(w.buf, c)
	}
	w.buf = append(w.buf, `","payload":`...)
	w.value(root)
	w.buf = append(w.buf, `,"target":`...)
	w.buf = appendString(w.buf, target)
	w.buf = append(w.buf, '}')
	if w.needKey {
		return Result{}, fmt.Errorf("%w: the payload has secret fields (%s); configure the deployment's key (%s)",
			ErrSecretKeyRequired, quoteForError(strings.Join(cfg.secret, " ")), SecretKeyEnv)
	}

	sum := sha256.Sum256(w.buf)
	var fp [len(Prefix) + 2*sha256.Size]byte
	copy(fp[:], Prefix)
	hex.Encode(fp[len(Prefix):], sum[:])
	return Result{Fingerprint: string(fp[:]), Intent: w.buf}, nil
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
	p := getParser()
	defer p.release()
	// The scanner gives typed errors for what the RFC refuses; the
	// canonical bytes of the public, language-neutral command come from
	// gowebpki/jcs, the reference implementation the fast path of Compute is
	// fuzzed against.
	if _, err := p.parse(data, false); err != nil {
		return nil, err
	}
	out, err := jcs.Transform(data)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
	return out, nil
}

// checkMethod checks that an HTTP method is a token (RFC 9110 §5.6.2).
// Tokens are ASCII, so upper-casing them gives the same result in every
// language.
func checkMethod(method string) error {
	if method == "" {
		return fmt.Errorf("%w: empty", ErrInvalidMethod)
	}
	for i := 0; i < len(method); i++ {
		if !isTokenChar(method[i]) {
			return fmt.Errorf("%w: %s is not an HTTP token", ErrInvalidMethod, quoteForError(method))
		}
	}
	return nil
}

// isTokenChar reports whether c is an RFC 9110 tchar.
func isTokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
