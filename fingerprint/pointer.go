package fingerprint

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// validatePointer checks that s is an RFC 6901 JSON pointer without
// allocating.
func validatePointer(s string) error {
	if s == "" {
		return nil
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidPointer, quoteForError(s))
	}
	if s[0] != '/' {
		return fmt.Errorf("%w: %s must be empty or start with '/'", ErrInvalidPointer, quoteForError(s))
	}
	for j := 0; j < len(s); j++ {
		if s[j] == '~' && (j+1 >= len(s) || (s[j+1] != '0' && s[j+1] != '1')) {
			return fmt.Errorf("%w: %s: '~' must be followed by '0' or '1'", ErrInvalidPointer, quoteForError(s))
		}
	}
	return nil
}

// resolvePointer returns the node the valid JSON pointer ptr refers to, or
// nil when there is none: a missing member, an index past the end, "-", or a
// token that is not an RFC 6901 array index applied to an array.
func resolvePointer(root *node, ptr string) *node {
	n := root
	for ptr != "" {
		ptr = ptr[1:] // the '/' before each token
		tok := ptr
		if i := strings.IndexByte(ptr, '/'); i >= 0 {
			tok, ptr = ptr[:i], ptr[i:]
		} else {
			ptr = ""
		}
		if strings.IndexByte(tok, '~') >= 0 {
			tok = unescapeToken(tok)
		}
		switch n.kind {
		case kindObject:
			var next *node
			for _, m := range n.members {
				if m.name == tok {
					next = m.value
					break
				}
			}
			if next == nil {
				return nil
			}
			n = next
		case kindArray:
			i, ok := arrayIndex(tok)
			if !ok || i >= len(n.elems) {
				return nil
			}
			n = n.elems[i]
		default:
			return nil
		}
	}
	return n
}

// unescapeToken decodes "~1" as '/' and "~0" as '~' in a reference token
// whose escapes are valid.
func unescapeToken(tok string) string {
	var b strings.Builder
	b.Grow(len(tok))
	for j := 0; j < len(tok); j++ {
		if tok[j] != '~' {
			b.WriteByte(tok[j])
			continue
		}
		if tok[j+1] == '0' {
			b.WriteByte('~')
		} else {
			b.WriteByte('/')
		}
		j++
	}
	return b.String()
}

// arrayIndex parses an RFC 6901 array-index: "0", or digits without a
// leading zero.
func arrayIndex(tok string) (int, bool) {
	if tok == "" || len(tok) > 9 || (len(tok) > 1 && tok[0] == '0') {
		return 0, false
	}
	i := 0
	for j := 0; j < len(tok); j++ {
		if !isDigit(tok[j]) {
			return 0, false
		}
		i = i*10 + int(tok[j]-'0')
	}
	return i, true
}
