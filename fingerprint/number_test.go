package fingerprint

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash"
	"math"
	"strconv"
	"testing"
)

// es6Static are the leading values of the ES6 number test sequence of
// github.com/cyberphone/json-canonicalization (testdata/README.md, the
// "ES6 Numbers" section): edge cases around exponent switches, rounding
// boundaries, subnormals and the extremes of the double range.
var es6Static = []uint64{
	0x0000000000000000, 0x8000000000000000, 0x0000000000000001, 0x8000000000000001,
	0xc46696695dbd1cc3, 0xc43211ede4974a35, 0xc3fce97ca0f21056, 0xc3c7213080c1a6ac,
	0xc39280f39a348556, 0xc35d9b1f5d20d557, 0xc327af4c4a80aaac, 0xc2f2f2a36ecd5556,
	0xc2be51057e155558, 0xc28840d131aaaaac, 0xc253670dc1555557, 0xc21f0b4935555557,
	0xc1e8d5d42aaaaaac, 0xc1b3de4355555556, 0xc17fca0555555556, 0xc1496e6aaaaaaaab,
	0xc114585555555555, 0xc0e046aaaaaaaaab, 0xc0aa0aaaaaaaaaaa, 0xc074d55555555555,
	0xc040aaaaaaaaaaab, 0xc00aaaaaaaaaaaab, 0xbfd5555555555555, 0xbfa1111111111111,
	0xbf6b4e81b4e81b4f, 0xbf35d867c3ece2a5, 0xbf0179ec9cbd821e, 0xbecbf647612f3696,
	0xbe965e9f80f29212, 0xbe61e54c672874db, 0xbe2ca213d840baf8, 0xbdf6e80fe033c8c6,
	0xbdc2533fe68fd3d2, 0xbd8d51ffd74c861c, 0xbd5774ccac3d3817, 0xbd22c3d6f030f9ac,
	0xbcee0624b3818f79, 0xbcb804ea293472c7, 0xbc833721ba905bd3, 0xbc4ebe9c5db3c61e,
	0xbc18987d17c304e5, 0xbbe3ad30dfcf371d, 0xbbaf7b816618582f, 0xbb792f9ab81379bf,
	0xbb442615600f9499, 0xbb101e77800c76e1, 0xbad9ca58cce0be35, 0xbaa4a1e0a3e6fe90,
	0xba708180831f320d, 0xba3a68cd9e985016, 0x446696695dbd1cc3, 0x443211ede4974a35,
	0x43fce97ca0f21056, 0x43c7213080c1a6ac, 0x439280f39a348556, 0x435d9b1f5d20d557,
	0x4327af4c4a80aaac, 0x42f2f2a36ecd5556, 0x42be51057e155558, 0x428840d131aaaaac,
	0x4253670dc1555557, 0x421f0b4935555557, 0x41e8d5d42aaaaaac, 0x41b3de4355555556,
	0x417fca0555555556, 0x41496e6aaaaaaaab, 0x4114585555555555, 0x40e046aaaaaaaaab,
	0x40aa0aaaaaaaaaaa, 0x4074d55555555555, 0x4040aaaaaaaaaaab, 0x400aaaaaaaaaaaab,
	0x3fd5555555555555, 0x3fa1111111111111, 0x3f6b4e81b4e81b4f, 0x3f35d867c3ece2a5,
	0x3f0179ec9cbd821e, 0x3ecbf647612f3696, 0x3e965e9f80f29212, 0x3e61e54c672874db,
	0x3e2ca213d840baf8, 0x3df6e80fe033c8c6, 0x3dc2533fe68fd3d2, 0x3d8d51ffd74c861c,
	0x3d5774ccac3d3817, 0x3d22c3d6f030f9ac, 0x3cee0624b3818f79, 0x3cb804ea293472c7,
	0x3c833721ba905bd3, 0x3c4ebe9c5db3c61e, 0x3c18987d17c304e5, 0x3be3ad30dfcf371d,
	0x3baf7b816618582f, 0x3b792f9ab81379bf, 0x3b442615600f9499, 0x3b101e77800c76e1,
	0x3ad9ca58cce0be35, 0x3aa4a1e0a3e6fe90, 0x3a708180831f320d, 0x3a3a68cd9e985016,
	0x4024000000000000, 0x4014000000000000, 0x3fe0000000000000, 0x3fa999999999999a,
	0x3f747ae147ae147b, 0x3f40624dd2f1a9fc, 0x3f0a36e2eb1c432d, 0x3ed4f8b588e368f1,
	0x3ea0c6f7a0b5ed8d, 0x3e6ad7f29abcaf48, 0x3e35798ee2308c3a, 0x3ed539223589fa95,
	0x3ed4ff26cd5a7781, 0x3ed4f95a762283ff, 0x3ed4f8c60703520c, 0x3ed4f8b72f19cd0d,
	0x3ed4f8b5b31c0c8d, 0x3ed4f8b58d1c461a, 0x3ed4f8b5894f7f0e, 0x3ed4f8b588ee37f3,
	0x3ed4f8b588e47da4, 0x3ed4f8b588e3849c, 0x3ed4f8b588e36bb5, 0x3ed4f8b588e36937,
	0x3ed4f8b588e368f8, 0x3ed4f8b588e368f1, 0x3ff0000000000000, 0xbff0000000000000,
	0xbfeffffffffffffa, 0xbfeffffffffffffb, 0x3feffffffffffffa, 0x3feffffffffffffb,
	0x3feffffffffffffc, 0x3feffffffffffffe, 0xbfefffffffffffff, 0xbfefffffffffffff,
	0x3fefffffffffffff, 0x3fefffffffffffff, 0x3fd3333333333332, 0x3fd3333333333333,
	0x3fd3333333333334, 0x0010000000000000, 0x000ffffffffffffd, 0x000fffffffffffff,
	0x7fefffffffffffff, 0xffefffffffffffff, 0x4340000000000000, 0xc340000000000000,
	0x4430000000000000, 0x44b52d02c7e14af5, 0x44b52d02c7e14af6, 0x44b52d02c7e14af7,
	0x444b1ae4d6e2ef4e, 0x444b1ae4d6e2ef4f, 0x444b1ae4d6e2ef50, 0x3eb0c6f7a0b5ed8c,
	0x3eb0c6f7a0b5ed8d, 0x41b3de4355555553, 0x41b3de4355555554, 0x41b3de4355555555,
	0x41b3de4355555556, 0x41b3de4355555557, 0xbecbf647612f3696, 0x43143ff3c1cb0959,
}

