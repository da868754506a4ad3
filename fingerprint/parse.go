package fingerprint

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/internal/jsonpointer"
)

// MaxDepth is the deepest nesting of arrays and objects accepted. It is the
// limit github.com/gowebpki/jcs (and encoding/json) applies, so everything
// this package validates can also be canonicalized.
const MaxDepth = 10000

// kind is the JSON type of a node.
type kind uint8

const (
	kindNull kind = iota
	kindBool
	kindNumber
	kindString
	kindArray
	kindObject
)

// node is one parsed JSON value. Numbers keep the exact text of the input
// (and the double it denotes), so that nothing is rounded before the
// canonical form is written. drop and secret are set by normalization (see
// Compute).
type node struct {
	kind    kind
	drop    bool
	secret  bool
	text    string  // number text, decoded string, or "true"/"false"
	num     float64 // the value of a number
	elems   []*node
	members []member // in input order until written (the writer sorts them); names are unique
}

// member is one name/value pair of an object.
type member struct {
	name  string
	value *node
}

// pathToken is one reference token of the location of the value being
// parsed: an array index, or (index < 0) an object member name. Tokens are
// turned into text only for an error message.
type pathToken struct {
	name  string
	index int
}

// parser is a single-pass recursive-descent scanner over one JSON text
// (RFC 8259). It checks the grammar, I-JSON string rules (no escaped lone
// surrogates; raw bytes are validated as UTF-8 before scanning), duplicate
// names, numbers and nesting as it goes, in input order, and builds the node
// tree with a few slab allocations: strings without escapes and number text
// are substrings of one copy of the input.
type parser struct {
	src string
	pos int
	// strict refuses numbers whose canonical form is a different value.
	strict bool
	depth  int
	// path holds the reference tokens of the value being parsed, for errors.
	path []pathToken

	nodes       []node   // slab the nodes are carved from
	elemStack   []*node  // elements of the arrays being parsed
	memberStack []member // members of the objects being parsed
	elemArena   []*node  // slab the finished elems slices are carved from
	memberArena []member // slab the finished members slices are carved from
	scratch     []byte   // decoding buffer for strings with escapes
	numBuf      [32]byte // canonical form of the number being checked
	// secretPointers are Compute's secret fields (valid pointers are not
	// required): an error about a value at or inside one never quotes it.
	secretPointers []string
}

// parse validates data as one I-JSON text and returns its tree. In strict
// mode numbers must also survive canonicalization exactly.
func parse(data []byte, strict bool) (*node, error) {
	return new(parser).parse(data, strict)
}

// parserPool recycles parsers, with their slabs, between the calls of
// Compute and Canonicalize, whose trees do not outlive the call.
var parserPool = sync.Pool{New: func() any { return new(parser) }}

// getParser returns a parser from the pool; release it when its tree is no
// longer used.
func getParser() *parser { return parserPool.Get().(*parser) }

// release clears what the last parse left in p (so that the pool holds no
// references into it) and returns p to the pool.
func (p *parser) release() {
	clear(p.nodes)
	clear(p.elemArena)
	clear(p.memberArena)
	clear(p.memberStack[:cap(p.memberStack)])
	clear(p.elemStack[:cap(p.elemStack)])
	clear(p.path[:cap(p.path)])
	if cap(p.memberStack) > slabLimit {
		p.memberStack = nil
	}
	if cap(p.elemStack) > slabLimit {
		p.elemStack = nil
	}
	if cap(p.path) > slabLimit {
		p.path = nil
	}
	if cap(p.scratch) > 1<<16 {
		p.scratch = nil
	}
	*p = parser{
		nodes: p.nodes[:0], elemArena: p.elemArena[:0], memberArena: p.memberArena[:0],
		memberStack: p.memberStack[:0], elemStack: p.elemStack[:0], path: p.path[:0], scratch: p.scratch[:0],
	}
	parserPool.Put(p)
}

