package sanitize

import (
	"bytes"
	"encoding/json"
	"strconv"
	"unicode/utf8"
)

// JSON returns raw as a JSON document PostgreSQL's jsonb accepts, with every
// string (and object key) passed through Text with maxString, and reports
// whether anything was altered.
//
// jsonb refuses the \u0000 escape and unpaired surrogate escapes inside
// strings, and text refuses invalid UTF-8; such documents are decoded and
// re-encoded. A document that was altered and is an object gets
// "sanitized": true; any other altered value is wrapped as
// {"sanitized": true, "value": ...}. A document that is not JSON becomes
// {"sanitized": true, "invalid_json": <excerpt>}; one longer than maxTotal
// bytes after sanitizing becomes {"sanitized": true, "truncated": true,
// "bytes": n, "excerpt": <excerpt>}. Numbers that are too long or out of
// float64 range are kept as strings. A clean document (the common case) is
// returned as is after a validity scan, without decoding.
func JSON(raw []byte, maxString, maxTotal int) (out []byte, changed bool) {
	if len(raw) == 0 {
		return raw, false
	}
	if (maxTotal <= 0 || len(raw) <= maxTotal) && utf8.Valid(raw) && !badEscape(raw) &&
		json.Valid(raw) && !unusual(raw, maxString) {
		return raw, false
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil || dec.More() {
		s, _ := Text(string(raw), excerptBytes(maxString))
		return marshal(map[string]any{"sanitized": true, "invalid_json": s}), true
	}
	v, changed = walk(v, maxString)
	if !utf8.Valid(raw) || badEscape(raw) {
		changed = true
	}
	if changed {
		if m, ok := v.(map[string]any); ok {
			m["sanitized"] = true
		} else {
			v = map[string]any{"sanitized": true, "value": v}
		}
	}
	out = marshal(v)
	if maxTotal > 0 && len(out) > maxTotal {
		s, _ := Text(string(out), min(excerptBytes(maxString), maxTotal/2))
		return marshal(map[string]any{"sanitized": true, "truncated": true, "bytes": len(out), "excerpt": s}), true
	}
	if !changed {
		return raw, false
	}
	return out, true
}

// excerptBytes bounds the excerpt of a document that could not be kept.
func excerptBytes(maxString int) int {
	if maxString <= 0 || maxString > 1024 {
		return 1024
	}
	return maxString
}

func marshal(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return []byte(`{"sanitized":true}`)
	}
	return bytes.TrimRight(b.Bytes(), "\n")
}

// walk sanitizes every string and key of a decoded document.
func walk(v any, maxString int) (any, bool) {
	switch x := v.(type) {
	case string:
		s, ch := Text(x, maxString)
		return s, ch
	case json.Number:
		if len(x) > 64 {
			s, _ := Text(string(x), 64)
			return s, true
		}
		if f, err := strconv.ParseFloat(string(x), 64); err != nil || f != f {
			return string(x), true
		}
		return x, false
	case []any:
		changed := false
		for i := range x {
			var ch bool
			x[i], ch = walk(x[i], maxString)
			changed = changed || ch
		}
		return x, changed
	case map[string]any:
		changed := false
		out := make(map[string]any, len(x))
		for k, e := range x {
			k2, ch := Text(k, maxString)
			e2, ch2 := walk(e, maxString)
			changed = changed || ch || ch2
			out[k2] = e2
		}
		return out, changed
	}
	return v, false
}

// badEscape reports whether raw holds a \u0000 escape or an unpaired
// surrogate escape, which jsonb refuses.
func badEscape(raw []byte) bool {
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' || i+1 >= len(raw) {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // skip the escaped character (it may be a backslash)
			continue
		}
		r, ok := hex4(raw, i+2)
		if !ok {
			return true
		}
		switch {
		case r == 0:
			return true
		case r >= 0xd800 && r < 0xdc00:
			if i+7 >= len(raw) || raw[i+6] != '\\' || raw[i+7] != 'u' {
				return true
			}
			lo, ok := hex4(raw, i+8)
			if !ok || lo < 0xdc00 || lo > 0xdfff {
				return true
			}
			i += 11
			continue
		case r >= 0xdc00 && r <= 0xdfff:
			return true
		}
		i += 5
	}
	return false
}

func hex4(b []byte, at int) (rune, bool) {
	if at+4 > len(b) {
		return 0, false
	}
	n, err := strconv.ParseUint(string(b[at:at+4]), 16, 32)
	return rune(n), err == nil
}

// unusual reports whether raw (valid JSON) may hold a string longer than
// max bytes, or a number with an exponent or more than 64 characters (which
// may overflow jsonb's numeric): a cheap over-estimate that sends such
// documents to the slow path.
func unusual(raw []byte, max int) bool {
	inString, run := false, 0
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		if inString {
			switch c {
			case '\\':
				i++
				run += 2
			case '"':
				inString = false
			default:
				run++
			}
			if max > 0 && run > max {
				return true
			}
			continue
		}
		switch {
		case c == '"':
			inString, run = true, 0
		case (c == 'e' || c == 'E') && i > 0 && (raw[i-1] == '.' || (raw[i-1] >= '0' && raw[i-1] <= '9')):
			return true
		case c == '-' || c == '.' || c == '+' || (c >= '0' && c <= '9'):
			run++
			if run > 64 {
				return true
			}
		default:
			run = 0
		}
	}
	return false
}
