package ledger

import (
	"encoding/base64"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// Issue 8, item 5: the text Caller.Do records for a failed call holds no
// URL path (a webhook's path is its secret) and no form of a credential.
func TestSafeErrorText(t *testing.T) {
	const token = "tok_7Hq2LmZp9Xw4Vb8N"
	raw := "https://bot:hunter2hunter2@hooks.example/services/T00/B00/XXsecretXXpath?sig=abcdef987654"
	req, _ := http.NewRequest("POST", raw, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	err := &url.Error{Op: "Post", URL: raw, Err: errors.New("read: connection reset; server said Bearer " +
		url.QueryEscape(token) + " " + base64.StdEncoding.EncodeToString([]byte(token)))}
	got := safeErrorText(err, req)
	for _, leak := range []string{"/services", "XXsecretXXpath", "hunter2", "abcdef987654", token,
		url.QueryEscape(token), base64.StdEncoding.EncodeToString([]byte(token))} {
		if strings.Contains(got, leak) {
			t.Errorf("recorded text holds %q: %s", leak, got)
		}
	}
	if !strings.Contains(got, `"https://hooks.example"`) {
		t.Errorf("the origin should stay: %s", got)
	}
	// Any text recorded from a call (a Classify override's message, an
	// ExternalID error) goes through the same redaction.
	basic := "Basic " + base64.StdEncoding.EncodeToString([]byte("bot:hunter2hunter2"))
	if got := redactRequestText("echo: "+basic+" at "+raw, req); strings.Contains(got, "hunter2") ||
		strings.Contains(got, basic[6:]) || strings.Contains(got, "XXsecretXXpath") {
		t.Errorf("redactRequestText leaks: %s", got)
	}
	long := strings.Repeat("é", maxMessageBytes)
	if got := redactRequestText(long, nil); len(got) > maxMessageBytes+len("…") {
		t.Errorf("not bounded: %d bytes", len(got))
	}
}