// parse validates data as one I-JSON text and returns its tree, which lives
// in p's slabs.
func (p *parser) parse(data []byte, strict bool) (*node, error) {
	if !utf8.Valid(data) {
		return nil, fmt.Errorf("%w: invalid byte sequence at byte offset %d", ErrInvalidUTF8, invalidUTF8Offset(data))
	}
	p.src, p.pos, p.strict, p.depth = string(data), 0, strict, 0
	p.presize()
	p.skipSpace()
	if p.pos == len(p.src) {
		return nil, fmt.Errorf("%w: empty input", ErrInvalidJSON)
	}
	root, err := p.value()
	if err != nil {
		return nil, err
	}
	// Exactly one value: after it only whitespace may follow.
	p.skipSpace()
	if p.pos < len(p.src) {
		if startsValue(p.src[p.pos]) {
			return nil, fmt.Errorf("%w: unexpected data after the top-level value at byte offset %d", ErrInvalidJSON, p.pos)
		}
		return nil, p.syntaxError("looking for beginning of value")
	}
	return root, nil
}

// invalidUTF8Offset returns the offset of the first byte of data that does
// not start a valid UTF-8 sequence, or -1.
func invalidUTF8Offset(data []byte) int {
	for i := 0; i < len(data); {
		r, size := utf8.DecodeRune(data[i:])
		if r == utf8.RuneError && size <= 1 {
			return i
		}
		i += size
	}
	return -1
}

// startsValue reports whether c can be the first byte of a JSON value.
func startsValue(c byte) bool {
	switch c {
	case '{', '[', '"', '-', 't', 'f', 'n':
		return true
	}
	return isDigit(c)
}

// syntaxError reports the byte at p.pos as unexpected, or the end of the
// input, in the words of encoding/json.
func (p *parser) syntaxError(context string) error {
	if p.pos >= len(p.src) {
		return fmt.Errorf("%w: unexpected end of input", ErrInvalidJSON)
	}
	if ptr, ok := p.secretAt(p.path); ok {
		return fmt.Errorf("%w: invalid character (not shown) in the secret field %s at byte offset %d",
			ErrInvalidJSON, quoteForError(ptr), p.pos)
	}
	r, _ := utf8.DecodeRuneInString(p.src[p.pos:])
	return fmt.Errorf("%w: invalid character %s %s at byte offset %d", ErrInvalidJSON, strconv.QuoteRune(r), context, p.pos)
}

// where renders the location of the value being parsed.
func (p *parser) where() string { return whereTokens(p.path) }

// secretAt reports whether path is at or inside one of p.secretPointers,
// and which. It runs only when an error is reported.
func (p *parser) secretAt(path []pathToken) (string, bool) {
	for _, ptr := range p.secretPointers {
		if validatePointer(ptr) != nil {
			continue
		}
		if pointerCovers(ptr, path) {
			return ptr, true
		}
	}
	return "", false
}

// pointerCovers reports whether the valid pointer ptr names path or one of
// its ancestors.
func pointerCovers(ptr string, path []pathToken) bool {
	i := 0
	for ptr != "" {
		if i >= len(path) {
			return false
		}
		var tok string
		tok, ptr = jsonpointer.Next(ptr)
		if t := path[i]; t.index >= 0 {
			if n, ok := jsonpointer.ArrayIndex(tok); !ok || n != t.index {
				return false
			}
		} else if t.name != tok {
			return false
		}
		i++
	}
	return true
}

// whereTokens renders a location given as path tokens for an error message.
func whereTokens(path []pathToken) string {
	tokens := make([]string, len(path))
	for i, t := range path {
		if t.index >= 0 {
			tokens[i] = strconv.Itoa(t.index)
		} else {
			tokens[i] = t.name
		}
	}
	return where(tokens)
}

