package fingerprint

import (
	"errors"
	"math"
	"strconv"
)

// formatNumber returns the RFC 8785 §3.2.2.3 (ECMAScript Number.toString)
// serialization of f, refusing NaN and the infinities, which have none. It is
// appendNumber, which writes every number of the canonical output; the tests
// pin it with the ES6 number sequence and compare it with jcs.NumberToJSON,
// the formatter of github.com/gowebpki/jcs.
func formatNumber(f float64) (string, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return "", errors.New("fingerprint: " + strconv.FormatFloat(f, 'g', -1, 64) + " has no JSON form")
	}
	var scratch [32]byte
	return string(appendNumber(scratch[:0], f)), nil
}

// appendNumber appends the RFC 8785 serialization of the finite double f:
// the shortest digits that round-trip (as ECMAScript chooses them), in plain
// notation for magnitudes in [1e-6, 1e21) and in exponent notation otherwise,
// with "e+" or "e-" and no leading zeros in the exponent, and 0 for -0.
func appendNumber(dst []byte, f float64) []byte {
	if f == 0 { // 0 and -0
		return append(dst, '0')
	}
	if f < 0 {
		dst = append(dst, '-')
		f = -f
	}
	if f >= 1e-6 && f < 1e21 {
		return strconv.AppendFloat(dst, f, 'f', -1, 64)
	}
	start := len(dst)
	dst = strconv.AppendFloat(dst, f, 'e', -1, 64)
	// Go writes at least two exponent digits ("1e+09"); ECMAScript does not.
	for i := len(dst) - 1; i > start; i-- {
		if dst[i] == 'e' {
			if dst[i+2] == '0' {
				dst = append(dst[:i+2], dst[i+3:]...)
			}
			break
		}
	}
	return dst
}

// plainInt recognizes number text that is already canonical and exact: an
// integer of at most 15 digits without leading zeros (every such integer is
// below 2^53, so it is a double, and ECMAScript writes it digit for digit).
// "-0" is not plain: its canonical form is "0".
func plainInt(text string) (float64, bool) {
	i := 0
	if i < len(text) && text[i] == '-' {
		i++
	}
	digits := len(text) - i
	if digits < 1 || digits > 15 || (text[i] == '0' && (digits > 1 || i > 0)) {
		return 0, false
	}
	var v int64
	for ; i < len(text); i++ {
		c := text[i]
		if !isDigit(c) {
			return 0, false
		}
		v = v*10 + int64(c-'0')
	}
	if text[0] == '-' {
		v = -v
	}
	return float64(v), true
}

// parseNumber converts JSON number text to the IEEE 754 double it denotes
// under RFC 8785, refusing values too large for a double.
func parseNumber(text string) (float64, error) {
	f, err := strconv.ParseFloat(text, 64)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) && math.IsInf(f, 0) {
			return 0, ErrNumberRange
		}
		// The decoder has already checked the RFC 8259 number grammar, so
		// ParseFloat has nothing else to object to.
		return 0, ErrInvalidJSON
	}
	return f, nil
}

// decimal is the exact value of a decimal numeral, digits × 10^exp, with no
// leading or trailing zeros in digits. Zero has empty digits (and either sign:
// -0 and 0 denote the same value).
type decimal struct {
	neg    bool
	digits string
	exp    int64
}

// expLimit caps the exponent read from number text. Any exponent beyond it is
// far outside the range of a double, so saturating it keeps the arithmetic in
// int64 without changing any comparison this package makes.
const expLimit = 1 << 50

// parseDecimal reads JSON number text (RFC 8259 §6 grammar, already checked by
// the decoder) into its exact value. It works on the digits themselves, in
// linear time: unlike math/big.Rat.SetString, text such as 1e-999999999
// cannot make it compute a power of ten with a billion digits.
func parseDecimal(text string) decimal {
	var d decimal
	i := 0
	if i < len(text) && text[i] == '-' {
		d.neg = true
		i++
	}
	intStart := i
	for i < len(text) && isDigit(text[i]) {
		i++
	}
	intPart := text[intStart:i]
	fracPart := ""
	if i < len(text) && text[i] == '.' {
		i++
		fracStart := i
		for i < len(text) && isDigit(text[i]) {
			i++
		}
		fracPart = text[fracStart:i]
	}
	var exp int64
	if i < len(text) && (text[i] == 'e' || text[i] == 'E') {
		i++
		expNeg := false
		if i < len(text) && (text[i] == '+' || text[i] == '-') {
			expNeg = text[i] == '-'
			i++
		}
		for ; i < len(text) && isDigit(text[i]); i++ {
			if exp < expLimit {
				exp = exp*10 + int64(text[i]-'0')
			}
		}
		if expNeg {
			exp = -exp
		}
	}

	digits := intPart + fracPart
	exp -= int64(len(fracPart))
	start := 0
	for start < len(digits) && digits[start] == '0' {
		start++
	}
	end := len(digits)
	for end > start && digits[end-1] == '0' {
		end--
		exp++
	}
	d.digits = digits[start:end]
	d.exp = exp
	if d.digits == "" {
		d.neg, d.exp = false, 0
	}
	return d
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// sameValue reports whether two JSON number texts denote exactly the same
// mathematical value.
func sameValue(a, b string) bool {
	if a == b {
		return true
	}
	return parseDecimal(a) == parseDecimal(b)
}

// exactCanonical returns the canonical form of the JSON number text, and
// whether that form denotes exactly the same value as the text.
//
// The comparison is between two decimal numerals, the text and its canonical
// form, not between the text and the binary value of the double: the double
// nearest 0.1 is 0.1000000000000000055511151231257827..., so comparing with
// it would refuse 0.1, 19.99 and nearly every other decimal fraction, while
// the canonical form "0.1" denotes exactly what the caller sent.
func exactCanonical(text string) (canonical string, exact bool, err error) {
	f, err := parseNumber(text)
	if err != nil {
		return "", false, err
	}
	canonical, err = formatNumber(f)
	if err != nil {
		return "", false, ErrNumberRange
	}
	return canonical, sameValue(text, canonical), nil
}
