// Package sanitize makes text from outside (API responses, agents) safe to store
// and to show: valid UTF-8, no NUL, bounded length, and says whether it changed anything.
//
// Text is for storage: PostgreSQL refuses NUL bytes and invalid UTF-8 in text
// columns, and the \u0000 escape inside jsonb strings, so every string that came
// from an API or an agent goes through Text with an explicit bound before it is
// written. Terminal is for display: it escapes every control character so that
// an API or an agent cannot rewrite an operator's screen.
package sanitize

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Ellipsis is appended by Text when it cuts a string to its bound.
const Ellipsis = "…"

// Text returns s as valid UTF-8 without NUL bytes, cut to at most max bytes on a
// rune boundary, and reports whether anything was altered.
//
// Each invalid byte becomes U+FFFD and each NUL becomes U+FFFD (so a reader sees
// that something was there). When the result is longer than max bytes it is cut
// on a rune boundary and "…" appended, the whole still at most max bytes (when max
// is smaller than the ellipsis, the cut has no ellipsis). A max of zero or less
// means no bound. Other control characters are kept: they are valid in text and
// jsonb; use Terminal to show the result to a human.
func Text(s string, max int) (out string, changed bool) {
	if clean(s) {
		out = s
	} else {
		var b strings.Builder
		b.Grow(len(s) + 8)
		for i := 0; i < len(s); {
			r, size := utf8.DecodeRuneInString(s[i:])
			switch {
			case r == utf8.RuneError && size <= 1:
				b.WriteRune(utf8.RuneError)
			case r == 0:
				b.WriteRune(utf8.RuneError)
			default:
				b.WriteString(s[i : i+size])
			}
			i += size
		}
		out, changed = b.String(), true
	}
	if max > 0 && len(out) > max {
		out, changed = cut(out, max), true
	}
	return out, changed
}

// clean reports whether s is valid UTF-8 without NUL bytes.
func clean(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// cut returns the longest prefix of the valid UTF-8 string s that ends on a rune
// boundary and, with the ellipsis appended, is at most max bytes.
func cut(s string, max int) string {
	room := max - len(Ellipsis)
	suffix := Ellipsis
	if room < 0 {
		room, suffix = max, ""
	}
	for room > 0 && !utf8.RuneStart(s[room]) {
		room--
	}
	return s[:room] + suffix
}

// Terminal escapes every control character in s for a human terminal; printable
// text is unchanged.
//
// C0 controls and DEL become \xNN (tab, newline and carriage return become \t, \n
// and \r), C1 controls, the line and paragraph separators (U+2028, U+2029), the
// bidirectional marks, embeddings, overrides and isolates (U+061C, U+200E, U+200F,
// U+202A–U+202E, U+2066–U+2069) and the byte order mark (U+FEFF) become \uXXXX,
// and each byte of invalid UTF-8 becomes \xNN. A backslash is printed as is.
func Terminal(s string) string {
	if !needsEscape(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		case escapedRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// needsEscape reports whether Terminal would change s.
func needsEscape(s string) bool {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return true
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if (r == utf8.RuneError && size <= 1) || escapedRune(r) {
			return true
		}
		i += size
	}
	return false
}

// escapedRune reports whether a non-ASCII rune is one Terminal escapes: C1
// controls, line and paragraph separators, bidirectional formatting characters
// and the byte order mark.
func escapedRune(r rune) bool {
	switch {
	case r >= 0x80 && r <= 0x9f:
		return true
	case r == 0x061c, r == 0x200e, r == 0x200f, r == 0xfeff:
		return true
	case r >= 0x2028 && r <= 0x202e:
		return true
	case r >= 0x2066 && r <= 0x2069:
		return true
	}
	return false
}
