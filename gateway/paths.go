package gateway

import (
	"strings"

	"github.com/receiptledger/reconciler/internal/percent"
)

// normalEscapes is s in the normal form of RFC 3986 §6.2.2.2: a
// percent-encoded unreserved character (ALPHA, DIGIT, "-", ".", "_", "~")
// decoded, and the hex of every other escape upper-cased. Both spellings
// name the same resource, so they must be one call to the duplicate guard,
// the operations and the upstream: "/f%61il" is "/fail". Any other escape
// stays as it is, a reserved one ("%2F", "%3F") above all, since decoding
// it would change what the path means. A '%' not followed by two hex
// digits is left for the path's own check to refuse.
func normalEscapes(s string) string {
	i := strings.IndexByte(s, '%')
	if i < 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	b.WriteString(s[:i])
	for ; i < len(s); i++ {
		d, ok := percent.At(s, i)
		if !ok {
			b.WriteByte(s[i])
			continue
		}
		if unreserved(d) {
			b.WriteByte(d)
		} else {
			b.WriteByte('%')
			b.WriteByte(upperHex(s[i+1]))
			b.WriteByte(upperHex(s[i+2]))
		}
		i += 2
	}
	return b.String()
}

// unreserved reports whether c is an unreserved character (RFC 3986 §2.3).
func unreserved(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~'
}

func upperHex(c byte) byte {
	if 'a' <= c && c <= 'f' {
		return c - 'a' + 'A'
	}
	return c
}
