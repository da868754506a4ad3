package fingerprint

import (
	"cmp"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"slices"
)

// writer serializes a parsed tree in RFC 8785 canonical form (§3.2): no
// insignificant whitespace, object members sorted by the UTF-16 code units
// of their names, strings with the minimal escapes of §3.2.2.2, numbers in
// ECMAScript form (§3.2.2.3). Dropped members and elements are left out.
// A secret value (the outermost, when secrets nest) is written, HMAC'd with
// mac and replaced by its keyed string; without mac, needKey is set.
type writer struct {
	buf      []byte
	inSecret bool
	mac      hash.Hash
	keyID    string
	needKey  bool
	sum      [sha256.Size]byte
}

// newMAC returns the HMAC-SHA256 of key.
func newMAC(key []byte) hash.Hash { return hmac.New(sha256.New, key) }

// value writes n.
func (w *writer) value(n *node) {
	if n.secret && !w.inSecret {
		if w.mac == nil {
			w.needKey = true
			return // Compute fails; nothing written is used
		}
		w.inSecret = true
		start := len(w.buf)
		w.value(n)
		w.inSecret = false
		end := len(w.buf)
		w.mac.Reset()
		w.mac.Write(w.buf[start:])
		sum := w.mac.Sum(w.sum[:0])
		w.buf = append(w.buf[:start], '"')
		w.buf = append(w.buf, KeyedPrefix...)
		w.buf = append(w.buf, w.keyID...)
		w.buf = append(w.buf, ':')
		w.buf = hex.AppendEncode(w.buf, sum)
		w.buf = append(w.buf, '"')
		if end > len(w.buf) {
			// No copy of the real value stays behind in the buffer.
			clear(w.buf[len(w.buf):end])
		}
		return
	}
	switch n.kind {
	case kindNull:
		w.buf = append(w.buf, "null"...)
	case kindBool:
		w.buf = append(w.buf, n.text...)
	case kindNumber:
		if _, ok := plainInt(n.text); ok {
			w.buf = append(w.buf, n.text...)
		} else {
			w.buf = appendNumber(w.buf, n.num)
		}
	case kindString:
		w.buf = appendString(w.buf, n.text)
	case kindArray:
		w.buf = append(w.buf, '[')
		first := true
		for _, e := range n.elems {
			if e.drop {
				continue
			}
			if !first {
				w.buf = append(w.buf, ',')
			}
			first = false
			w.value(e)
		}
		w.buf = append(w.buf, ']')
	case kindObject:
		if len(n.members) > 1 {
			slices.SortFunc(n.members, func(a, b member) int { return compareUTF16(a.name, b.name) })
		}
		w.buf = append(w.buf, '{')
		first := true
		for _, m := range n.members {
			if m.value.drop {
				continue
			}
			if !first {
				w.buf = append(w.buf, ',')
			}
			first = false
			w.buf = appendString(w.buf, m.name)
			w.buf = append(w.buf, ':')
			w.value(m.value)
		}
		w.buf = append(w.buf, '}')
	}
}

// compareUTF16 compares two valid UTF-8 strings by their UTF-16 code units,
// the property order of RFC 8785 §3.2.3.
//
// UTF-8 byte order is code point order, which is UTF-16 code unit order
// except between a supplementary character (UTF-16 high surrogate D800-DBFF)
// and a character in U+E000-U+FFFF: the first sorts first in UTF-16, last in
// UTF-8. At the first differing byte, those two are exactly the cases where
// one byte is a 4-byte lead (F0-F4) and the other a lead of U+E000-U+FFFF
// (EE or EF); continuation bytes are below EE, and a common prefix of valid
// UTF-8 strings ending at a lead byte in one ends at a rune boundary in both.
func compareUTF16(a, b string) int {
	n := min(len(a), len(b))
	i := 0
	for i < n && a[i] == b[i] {
		i++
	}
	if i == n {
		return cmp.Compare(len(a), len(b))
	}
	x, y := a[i], b[i]
	if x >= 0xEE && y >= 0xEE && (x >= 0xF0) != (y >= 0xF0) {
		if x >= 0xF0 {
			return -1
		}
		return 1
	}
	return cmp.Compare(x, y)
}

// appendString appends s (valid UTF-8) as a JSON string literal in RFC 8785
// form: '"' and '\' escaped with a backslash, the control characters with a
// short escape (\b \t \n \f \r) when there is one and as \u00xx (lowercase)
// otherwise, everything else as is.
func appendString(dst []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\b':
			dst = append(dst, '\\', 'b')
		case '\t':
			dst = append(dst, '\\', 't')
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\f':
			dst = append(dst, '\\', 'f')
		case '\r':
			dst = append(dst, '\\', 'r')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
		}
		start = i + 1
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
