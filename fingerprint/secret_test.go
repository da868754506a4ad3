package fingerprint

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

// testKey is a 32-byte key: the bytes 0x00 to 0x1f.
var testKey = func() []byte {
	k := make([]byte, 32)
	for i := range k {
		k[i] = byte(i)
	}
	return k
}()

// Issue 8, item 6: a keyed fingerprint of secret values, reproducible in any
// language. This is the example docs/concepts.md gives: the expected strings were
// computed independently (Python's hmac and hashlib over hand-written
// canonical JSON), not by this package.
func TestKeyedFingerprintExample(t *testing.T) {
	const payload = `{"pin": 1234, "card_number": "4111111111111111", "amount": 500}`
	res, err := Compute("post", "/v1/charges", []byte(payload),
		WithSecret("/card_number", "/pin"), WithSecretKey("2025-01", testKey))
	if err != nil {
		t.Fatal(err)
	}
	const (
		card       = "hmac-sha256:2025-01:5b90d95161237ce2385af94f39d0f420ad1569ee25feb7ed5f87c18cd39ff079"
		pin        = "hmac-sha256:2025-01:75a2b0661f593e7c9af372baabd1751c4aa612b8a2fd605a1fc4963915193dd1"
		wantIntent = `{"method":"POST","payload":{"amount":500,"card_number":"` + card + `","pin":"` + pin + `"},"target":"/v1/charges"}`
		wantFP     = "sha256:fc8e1ee07a44f000bcf1efd1ec3d66b35c73472e5fcc87b8d4cac3464feea824"
	)
	if string(res.Intent) != wantIntent {
		t.Errorf("Intent = %s\nwant %s", res.Intent, wantIntent)
	}
	if res.Fingerprint != wantFP {
		t.Errorf("Fingerprint = %s, want %s", res.Fingerprint, wantFP)
	}
	// Step by step, as another language would: HMAC of each value's RFC
	// 8785 form (quotes included for a string), then the plain
	// fingerprint of the substituted intent.
	mac := hmac.New(sha256.New, testKey)
	mac.Write([]byte(`"4111111111111111"`))
	if got := KeyedPrefix + "2025-01:" + hex.EncodeToString(mac.Sum(nil)); got != card {
		t.Errorf("HMAC of the card number = %s, want %s", got, card)
	}
	substituted := `{"amount":500,"card_number":"` + card + `","pin":"` + pin + `"}`
	plain, err := Compute("POST", "/v1/charges", []byte(substituted))
	if err != nil || plain.Fingerprint != wantFP {
		t.Errorf("plain fingerprint of the substituted payload = %s, %v; want %s", plain.Fingerprint, err, wantFP)
	}
	for _, v := range []string{"4111111111111111", "1234"} {
		if strings.Contains(string(res.Intent), v) {
			t.Errorf("the stored intent holds the secret %s", v)
		}
	}
	if !HasSecrets(res.Intent) {
		t.Errorf("HasSecrets(keyed intent) = false")
	}
}

