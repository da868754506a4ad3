package fingerprint

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/gowebpki/jcs"

	"github.com/receiptledger/reconciler/internal/jsonpointer"
)

// refKeyID and refKey are the secret key of the reference tests.
const refKeyID = "ref-1"

var refKey = []byte("0123456789abcdef0123456789abcdef")

// refCompute is Compute as this package computed it before it wrote the
// canonical form itself: the encoding/json based parser (refParse), a compact
// serialization in input order, and jcs.Transform; each secret value is
// replaced by the HMAC (under refKey) of its own jcs.Transform form.
// method must be valid.
func refCompute(method, target string, payload []byte, drops, secrets []string) (Result, error) {
	root, err := refParse(payload, true)
	if err != nil {
		return Result{}, err
	}
	for _, ptr := range drops {
		tokens, err := parsePointer(ptr)
		if err != nil {
			return Result{}, err
		}
		if n := refResolve(root, tokens); n != nil {
			n.drop = true
		}
	}
	for _, ptr := range secrets {
		tokens, err := parsePointer(ptr)
		if err != nil {
			return Result{}, err
		}
		n := refResolve(root, tokens)
		if n == nil {
			return Result{}, ErrSecretNotFound
		}
		if !n.drop {
			n.secret = true
		}
	}
	full, err := refCanonicalIntent(strings.ToUpper(method), target, root, true)
	if err != nil {
		return Result{}, err
	}
	sum := sha256.Sum256(full)
	return Result{Fingerprint: Prefix + hex.EncodeToString(sum[:]), Intent: full}, nil
}

// refKeyed is the keyed string of a secret value: HMAC-SHA256 under refKey
// of the value's RFC 8785 form, computed by jcs.Transform.
func refKeyed(n *node) string {
	var buf bytes.Buffer
	refWriteNode(&buf, n, false)
	canon, err := jcs.Transform(buf.Bytes())
	if err != nil {
		panic(err)
	}
	mac := hmac.New(sha256.New, refKey)
	mac.Write(canon)
	return KeyedPrefix + refKeyID + ":" + hex.EncodeToString(mac.Sum(nil))
}

