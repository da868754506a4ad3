package sanitize

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// Issue 8, item 1: text from an API reaches text and jsonb columns only as valid
// UTF-8 without NUL, bounded, and the caller learns whether it changed.
func TestText(t *testing.T) {
	euro := "€" // 3 bytes: e2 82 ac
	cases := []struct {
		name    string
		in      string
		max     int
		want    string
		changed bool
	}{
		{"plain", "busy", 200, "busy", false},
		{"empty", "", 10, "", false},
		{"unbounded", strings.Repeat("a", 5000), 0, strings.Repeat("a", 5000), false},
		{"exactly max", "abcde", 5, "abcde", false},
		{"nul dropped to replacement", "busy\x00", 200, "busy\uFFFD", true},
		{"only nul", "\x00\x00", 200, "\uFFFD\uFFFD", true},
		{"invalid byte", "a\xffb", 200, "a\uFFFDb", true},
		{"lone continuation", "\x80", 200, "\uFFFD", true},
		{"overlong encoding", "\xc0\xaf", 200, "\uFFFD\uFFFD", true},
		{"surrogate half", "\xed\xa0\x80", 200, "\uFFFD\uFFFD\uFFFD", true},
		{"split multi-byte at end (cut at 200 by a sender)", "ok" + euro[:2], 200, "ok\uFFFD\uFFFD", true},
		{"split multi-byte at start", euro[1:] + "ok", 200, "\uFFFD\uFFFDok", true},
		{"controls other than NUL kept", "a\x1b[2Jb\u0085\u202e", 200, "a\x1b[2Jb\u0085\u202e", false},
		{"cut with ellipsis", "abcdefghij", 6, "abc" + Ellipsis, true},
		{"cut never splits a rune", "a" + euro + euro, 6, "a" + Ellipsis, true},
		{"cut mid rune backs off", "ab" + euro + "cd", 6, "ab" + Ellipsis, true},
		{"cut on boundary", "ab" + euro + "cdef", 8, "ab" + euro + Ellipsis, true},
		{"cut after sanitize", "\x00\x00\x00\x00", 6, "\uFFFD" + Ellipsis, true},
		{"max smaller than ellipsis", "abcdef", 2, "ab", true},
		{"max smaller than ellipsis mid rune", euro + euro, 2, "", true},
		{"1 MiB id bounded", strings.Repeat("x", 1<<20), 255, strings.Repeat("x", 252) + Ellipsis, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, changed := Text(c.in, c.max)
			if got != c.want || changed != c.changed {
				t.Fatalf("Text(%q, %d) = %q, %v; want %q, %v", c.in, c.max, got, changed, c.want, c.changed)
			}
			if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 {
				t.Fatalf("Text(%q) = %q: not valid UTF-8 without NUL", c.in, got)
			}
			if c.max > 0 && len(got) > c.max {
				t.Fatalf("Text(%q, %d) = %d bytes, over the bound", c.in, c.max, len(got))
			}
		})
	}
}

// Issue 8, item 7: every control character is escaped for a human terminal.
func TestTerminal(t *testing.T) {
	cases := []struct {
		name string
		in   string
		want string
	}{
		{"plain", "refund ch_123", "refund ch_123"},
		{"unicode printable", "naïve € 日本 🙂", "naïve € 日本 🙂"},
		{"backslash kept", `a\b`, `a\b`},
		{"ESC CSI clear screen", "\x1b[2J\x1b[Hhi", `\x1b[2J\x1b[Hhi`},
		{"OSC title", "\x1b]0;pwned\x07", `\x1b]0;pwned\x07`},
		{"NUL", "a\x00b", `a\x00b`},
		{"tab newline cr", "a\tb\nc\rd", `a\tb\nc\rd`},
		{"DEL", "a\x7fb", `a\x7fb`},
		{"C1 CSI", "a\u009b2Jb", `a\u009b2Jb`},
		{"C1 NEL", "a\u0085b", `a\u0085b`},
		{"line and paragraph separators", "a\u2028b\u2029c", `a\u2028b\u2029c`},
		{"bidi override", "file\u202egnp.exe", `file\u202egnp.exe`},
		{"bidi isolates", "\u2066x\u2069\u2067\u2068", `\u2066x\u2069\u2067\u2068`},
		{"bidi marks", "\u200e\u200f\u061c", `\u200e\u200f\u061c`},
		{"BOM", "\ufeffid", `\ufeffid`},
		{"invalid UTF-8", "a\xffb\xc3", `a\xffb\xc3`},
		{"split multi-byte", "ok\xe2\x82", `ok\xe2\x82`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Terminal(c.in)
			if got != c.want {
				t.Fatalf("Terminal(%q) = %q; want %q", c.in, got, c.want)
			}
			for _, r := range got {
				if r < 0x20 || r == 0x7f || escapedRune(r) {
					t.Fatalf("Terminal(%q) = %q still holds %U", c.in, got, r)
				}
			}
			if !utf8.ValidString(got) {
				t.Fatalf("Terminal(%q) = %q: not valid UTF-8", c.in, got)
			}
		})
	}
}

