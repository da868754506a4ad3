package reviewui

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestVisible(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"plain text", "plain text"},
		{"<script>alert(1)</script>", "&lt;script&gt;alert(1)&lt;/script&gt;"},
		{"invoice\u202Etxt.exe", `invoice<span class="ctl" title="control character">U+202E</span>txt.exe`},
		{"a\u2066b\u200fc", `a<span class="ctl" title="control character">U+2066</span>b<span class="ctl" title="control character">U+200F</span>c`},
		{"line\nbreak\x00", `line<span class="ctl" title="control character">U+000A</span>break<span class="ctl" title="control character">U+0000</span>`},
		{"bad\xffbyte", `bad<span class="ctl" title="invalid byte">\xff</span>byte`},
		{`"quoted" & 'single'`, "&#34;quoted&#34; &amp; &#39;single&#39;"},
	} {
		if got := string(visible(c.in)); got != c.want {
			t.Errorf("visible(%q) = %s, want %s", c.in, got, c.want)
		}
	}
	if got := plain("evil\u202Eexe\x1b"); got != "evil[U+202E]exe[U+001B]" {
		t.Errorf("plain = %q", got)
	}
	// JSON keeps its layout's newlines; a control inside a string is shown.
	got := string(visibleJSON(json.RawMessage("{\"a\":\"x\u202Ey\",\"b\":\"<b>\"}")))
	if !strings.Contains(got, "\n  &#34;a&#34;") || !strings.Contains(got, "U+202E") || strings.Contains(got, "\u202E") ||
		strings.Contains(got, "<b>") {
		t.Errorf("visibleJSON = %s", got)
	}
}

func TestIntentFields(t *testing.T) {
	got := intentFields(json.RawMessage(`{"method":"POST","payload":{"a/b":[1,{}],"card":"hmac-sha256:k1:` +
		strings.Repeat("a", 64) + `","pin":"[redacted]","note":"hmac-sha256:not a keyed value"},"target":"/x"}`))
	want := []field{
		{"/method", `"POST"`, false},
		{"/payload/a~1b/0", "1", false},
		{"/payload/a~1b/1", "{}", false},
		{"/payload/card", "hmac-sha256:k1:" + strings.Repeat("a", 64), true},
		{"/payload/note", `"hmac-sha256:not a keyed value"`, false},
		{"/payload/pin", "[redacted]", true},
		{"/target", `"/x"`, false},
	}
	if len(got) != len(want) {
		t.Fatalf("fields %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("field %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}