// refResolve is the resolver that went with refCompute.
func refResolve(root *node, tokens []string) *node {
	n := root
	for _, tok := range tokens {
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

func refCanonicalIntent(method, target string, payload *node, redact bool) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteString(`{"method":`)
	refWriteString(&buf, method)
	buf.WriteString(`,"target":`)
	refWriteString(&buf, target)
	buf.WriteString(`,"payload":`)
	refWriteNode(&buf, payload, redact)
	buf.WriteByte('}')
	return jcs.Transform(buf.Bytes())
}

func refWriteNode(buf *bytes.Buffer, n *node, redact bool) {
	if redact && n.secret {
		refWriteString(buf, refKeyed(n))
		return
	}
	switch n.kind {
	case kindNull:
		buf.WriteString("null")
	case kindBool, kindNumber:
		buf.WriteString(n.text)
	case kindString:
		refWriteString(buf, n.text)
	case kindArray:
		buf.WriteByte('[')
		first := true
		for _, e := range n.elems {
			if e.drop {
				continue
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			refWriteNode(buf, e, redact)
		}
		buf.WriteByte(']')
	case kindObject:
		buf.WriteByte('{')
		first := true
		for _, m := range n.members {
			if m.value.drop {
				continue
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			refWriteString(buf, m.name)
			buf.WriteByte(':')
			refWriteNode(buf, m.value, redact)
		}
		buf.WriteByte('}')
	}
}

func refWriteString(buf *bytes.Buffer, s string) {
	buf.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			buf.WriteByte('\\')
			buf.WriteByte(c)
		case c < 0x20:
			buf.WriteString(`\u00`)
			buf.WriteByte("0123456789abcdef"[c>>4])
			buf.WriteByte("0123456789abcdef"[c&0xF])
		default:
			buf.WriteByte(c)
		}
	}
	buf.WriteByte('"')
}

// sentinelOf returns the sentinel err wraps, or nil.
func sentinelOf(err error) error {
	for _, s := range allSentinels {
		if errors.Is(err, s) {
			return s
		}
	}
	return nil
}

// sameTree reports how two trees differ, or "": kinds, texts (number text
// exactly as received), element order and member order.
func sameTree(a, b *node, at string) string {
	if a.kind != b.kind || a.text != b.text || len(a.elems) != len(b.elems) || len(a.members) != len(b.members) {
		return "different values at " + strconv.Quote(at)
	}
	for i := range a.elems {
		if d := sameTree(a.elems[i], b.elems[i], at+"/"+strconv.Itoa(i)); d != "" {
			return d
		}
	}
	for i := range a.members {
		if a.members[i].name != b.members[i].name {
			return "different member names at " + strconv.Quote(at)
		}
		if d := sameTree(a.members[i].value, b.members[i].value, at+"/"+a.members[i].name); d != "" {
			return d
		}
	}
	return ""
}

// checkAgainstReference compares the scanner with the encoding/json based
// parser on data, in both modes, and Canonicalize with jcs.Transform.
func checkAgainstReference(t *testing.T, data []byte) {
	t.Helper()
	for _, strict := range []bool{false, true} {
		got, err := parse(data, strict)
		want, refErr := refParse(data, strict)
		switch {
		case (err == nil) != (refErr == nil):
			t.Fatalf("parse(%q, strict=%v) = %v; the encoding/json parser says %v", data, strict, err, refErr)
		case err != nil:
			if sentinelOf(err) != sentinelOf(refErr) {
				t.Fatalf("parse(%q, strict=%v) = %v; the encoding/json parser says %v", data, strict, err, refErr)
			}
			if !errors.Is(err, ErrInvalidJSON) && err.Error() != refErr.Error() {
				t.Fatalf("parse(%q, strict=%v) = %q; the encoding/json parser says %q", data, strict, err, refErr)
			}
			if strings.ContainsAny(err.Error(), "\r\n") {
				t.Fatalf("parse(%q): error message spans lines: %q", data, err)
			}
		default:
			if d := sameTree(got, want, ""); d != "" {
				t.Fatalf("parse(%q, strict=%v): trees differ: %s", data, strict, d)
			}
		}
	}
	out, err := Canonicalize(data)
	jcsOut, jcsErr := jcs.Transform(data)
	if err == nil && (jcsErr != nil || !bytes.Equal(out, jcsOut)) {
		t.Fatalf("Canonicalize(%q) = %q, jcs = %q, %v", data, out, jcsOut, jcsErr)
	}
}

// pointersOf lists the JSON pointers of the values of the tree, root first,
// up to limit.
func pointersOf(n *node, prefix string, limit int, out []string) []string {
	if len(out) >= limit {
		return out
	}
	out = append(out, prefix)
	for i, e := range n.elems {
		out = pointersOf(e, prefix+"/"+strconv.Itoa(i), limit, out)
	}
	for _, m := range n.members {
		out = pointersOf(m.value, prefix+"/"+formatPointer([]string{m.name})[1:], limit, out)
	}
	return out
}

// checkComputeAgainstReference compares Compute with refCompute on data,
// with drops and secrets chosen among the pointers of data by sel.
func checkComputeAgainstReference(t *testing.T, data []byte, sel uint8) {
	t.Helper()
	var drops, secrets []string
	if root, err := refParse(data, false); err == nil {
		for i, ptr := range pointersOf(root, "", 64, nil) {
			switch (i + int(sel)) % 5 {
			case 0:
				if ptr != "" {
					drops = append(drops, ptr)
				}
			case 1:
				secrets = append(secrets, ptr)
			case 2:
				if ptr != "" {
					drops = append(drops, ptr)
					secrets = append(secrets, ptr)
				}
			}
		}
		drops = append(drops, "/missing", "/0/x")
	}
	if sel&0x80 != 0 {
		secrets = append(secrets, "")
	}
	got, err := Compute("post", "/ref", data, WithDrop(drops...), WithSecret(secrets...), WithMaxBytes(0), WithSecretKey(refKeyID, refKey))
	want, refErr := refCompute("post", "/ref", data, drops, secrets)
	switch {
	case (err == nil) != (refErr == nil) || sentinelOf(err) != sentinelOf(refErr):
		t.Fatalf("Compute(%q) = %v; the reference says %v", data, err, refErr)
	case err == nil && (got.Fingerprint != want.Fingerprint || !bytes.Equal(got.Intent, want.Intent)):
		t.Fatalf("Compute(%q, drop %q, secret %q)\n got %s %s\nwant %s %s", data, drops, secrets,
			got.Fingerprint, got.Intent, want.Fingerprint, want.Intent)
	}
}

// referenceCorpus holds texts the tests and the fuzz target start from.
func referenceCorpus() []string {
	corpus := append([]string{
		benchPayload,
		`{"a":[1,2,{"b":null,"c":"x\u0000y"}],"d":{"e":true,"f":false},"g":-0.0,"h":1e-7,"i":"` + "\u00e9\U0001F600" + `"}`,
		`{"z":1,"y":[{"\ud83d\ude00":1,"\ue000":2,"\u20ac":3}],"x":{"b":1,"a":2,"":3},"a/b":{"m~n":[0]}}`,
		`[1.0, 1e2, 100, -0, 0.1, 19.99, 1e21, 1e-7, 9007199254740992, 5e-324, 123456789012345, -123456789012345, 1234567890123456]`,
		`{"s":"\u0000\u001f\"\\/\b\f\n\r\t\u007f\u00e9\ud83d\ude00","t":"\uD834\uDD1E","u":"a\ud800b","v":"\ud800\u0041"}`,
		`{"k0":0,"k1":1,"k2":2,"k3":3,"k4":4,"k5":5,"k6":6,"k7":7,"k8":8,"k9":9,"k10":10,"k11":11,"k12":12,"k13":13,"k14":14,"k15":15,"k16":16,"k1":17}`,
		`[[],{},[[]],{"a":{}},"",0,-1,true,false,null]`,
		"\t[ 1 ,\n2 ] ",
		`{"a":1 "b":2}`, `{"a" 1}`, `{"a":1,}`, `[1 2]`, `[1,,2]`, `{,}`, `{"a":}`, `["a\x"]`, `"\u12G4"`, `tRue`, `nul`, `-`, `-a`, `1.e3`, `1e+`, `.1`, `01`, `1.5.`, `"\`,
		"\"a\tb\"", "[1]\xff", "\"\xed\xa0\x80\"", "\ufeff{}", `[1] x`, `[1] [2]`, `{"a":1}}`,
		`[1e400`, `[1e400,`, `{"a":1,"a"`, `{"\ud800"`, `{"\ud800":`, `["\ud800`, `["\ud800\q"]`, `[0.10000000000000001`,
	}, fuzzSeeds...)
	return corpus
}

func TestScannerMatchesReference(t *testing.T) {
	for _, text := range referenceCorpus() {
		// Every prefix, which covers each way for input to end early, and
		// a few single-byte mutations.
		for i := 0; i <= len(text); i++ {
			checkAgainstReference(t, []byte(text[:i]))
		}
		rng := rand.New(rand.NewPCG(uint64(len(text)), 1))
		const alphabet = "{}[]:,\"\\ u0123456789.eE+-tfnaxd\x00\n\xff"
		for range 200 {
			if len(text) == 0 {
				break
			}
			b := []byte(text)
			b[rng.IntN(len(b))] = alphabet[rng.IntN(len(alphabet))]
			checkAgainstReference(t, b)
		}
	}
	deep := strings.Repeat(`{"a":[`, MaxDepth/2) + "1" + strings.Repeat(`]}`, MaxDepth/2)
	checkAgainstReference(t, []byte(deep))
	checkAgainstReference(t, []byte(`[`+deep+`]`))
}

func TestComputeMatchesReference(t *testing.T) {
	for _, text := range referenceCorpus() {
		for sel := range 10 {
			checkComputeAgainstReference(t, []byte(text), uint8(sel))
			checkComputeAgainstReference(t, []byte(text), uint8(sel)|0x80)
		}
	}
}

// FuzzScanner compares the scanner with the encoding/json based parser it
// replaced, and Compute with that parser plus jcs.Transform, including drops
// and secrets.
func FuzzScanner(f *testing.F) {
	for _, text := range referenceCorpus() {
		f.Add([]byte(text), uint8(0))
	}
	f.Fuzz(func(t *testing.T, data []byte, sel uint8) {
		checkAgainstReference(t, data)
		checkComputeAgainstReference(t, data, sel)
	})
}

func TestFormatNumberMatchesJCS(t *testing.T) {
	n := 0
	check := func(f float64) {
		got, err := formatNumber(f)
		want, jcsErr := jcs.NumberToJSON(f)
		if (err == nil) != (jcsErr == nil) || (err == nil && got != want) {
			t.Fatalf("formatNumber(%v) = %q, %v; jcs.NumberToJSON = %q, %v", f, got, err, want, jcsErr)
		}
	}
	es6Sequence(func(bits uint64) bool {
		check(math.Float64frombits(bits))
		n++
		return n < 200000
	})
	rng := rand.New(rand.NewPCG(3, 4))
	for range 200000 {
		check(math.Float64frombits(rng.Uint64()))
	}
	for _, f := range []float64{0, math.Copysign(0, -1), 1e21, 1e-6, 1e-7, 999999999999999900000, math.MaxFloat64, math.SmallestNonzeroFloat64, math.NaN(), math.Inf(1)} {
		check(f)
		check(-f)
	}
}

func TestPlainInt(t *testing.T) {
	for _, text := range []string{"0", "7", "-7", "10", "129900", "999999999999999", "-999999999999999", "100000000000000"} {
		f, ok := plainInt(text)
		if want, _ := strconv.ParseFloat(text, 64); !ok || f != want {
			t.Errorf("plainInt(%q) = %v, %v", text, f, ok)
		}
		if form, _ := formatNumber(f); form != text {
			t.Errorf("%q is not its own canonical form %q", text, form)
		}
	}
	for _, text := range []string{"", "-", "-0", "00", "01", "-01", "1.0", "1e2", "1000000000000000", "9007199254740993", "1a"} {
		if _, ok := plainInt(text); ok {
			t.Errorf("plainInt(%q) accepted", text)
		}
	}
}

func TestCompareUTF16(t *testing.T) {
	units := func(s string) []uint16 { return utf16.Encode([]rune(s)) }
	rng := rand.New(rand.NewPCG(5, 6))
	runes := []rune{0, 'a', 'b', 0x7f, 0x80, 0x7ff, 0x800, 0xd7ff, 0xe000, 0xefff, 0xf000, 0xfb33, 0xffff, 0x10000, 0x1f600, 0x10ffff}
	random := func() string {
		var b strings.Builder
		for range rng.IntN(4) {
			if rng.IntN(2) == 0 {
				b.WriteRune(runes[rng.IntN(len(runes))])
			} else {
				b.WriteRune(rune(rng.IntN(0x110000)))
			}
		}
		return b.String()
	}
	for range 200000 {
		a, b := random(), random()
		if !utf8.ValidString(a) || !utf8.ValidString(b) {
			continue // a surrogate code point became U+FFFD; still fine, but skip
		}
		if got, want := compareUTF16(a, b), slices.Compare(units(a), units(b)); got != want {
			t.Fatalf("compareUTF16(%q, %q) = %d, want %d", a, b, got, want)
		}
	}
}

// TestPooledParsersDoNotLeak runs Compute and Canonicalize concurrently on
// inputs of different shapes, failures included, and checks every result
// against a fresh computation: a recycled parser must not carry anything
// from one call into the next.
func TestPooledParsersDoNotLeak(t *testing.T) {
	inputs := referenceCorpus()
	type expected struct {
		canon    []byte
		canonErr error
		res      Result
		resErr   error
	}
	want := make([]expected, len(inputs))
	for i, in := range inputs {
		root, err := refParse([]byte(in), false)
		if err == nil {
			want[i].canon, _ = jcs.Transform([]byte(in))
		}
		want[i].canonErr = sentinelOf(err)
		want[i].res, err = refCompute("PUT", "/p", []byte(in), []string{"/a"}, []string{"/b"})
		want[i].resErr = sentinelOf(err)
		_ = root
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for range 2000 {
				i := rng.IntN(len(inputs))
				out, err := Canonicalize([]byte(inputs[i]))
				if sentinelOf(err) != want[i].canonErr || !bytes.Equal(out, want[i].canon) {
					t.Errorf("Canonicalize(%q) = %q, %v; want %q, %v", inputs[i], out, err, want[i].canon, want[i].canonErr)
					return
				}
				res, err := Compute("PUT", "/p", []byte(inputs[i]), WithDrop("/a"), WithSecret("/b"), WithMaxBytes(0), WithSecretKey(refKeyID, refKey))
				if sentinelOf(err) != want[i].resErr || res.Fingerprint != want[i].res.Fingerprint || !bytes.Equal(res.Intent, want[i].res.Intent) {
					t.Errorf("Compute(%q) = %v, %v; want %v, %v", inputs[i], res, err, want[i].res, want[i].resErr)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// parsePointer splits an RFC 6901 JSON pointer into its unescaped reference
// tokens, in the package's error form, as the reference path does. (Compute
// validates and resolves pointers without splitting them: validatePointer
// and resolvePointer.)
func parsePointer(s string) ([]string, error) {
	if err := validatePointer(s); err != nil {
		return nil, err
	}
	return jsonpointer.Parse(s)
}
