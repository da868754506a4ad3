package redact

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// Issue 8, item 5: every form an API echoes a credential in is redacted.
func TestForRequestForms(t *testing.T) {
	const token = "sk_live_4eC39HqLyjWDarjtT1zdp7dc/+x"
	req, _ := http.NewRequest("POST", "https://alice:pa55w0rd!@api.example/hooks/T0001/B0002/XyZsecretPath?api_key=qk_9f8e7d6c5b&x=1", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("X-Api-Key", "hk_abcdef123456")
	req.Header.Set("Content-Type", "application/json")
	r := ForRequest(req, true)
	basic := base64.StdEncoding.EncodeToString([]byte("alice:pa55w0rd!"))
	leaks := []string{
		token, "Bearer " + token, url.QueryEscape(token), url.PathEscape(token),
		base64.StdEncoding.EncodeToString([]byte(token)), base64.RawURLEncoding.EncodeToString([]byte(token)),
		lowerEscapes(url.QueryEscape(token)), percentAll(token, "0123456789abcdef"),
		strings.ReplaceAll(token, "/", `\/`),
		"Basic " + basic, basic, "alice:pa55w0rd!", "pa55w0rd!", url.QueryEscape("pa55w0rd!"),
		"qk_9f8e7d6c5b", "api_key=qk_9f8e7d6c5b&x=1", "hk_abcdef123456",
		"/hooks/T0001/B0002/XyZsecretPath", "XyZsecretPath",
	}
	for _, leak := range leaks {
		text := `{"error":"bad credentials","echo":"` + leak + `"}`
		if got := r.String(text); strings.Contains(got, leak) || !strings.Contains(got, Marker) {
			t.Errorf("%q not redacted: %s", leak, got)
		}
	}
	if got := r.String("Content-Type application/json is fine"); got != "Content-Type application/json is fine" {
		t.Errorf("a header that is not a credential was redacted: %s", got)
	}
}

func TestShortPartsAndNil(t *testing.T) {
	r := New()
	r.AddPart("abc")
	if r.String("abc") != "abc" {
		t.Errorf("a part shorter than MinLen was redacted")
	}
	var nilR *Redactor
	if nilR.String("x") != "x" || !nilR.Empty() {
		t.Errorf("nil Redactor")
	}
	r.AddHeader("Basic " + base64.StdEncoding.EncodeToString([]byte("user:1234")))
	if got := r.String("user:1234 and 1234"); strings.Contains(got, "1234") {
		t.Errorf("a decoded Basic password was not redacted: %s", got)
	}
}
