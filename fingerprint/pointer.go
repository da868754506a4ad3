package fingerprint

import (
	"errors"
	"fmt"

	"github.com/receiptledger/reconciler/internal/jsonpointer"
)

// validatePointer checks that s is an RFC 6901 JSON pointer without
// allocating, in the package's error form.
func validatePointer(s string) error {
	var se *jsonpointer.SyntaxError
	if err := jsonpointer.Validate(s); errors.As(err, &se) {
		return fmt.Errorf("%w: %s: %s", ErrInvalidPointer, quoteForError(s), se.Reason)
	}
	return nil
}

// resolvePointer returns the node the valid JSON pointer ptr refers to, or
// nil when there is none: a missing member, an index past the end, "-", or a
// token that is not an RFC 6901 array index applied to an array.
func resolvePointer(root *node, ptr string) *node {
	n := root
	for ptr != "" {
		var tok string
		tok, ptr = jsonpointer.Next(ptr)
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
			i, ok := jsonpointer.ArrayIndex(tok)
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
