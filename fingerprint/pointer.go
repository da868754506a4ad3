package fingerprint

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// parsePointer splits an RFC 6901 JSON pointer into its unescaped reference
// tokens. The empty pointer refers to the whole document and yields no
// tokens.
func parsePointer(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	if !utf8.ValidString(s) {
		return nil, fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidPointer, quoteForError(s))
	}
	if s[0] != '/' {
		return nil, fmt.Errorf("%w: %s must be empty or start with '/'", ErrInvalidPointer, quoteForError(s))
	}
	tokens := strings.Split(s[1:], "/")
	for i, tok := range tokens {
		if !strings.Contains(tok, "~") {
			continue
		}
		var b strings.Builder
		for j := 0; j < len(tok); j++ {
			if tok[j] != '~' {
				b.WriteByte(tok[j])
				continue
			}
			if j+1 >= len(tok) || (tok[j+1] != '0' && tok[j+1] != '1') {
				return nil, fmt.Errorf("%w: %s: '~' must be followed by '0' or '1'", ErrInvalidPointer, quoteForError(s))
			}
			if tok[j+1] == '0' {
				b.WriteByte('~')
			} else {
				b.WriteByte('/')
			}
			j++
		}
		tokens[i] = b.String()
	}
	return tokens, nil
}

// resolve returns the node the reference tokens point to, or nil when there is
// none: a missing member, an index past the end, "-", or a token that is not
// an RFC 6901 array index applied to an array.
func resolve(root *node, tokens []string) *node {
	n := root
	for _, tok := range tokens {
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
