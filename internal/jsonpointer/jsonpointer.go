// Package jsonpointer is the one parser of RFC 6901 JSON pointers: the
// fingerprint's drop and secret fields, the adapters' item, id and
// pagination pointers, and the ledger's external-id pointer all name a
// place in a JSON document the same way, so they must agree on what a
// pointer is and what it names ("+1" is no array index, "~2" no escape).
package jsonpointer

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// ErrSyntax is matched (errors.Is) by every *SyntaxError.
var ErrSyntax = errors.New("invalid JSON pointer")

// SyntaxError says why a string is not a JSON pointer.
type SyntaxError struct {
	// Pointer is the string refused.
	Pointer string
	// Reason is what is wrong with it, e.g. "'~' must be followed by '0'
	// or '1'".
	Reason string
}

// Error returns the pointer, quoted, and the reason.
func (e *SyntaxError) Error() string {
	return fmt.Sprintf("JSON pointer %q: %s", e.Pointer, e.Reason)
}

// Is makes errors.Is(err, ErrSyntax) hold.
func (e *SyntaxError) Is(target error) bool { return target == ErrSyntax }

// Validate returns a *SyntaxError if s is not a JSON pointer: empty (the
// whole document), or '/'-separated reference tokens in valid UTF-8 whose
// only escapes are "~0" and "~1". It does not allocate for a valid s, so
// a hot path may validate before each use.
func Validate(s string) error {
	if s == "" {
		return nil
	}
	if !utf8.ValidString(s) {
		return &SyntaxError{Pointer: s, Reason: "not valid UTF-8"}
	}
	if s[0] != '/' {
		return &SyntaxError{Pointer: s, Reason: "must be empty or start with '/'"}
	}
	for j := 0; j < len(s); j++ {
		if s[j] == '~' && (j+1 >= len(s) || (s[j+1] != '0' && s[j+1] != '1')) {
			return &SyntaxError{Pointer: s, Reason: "'~' must be followed by '0' or '1'"}
		}
	}
	return nil
}

// Parse returns the unescaped reference tokens of the pointer s; the empty
// pointer has none.
func Parse(s string) ([]string, error) {
	if err := Validate(s); err != nil {
		return nil, err
	}
	var tokens []string
	for s != "" {
		var tok string
		tok, s = Next(s)
		tokens = append(tokens, tok)
	}
	return tokens, nil
}

// Next splits the first reference token off a valid, non-empty pointer:
// tok is that token unescaped, rest the pointer that remains ("" after the
// last). It lets a caller walk a pointer without allocating a slice.
func Next(ptr string) (tok, rest string) {
	ptr = ptr[1:] // the '/' before each token
	tok = ptr
	if i := strings.IndexByte(ptr, '/'); i >= 0 {
		tok, rest = ptr[:i], ptr[i:]
	}
	if strings.IndexByte(tok, '~') >= 0 {
		tok = unescape(tok)
	}
	return tok, rest
}

// unescape decodes "~1" as '/' and "~0" as '~' in a token whose escapes
// are valid (RFC 6901 §4: "~1" first, so "~01" is "~1").
func unescape(tok string) string {
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

// ArrayIndex parses a token as an RFC 6901 array index: "0", or decimal
// digits without a leading zero ("01", "+1", "-1" and "" are not). Indexes
// past 999,999,999 are refused: no document this project reads has such
// an array, and the bound keeps the arithmetic in range.
func ArrayIndex(tok string) (int, bool) {
	if tok == "" || len(tok) > 9 || (len(tok) > 1 && tok[0] == '0') {
		return 0, false
	}
	i := 0
	for j := 0; j < len(tok); j++ {
		c := tok[j]
		if c < '0' || c > '9' {
			return 0, false
		}
		i = i*10 + int(c-'0')
	}
	return i, true
}

// Get resolves tokens in a document decoded by encoding/json into any
// (objects as map[string]any, arrays as []any): the value they name, and
// whether there is one.
func Get(doc any, tokens []string) (any, bool) {
	cur := doc
	for _, t := range tokens {
		switch c := cur.(type) {
		case map[string]any:
			v, ok := c[t]
			if !ok {
				return nil, false
			}
			cur = v
		case []any:
			i, ok := ArrayIndex(t)
			if !ok || i >= len(c) {
				return nil, false
			}
			cur = c[i]
		default:
			return nil, false
		}
	}
	return cur, true
}
