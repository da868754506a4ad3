// Package percent reads one percent-encoded octet (RFC 3986 §2.1), hex
// digits of either case, for the places that decode escapes by hand: the
// gateway's path normal form and the redactor's decoded view.
package percent

// At reports the octet that the escape at s[i:i+3] encodes; ok is false
// unless s[i] is '%' followed by two hex digits.
func At(s string, i int) (b byte, ok bool) {
	if i < 0 || i+2 >= len(s) || s[i] != '%' {
		return 0, false
	}
	hi, ok1 := unhex(s[i+1])
	lo, ok2 := unhex(s[i+2])
	if !ok1 || !ok2 {
		return 0, false
	}
	return hi<<4 | lo, true
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
