package reviewui

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html/template"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

// Stored text comes from APIs and agents: hostile by default. html/template
// escapes markup, but characters that are valid text yet change what a
// person reads (U+202E turning "exe.txt" around, a line separator, a NUL
// turned U+FFFD, a C0 or C1 control) pass through it. visible shows each
// such character as a marked code point instead, escaped like everything
// else, so what the page shows is what is stored. The set of characters is
// the one the CLI escapes for a terminal (sanitize.Terminal).

// visible returns s as HTML text with every control character shown as
// its code point in a marked span.
func visible(s string) template.HTML {
	return template.HTML(visibleText(s, false))
}

// visibleJSON returns a JSON value indented for reading, as visible
// does. Its newlines are the indentation's own: a JSON string cannot hold a
// raw newline.
func visibleJSON(raw json.RawMessage) template.HTML {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return visible(string(raw))
	}
	return template.HTML(visibleText(b.String(), true))
}

// plain returns s with every control character replaced by its code point
// in brackets, for places that take text only (an option's label, a
// title attribute); html/template escapes the result.
func plain(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size <= 1:
			fmt.Fprintf(&b, `[\x%02x]`, s[i])
		case sanitize.Terminal(s[i:i+size]) != s[i:i+size]:
			fmt.Fprintf(&b, "[U+%04X]", r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

func visibleText(s string, keepNewlines bool) string {
	var b strings.Builder
	plain := 0
	flush := func(i int) {
		b.WriteString(template.HTMLEscapeString(s[plain:i]))
	}
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		invalid := r == utf8.RuneError && size <= 1
		if !invalid && (r == '\n' && keepNewlines || sanitize.Terminal(s[i:i+size]) == s[i:i+size]) {
			i += size
			continue
		}
		flush(i)
		if invalid {
			fmt.Fprintf(&b, `<span class="ctl" title="invalid byte">\x%02x</span>`, s[i])
		} else {
			fmt.Fprintf(&b, `<span class="ctl" title="control character">U+%04X</span>`, r)
		}
		i += size
		plain = i
	}
	flush(len(s))
	return b.String()
}

// field is one leaf of a stored intent: its JSON pointer, its value as
// JSON, and whether the value is a secret the ledger redacted before
// storing (fingerprint.RedactedMarker or a keyed "hmac-sha256:" string).
type field struct {
	Pointer  string
	Value    string
	Redacted bool
}

// intentFields flattens a stored intent into its leaves, in key order.
func intentFields(raw json.RawMessage) []field {
	var v any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return []field{{Pointer: "", Value: string(raw)}}
	}
	var out []field
	var walk func(ptr string, v any)
	walk = func(ptr string, v any) {
		switch x := v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				walk(ptr+"/"+strings.NewReplacer("~", "~0", "/", "~1").Replace(k), x[k])
			}
			if len(x) == 0 {
				out = append(out, field{Pointer: ptr, Value: "{}"})
			}
		case []any:
			for i, e := range x {
				walk(ptr+"/"+strconv.Itoa(i), e)
			}
			if len(x) == 0 {
				out = append(out, field{Pointer: ptr, Value: "[]"})
			}
		case string:
			if x == fingerprint.RedactedMarker || fingerprint.IsKeyedValue(x) {
				out = append(out, field{Pointer: ptr, Redacted: true, Value: x})
				return
			}
			b, _ := json.Marshal(x)
			out = append(out, field{Pointer: ptr, Value: string(b)})
		default:
			b, _ := json.Marshal(x)
			out = append(out, field{Pointer: ptr, Value: string(b)})
		}
	}
	walk("", v)
	return out
}

// decision is one way out of manual_review, in the words a reviewer needs.
type decision struct {
	Value   string // the form's value: a state, or "requeue"
	Label   string
	Meaning string
}

// decisions are the ways out of manual_review (SPEC §3), in plain words.
var decisions = []decision{
	{string(statemachine.Succeeded), "It happened: succeeded",
		"The call took effect. The receipt is settled as succeeded and nothing is sent again. " +
			"Give the external id of what you found, if any."},
	{string(statemachine.SafeToRetry), "It did not happen: safe to retry",
		"You are sure the call had no effect. The agent may send it again as a new attempt linked to this one. " +
			"If the effect exists after all, this causes a duplicate."},
	{string(statemachine.Rejected), "It did not happen and must not: rejected",
		"The call had no effect and nobody should send it again (the API refused it, or it is no longer wanted). " +
			"The receipt is settled as rejected."},
	{"requeue", "Not sure yet: send back to the reconciler",
		"The receipt goes back to outcome_unknown and the reconciler checks it again at once through its adapter; " +
			"if it still cannot prove the outcome, it comes back here."},
}

// meaning returns the plain-words meaning of a state a receipt can be in,
// for the receipt page's heading.
func meaning(s statemachine.State) string {
	switch s {
	case statemachine.Planned:
		return "recorded, nothing sent yet"
	case statemachine.Submitted:
		return "sent (or about to be); waiting for the answer"
	case statemachine.OutcomeUnknown:
		return "sent, but the answer was lost; the reconciler will check"
	case statemachine.Reconciling:
		return "the reconciler is reading back what happened"
	case statemachine.Succeeded:
		return "settled: the effect exists"
	case statemachine.SafeToRetry:
		return "settled: the effect is proven absent, a retry may be sent"
	case statemachine.Rejected:
		return "settled: no effect, and not to be sent again"
	case statemachine.ManualReview:
		return "held: no program could prove what happened, a person must decide"
	}
	return ""
}

// stamp prints a time in UTC to the millisecond.
func stamp(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05.000Z") }

// ages are the queue's age filter choices: a Go duration each.
var ages = []struct{ Value, Label string }{
	{"", "any age"}, {"15m", "15 minutes or more"}, {"1h", "1 hour or more"},
	{"24h", "1 day or more"}, {"168h", "7 days or more"},
}

var funcs = template.FuncMap{
	"visible":     visible,
	"plain":       plain,
	"visibleJSON": visibleJSON,
	"fields":      intentFields,
	"meaning":     meaning,
	"age":         review.FormatAge,
	"stamp":       stamp,
	"latency": func(d time.Duration) string {
		return d.Round(time.Microsecond).String()
	},
	"count": func(n int64) string {
		s := strconv.FormatInt(n, 10)
		for i := len(s) - 3; i > 0; i -= 3 {
			s = s[:i] + "," + s[i:]
		}
		return s
	},
}