// Issue 8, item 6: the same secret under another key, or another secret
// under the same key, gives another fingerprint; an intent without secret
// fields keeps its plain RFC 8785 fingerprint whatever the key.
func TestKeyedFingerprintProperties(t *testing.T) {
	const payload = `{"card":{"number":"4111111111111111","exp":"12/30"},"token":"s3cr3t","amount":5}`
	key2 := append([]byte(nil), testKey...)
	key2[0] ^= 1
	opts := func(id string, key []byte) []Option {
		return []Option{WithSecret("/card/number", "/token"), WithSecretKey(id, key)}
	}
	a := mustCompute(t, "POST", "/pay", payload, opts("k1", testKey)...)
	b := mustCompute(t, "POST", "/pay", payload, opts("k1", key2)...)
	c := mustCompute(t, "POST", "/pay", strings.Replace(payload, "s3cr3t", "other", 1), opts("k1", testKey)...)
	d := mustCompute(t, "POST", "/pay", payload, opts("k2", testKey)...)
	if a.Fingerprint == b.Fingerprint || a.Fingerprint == c.Fingerprint || a.Fingerprint == d.Fingerprint {
		t.Errorf("fingerprints do not depend on key, secret and key id: %s %s %s %s", a.Fingerprint, b.Fingerprint, c.Fingerprint, d.Fingerprint)
	}
	sum := sha256.Sum256(a.Intent)
	if got := Prefix + hex.EncodeToString(sum[:]); got != a.Fingerprint {
		t.Errorf("sha256(Intent) = %s, want the fingerprint %s", got, a.Fingerprint)
	}
	if strings.Contains(string(a.Intent), "4111") || strings.Contains(string(a.Intent), "s3cr3t") {
		t.Errorf("Intent leaks a secret: %s", a.Intent)
	}
	if !strings.Contains(string(a.Intent), `"exp":"12/30"`) {
		t.Errorf("a field that is not secret was changed: %s", a.Intent)
	}

	plain := mustCompute(t, "POST", "/pay", payload)
	keyed := mustCompute(t, "POST", "/pay", payload, WithSecretKey("k1", testKey))
	if plain.Fingerprint != keyed.Fingerprint || string(plain.Intent) != string(keyed.Intent) {
		t.Errorf("a key changed an intent without secret fields: %s vs %s", plain.Fingerprint, keyed.Fingerprint)
	}

	t.Run("whole payload", func(t *testing.T) {
		res := mustCompute(t, "POST", "/pay", payload, WithSecret(""), WithSecretKey("k1", testKey))
		mac := hmac.New(sha256.New, testKey)
		mac.Write([]byte(`{"amount":5,"card":{"exp":"12/30","number":"4111111111111111"},"token":"s3cr3t"}`))
		want := `{"method":"POST","payload":"hmac-sha256:k1:` + hex.EncodeToString(mac.Sum(nil)) + `","target":"/pay"}`
		if string(res.Intent) != want {
			t.Errorf("Intent = %s, want %s", res.Intent, want)
		}
	})
	t.Run("nested secrets: the outer one covers the inner", func(t *testing.T) {
		outer := mustCompute(t, "POST", "/pay", payload, WithSecret("/card"), WithSecretKey("k1", testKey))
		both := mustCompute(t, "POST", "/pay", payload, WithSecret("/card/number", "/card"), WithSecretKey("k1", testKey))
		if outer.Fingerprint != both.Fingerprint {
			t.Errorf("an inner secret changed the outer one's HMAC")
		}
	})
	t.Run("dropped wins over secret", func(t *testing.T) {
		res := mustCompute(t, "POST", "/pay", payload, WithSecret("/token"), WithDrop("/token"))
		want := `{"method":"POST","payload":{"amount":5,"card":{"exp":"12/30","number":"4111111111111111"}},"target":"/pay"}`
		if string(res.Intent) != want {
			t.Errorf("Intent = %s, want %s", res.Intent, want)
		}
	})
}

// Issue 8, item 6: without a key, an intent with a secret field is refused
// (never an unsalted hash of a secret); a bad key or key id is refused.
func TestKeyedFingerprintRefusals(t *testing.T) {
	const payload = `{"pin":"1234","amount":5}`
	if _, err := Compute("POST", "/p", []byte(payload), WithSecret("/pin")); !errors.Is(err, ErrSecretKeyRequired) {
		t.Errorf("no key: err = %v, want ErrSecretKeyRequired", err)
	} else if strings.Contains(err.Error(), "1234") {
		t.Errorf("the error quotes the secret: %v", err)
	}
	for name, opt := range map[string]Option{
		"short key":       WithSecretKey("k", testKey[:31]),
		"empty id":        WithSecretKey("", testKey),
		"id with a colon": WithSecretKey("a:b", testKey),
		"long id":         WithSecretKey(strings.Repeat("k", 65), testKey),
	} {
		if _, err := Compute("POST", "/p", []byte(payload), WithSecret("/pin"), opt); !errors.Is(err, ErrInvalidSecretKey) {
			t.Errorf("%s: err = %v, want ErrInvalidSecretKey", name, err)
		}
	}
}

// Issue 8, item 6: a secret pointer that matches nothing is an error, never
// a silently stored value.
func TestSecretPointerMatchingNothing(t *testing.T) {
	const payload = `{"card_number":"4111111111111111","items":[{"pin":"1"}]}`
	for _, ptr := range []string{"/cardnumber", "/card_number/x", "/items/1/pin", "/items/-", "/items/0/PIN"} {
		_, err := Compute("POST", "/p", []byte(payload), WithSecret(ptr), WithSecretKey("k", testKey))
		if !errors.Is(err, ErrSecretNotFound) {
			t.Errorf("secret %q: err = %v, want ErrSecretNotFound", ptr, err)
		}
	}
	// A secret inside a dropped field matched: nothing is stored either way.
	if _, err := Compute("POST", "/p", []byte(payload), WithDrop("/items"), WithSecret("/items/0/pin")); err != nil {
		t.Errorf("secret inside a dropped field: %v", err)
	}
}

