package fingerprint

// This file keeps, as a test oracle, the parser the package had before the
// single-pass scanner of parse.go: encoding/json's Decoder, token by token.
// The tests check that the scanner accepts the same texts, builds the same
// trees, and refuses the same texts with the same sentinel (and, for
// everything but syntax errors, the same message).

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// refParser is the parser this package used before its own scanner: it
// reads one JSON text token by token with encoding/json's Decoder, so
// numbers keep their text (UseNumber) and every object member is seen (the
// Decoder's map decoding would keep the last of two duplicates silently).
type refParser struct {
	data []byte
	dec  *json.Decoder
	// strict refuses numbers whose canonical form is a different value.
	strict bool
	depth  int
	// path holds the reference tokens of the value being parsed, for errors.
	path []string
	// start is the input offset before the most recent token (whitespace
	// and separators included), used to find a string's raw text.
	start int64
}

// refParse validates data as one I-JSON text and returns its tree. In strict
// mode numbers must also survive canonicalization exactly.
func refParse(data []byte, strict bool) (*node, error) {
	if !utf8.Valid(data) {
		return nil, fmt.Errorf("%w: invalid byte sequence at byte offset %d", ErrInvalidUTF8, invalidUTF8Offset(data))
	}
	p := &refParser{data: data, dec: json.NewDecoder(bytes.NewReader(data)), strict: strict}
	p.dec.UseNumber()
	tok, err := p.next()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: empty input", ErrInvalidJSON)
		}
		return nil, err
	}
	root, err := p.value(tok)
	if err != nil {
		return nil, err
	}
	// Exactly one value: after it only whitespace may follow.
	p.start = p.dec.InputOffset()
	switch _, err := p.dec.Token(); {
	case errors.Is(err, io.EOF):
		return root, nil
	case err != nil:
		return nil, p.syntaxError(err)
	default:
		return nil, fmt.Errorf("%w: unexpected data after the top-level value at byte offset %d", ErrInvalidJSON, p.skipSpace(p.start))
	}
}

// next returns the next token. io.EOF is returned unwrapped only when the
// input holds nothing but whitespace; any other failure is a typed error.
func (p *refParser) next() (json.Token, error) {
	p.start = p.dec.InputOffset()
	tok, err := p.dec.Token()
	if err != nil {
		if errors.Is(err, io.EOF) && p.depth == 0 && p.start == 0 {
			return nil, io.EOF
		}
		return nil, p.syntaxError(err)
	}
	return tok, nil
}

// syntaxError converts a Decoder error into an ErrInvalidJSON error.
func (p *refParser) syntaxError(err error) error {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		return fmt.Errorf("%w: %s at byte offset %d", ErrInvalidJSON, se.Error(), se.Offset)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: unexpected end of input", ErrInvalidJSON)
	default:
		return fmt.Errorf("%w: %v", ErrInvalidJSON, err)
	}
}

// skipSpace returns the offset of the first non-whitespace byte at or after
// off.
func (p *refParser) skipSpace(off int64) int64 {
	for off < int64(len(p.data)) {
		switch p.data[off] {
		case ' ', '\t', '\n', '\r':
			off++
		default:
			return off
		}
	}
	return off
}

// value builds the node for a token that starts a value.
func (p *refParser) value(tok json.Token) (*node, error) {
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '[':
			return p.array()
		case '{':
			return p.object()
		}
	case string:
		if err := p.checkString(t); err != nil {
			return nil, err
		}
		return &node{kind: kindString, text: t}, nil
	case json.Number:
		if err := p.checkNumber(string(t)); err != nil {
			return nil, err
		}
		return &node{kind: kindNumber, text: string(t)}, nil
	case bool:
		if t {
			return &node{kind: kindBool, text: "true"}, nil
		}
		return &node{kind: kindBool, text: "false"}, nil
	case nil:
		return &node{kind: kindNull}, nil
	}
	// The Decoder only hands out the tokens above, and never a closing
	// delimiter where a value is expected.
	return nil, fmt.Errorf("%w: unexpected token %v at byte offset %d", ErrInvalidJSON, tok, p.skipSpace(p.start))
}

// enter records one more level of nesting, refusing to go past MaxDepth.
func (p *refParser) enter() error {
	p.depth++
	if p.depth > MaxDepth {
		return fmt.Errorf("%w: more than %d nested arrays and objects %s", ErrTooDeep, MaxDepth, where(p.path))
	}
	return nil
}

func (p *refParser) array() (*node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	n := &node{kind: kindArray}
	for i := 0; ; i++ {
		tok, err := p.next()
		if err != nil {
			return nil, err
		}
		if d, ok := tok.(json.Delim); ok && d == ']' {
			p.depth--
			return n, nil
		}
		p.path = append(p.path, strconv.Itoa(i))
		v, err := p.value(tok)
		if err != nil {
			return nil, err
		}
		p.path = p.path[:len(p.path)-1]
		n.elems = append(n.elems, v)
	}
}