// es6Sequence generates the ES6 number test sequence: the static values, then
// 2000 serial values starting at the smallest normal double, then values
// read as little-endian doubles from a chain of SHA-256 blocks (each block is
// the hash of the previous one, starting from 32 zero bytes), skipping zero
// and non-finite values. yield receives the IEEE 754 bits of each value and
// stops the sequence by returning false.
func es6Sequence(yield func(bits uint64) bool) {
	for _, u := range es6Static {
		if !yield(u) {
			return
		}
	}
	for i := uint64(0); i < 2000; i++ {
		if !yield(0x0010000000000000 + i) {
			return
		}
	}
	var block [sha256.Size]byte
	for {
		block = sha256.Sum256(block[:])
		for off := 0; off < len(block); off += 8 {
			u := binary.LittleEndian.Uint64(block[off:])
			f := math.Float64frombits(u)
			if f == 0 || math.IsInf(f, 0) || math.IsNaN(f) {
				continue
			}
			if !yield(u) {
				return
			}
		}
	}
}

// TestES6NumberSequence checks the number formatting of the canonicalizer
// against the published SHA-256 of the first lines of es6testfile100m.txt,
// whose lines are "<bits as lowercase hex without leading zeros>,<ES6 form>\n".
// Each value is also pushed through Canonicalize, as the shortest text Go
// prints for it, to check that the full path produces the same form.
func TestES6NumberSequence(t *testing.T) {
	checkpoints := map[int]string{
		1000:   "be18b62b6f69cdab33a7e0dae0d9cfa869fda80ddc712221570f9f40a5878687",
		10000:  "b9f7a8e75ef22a835685a52ccba7f7d6bdc99e34b010992cbc5864cd12be6892",
		100000: "22776e6d4b49fa294a0d0f349268e5c28808fe7e0cb2bcbe28f63894e494d4c7",
	}
	lines := 100000
	if !testing.Short() {
		checkpoints[1000000] = "49415fee2c56c77864931bd3624faad425c3c577d6d74e89a83bc725506dad16"
		lines = 1000000
	}
	const viaCanonicalize = 100000

	var h hash.Hash = sha256.New()
	var line []byte
	n := 0
	var failed error
	es6Sequence(func(bits uint64) bool {
		n++
		f := math.Float64frombits(bits)
		form, err := formatNumber(f)
		if err != nil {
			failed = err
			return false
		}
		if n <= viaCanonicalize {
			text := strconv.FormatFloat(f, 'g', -1, 64)
			got, err := Canonicalize([]byte(text))
			if err != nil || string(got) != form {
				t.Errorf("line %d: Canonicalize(%s) = %q, %v; want %q", n, text, got, err, form)
			}
			// The shortest round-trip text of a double denotes the same
			// value as its canonical form, so strict mode accepts it.
			if _, exact, err := exactCanonical(text); err != nil || !exact {
				t.Errorf("line %d: exactCanonical(%s) = %v, %v; want exact", n, text, exact, err)
			}
		}
		line = strconv.AppendUint(line[:0], bits, 16)
		line = append(line, ',')
		line = append(line, form...)
		line = append(line, '\n')
		h.Write(line)
		if want, ok := checkpoints[n]; ok {
			if got := hex.EncodeToString(h.Sum(nil)); got != want {
				t.Errorf("SHA-256 of the first %d lines = %s, want %s", n, got, want)
			}
		}
		return n < lines && !t.Failed()
	})
	if failed != nil {
		t.Fatalf("line %d: %v", n, failed)
	}
}

