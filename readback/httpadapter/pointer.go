package httpadapter

import (
	"errors"
	"fmt"

	"github.com/receiptledger/reconciler/internal/jsonpointer"
)

// pointer is a parsed RFC 6901 JSON pointer; the empty pointer is the
// whole document.
type pointer struct {
	text   string
	tokens []string
}

// parsePointer validates p at load time so a typo in a pointer fails at
// start, not on every check.
func parsePointer(p string) (pointer, error) {
	toks, err := jsonpointer.Parse(p)
	if err != nil {
		return pointer{}, err
	}
	return pointer{text: p, tokens: toks}, nil
}

// String returns the pointer's text.
func (p pointer) String() string { return p.text }

// get resolves p in a document decoded with UseNumber.
func (p pointer) get(doc any) (any, bool) { return jsonpointer.Get(doc, p.tokens) }

// lookup resolves the pointer text ptr in doc; a malformed pointer (which
// load-time validation rules out) finds nothing.
func lookup(doc any, ptr string) (any, bool) {
	p, err := parsePointer(ptr)
	if err != nil {
		return nil, false
	}
	return p.get(doc)
}

// errPointerConflict means two fingerprint fields overlap (/a and /a/b).
var errPointerConflict = errors.New("overlapping pointers")

// set stores v at p in the object root, creating intermediate objects, to
// rebuild a payload from an item's fields for fingerprint matching.
func (p pointer) set(root map[string]any, v any) error {
	if len(p.tokens) == 0 {
		return fmt.Errorf("%w: the empty pointer cannot name a payload field", errPointerConflict)
	}
	cur := root
	for _, t := range p.tokens[:len(p.tokens)-1] {
		next, ok := cur[t]
		if !ok {
			m := map[string]any{}
			cur[t] = m
			cur = m
			continue
		}
		m, ok := next.(map[string]any)
		if !ok {
			return fmt.Errorf("%w at %s", errPointerConflict, p.text)
		}
		cur = m
	}
	last := p.tokens[len(p.tokens)-1]
	if _, exists := cur[last]; exists {
		return fmt.Errorf("%w at %s", errPointerConflict, p.text)
	}
	cur[last] = v
	return nil
}