// Issue 8, item 6: an error about a value at or inside a secret field never
// prints the value ("9111111111111111" at "/card_number" did).
func TestErrorsDoNotQuoteSecretValues(t *testing.T) {
	cases := []struct {
		payload, secret, value string
		want                   error
	}{
		{`{"card_number": 9111111111111111}`, "/card_number", "9111111111111111", ErrNumberPrecision},
		{`{"card": {"number": 9111111111111111}}`, "/card", "9111111111111111", ErrNumberPrecision},
		{`{"pins": [1, 0.10000000000000001]}`, "/pins/1", "0.10000000000000001", ErrNumberPrecision},
		{`{"card_number": 9e999}`, "/card_number", "9e999", ErrNumberRange},
		{`{"card": {"pin": "1", "pin": "2"}}`, "/card", "pin", ErrDuplicateKey},
		{`{"token": "\ud800secretpart"}`, "/token", `\ud800`, ErrInvalidUTF8},
		{`{"token": "abc` + "\x01" + `def"}`, "/token", `\x01`, ErrInvalidJSON},
		{`{"a~/b": {"c": 12345678901234567890}}`, "/a~0~1b", "12345678901234567890", ErrNumberPrecision},
		{`[9111111111111111]`, "", "9111111111111111", ErrNumberPrecision},
	}
	for _, c := range cases {
		_, err := Compute("POST", "/p", []byte(c.payload), WithSecret(c.secret), WithSecretKey("k", testKey))
		if !errors.Is(err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.payload, err, c.want)
			continue
		}
		if strings.Contains(err.Error(), c.value) {
			t.Errorf("%s: the error prints the secret value %s: %v", c.payload, c.value, err)
		}
		// Without the secret marking, the value is shown (the message
		// stays useful for fields that are not secret).
		if _, err := Compute("POST", "/p", []byte(c.payload)); err == nil || (c.want == ErrNumberPrecision && !strings.Contains(err.Error(), c.value)) {
			t.Errorf("%s without secrets: %v", c.payload, err)
		}
	}
}

func TestParseSecretKey(t *testing.T) {
	hexKey := hex.EncodeToString(testKey)
	for _, text := range []string{
		hexKey, " " + hexKey + "\n", "hex:" + hexKey,
		base64.StdEncoding.EncodeToString(testKey), base64.RawURLEncoding.EncodeToString(testKey),
		"base64:" + base64.StdEncoding.EncodeToString(testKey),
	} {
		key, err := ParseSecretKey(text)
		if err != nil || string(key) != string(testKey) {
			t.Errorf("ParseSecretKey(%q) = %x, %v", text, key, err)
		}
	}
	for _, text := range []string{"", "hex:zz", hexKey[:62], "not base64 !", base64.StdEncoding.EncodeToString(testKey[:31])} {
		if _, err := ParseSecretKey(text); !errors.Is(err, ErrInvalidSecretKey) {
			t.Errorf("ParseSecretKey(%q): err = %v, want ErrInvalidSecretKey", text, err)
		} else if text != "" && strings.Contains(err.Error(), text) {
			t.Errorf("the error quotes the key text: %v", err)
		}
	}
	env := map[string]string{SecretKeyEnv: hexKey}
	id, key, ok, err := SecretKeyFromEnv(func(k string) string { return env[k] })
	if err != nil || !ok || string(key) != string(testKey) || id != DefaultKeyID(testKey) || !strings.HasPrefix(id, "k") {
		t.Errorf("SecretKeyFromEnv = %q, %x, %v, %v", id, key, ok, err)
	}
	env[SecretKeyIDEnv] = "2025-01"
	if id, _, _, err := SecretKeyFromEnv(func(k string) string { return env[k] }); id != "2025-01" || err != nil {
		t.Errorf("SecretKeyFromEnv with an id = %q, %v", id, err)
	}
	env[SecretKeyIDEnv] = "bad id"
	if _, _, _, err := SecretKeyFromEnv(func(k string) string { return env[k] }); !errors.Is(err, ErrInvalidSecretKey) {
		t.Errorf("SecretKeyFromEnv with a bad id: %v", err)
	}
	if _, _, ok, err := SecretKeyFromEnv(func(string) string { return "" }); ok || err != nil {
		t.Errorf("SecretKeyFromEnv unset = %v, %v", ok, err)
	}
}

func TestHasSecrets(t *testing.T) {
	for intent, want := range map[string]bool{
		`{"method":"POST","payload":{"a":1},"target":"/t"}`:                                                  false,
		`{"method":"POST","payload":{"a":"[redacted]"},"target":"/t"}`:                                       true,
		`{"method":"POST","payload":[{"a":"hmac-sha256:k:` + strings.Repeat("ab", 32) + `"}],"target":"/t"}`: true,
		`{"method":"POST","payload":{"a":"hmac-sha256:k:short"},"target":"/t"}`:                              false,
		`not json`: true,
	} {
		if got := HasSecrets([]byte(intent)); got != want {
			t.Errorf("HasSecrets(%s) = %v, want %v", intent, got, want)
		}
	}
}
