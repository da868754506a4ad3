package main

// Human output: every table and line of text a command prints for a person
// goes through a screen, so no field can reach the operator's terminal raw.
// Operations, dependencies, targets, keys, external ids (set by an API),
// actors, reasons, evidence and error text come from outside (an API, an
// agent, an operator): an ESC or CSI byte in one of them could rewrite the
// screen, a CR or a newline forge a line, a bidi override reverse what a
// line says. Issue 8, item 7.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"text/tabwriter"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/internal/sanitize"
)

// termText is s made safe for a terminal (sanitize.Terminal): every control
// character (C0 including ESC, CR, BS, newline and tab, DEL, C1, U+2028/2029,
// the bidi marks, overrides and isolates, BOM) and every byte that is not
// UTF-8 becomes a visible escape (\x1b, \n, \u009b, \u202e); printable text is
// unchanged, so the value stays recognizable.
func termText(s string) string { return sanitize.Terminal(s) }

// shown reports whether the rune r, encoded as enc, reaches a terminal as
// it is: termText leaves it alone and it is not an invalid byte.
func shown(r rune, enc []byte) bool {
	if r == utf8.RuneError && len(enc) == 1 {
		return false
	}
	return termText(string(enc)) == string(enc)
}

// screen writes human output. Printf escapes every argument
// that is not a number or a boolean with termText before formatting (so a
// value's newline or tab cannot forge a line or a column: only the format's
// own layout can: put "\n" and "\t" in the format, never in an argument),
// and whatever reaches the underlying writer passes a
// guard that escapes any control character other than the layout's "\n"
// and "\t". Formats take %s, %v or %q for text: a non-numeric argument
// arrives as a string.
type screen struct {
	w     io.Writer
	flush func() error
}

// newScreen is a screen over w, typically c.App.Writer.
func newScreen(w io.Writer) *screen { return &screen{w: guard{w: w}} }

// Printf formats like fmt.Fprintf with every argument escaped.
func (s *screen) Printf(format string, args ...any) {
	fmt.Fprintf(s.w, format, escapeArgs(args)...)
}

// Table is a screen that aligns tab-separated columns; Flush prints it.
func (s *screen) Table() *screen {
	tw := tabwriter.NewWriter(s.w, 2, 4, 2, ' ', 0)
	return &screen{w: tw, flush: tw.Flush}
}

// Flush prints a Table's rows; it does nothing on other screens.
func (s *screen) Flush() error {
	if s.flush == nil {
		return nil
	}
	return s.flush()
}

// escapeArgs returns args with every non-numeric value replaced by its
// escaped text.
func escapeArgs(args []any) []any {
	out := make([]any, len(args))
	for i, a := range args {
		out[i] = escapeArg(a)
	}
	return out
}

func escapeArg(a any) any {
	switch v := a.(type) {
	case nil:
		return a
	case string:
		return termText(v)
	case json.RawMessage:
		return termText(string(v))
	case []byte:
		return termText(string(v))
	case error:
		return termText(v.Error())
	case fmt.Stringer:
		return termText(v.String())
	}
	switch reflect.ValueOf(a).Kind() {
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		return a
	}
	// Named strings (states, actors), slices, maps and structs.
	return termText(fmt.Sprint(a))
}

// guard is the last line: it passes "\n" and "\t" (the printers' layout)
// and escapes any other control character in what is written to w. Callers
// write whole runes (fmt and tabwriter do); a rune cut between two writes
// is escaped byte by byte, never passed raw.
type guard struct{ w io.Writer }

func (g guard) Write(p []byte) (int, error) {
	if layoutOnly(p) {
		return g.w.Write(p)
	}
	var b bytes.Buffer
	rest := p
	for len(rest) > 0 {
		i := bytes.IndexAny(rest, "\n\t")
		if i < 0 {
			b.WriteString(termText(string(rest)))
			break
		}
		b.WriteString(termText(string(rest[:i])))
		b.WriteByte(rest[i])
		rest = rest[i+1:]
	}
	if _, err := g.w.Write(b.Bytes()); err != nil {
		return 0, err
	}
	return len(p), nil
}

// layoutOnly reports whether p holds no control character other than "\n"
// and "\t", and only valid UTF-8.
func layoutOnly(p []byte) bool {
	for i := 0; i < len(p); {
		r, n := utf8.DecodeRune(p[i:])
		if r != '\n' && r != '\t' && !shown(r, p[i:i+n]) {
			return false
		}
		i += n
	}
	return true
}

// jsonText makes encoded JSON safe to show as well as to parse. encoding/json
// escapes C0 and U+2028/2029 in the strings it encodes, but passes DEL, C1
// and the bidi controls raw, and copies a json.RawMessage (an intent, some
// evidence, read from jsonb) as it is. Each of those, and any byte that is
// not UTF-8, becomes a \u escape: outside strings encoded JSON is ASCII, so
// the document stays valid and means the same (an invalid byte reads as
// U+FFFD, as encoding/json decodes it).
func jsonText(b []byte) []byte {
	if layoutOnly(b) {
		return b
	}
	out := make([]byte, 0, len(b)+32)
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			out = append(out, `\ufffd`...)
		case r == '\n' || r == '\t':
			out = append(out, b[i])
		case !shown(r, b[i:i+n]):
			out = fmt.Appendf(out, `\u%04x`, r)
		default:
			out = append(out, b[i:i+n]...)
		}
		i += n
	}
	return out
}

// Write prints p, text already laid out by a printer of this package,
// through the guard only: its own "\n" and "\t" pass, any other control
// character is escaped.
func (s *screen) Write(p []byte) (int, error) { return s.w.Write(p) }

// jsonLines writes encoded JSON documents, one per Write as log/slog's
// JSON handler writes them, through jsonText: the daemon's logs carry text
// from APIs and agents, and an operator tails them on a terminal.
type jsonLines struct{ w io.Writer }

// Write writes p with jsonText applied and reports p as written whole.
func (j jsonLines) Write(p []byte) (int, error) {
	if _, err := j.w.Write(jsonText(p)); err != nil {
		return 0, err
	}
	return len(p), nil
}