// skipSpace moves past insignificant whitespace.
func (p *parser) skipSpace() {
	for p.pos < len(p.src) {
		switch p.src[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

// slabLimit caps the size, in elements, of one slab, so that input crafted
// to make the estimates of presize large (commas inside strings) cannot make
// the parser allocate much more than it uses.
const slabLimit = 1024

// presize sizes the slabs from an upper bound on the number of values: every
// value but the first follows a ',' or opens a non-empty container after
// '[' or ':', and every member name is followed by ':'. Outside strings the
// bounds are exact enough that a typical payload needs one slab of each.
func (p *parser) presize() {
	commas := strings.Count(p.src, ",")
	colons := strings.Count(p.src, ":")
	opens := strings.Count(p.src, "[") + strings.Count(p.src, "{")
	values := min(1+commas+opens, slabLimit)
	members := min(colons, slabLimit)
	elems := min(max(values-1-colons, 0), slabLimit)
	if cap(p.nodes) < values {
		p.nodes = make([]node, 0, values)
	}
	if cap(p.memberArena) < members {
		p.memberArena = make([]member, 0, members)
	}
	if cap(p.elemArena) < elems {
		p.elemArena = make([]*node, 0, elems)
	}
	if p.memberStack == nil {
		p.memberStack = make([]member, 0, min(members, 32))
	}
	if p.elemStack == nil {
		p.elemStack = make([]*node, 0, min(elems, 32))
	}
}

// newNode returns a zeroed node of kind k carved from the node slab.
func (p *parser) newNode(k kind) *node {
	if len(p.nodes) == cap(p.nodes) {
		p.nodes = make([]node, 0, min(max(2*cap(p.nodes), 16), slabLimit))
	}
	p.nodes = p.nodes[:len(p.nodes)+1]
	n := &p.nodes[len(p.nodes)-1]
	n.kind = k
	return n
}

// takeElems moves the elements pushed since base into a slice of their own.
func (p *parser) takeElems(base int) []*node {
	k := len(p.elemStack) - base
	if cap(p.elemArena)-len(p.elemArena) < k {
		p.elemArena = make([]*node, 0, max(k, min(2*cap(p.elemArena)+16, slabLimit)))
	}
	at := len(p.elemArena)
	p.elemArena = append(p.elemArena, p.elemStack[base:]...)
	p.elemStack = p.elemStack[:base]
	return p.elemArena[at : at+k : at+k]
}

// takeMembers moves the members pushed since base into a slice of their own.
func (p *parser) takeMembers(base int) []member {
	k := len(p.memberStack) - base
	if cap(p.memberArena)-len(p.memberArena) < k {
		p.memberArena = make([]member, 0, max(k, min(2*cap(p.memberArena)+16, slabLimit)))
	}
	at := len(p.memberArena)
	p.memberArena = append(p.memberArena, p.memberStack[base:]...)
	p.memberStack = p.memberStack[:base]
	return p.memberArena[at : at+k : at+k]
}

// value parses the value starting at p.pos (whitespace already skipped).
func (p *parser) value() (*node, error) {
	if p.pos >= len(p.src) {
		return nil, p.syntaxError("")
	}
	switch c := p.src[p.pos]; c {
	case '{':
		return p.object()
	case '[':
		return p.array()
	case '"':
		s, lone, err := p.string()
		if err != nil {
			return nil, err
		}
		if lone != "" {
			return nil, p.loneSurrogateError(lone)
		}
		n := p.newNode(kindString)
		n.text = s
		return n, nil
	case 't':
		return p.literal("true", kindBool)
	case 'f':
		return p.literal("false", kindBool)
	case 'n':
		return p.literal("null", kindNull)
	default:
		if c == '-' || isDigit(c) {
			return p.number()
		}
		return nil, p.syntaxError("looking for beginning of value")
	}
}

// literal parses true, false or null.
func (p *parser) literal(word string, k kind) (*node, error) {
	for i := 0; i < len(word); i++ {
		if p.pos >= len(p.src) || p.src[p.pos] != word[i] {
			return nil, p.syntaxError("in literal " + word + " (expecting " + strconv.QuoteRune(rune(word[i])) + ")")
		}
		p.pos++
	}
	n := p.newNode(k)
	if k == kindBool {
		n.text = word
	}
	return n, nil
}

// number parses a number (RFC 8259 §6 grammar) and checks its value.
func (p *parser) number() (*node, error) {
	start := p.pos
	src := p.src
	if src[p.pos] == '-' {
		p.pos++
	}
	switch {
	case p.pos < len(src) && src[p.pos] == '0':
		p.pos++
	case p.pos < len(src) && src[p.pos] >= '1' && src[p.pos] <= '9':
		for p.pos < len(src) && isDigit(src[p.pos]) {
			p.pos++
		}
	default:
		return nil, p.syntaxError("in numeric literal")
	}
	if p.pos < len(src) && src[p.pos] == '.' {
		p.pos++
		if p.pos >= len(src) || !isDigit(src[p.pos]) {
			return nil, p.syntaxError("after decimal point in numeric literal")
		}
		for p.pos < len(src) && isDigit(src[p.pos]) {
			p.pos++
		}
	}
	if p.pos < len(src) && (src[p.pos] == 'e' || src[p.pos] == 'E') {
		p.pos++
		if p.pos < len(src) && (src[p.pos] == '+' || src[p.pos] == '-') {
			p.pos++
		}
		if p.pos >= len(src) || !isDigit(src[p.pos]) {
			return nil, p.syntaxError("in exponent of numeric literal")
		}
		for p.pos < len(src) && isDigit(src[p.pos]) {
			p.pos++
		}
	}
	text := src[start:p.pos]
	f, err := p.numberValue(text)
	if err != nil {
		return nil, err
	}
	n := p.newNode(kindNumber)
	n.text = text
	n.num = f
	return n, nil
}

// string parses the string literal at p.pos. It returns the decoded string
// and, if the literal escapes a UTF-16 surrogate that is not part of a
// high-low pair, the first such escape as written (decoded as U+FFFD, as
// encoding/json does). Syntax errors anywhere in the literal take precedence
// over a lone surrogate, which the caller reports once the literal is known
// to be well formed.
func (p *parser) string() (s, lone string, err error) {
	src := p.src
	start := p.pos + 1
	i := start
	for i < len(src) {
		c := src[i]
		if c == '"' {
			p.pos = i + 1
			return src[start:i], "", nil
		}
		if c == '\\' {
			break
		}
		if c < 0x20 {
			p.pos = i
			return "", "", p.syntaxError("in string literal")
		}
		i++
	}
	buf := append(p.scratch[:0], src[start:i]...)
	for {
		if i >= len(src) {
			p.pos = i
			return "", "", p.syntaxError("")
		}
		c := src[i]
		switch {
		case c == '"':
			p.pos = i + 1
			p.scratch = buf
			return string(buf), lone, nil
		case c < 0x20:
			p.pos = i
			return "", "", p.syntaxError("in string literal")
		case c != '\\':
			buf = append(buf, c)
			i++
			continue
		}
		// An escape.
		if i+1 >= len(src) {
			p.pos = i + 1
			return "", "", p.syntaxError("")
		}
		switch e := src[i+1]; e {
		case '"', '\\', '/':
			buf = append(buf, e)
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case 'u':
			r, err := p.hex4(i + 2)
			if err != nil {
				return "", "", err
			}
			if r < 0xD800 || r > 0xDFFF {
				buf = utf8.AppendRune(buf, r)
				i += 6
				continue
			}
			if r < 0xDC00 && i+11 < len(src) && src[i+6] == '\\' && src[i+7] == 'u' {
				if r2, ok := hex4(src, i+8); ok && r2 >= 0xDC00 && r2 <= 0xDFFF {
					buf = utf8.AppendRune(buf, 0x10000+(r-0xD800)<<10+(r2-0xDC00))
					i += 12
					continue
				}
			}
			if lone == "" {
				lone = src[i : i+6]
			}
			buf = utf8.AppendRune(buf, utf8.RuneError)
			i += 6
			continue
		default:
			p.pos = i + 1
			return "", "", p.syntaxError("in string escape code")
		}
		i += 2
	}
}

// hex4 decodes the four hexadecimal digits of a \u escape at src[at:].
func (p *parser) hex4(at int) (rune, error) {
	if r, ok := hex4(p.src, at); ok {
		return r, nil
	}
	p.pos = at
	for p.pos < len(p.src) && p.pos < at+4 && isHex(p.src[p.pos]) {
		p.pos++
	}
	return 0, p.syntaxError(`in \u hexadecimal character escape`)
}

// hex4 decodes the four hexadecimal digits at s[at:at+4].
func hex4(s string, at int) (rune, bool) {
	if at+4 > len(s) {
		return 0, false
	}
	var r rune
	for i := at; i < at+4; i++ {
		c := s[i]
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

func isHex(c byte) bool {
	return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func (p *parser) loneSurrogateError(esc string) error {
	if ptr, ok := p.secretAt(p.path); ok {
		return fmt.Errorf("%w: string escapes a lone UTF-16 surrogate in the secret field %s", ErrInvalidUTF8, quoteForError(ptr))
	}
	return fmt.Errorf("%w: string escapes a lone UTF-16 surrogate %s %s", ErrInvalidUTF8, esc, p.where())
}

// enter records one more level of nesting, refusing to go past MaxDepth.
func (p *parser) enter() error {
	p.depth++
	if p.depth > MaxDepth {
		return fmt.Errorf("%w: more than %d nested arrays and objects %s", ErrTooDeep, MaxDepth, p.where())
	}
	return nil
}

func (p *parser) array() (*node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	p.pos++ // '['
	n := p.newNode(kindArray)
	p.skipSpace()
	if p.pos < len(p.src) && p.src[p.pos] == ']' {
		p.pos++
		p.depth--
		return n, nil
	}
	base := len(p.elemStack)
	p.path = append(p.path, pathToken{})
	top := len(p.path) - 1
	for i := 0; ; i++ {
		p.path[top].index = i
		p.skipSpace()
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		p.elemStack = append(p.elemStack, v)
		p.skipSpace()
		if p.pos >= len(p.src) {
			return nil, p.syntaxError("")
		}
		switch p.src[p.pos] {
		case ',':
			p.pos++
			continue
		case ']':
			p.pos++
		default:
			return nil, p.syntaxError("after array element")
		}
		break
	}
	p.path = p.path[:top]
	n.elems = p.takeElems(base)
	p.depth--
	return n, nil
}

// linearScanMembers is the object size up to which duplicate names are found
// by scanning the members already read; larger objects use a map.
const linearScanMembers = 16

func (p *parser) object() (*node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	p.pos++ // '{'
	n := p.newNode(kindObject)
	p.skipSpace()
	if p.pos < len(p.src) && p.src[p.pos] == '}' {
		p.pos++
		p.depth--
		return n, nil
	}
	base := len(p.memberStack)
	var seen map[string]struct{}
	p.path = append(p.path, pathToken{index: -1})
	top := len(p.path) - 1
	for {
		p.skipSpace()
		if p.pos >= len(p.src) || p.src[p.pos] != '"' {
			return nil, p.syntaxError("looking for beginning of object key string")
		}
		name, lone, err := p.string()
		if err != nil {
			return nil, err
		}
		p.path[top].name = name
		if lone != "" {
			return nil, p.loneSurrogateError(lone)
		}
		if isDuplicate(p.memberStack[base:], &seen, name) {
			if ptr, ok := p.secretAt(p.path[:top]); ok {
				return nil, fmt.Errorf("%w: a name appears twice in the secret field %s", ErrDuplicateKey, quoteForError(ptr))
			}
			return nil, fmt.Errorf("%w: %s appears twice %s", ErrDuplicateKey, quoteForError(name), whereTokens(p.path[:top]))
		}
		p.skipSpace()
		if p.pos >= len(p.src) || p.src[p.pos] != ':' {
			return nil, p.syntaxError("after object key")
		}
		p.pos++
		p.skipSpace()
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		p.memberStack = append(p.memberStack, member{name: name, value: v})
		p.skipSpace()
		if p.pos >= len(p.src) {
			return nil, p.syntaxError("")
		}
		switch p.src[p.pos] {
		case ',':
			p.pos++
			continue
		case '}':
			p.pos++
		default:
			return nil, p.syntaxError("after object key:value pair")
		}
		break
	}
	p.path = p.path[:top]
	n.members = p.takeMembers(base)
	p.depth--
	return n, nil
}

// isDuplicate reports whether name is already a member. Names are compared
// after unescaping, so "a" and "\u0061" are the same name.
func isDuplicate(members []member, seen *map[string]struct{}, name string) bool {
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

// checkNumber refuses numbers outside the range of a double and, in strict
// mode, numbers that canonicalize to a different value.
func (p *parser) checkNumber(text string) error {
	_, err := p.numberValue(text)
	return err
}

// numberValue returns the double that the number text denotes, refusing
// numbers outside the range of a double and, in strict mode, numbers whose
// canonical form denotes a different value.
func (p *parser) numberValue(text string) (float64, error) {
	if f, ok := plainInt(text); ok {
		return f, nil // its own canonical form
	}
	f, err := parseNumber(text)
	if err != nil {
		if ptr, ok := p.secretAt(p.path); ok {
			return 0, fmt.Errorf("%w: a number in the secret field %s (value not shown)", err, quoteForError(ptr))
		}
		return 0, fmt.Errorf("%w: %s %s", err, quoteForError(text), p.where())
	}
	if !p.strict {
		return f, nil
	}
	canonical := appendNumber(p.numBuf[:0], f)
	if string(canonical) == text || sameValue(text, string(canonical)) {
		return f, nil
	}
	if ptr, ok := p.secretAt(p.path); ok {
		return 0, fmt.Errorf("%w: a number in the secret field %s (value not shown) would be canonicalized as a different value; send it as a string or in minor units",
			ErrNumberPrecision, quoteForError(ptr))
	}
	return 0, fmt.Errorf("%w: %s %s would be canonicalized as %s, a different value; send it as a string or in minor units",
		ErrNumberPrecision, quoteForError(text), p.where(), canonical)
}
