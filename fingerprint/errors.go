package fingerprint

import (
	"errors"
	"strconv"
	"strings"
)

// Sentinel errors. Every error returned by this package wraps exactly one of
// them (test with errors.Is) and adds context: the JSON pointer of the
// offending value inside the document, or the byte offset of a syntax error.
var (
	// ErrInvalidJSON reports input that is not a single well-formed JSON text
	// (RFC 8259): a syntax error, an empty input, or data after the value.
	ErrInvalidJSON = errors.New("fingerprint: invalid JSON")

	// ErrInvalidUTF8 reports text that is not valid Unicode: bytes that are
	// not UTF-8, or a \u escape of an unpaired UTF-16 surrogate. RFC 8785
	// §3.1 requires string data to be expressible as Unicode, so both are
	// refused by Canonicalize as well as by Compute.
	ErrInvalidUTF8 = errors.New("fingerprint: invalid UTF-8")

	// ErrDuplicateKey reports an object with the same member name twice.
	// RFC 8785 §3.1 (through I-JSON, RFC 7493 §2.3) forbids duplicate
	// property names, so Canonicalize refuses them as well as Compute.
	ErrDuplicateKey = errors.New("fingerprint: duplicate object key")

	// ErrNumberRange reports a number too large in magnitude for an IEEE 754
	// double (for example 1e400). It has no RFC 8785 form at all.
	ErrNumberRange = errors.New("fingerprint: number out of range")

	// ErrNumberPrecision reports a number whose canonical (ECMAScript) form
	// denotes a different value than the text the caller sent, such as
	// 9007199254740993 (canonically 9007199254740992) or
	// 0.10000000000000001 (canonically 0.1). Only Compute refuses these:
	// they would silently share a fingerprint with another amount. Send such
	// values as strings or in minor units.
	ErrNumberPrecision = errors.New("fingerprint: number not exactly representable")

	// ErrTooLarge reports a payload longer than the configured limit
	// (DefaultMaxBytes unless changed with WithMaxBytes).
	ErrTooLarge = errors.New("fingerprint: payload too large")

	// ErrTooDeep reports arrays and objects nested deeper than MaxDepth.
	ErrTooDeep = errors.New("fingerprint: nesting too deep")

	// ErrInvalidPointer reports a drop or secret field that is not a
	// syntactically valid RFC 6901 JSON pointer, or a drop of the whole
	// payload. A valid drop pointer that resolves to nothing is not an
	// error; a secret one is (ErrSecretNotFound).
	ErrInvalidPointer = errors.New("fingerprint: invalid JSON pointer")

	// ErrInvalidMethod reports a method that is empty or not an HTTP token
	// (RFC 9110 §5.6.2).
	ErrInvalidMethod = errors.New("fingerprint: invalid method")

	// ErrInvalidTarget reports a target that is empty or not valid UTF-8.
	ErrInvalidTarget = errors.New("fingerprint: invalid target")

	// ErrSecretNotFound reports a secret field (WithSecret) whose pointer
	// resolves to nothing in the payload: a misspelled or misplaced
	// pointer would otherwise leave the real value in the stored intent.
	ErrSecretNotFound = errors.New("fingerprint: secret field not found")

	// ErrSecretKeyRequired reports an intent with a secret field computed
	// without WithSecretKey: a secret value is never hashed without a key.
	ErrSecretKeyRequired = errors.New("fingerprint: a secret key is required for secret fields")

	// ErrInvalidSecretKey reports a secret key shorter than
	// MinSecretKeyBytes, a key text that is not hex or base64, or a
	// malformed key id.
	ErrInvalidSecretKey = errors.New("fingerprint: invalid secret key")
)

// maxErrorText bounds how much caller-supplied text (a key, a number, a
// pointer) is copied into an error message, so that a hostile payload cannot
// write megabytes into a log line.
const maxErrorText = 64

// quoteForError renders caller-supplied text for an error message: quoted
// (so it cannot carry newlines or terminal escapes into a log) and truncated.
func quoteForError(s string) string {
	if len(s) <= maxErrorText {
		return strconv.Quote(s)
	}
	cut := maxErrorText
	for cut > 0 && !isRuneStart(s[cut]) {
		cut--
	}
	return strconv.Quote(s[:cut]) + "..."
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// where renders the location of a value, given the reference tokens of its
// JSON pointer, for an error message.
func where(path []string) string {
	if len(path) == 0 {
		return "at the top level"
	}
	return "at " + quoteForError(formatPointer(path))
}

// formatPointer joins reference tokens into an RFC 6901 JSON pointer.
func formatPointer(path []string) string {
	var b strings.Builder
	for _, tok := range path {
		b.WriteByte('/')
		for i := 0; i < len(tok); i++ {
			switch tok[i] {
			case '~':
				b.WriteString("~0")
			case '/':
				b.WriteString("~1")
			default:
				b.WriteByte(tok[i])
			}
		}
	}
	return b.String()
}
