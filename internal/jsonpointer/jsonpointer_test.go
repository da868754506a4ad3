package jsonpointer

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in     string
		tokens []string
		bad    bool
	}{
		{in: "", tokens: nil},
		{in: "/", tokens: []string{""}},
		{in: "/a/b", tokens: []string{"a", "b"}},
		{in: "/a~1b/m~0n", tokens: []string{"a/b", "m~n"}},
		{in: "/~01", tokens: []string{"~1"}}, // RFC 6901 §4: not "/"
		{in: "//", tokens: []string{"", ""}},
		{in: "/ü/ 0", tokens: []string{"ü", " 0"}},
		{in: "a", bad: true},
		{in: "/a~", bad: true},
		{in: "/a~2", bad: true},
		{in: "/\xff", bad: true},
	} {
		got, err := Parse(tc.in)
		if tc.bad {
			var se *SyntaxError
			if !errors.Is(err, ErrSyntax) || !errors.As(err, &se) || se.Pointer != tc.in {
				t.Errorf("Parse(%q) = %q, %v; want a *SyntaxError", tc.in, got, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.tokens) {
			t.Errorf("Parse(%q) = %q, %v; want %q", tc.in, got, err, tc.tokens)
		}
	}
}

func TestArrayIndex(t *testing.T) {
	for _, tc := range []struct {
		in string
		i  int
		ok bool
	}{
		{"0", 0, true}, {"7", 7, true}, {"10", 10, true}, {"999999999", 999999999, true},
		{"", 0, false}, {"01", 0, false}, {"+1", 0, false}, {"-1", 0, false}, {"-0", 0, false},
		{"1e2", 0, false}, {" 1", 0, false}, {"1000000000", 0, false}, {"-", 0, false},
	} {
		if i, ok := ArrayIndex(tc.in); i != tc.i || ok != tc.ok {
			t.Errorf("ArrayIndex(%q) = %d, %v; want %d, %v", tc.in, i, ok, tc.i, tc.ok)
		}
	}
}

func TestGet(t *testing.T) {
	var doc any
	if err := json.Unmarshal([]byte(`{"a":{"b":[10,{"c":"x"}]},"a/b":1,"m~n":2,"":3}`), &doc); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ptr  string
		want any
		ok   bool
	}{
		{"/a/b/0", 10.0, true},
		{"/a/b/1/c", "x", true},
		{"/a~1b", 1.0, true},
		{"/m~0n", 2.0, true},
		{"/", 3.0, true},
		{"/a/b/2", nil, false},
		{"/a/b/+1", nil, false}, // strconv.Atoi would take it as 1
		{"/a/b/01", nil, false},
		{"/a/b/-", nil, false},
		{"/a/x", nil, false},
		{"/a/b/0/c", nil, false},
	} {
		tokens, err := Parse(tc.ptr)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := Get(doc, tokens)
		if ok != tc.ok || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Get(%q) = %v, %v; want %v, %v", tc.ptr, got, ok, tc.want, tc.ok)
		}
	}
}

func TestValidateDoesNotAllocate(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { _ = Validate("/a/b~0c/0") }); n != 0 {
		t.Errorf("Validate allocated %v times for a valid pointer", n)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = Next("/a/b") }); n != 0 {
		t.Errorf("Next allocated %v times for a token without escapes", n)
	}
}
