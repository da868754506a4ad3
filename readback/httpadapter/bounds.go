package httpadapter

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// Response bounds. A response is read up to max_response_bytes, then
// scanned token by token (nothing is kept) before anything is decoded: the
// scan stops at the first bound crossed, so a hostile page costs at most
// the bound's worth of work, never its full size in decoded maps (16 MiB of
// `{}` items decoded whole took about 650 MiB of heap).
const (
	// defaultMaxResponseBytes bounds one response body (max_response_bytes).
	defaultMaxResponseBytes = 8 << 20
	// maxMaxResponseBytes is the highest max_response_bytes accepted.
	maxMaxResponseBytes = 64 << 20
	// defaultMaxPageItems bounds the items of one search page
	// (search.max_page_items).
	defaultMaxPageItems = 1000
	// maxMaxPageItems is the highest search.max_page_items accepted.
	maxMaxPageItems = 100000
	// valuesPerItem and baseValues bound the JSON values (objects, arrays,
	// scalars, keys not counted) of one response: valuesPerItem per
	// allowed item plus baseValues, so a page within its item bound but
	// padded elsewhere is refused too.
	valuesPerItem = 256
	baseValues    = 4096
	// maxDepth bounds nesting.
	maxDepth = 128
)

// errTooLarge marks a response over a bound: a permanent error (the API
// answers pages the file does not allow: lower the page size the query asks
// for, or raise the bound), never an absence.
var errTooLarge = errors.New("response over the adapter's bounds")

// scanBounds walks body's JSON tokens without keeping them and fails when
// the document is deeper than maxDepth, holds more than maxValues values,
// or when the array at items (nil: no list to count) holds more than
// maxItems elements. A syntax error is returned as is (the caller decides:
// a cut page is transient).
func scanBounds(body []byte, items *pointer, maxItems, maxValues int) error {
	s := &scanner{dec: json.NewDecoder(bytes.NewReader(body)), items: items, maxItems: maxItems, maxValues: maxValues}
	s.dec.UseNumber()
	if err := s.value(0); err != nil {
		return err
	}
	if _, err := s.dec.Token(); err != io.EOF {
		if err == nil {
			return errors.New("invalid JSON: data after the top-level value")
		}
		return err
	}
	return nil
}

type scanner struct {
	dec                 *json.Decoder
	items               *pointer
	path                []string
	values              int
	maxItems, maxValues int
}

func (s *scanner) atItems() bool {
	if s.items == nil || len(s.path) != len(s.items.tokens) {
		return false
	}
	for i, t := range s.items.tokens {
		if s.path[i] != t {
			return false
		}
	}
	return true
}

func (s *scanner) value(depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("%w: nested deeper than %d levels", errTooLarge, maxDepth)
	}
	s.values++
	if s.values > s.maxValues {
		return fmt.Errorf("%w: more than %d JSON values", errTooLarge, s.maxValues)
	}
	tok, err := s.dec.Token()
	if err != nil {
		if err == io.EOF {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '{':
		for s.dec.More() {
			key, err := s.dec.Token()
			if err != nil {
				return err
			}
			k, _ := key.(string)
			s.path = append(s.path, k)
			err = s.value(depth + 1)
			s.path = s.path[:len(s.path)-1]
			if err != nil {
				return err
			}
		}
	case '[':
		counting := s.atItems()
		for i := 0; s.dec.More(); i++ {
			if counting && i >= s.maxItems {
				return fmt.Errorf("%w: more than %d items in one page", errTooLarge, s.maxItems)
			}
			s.path = append(s.path, strconv.Itoa(i))
			err := s.value(depth + 1)
			s.path = s.path[:len(s.path)-1]
			if err != nil {
				return err
			}
		}
	}
	_, err = s.dec.Token() // the closing delimiter
	return err
}