func TestES6SequenceSampleLines(t *testing.T) {
	// Sample lines quoted in the README of the test data.
	want := map[uint64]string{
		0x4340000000000001: "9007199254740994",
		0x4340000000000002: "9007199254740996",
		0x444b1ae4d6e2ef50: "1e+21",
		0x3eb0c6f7a0b5ed8d: "0.000001",
		0x3eb0c6f7a0b5ed8c: "9.999999999999997e-7",
		0x8000000000000000: "0",
		0x0000000000000000: "0",
	}
	for bits, form := range want {
		got, err := formatNumber(math.Float64frombits(bits))
		if err != nil || got != form {
			t.Errorf("formatNumber(%#x) = %q, %v; want %q", bits, got, err, form)
		}
	}
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		if _, err := formatNumber(f); err == nil {
			t.Errorf("formatNumber(%v) succeeded; NaN and Infinity have no JSON form", f)
		}
	}
}

func TestNumberExactness(t *testing.T) {
	tests := []struct {
		text string
		want error // nil: accepted
	}{
		{"0", nil},
		{"-0", nil},
		{"0.0", nil},
		{"-0.000e-5", nil},
		{"100", nil},
		{"1e2", nil},
		{"1E+2", nil},
		{"100e-2", nil},
		{"1.0", nil},
		{"1.50", nil},
		{"0.1", nil},
		{"19.99", nil},
		{"-12.345", nil},
		{"1e21", nil},
		{"1e-7", nil},
		{"0.000001", nil},
		{"5e-324", nil},
		{"1.7976931348623157e308", nil},
		{"9007199254740992", nil},
		{"123456789012345680000", nil},
		{"10000000000000000000000000000000e-31", nil},
		{"0.000000000000000000000000000000000000000001e42", nil},

		{"9007199254740993", ErrNumberPrecision},
		{"-9007199254740993", ErrNumberPrecision},
		{"0.10000000000000001", ErrNumberPrecision},
		{"123456789012345678901", ErrNumberPrecision},
		{"1.00000000000000000001", ErrNumberPrecision},
		{"333333333.33333329", ErrNumberPrecision},
		{"4.9e-324", ErrNumberPrecision},
		{"1e-400", ErrNumberPrecision},
		{"-1e-999999999999999999999", ErrNumberPrecision},
		{"0.00000000000000000000000000000000000000000000000000001e-999999999", ErrNumberPrecision},

		{"1e400", ErrNumberRange},
		{"-1.8e308", ErrNumberRange},
		{"1e999999999999999999999", ErrNumberRange},
	}
	for _, tc := range tests {
		p := &parser{strict: true}
		err := p.checkNumber(tc.text)
		if tc.want == nil && err != nil {
			t.Errorf("%s: refused: %v", tc.text, err)
		}
		if tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.text, err, tc.want)
		}
	}
}

func TestParseDecimal(t *testing.T) {
	tests := []struct {
		text string
		want decimal
	}{
		{"0", decimal{}},
		{"-0", decimal{}},
		{"-0.00e7", decimal{}},
		{"1", decimal{digits: "1"}},
		{"100", decimal{digits: "1", exp: 2}},
		{"1e2", decimal{digits: "1", exp: 2}},
		{"0.0120", decimal{digits: "12", exp: -3}},
		{"-1.25E-1", decimal{neg: true, digits: "125", exp: -3}},
		{"10e-1", decimal{digits: "1"}},
	}
	for _, tc := range tests {
		if got := parseDecimal(tc.text); got != tc.want {
			t.Errorf("parseDecimal(%q) = %+v, want %+v", tc.text, got, tc.want)
		}
	}
}
