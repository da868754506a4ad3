package fingerprint

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

// The vectors below were written for this repository from RFC 8785 §3.2
// (they cover what the RFC's own examples cover). Inputs are raw Go strings
// holding JSON escapes; expected outputs are interpreted Go strings, so
// "\u20ac" in an expected output is the UTF-8 encoding of U+20AC, and JSON
// escapes appear there as "\\u000f".
func TestCanonicalizeVectors(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		// §3.2.3: property sorting by UTF-16 code units, recursively.
		{
			name: "sort by UTF-16 code units, not code points",
			// U+1F600 is D83D DE00 in UTF-16, so it sorts before U+E000 and
			// U+FB33 although its code point is larger than both.
			in:   `{"\ufb33":"dalet","\ue000":"private","\ud83d\ude00":"grin","\u20ac":"euro"}`,
			want: "{\"\u20ac\":\"euro\",\"\U0001F600\":\"grin\",\"\ue000\":\"private\",\"\ufb33\":\"dalet\"}",
		},
		{
			name: "sort control, digits, markup, latin-1, euro",
			in:   `{"\u20ac":"Euro Sign","\r":"CR","\u000a":"LF","1":"One","\u0080":"C1","\u00f6":"o","</x>":"tag"}`,
			want: "{\"\\n\":\"LF\",\"\\r\":\"CR\",\"1\":\"One\",\"</x>\":\"tag\",\"\u0080\":\"C1\",\"\u00f6\":\"o\",\"\u20ac\":\"Euro Sign\"}",
		},
		{
			name: "sort is by code unit, not locale; prefixes first; case sensitive",
			in:   `{"sin":4,"p\u00eache":3,"p\u00e9ch\u00e9":2,"peach":1,"b":0,"aa":0,"a":0,"B":0,"":0}`,
			want: "{\"\":0,\"B\":0,\"a\":0,\"aa\":0,\"b\":0,\"peach\":1,\"p\u00e9ch\u00e9\":2,\"p\u00eache\":3,\"sin\":4}",
		},
		{
			name: "nested objects sorted, array order kept",
			in:   `{"10":{},"1":{"f":{"f":"hi","F":5},"\n":56.0},"":"empty","a":[{"e":"yes","E":"no"},3,1,2]}`,
			want: `{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"a":[{"E":"no","e":"yes"},3,1,2]}`,
		},
		// §3.2.2.2: strings.
		{
			name: "control characters as lowercase \\u00XX, short escapes, quote and backslash",
			in:   `"\u0000\u0001\u000B\u001F\u0008\u0009\u000A\u000C\u000D\b\t\n\f\r\"\\"`,
			want: `"\u0000\u0001\u000b\u001f\b\t\n\f\r\b\t\n\f\r\"\\"`,
		},
		{
			name: "solidus not escaped, escaped solidus unescaped",
			in:   `"a/b\/c"`,
			want: `"a/b/c"`,
		},
		{
			name: "non-ASCII written as UTF-8, never escaped",
			in:   `"\u00e9\u20ac\ud83d\ude00\u007f\u2028\u2029\uffff caf` + "\u00e9" + `"`,
			want: "\"\u00e9\u20ac\U0001F600\u007f\u2028\u2029\uffff caf\u00e9\"",
		},
		{
			name: "unicode is not normalized",
			in:   `{"Unnormalized":"A\u030a"}`,
			want: "{\"Unnormalized\":\"A\u030a\"}",
		},
		{
			name: "escaped and raw spellings of one string agree",
			in:   `["\u0041\u0042", "AB", "\u00E9", "` + "\u00e9" + `"]`,
			want: "[\"AB\",\"AB\",\"\u00e9\",\"\u00e9\"]",
		},
		// §3.2.2.3: numbers, ECMAScript Number.prototype.toString.
		{
			name: "integers and zeros",
			in:   `[0, -0, 0.0, -0.0, 0e10, 1, -1, 1.0, 4294967296, 9007199254740992]`,
			want: `[0,0,0,0,0,1,-1,1,4294967296,9007199254740992]`,
		},
		{
			name: "exponent forms",
			in:   `[1E+2, 1e2, 1e+0, 100e-2, 1E30, 1e21, 1e20, 999999999999999999999, 1.5e300, -1.5E+300]`,
			want: `[100,100,1,1,1e+30,1e+21,100000000000000000000,1e+21,1.5e+300,-1.5e+300]`,
		},
		{
			name: "small numbers switch to exponent below 1e-6",
			in:   `[0.000001, 1e-6, 0.0000001, 1e-7, -1e-7, 123e-9, 1.2345e-7, 0.00001, 2e-3, 0.000000000000000000000000001]`,
			want: `[0.000001,0.000001,1e-7,1e-7,-1e-7,1.23e-7,1.2345e-7,0.00001,0.002,1e-27]`,
		},
		{
			// Both 1.2345678901234568e+23 and ...569e+23 round-trip for the
			// third value; ECMAScript picks the one closer to the double
			// (123456789012345685803008).
			name: "fractions, shortest round-trip digits, closest when tied",
			in:   `[4.50, 0.1, 0.10000000000000001, 333333333.33333329, 123456789012345678901234, 9007199254740993]`,
			want: `[4.5,0.1,0.1,333333333.3333333,1.2345678901234569e+23,9007199254740992]`,
		},
		{
			name: "extremes of the double range",
			in:   `[5e-324, 4.9e-324, 1e-400, 2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157E308]`,
			want: `[5e-324,5e-324,0,2.2250738585072014e-308,1.7976931348623157e+308,-1.7976931348623157e+308]`,
		},
		// Literals, top-level scalars, whitespace.
		{name: "literals", in: "[ true ,\tfalse ,\nnull ]", want: `[true,false,null]`},
		{name: "top-level literal", in: " \r\n\ttrue \n", want: `true`},
		{name: "top-level number", in: " 1E3 ", want: `1000`},
		{name: "top-level string", in: `"x"`, want: `"x"`},
		{name: "empty containers", in: "{ \"a\" : [ ] , \"b\" : { } }", want: `{"a":[],"b":{}}`},
		{
			name: "insignificant whitespace removed everywhere",
			in:   "\n{\r\n  \"b\" :\t[ 1 , { \"d\" : 2 , \"c\" : 3 } ] ,\n  \"a\" : \"x y\"\n}\n",
			want: `{"a":"x y","b":[1,{"c":3,"d":2}]}`,
		},
		{
			name: "deep nesting at the limit",
			in:   strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth),
			want: strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Canonicalize([]byte(tc.in))
			if err != nil {
				t.Fatalf("Canonicalize(%q): %v", tc.in, err)
			}
			if string(got) != tc.want {
				t.Errorf("Canonicalize(%q)\n got %q\nwant %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestCanonicalizeRefuses(t *testing.T) {
	deep := strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1)
	var manyKeys strings.Builder
	manyKeys.WriteString("{")
	for i := 0; i < 40; i++ {
		manyKeys.WriteString(`"k` + strconv.Itoa(i) + `":0,`)
	}
	manyKeys.WriteString(`"k0":1}`)

	tests := []struct {
		name string
		in   string
		want error
	}{
		{"empty", ``, ErrInvalidJSON},
		{"whitespace only", " \n\t", ErrInvalidJSON},
		{"unclosed object", `{`, ErrInvalidJSON},
		{"unclosed array", `[1,`, ErrInvalidJSON},
		{"unclosed string", `"abc`, ErrInvalidJSON},
		{"stray close", `]`, ErrInvalidJSON},
		{"trailing comma in array", `[1,]`, ErrInvalidJSON},
		{"trailing comma in object", `{"a":1,}`, ErrInvalidJSON},
		{"missing comma", `[1 2]`, ErrInvalidJSON},
		{"missing colon", `{"a" 1}`, ErrInvalidJSON},
		{"unquoted key", `{a:1}`, ErrInvalidJSON},
		{"single quotes", `'a'`, ErrInvalidJSON},
		{"two top-level values", `1 2`, ErrInvalidJSON},
		{"two top-level objects", `{} {}`, ErrInvalidJSON},
		{"garbage after value", `{"a":1}x`, ErrInvalidJSON},
		{"leading zero", `01`, ErrInvalidJSON},
		{"bare fraction", `.5`, ErrInvalidJSON},
		{"trailing point", `1.`, ErrInvalidJSON},
		{"plus sign", `+1`, ErrInvalidJSON},
		{"hex number", `0x10`, ErrInvalidJSON},
		{"NaN", `NaN`, ErrInvalidJSON},
		{"Infinity", `[Infinity]`, ErrInvalidJSON},
		{"negative Infinity", `-Infinity`, ErrInvalidJSON},
		{"truncated literal", `tru`, ErrInvalidJSON},
		{"capitalized literal", `True`, ErrInvalidJSON},
		{"raw tab in string", "\"a\tb\"", ErrInvalidJSON},
		{"raw newline in string", "\"a\nb\"", ErrInvalidJSON},
		{"unknown escape", `"\x41"`, ErrInvalidJSON},
		{"short unicode escape", `"\u12"`, ErrInvalidJSON},
		{"byte order mark", "\ufeff{}", ErrInvalidJSON},
		{"comment", `[1 /* c */]`, ErrInvalidJSON},

		{"invalid byte", "\"\xff\"", ErrInvalidUTF8},
		{"invalid byte outside string", "[1]\xff", ErrInvalidUTF8},
		{"overlong encoding", "\"\xc0\xaf\"", ErrInvalidUTF8},
		{"truncated sequence", "\"\xe2\x82\"", ErrInvalidUTF8},
		{"UTF-8 encoded surrogate", "\"\xed\xa0\x80\"", ErrInvalidUTF8},
		{"lone high surrogate", `"\ud800"`, ErrInvalidUTF8},
		{"lone high surrogate then text", `"\uD83Dx"`, ErrInvalidUTF8},
		{"lone low surrogate", `"\udc00"`, ErrInvalidUTF8},
		{"high then non-surrogate escape", `"\ud800\u0041"`, ErrInvalidUTF8},
		{"two high surrogates", `"\ud800\ud800"`, ErrInvalidUTF8},
		{"reversed pair", `"\ude00\ud83d"`, ErrInvalidUTF8},
		{"lone surrogate in key", `{"\udfff":1}`, ErrInvalidUTF8},
		{"lone surrogate after escaped backslash", `["\\", "\\\udc00"]`, ErrInvalidUTF8},

		{"duplicate key", `{"a":1,"a":2}`, ErrDuplicateKey},
		{"duplicate key with equal values", `{"a":1,"a":1}`, ErrDuplicateKey},
		{"duplicate key nested", `[{"x":{"y":1,"z":2,"y":3}}]`, ErrDuplicateKey},
		{"duplicate key spelled with an escape", `{"a":1,"\u0061":2}`, ErrDuplicateKey},
		{"duplicate key in a large object", manyKeys.String(), ErrDuplicateKey},

		{"number above double range", `1e400`, ErrNumberRange},
		{"negative number above double range", `[-1e309]`, ErrNumberRange},
		{"just past the largest double", `1.8e308`, ErrNumberRange},

		{"nesting past the limit", deep, ErrTooDeep},
	}
	sentinels := []error{ErrInvalidJSON, ErrInvalidUTF8, ErrDuplicateKey, ErrNumberRange, ErrNumberPrecision, ErrTooDeep}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Canonicalize([]byte(tc.in))
			if !errors.Is(err, tc.want) {
				t.Fatalf("Canonicalize(%.40q) = %q, %v; want %v", tc.in, got, err, tc.want)
			}
			for _, s := range sentinels {
				if s != tc.want && errors.Is(err, s) {
					t.Errorf("error %v also matches %v", err, s)
				}
			}
			if strings.ContainsAny(err.Error(), "\n\r") {
				t.Errorf("error message spans lines: %q", err)
			}
		})
	}
}

func TestCanonicalizeErrorContext(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{`{"a":[{"b":1,"b":2}]}`, `"b" appears twice at "/a/0"`},
		{`{"x~y":{"p/q":"\ud800"}}`, `at "/x~0y/p~1q"`},
		{`{"n":[1,1e999]}`, `"1e999" at "/n/1"`},
		{`[1,2]]`, `at byte offset 5`},
		{`{"a":1} 2`, `after the top-level value at byte offset 8`},
	}
	for _, tc := range tests {
		_, err := Canonicalize([]byte(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Canonicalize(%q) error = %v; want it to contain %q", tc.in, err, tc.want)
		}
	}
}

func TestCanonicalizeLongKeyInErrorIsTruncated(t *testing.T) {
	key := strings.Repeat("k", 10000)
	_, err := Canonicalize([]byte(`{"` + key + `":1,"` + key + `":2}`))
	if !errors.Is(err, ErrDuplicateKey) {
		t.Fatalf("err = %v, want ErrDuplicateKey", err)
	}
	if len(err.Error()) > 300 {
		t.Errorf("error message is %d bytes long; caller text should be truncated", len(err.Error()))
	}
}