func FuzzText(f *testing.F) {
	for _, s := range []string{"busy\x00", "a\xffb", "€", "\x1b[2J", strings.Repeat("é", 100)} {
		f.Add(s, 10)
	}
	f.Fuzz(func(t *testing.T, s string, max int) {
		max %= 4096
		got, changed := Text(s, max)
		if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 {
			t.Fatalf("Text(%q) = %q", s, got)
		}
		if max > 0 && len(got) > max {
			t.Fatalf("Text(%q, %d) = %d bytes", s, max, len(got))
		}
		if !changed && got != s {
			t.Fatalf("Text(%q) changed to %q without saying so", s, got)
		}
		esc := Terminal(s)
		if !utf8.ValidString(esc) {
			t.Fatalf("Terminal(%q) = %q", s, esc)
		}
		for _, r := range esc {
			if r < 0x20 || r == 0x7f || escapedRune(r) {
				t.Fatalf("Terminal(%q) = %q holds %U", s, esc, r)
			}
		}
	})
}

// Issue 8, item 1: evidence JSON reaches jsonb only in a form it accepts,
// marked when altered.
func TestJSON(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		changed bool
		want    string // "" means same as in
	}{
		{"clean", `{"a":"b","n":1}`, false, ""},
		{"clean literals", `{"t":true,"f":false,"n":null,"x":-1.5}`, false, ""},
		{"clean escapes", `{"a":"\u00e9\ud83d\ude00\\u0000"}`, false, ""},
		{"nul escape", `{"a":"busy\u0000"}`, true, `{"a":"busy\ufffd","sanitized":true}`},
		{"lone high surrogate", `{"a":"\ud800x"}`, true, `{"a":"\ufffdx","sanitized":true}`},
		{"lone low surrogate", `["\udc00"]`, true, `{"sanitized":true,"value":["\ufffd"]}`},
		{"raw invalid utf8", "{\"a\":\"\xff\"}", true, `{"a":"\ufffd","sanitized":true}`},
		{"nul in key", `{"k\u0000":1}`, true, `{"k\ufffd":1,"sanitized":true}`},
		{"not json", "busy\x00", true, `{"invalid_json":"busy\ufffd","sanitized":true}`},
		{"huge number", `{"n":1e999999}`, true, `{"n":"1e999999","sanitized":true}`},
		{"long string", `{"a":"` + strings.Repeat("x", 40) + `"}`, true, `{"a":"` + strings.Repeat("x", 13) + `…","sanitized":true}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, changed := JSON([]byte(c.in), 16, 4096)
			want := c.want
			if want == "" {
				want = c.in
			}
			if changed != c.changed {
				t.Fatalf("JSON(%q) changed = %v, want %v (%s)", c.in, changed, c.changed, got)
			}
			var a, b any
			if json.Unmarshal(got, &a) != nil || json.Unmarshal([]byte(want), &b) != nil || !reflect.DeepEqual(a, b) {
				t.Fatalf("JSON(%q) = %s, want %s", c.in, got, want)
			}
			if badEscape(got) || !utf8.Valid(got) {
				t.Fatalf("JSON(%q) = %s still refused by jsonb", c.in, got)
			}
		})
	}
	if !unusual([]byte(`{"n":2E3}`), 16) || unusual([]byte(`{"t":true,"f":false}`), 16) {
		t.Fatal("unusual: exponent or literal misread")
	}
	big := []byte(`{"a":"` + strings.Repeat("y", 10000) + `"}`)
	got, changed := JSON(big, 0, 1000)
	if !changed || len(got) > 1000 || !strings.Contains(string(got), `"truncated":true`) {
		t.Fatalf("JSON(10 KB, max 1000) = %d bytes %.80s, %v", len(got), got, changed)
	}
}
