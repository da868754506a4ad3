package fingerprint

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"unicode/utf8"

	"github.com/gowebpki/jcs"
)

var fuzzSeeds = []string{
	`{"\ufb33":"dalet","\ue000":"private","\ud83d\ude00":"grin","\u20ac":"euro","\r":1,"":[]}`,
	`{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001,-0,1e21,1e-7]}`,
	`"\u0000\u001F\b\t\n\f\r\"\\\/\u00e9\ud83d\ude00"`,
	`[true,false,null,{"a":{"b":[{}]}}]`,
	" \n{ \"b\" : [ 1 , 2 ] , \"a\" : { } }\t",
	`9007199254740993`,
	`0.10000000000000001`,
	`1e400`,
	`1e-400`,
	`{"a":1,"a":2}`,
	`{"a":1,"\u0061":2}`,
	`"\ud800"`,
	`"\udc00\ud800"`,
	"\"\xff\"",
	"\"\xed\xa0\x80\"",
	`[1,]`,
	`{} {}`,
	`[[[[[[[[[[]]]]]]]]]]`,
}

var allSentinels = []error{
	ErrInvalidJSON, ErrInvalidUTF8, ErrDuplicateKey, ErrNumberRange, ErrNumberPrecision,
	ErrTooLarge, ErrTooDeep, ErrInvalidPointer, ErrInvalidMethod, ErrInvalidTarget,
	ErrSecretNotFound, ErrSecretKeyRequired, ErrInvalidSecretKey,
}

func isSentinel(err error) bool {
	for _, s := range allSentinels {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// FuzzCanonicalize checks, for any input, that Canonicalize and Compute never
// panic and only fail with this package's errors, and that an accepted input
// gives valid JSON that canonicalizes to itself and denotes the same value.
// It also compares acceptance with jcs.Transform and encoding/json.Valid.
func FuzzCanonicalize(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, err := Canonicalize(data)
		jcsOut, jcsErr := jcs.Transform(data)
		if err != nil {
			if !isSentinel(err) {
				t.Fatalf("Canonicalize(%q): untyped error %v", data, err)
			}
			if jcsErr == nil {
				t.Fatalf("Canonicalize(%q) refused (%v) but jcs accepted it as %q", data, err, jcsOut)
			}
			if errors.Is(err, ErrInvalidJSON) && json.Valid(data) {
				t.Fatalf("Canonicalize(%q) = %v but encoding/json finds it valid", data, err)
			}
			if _, cerr := Compute("POST", "/fuzz", data, WithMaxBytes(0)); cerr == nil {
				t.Fatalf("Compute accepted %q, which Canonicalize refused (%v)", data, err)
			}
			return
		}

		if !json.Valid(data) {
			t.Fatalf("Canonicalize accepted %q, which encoding/json finds invalid", data)
		}
		if jcsErr != nil || !bytes.Equal(out, jcsOut) {
			t.Fatalf("Canonicalize(%q) = %q, jcs = %q, %v", data, out, jcsOut, jcsErr)
		}
		if !json.Valid(out) || !utf8.Valid(out) {
			t.Fatalf("Canonicalize(%q) = %q: not valid JSON", data, out)
		}
		again, err := Canonicalize(out)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("not idempotent: %q -> %q -> %q, %v", data, out, again, err)
		}
		if diff := sameJSON(data, out); diff != "" {
			t.Fatalf("Canonicalize(%q) = %q changes the value: %s", data, out, diff)
		}

		res, err := Compute("post", "/fuzz", data, WithMaxBytes(0))
		if err != nil {
			if !errors.Is(err, ErrNumberPrecision) {
				t.Fatalf("Compute(%q) refused input Canonicalize accepted: %v", data, err)
			}
			return
		}
		if !fingerprintPattern.MatchString(res.Fingerprint) {
			t.Fatalf("Compute(%q): fingerprint %q", data, res.Fingerprint)
		}
		if c, err := Canonicalize(res.Intent); err != nil || !bytes.Equal(c, res.Intent) {
			t.Fatalf("Compute(%q): Intent %q is not canonical (%v)", data, res.Intent, err)
		}
		// The canonical form of an accepted payload is the same intent.
		res2, err := Compute("POST", "/fuzz", out, WithMaxBytes(0))
		if err != nil || res2.Fingerprint != res.Fingerprint {
			t.Fatalf("Compute(%q) and Compute(%q) differ: %s vs %s, %v", data, out, res.Fingerprint, res2.Fingerprint, err)
		}
	})
}

// sameJSON reports how two accepted JSON texts differ in value, or "" if they
// denote the same value (numbers compared as doubles, member order ignored).
func sameJSON(a, b []byte) string {
	na, err := parse(a, false)
	if err != nil {
		return "first does not parse: " + err.Error()
	}
	nb, err := parse(b, false)
	if err != nil {
		return "second does not parse: " + err.Error()
	}
	return sameNode(na, nb, "")
}

func sameNode(a, b *node, at string) string {
	if a.kind != b.kind {
		return "different types at " + strconv.Quote(at)
	}
	switch a.kind {
	case kindNumber:
		fa, _ := strconv.ParseFloat(a.text, 64)
		fb, _ := strconv.ParseFloat(b.text, 64)
		if fa != fb {
			return "different numbers at " + strconv.Quote(at)
		}
	case kindString, kindBool:
		if a.text != b.text {
			return "different values at " + strconv.Quote(at)
		}
	case kindArray:
		if len(a.elems) != len(b.elems) {
			return "different lengths at " + strconv.Quote(at)
		}
		for i := range a.elems {
			if d := sameNode(a.elems[i], b.elems[i], at+"/"+strconv.Itoa(i)); d != "" {
				return d
			}
		}
	case kindObject:
		if len(a.members) != len(b.members) {
			return "different member counts at " + strconv.Quote(at)
		}
		for _, ma := range a.members {
			var vb *node
			for _, mb := range b.members {
				if mb.name == ma.name {
					vb = mb.value
					break
				}
			}
			if vb == nil {
				return "member " + strconv.Quote(ma.name) + " missing at " + strconv.Quote(at)
			}
			if d := sameNode(ma.value, vb, at+"/"+ma.name); d != "" {
				return d
			}
		}
	}
	return ""
}
