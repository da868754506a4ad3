package fingerprint

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"regexp"
	"strings"
	"testing"
)

var fingerprintPattern = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

func mustCompute(t *testing.T, method, target, payload string, opts ...Option) Result {
	t.Helper()
	res, err := Compute(method, target, []byte(payload), opts...)
	if err != nil {
		t.Fatalf("Compute(%q, %q, %q): %v", method, target, payload, err)
	}
	if !fingerprintPattern.MatchString(res.Fingerprint) {
		t.Fatalf("fingerprint %q does not match %s", res.Fingerprint, fingerprintPattern)
	}
	return res
}

// TestComputeGolden pins the fingerprint definition: SHA-256 over the RFC 8785
// form of {"method","payload","target"}, written out by hand here.
func TestComputeGolden(t *testing.T) {
	const canonical = `{"method":"POST","payload":{"amount":100,"currency":"EUR"},"target":"/v1/refunds"}`
	const want = "sha256:62098b4fbd6294bed51bfcc0100322fa21d6607c17437b6851f50e70e58d48ac"
	sum := sha256.Sum256([]byte(canonical))
	if got := Prefix + hex.EncodeToString(sum[:]); got != want {
		t.Fatalf("golden constant is stale: %s", got)
	}

	res := mustCompute(t, "post", "/v1/refunds", "{\n  \"currency\": \"EUR\",\n  \"amount\": 1.00e2\n}\n")
	if res.Fingerprint != want {
		t.Errorf("Fingerprint = %s, want %s", res.Fingerprint, want)
	}
	if string(res.Intent) != canonical {
		t.Errorf("Intent = %s, want %s", res.Intent, canonical)
	}
}

