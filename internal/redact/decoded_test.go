package redact

import (
	"encoding/base64"
	"strings"
	"testing"
)

// Issue 19, item 4: a credential is matched after percent-decoding, not by a
// list of its encodings: an echo with any mix of its bytes encoded, in
// either hex case, is redacted, and so is every encoding of its base64 and
// Basic forms; the text around it is kept as it is.
func TestCredentialInAnyPercentEncoding(t *testing.T) {
	const token = "sk_test_4eC39HqLyjWDarjtT1zdp7dc"
	r := New(token)
	r.AddBasic("alice", "pa55w0rd!")
	b64 := base64.StdEncoding.EncodeToString([]byte("alice:pa55w0rd!"))
	for _, leak := range []string{
		strings.ReplaceAll(token, "_", "%5F"),
		strings.ReplaceAll(token, "_", "%5f"),
		"%73k_test_4eC39HqLyjWDarjtT1zdp7d%63",
		"sk%5Ftest_4%65C39%48qLyjWDarjtT1zdp7dc",
		"sk%5Ftest%5f4eC39Hq%4cyjWDarjtT1%7Adp7dc", // both hex cases in one echo
		strings.ReplaceAll(strings.ReplaceAll(b64, "=", "%3D"), "6", "%36"),
		"pa55w0rd%21", "pa%35%35w0rd%21",
	} {
		text := `{"error":"bad key","echo":"` + leak + `","next":"100% sure"}`
		got := r.String(text)
		if strings.Contains(got, leak) || !strings.Contains(got, `"echo":"`+Marker+`"`) || !strings.HasSuffix(got, `"next":"100% sure"}`) {
			t.Errorf("%q: got %s", leak, got)
		}
	}
	// Escapes that decode to no credential are left as they are.
	for _, text := range []string{"a%2Fb sk%5Ftest", "%", "%zz%5", "sk_test_4eC39HqLyjWDarjtT1zdp7d%"} {
		if got := r.String(text); got != text {
			t.Errorf("%q redacted to %q", text, got)
		}
	}
}

// percentAll percent-encodes every byte of s with the given hex digits.
func percentAll(s, digits string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteByte('%')
		b.WriteByte(digits[s[i]>>4])
		b.WriteByte(digits[s[i]&0xF])
	}
	return b.String()
}

// lowerEscapes lowercases the hex digits of the %XX escapes in s.
func lowerEscapes(s string) string {
	b := []byte(s)
	for i := 0; i+2 < len(b); i++ {
		if b[i] == '%' {
			for j := i + 1; j <= i+2; j++ {
				if b[j] >= 'A' && b[j] <= 'F' {
					b[j] += 'a' - 'A'
				}
			}
			i += 2
		}
	}
	return string(b)
}

// BenchmarkString measures String on a 64 KiB JSON body, as the gateway
// redacts every response: without escapes (the replacer alone), and with
// percent escapes throughout (decoded and matched again).
func BenchmarkString(b *testing.B) {
	r := New("sk_test_4eC39HqLyjWDarjtT1zdp7dc")
	r.AddBasic("alice", "pa55w0rd!")
	for _, tc := range []struct{ name, unit string }{
		{"plain", `{"id":"ch_1","note":"nothing to see here"},`},
		{"escaped", `{"id":"ch_1","next":"/v1/charges?starting_after=ch%5F1&limit=10"},`},
	} {
		body := strings.Repeat(tc.unit, (64<<10)/len(tc.unit))
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				_ = r.String(body)
			}
		})
	}
}