func (p *refParser) object() (*node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	n := &node{kind: kindObject}
	var seen map[string]struct{}
	for {
		tok, err := p.next()
		if err != nil {
			return nil, err
		}
		if d, ok := tok.(json.Delim); ok && d == '}' {
			p.depth--
			return n, nil
		}
		name, ok := tok.(string)
		if !ok {
			// The Decoder only returns a string or '}' here.
			return nil, fmt.Errorf("%w: expected an object member name at byte offset %d", ErrInvalidJSON, p.skipSpace(p.start))
		}
		p.path = append(p.path, name)
		if err := p.checkString(name); err != nil {
			return nil, err
		}
		if p.isDuplicate(n.members, &seen, name) {
			return nil, fmt.Errorf("%w: %s appears twice %s", ErrDuplicateKey, quoteForError(name), where(p.path[:len(p.path)-1]))
		}
		tok, err = p.next()
		if err != nil {
			return nil, err
		}
		v, err := p.value(tok)
		if err != nil {
			return nil, err
		}
		p.path = p.path[:len(p.path)-1]
		n.members = append(n.members, member{name: name, value: v})
	}
}

// isDuplicate reports whether name is already a member. Names are compared
// after unescaping, so "a" and "\u0061" are the same name.
func (p *refParser) isDuplicate(members []member, seen *map[string]struct{}, name string) bool {
	if len(members) < linearScanMembers {
		for _, m := range members {
			if m.name == name {
				return true
			}
		}
		return false
	}
	if *seen == nil {
		*seen = make(map[string]struct{}, 2*len(members))
		for _, m := range members {
			(*seen)[m.name] = struct{}{}
		}
	}
	if _, dup := (*seen)[name]; dup {
		return true
	}
	(*seen)[name] = struct{}{}
	return false
}

// checkString refuses a string whose escapes denote an unpaired UTF-16
// surrogate. encoding/json silently turns those into U+FFFD, so when the
// decoded string holds U+FFFD the raw text of the literal is examined. Raw
// bytes are known to be valid UTF-8 already.
func (p *refParser) checkString(s string) error {
	if !strings.ContainsRune(s, utf8.RuneError) {
		return nil
	}
	end := p.dec.InputOffset()
	if p.start < 0 || end > int64(len(p.data)) || p.start > end {
		return fmt.Errorf("%w: cannot locate string %s", ErrInvalidJSON, where(p.path))
	}
	raw := p.data[p.start:end]
	q := bytes.IndexByte(raw, '"')
	if q < 0 {
		return fmt.Errorf("%w: cannot locate string %s", ErrInvalidJSON, where(p.path))
	}
	if esc, ok := refLoneSurrogate(raw[q:]); ok {
		return fmt.Errorf("%w: string escapes a lone UTF-16 surrogate %s %s", ErrInvalidUTF8, esc, where(p.path))
	}
	return nil
}

// loneSurrogate scans the raw text of a JSON string literal (starting at its
// opening quote) for a \u escape of a surrogate that is not part of a
// high-low pair, and returns that escape.
func refLoneSurrogate(lit []byte) (string, bool) {
	for i := 1; i < len(lit); i++ {
		if lit[i] == '"' {
			return "", false
		}
		if lit[i] != '\\' {
			continue
		}
		if i+1 >= len(lit) {
			return "", false
		}
		if lit[i+1] != 'u' {
			i++ // skip the escaped character (it may be a quote)
			continue
		}
		r, ok := refHex4(lit, i+2)
		if !ok {
			return "", false
		}
		if !utf16.IsSurrogate(r) {
			i += 5
			continue
		}
		if r < 0xDC00 && i+11 < len(lit) && lit[i+6] == '\\' && lit[i+7] == 'u' {
			if r2, ok := refHex4(lit, i+8); ok && r2 >= 0xDC00 && r2 <= 0xDFFF {
				i += 11
				continue
			}
		}
		return string(lit[i : i+6]), true
	}
	return "", false
}

// hex4 decodes the four hexadecimal digits at lit[at:at+4].
func refHex4(lit []byte, at int) (rune, bool) {
	if at+4 > len(lit) {
		return 0, false
	}
	var r rune
	for _, c := range lit[at : at+4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// checkNumber refuses numbers outside the range of a double and, in strict
// mode, numbers that canonicalize to a different value.
func (p *refParser) checkNumber(text string) error {
	if !p.strict {
		if _, err := parseNumber(text); err != nil {
			return fmt.Errorf("%w: %s %s", err, quoteForError(text), where(p.path))
		}
		return nil
	}
	canonical, exact, err := exactCanonical(text)
	if err != nil {
		return fmt.Errorf("%w: %s %s", err, quoteForError(text), where(p.path))
	}
	if !exact {
		return fmt.Errorf("%w: %s %s would be canonicalized as %s, a different value; send it as a string or in minor units",
			ErrNumberPrecision, quoteForError(text), where(p.path), canonical)
	}
	return nil
}