func TestComputeStability(t *testing.T) {
	base := mustCompute(t, "POST", "/v1/articles",
		`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`)

	same := []struct {
		name    string
		method  string
		payload string
	}{
		{"keys reordered at every level", "POST",
			`{"n":100,"price":19.99,"meta":{"draft":false,"lang":"en"},"tags":["a","b"],"title":"Hello"}`},
		{"whitespace differs", "POST",
			"{ \"title\" : \"Hello\" ,\n\t\"tags\" : [ \"a\" , \"b\" ] , \"meta\" : { \"lang\" : \"en\" , \"draft\" : false } ,\r\n \"price\" : 19.99 , \"n\" : 100 }"},
		{"number spelled differently, same value", "POST",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":1999e-2,"n":1E2}`},
		{"string escaped differently", "POST",
			`{"title":"H\u0065llo","tags":["\u0061","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100.0}`},
		{"method lower case", "post",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`},
		{"method mixed case", "PoSt",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`},
	}
	for _, tc := range same {
		t.Run(tc.name, func(t *testing.T) {
			got := mustCompute(t, tc.method, "/v1/articles", tc.payload)
			if got.Fingerprint != base.Fingerprint {
				t.Errorf("Fingerprint = %s, want %s", got.Fingerprint, base.Fingerprint)
			}
			if string(got.Intent) != string(base.Intent) {
				t.Errorf("Intent = %s, want %s", got.Intent, base.Intent)
			}
		})
	}

	different := []struct {
		name, method, target, payload string
	}{
		{"other method", "PUT", "/v1/articles",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`},
		{"other target", "POST", "/v1/articles/",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`},
		{"array order", "POST", "/v1/articles",
			`{"title":"Hello","tags":["b","a"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100}`},
		{"number as string", "POST", "/v1/articles",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":"19.99","n":100}`},
		{"extra field", "POST", "/v1/articles",
			`{"title":"Hello","tags":["a","b"],"meta":{"lang":"en","draft":false},"price":19.99,"n":100,"x":null}`},
	}
	for _, tc := range different {
		t.Run(tc.name, func(t *testing.T) {
			if got := mustCompute(t, tc.method, tc.target, tc.payload); got.Fingerprint == base.Fingerprint {
				t.Errorf("Fingerprint equals the base fingerprint; want a different one")
			}
		})
	}
}

func TestComputeMethodUppercased(t *testing.T) {
	res := mustCompute(t, "patch", "/x", `null`)
	if want := `{"method":"PATCH","payload":null,"target":"/x"}`; string(res.Intent) != want {
		t.Errorf("Intent = %s, want %s", res.Intent, want)
	}
}

func TestComputeDrop(t *testing.T) {
	tests := []struct {
		name     string
		payload  string
		drop     []string
		want     string // canonical payload after dropping
		sameAs   string // payload without the volatile fields
		sameDrop []string
	}{
		{
			name:    "top-level request id",
			payload: `{"request_id":"r-1","amount":5}`,
			drop:    []string{"/request_id"},
			want:    `{"amount":5}`,
			sameAs:  `{"amount":5}`,
		},
		{
			name:    "nested nonce",
			payload: `{"meta":{"nonce":"n-77","source":"agent"},"amount":5}`,
			drop:    []string{"/meta/nonce"},
			want:    `{"amount":5,"meta":{"source":"agent"}}`,
			sameAs:  `{"meta":{"source":"agent"},"amount":5}`,
		},
		{
			name:    "field of an array element",
			payload: `{"items":[{"ts":"2024-01-01T00:00:00Z","sku":"a"},{"ts":"x","sku":"b"}]}`,
			drop:    []string{"/items/0/ts"},
			want:    `{"items":[{"sku":"a"},{"sku":"b","ts":"x"}]}`,
		},
		{
			name:    "array elements, resolved against the original payload",
			payload: `{"items":["v0","v1","v2"]}`,
			drop:    []string{"/items/1", "/items/0"},
			want:    `{"items":["v2"]}`,
		},
		{
			name:    "escaped pointer tokens",
			payload: `{"a/b":1,"m~n":2,"keep":3}`,
			drop:    []string{"/a~1b", "/m~0n"},
			want:    `{"keep":3}`,
		},
		{
			name:    "pointers that resolve to nothing are ignored",
			payload: `{"a":[1,2],"b":"s"}`,
			drop:    []string{"/missing", "/a/2", "/a/-", "/a/01", "/a/x", "/b/0", "/a/0/deeper"},
			want:    `{"a":[1,2],"b":"s"}`,
		},
		{
			name:    "empty member name",
			payload: `{"":1,"a":2}`,
			drop:    []string{"/"},
			want:    `{"a":2}`,
		},
		{
			name:    "same pointer twice",
			payload: `{"a":1,"b":2}`,
			drop:    []string{"/a", "/a"},
			want:    `{"b":2}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res := mustCompute(t, "POST", "/t", tc.payload, WithDrop(tc.drop...))
			want := `{"method":"POST","payload":` + tc.want + `,"target":"/t"}`
			if string(res.Intent) != want {
				t.Errorf("Intent = %s, want %s", res.Intent, want)
			}
			plain := mustCompute(t, "POST", "/t", tc.want)
			if res.Fingerprint != plain.Fingerprint {
				t.Errorf("Fingerprint with drops = %s, want the fingerprint of %s (%s)", res.Fingerprint, tc.want, plain.Fingerprint)
			}
		})
	}

	// The same logical intent with different volatile values shares a
	// fingerprint.
	a := mustCompute(t, "POST", "/t", `{"request_id":"1","meta":{"nonce":"x"},"v":1}`, WithDrop("/request_id"), WithDrop("/meta/nonce"))
	b := mustCompute(t, "POST", "/t", `{"v":1,"meta":{"nonce":"y"},"request_id":"2"}`, WithDrop("/request_id", "/meta/nonce"))
	if a.Fingerprint != b.Fingerprint {
		t.Errorf("volatile fields changed the fingerprint: %s vs %s", a.Fingerprint, b.Fingerprint)
	}
}

func TestComputeMaxBytes(t *testing.T) {
	big := `"` + strings.Repeat("x", DefaultMaxBytes) + `"`
	if _, err := Compute("POST", "/t", []byte(big)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("default limit: err = %v, want ErrTooLarge", err)
	}
	if _, err := Compute("POST", "/t", []byte(big), WithMaxBytes(0)); err != nil {
		t.Errorf("no limit: %v", err)
	}
	if _, err := Compute("POST", "/t", []byte(big), WithMaxBytes(len(big))); err != nil {
		t.Errorf("payload exactly at the limit: %v", err)
	}
	if _, err := Compute("POST", "/t", []byte(`{"a":1}`), WithMaxBytes(6)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("small limit: err = %v, want ErrTooLarge", err)
	}
	if _, err := Compute("POST", "/t", []byte(`{"a":1}`), nil, WithMaxBytes(7)); err != nil {
		t.Errorf("nil option and payload at the limit: %v", err)
	}
}

func TestComputeRefuses(t *testing.T) {
	tests := []struct {
		name    string
		method  string
		target  string
		payload string
		opts    []Option
		want    error
		context string // substring the message must contain
	}{
		{"invalid JSON", "POST", "/t", `{"a":}`, nil, ErrInvalidJSON, "byte offset 5"},
		{"empty payload", "POST", "/t", ``, nil, ErrInvalidJSON, "empty"},
		{"trailing data", "POST", "/t", `{} []`, nil, ErrInvalidJSON, ""},
		{"invalid UTF-8", "POST", "/t", "{\"a\":\"\xfe\"}", nil, ErrInvalidUTF8, "byte offset 6"},
		{"lone surrogate", "POST", "/t", `{"a":["\udead"]}`, nil, ErrInvalidUTF8, `"/a/0"`},
		{"duplicate key", "POST", "/t", `{"a":{"b":1,"b":2}}`, nil, ErrDuplicateKey, `"b" appears twice at "/a"`},
		{"duplicate key inside a dropped field", "POST", "/t", `{"v":{"x":1,"x":2}}`, []Option{WithDrop("/v")}, ErrDuplicateKey, ""},
		{"precision: 2^53+1", "POST", "/t", `{"amount":9007199254740993}`, nil, ErrNumberPrecision, `"9007199254740993" at "/amount" would be canonicalized as 9007199254740992`},
		{"precision: 0.10000000000000001", "POST", "/t", `[0.10000000000000001]`, nil, ErrNumberPrecision, `as 0.1,`},
		{"precision: underflow", "POST", "/t", `1e-400`, nil, ErrNumberPrecision, "at the top level"},
		{"range", "POST", "/t", `{"x":[1e400]}`, nil, ErrNumberRange, `"/x/0"`},
		{"too deep", "POST", "/t", strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), nil, ErrTooDeep, ""},
		{"too large", "POST", "/t", `[1,2,3]`, []Option{WithMaxBytes(3)}, ErrTooLarge, "7 bytes, the limit is 3"},
		{"pointer without slash", "POST", "/t", `{}`, []Option{WithDrop("a")}, ErrInvalidPointer, `"a"`},
		{"pointer with bad escape", "POST", "/t", `{}`, []Option{WithDrop("/a~2")}, ErrInvalidPointer, ""},
		{"pointer with trailing tilde", "POST", "/t", `{}`, []Option{WithSecret("/a~")}, ErrInvalidPointer, ""},
		{"pointer not UTF-8", "POST", "/t", `{}`, []Option{WithSecret("/\xff")}, ErrInvalidPointer, ""},
		{"drop the whole payload", "POST", "/t", `{}`, []Option{WithDrop("")}, ErrInvalidPointer, ""},
		{"empty method", "", "/t", `{}`, nil, ErrInvalidMethod, ""},
		{"method with space", "GE T", "/t", `{}`, nil, ErrInvalidMethod, ""},
		{"method with newline", "GET\n", "/t", `{}`, nil, ErrInvalidMethod, `"GET\n"`},
		{"non-ASCII method", "p\u00f6st", "/t", `{}`, nil, ErrInvalidMethod, ""},
		{"empty target", "POST", "", `{}`, nil, ErrInvalidTarget, ""},
		{"target not UTF-8", "POST", "/\xff", `{}`, nil, ErrInvalidTarget, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := Compute(tc.method, tc.target, []byte(tc.payload), tc.opts...)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if res.Fingerprint != "" || res.Intent != nil {
				t.Errorf("result %+v returned with an error", res)
			}
			if !strings.Contains(err.Error(), tc.context) {
				t.Errorf("error %q does not contain %q", err, tc.context)
			}
			if strings.ContainsAny(err.Error(), "\n\r") {
				t.Errorf("error message spans lines: %q", err)
			}
		})
	}
}

func TestComputeAcceptsExactNumbers(t *testing.T) {
	res := mustCompute(t, "POST", "/t", `[1.0, 1e2, 100, -0, 0.1, 19.99, 1e21, 1e-7, 9007199254740992, 5e-324]`)
	want := `{"method":"POST","payload":[1,100,100,0,0.1,19.99,1e+21,1e-7,9007199254740992,5e-324],"target":"/t"}`
	if string(res.Intent) != want {
		t.Errorf("Intent = %s, want %s", res.Intent, want)
	}
}

func TestComputeKeepsStringsExact(t *testing.T) {
	// Strings are written back through the canonicalizer; every escape
	// class must survive the round trip.
	res := mustCompute(t, "POST", "/t\u00e9/\"q\"", `{"s":"\u0000\u001f\"\\/\b\f\n\r\t\u007f\u00e9\ud83d\ude00"}`)
	want := "{\"method\":\"POST\",\"payload\":{\"s\":\"\\u0000\\u001f\\\"\\\\/\\b\\f\\n\\r\\t\u007f\u00e9\U0001F600\"},\"target\":\"/t\u00e9/\\\"q\\\"\"}"
	if string(res.Intent) != want {
		t.Errorf("Intent = %q\nwant       %q", res.Intent, want)
	}
}

func TestParsePointer(t *testing.T) {
	tests := []struct {
		in   string
		want []string
		err  bool
	}{
		{"", nil, false},
		{"/", []string{""}, false},
		{"/a", []string{"a"}, false},
		{"/a/b/0", []string{"a", "b", "0"}, false},
		{"/a~1b", []string{"a/b"}, false},
		{"/m~0n", []string{"m~n"}, false},
		{"/~01", []string{"~1"}, false},
		{"/~10", []string{"/0"}, false},
		{"//", []string{"", ""}, false},
		{"/ ", []string{" "}, false},
		{"a", nil, true},
		{"#/a", nil, true},
		{"/~", nil, true},
		{"/~2", nil, true},
		{"/a~", nil, true},
	}
	for _, tc := range tests {
		got, err := parsePointer(tc.in)
		if tc.err {
			if !errors.Is(err, ErrInvalidPointer) {
				t.Errorf("parsePointer(%q) err = %v, want ErrInvalidPointer", tc.in, err)
			}
			continue
		}
		if err != nil || strings.Join(got, "\x00") != strings.Join(tc.want, "\x00") || len(got) != len(tc.want) {
			t.Errorf("parsePointer(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
		if formatPointer(got) != tc.in {
			t.Errorf("formatPointer(parsePointer(%q)) = %q", tc.in, formatPointer(got))
		}
	}
}
