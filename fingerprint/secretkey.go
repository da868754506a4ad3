package fingerprint

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"
)

// Keyed secret values.
//
// A secret field (WithSecret) is never hashed without a key: its value would
// be recoverable by brute force from an unsalted SHA-256 (a 4-digit PIN in
// milliseconds). Before canonicalization, Compute replaces the value of each
// secret field by the JSON string
//
//	"hmac-sha256:<key id>:<64 lowercase hex>"
//
// where the hex digits are HMAC-SHA256(key, RFC 8785 canonical JSON of the
// field's value) — for the string "1234" that is the HMAC of the six bytes
// "1234" with their quotes; for an object, of its canonical form with the
// real values of every field inside it. The fingerprint is then the plain
// SHA-256 of the RFC 8785 form of the substituted intent, and the stored
// intent (Result.Intent) is exactly those bytes: the keyed string stands
// where a secret value was. An intent without secret fields is untouched,
// so its fingerprint stays the plain RFC 8785 one.

// KeyedPrefix starts the string that replaces a secret value.
const KeyedPrefix = "hmac-sha256:"

// MinSecretKeyBytes is the shortest secret key WithSecretKey accepts.
const MinSecretKeyBytes = 32

// maxKeyIDBytes bounds a key id.
const maxKeyIDBytes = 64

// SecretKeyEnv and SecretKeyIDEnv are the environment variables the
// command line and SecretKeyFromEnv read the deployment's key from.
const (
	SecretKeyEnv   = "RECONCILER_SECRET_KEY"
	SecretKeyIDEnv = "RECONCILER_SECRET_KEY_ID"
)

// WithSecretKey sets the key that secret field values are HMAC'd with, and
// its id, recorded in every keyed value so that keys can be rotated. key
// must be at least MinSecretKeyBytes long; keyID must be 1 to 64 characters
// from A-Z a-z 0-9 . _ - (so it never needs escaping and never contains
// ':'). Otherwise Compute fails with ErrInvalidSecretKey. Without this
// option, Compute refuses an intent with a secret field
// (ErrSecretKeyRequired). The key is not copied: do not modify it.
func WithSecretKey(keyID string, key []byte) Option {
	return func(s *settings) { s.keyID, s.key, s.keySet = keyID, key, true }
}

// checkSecretKey validates a key and its id.
func checkSecretKey(keyID string, key []byte) error {
	if len(key) < MinSecretKeyBytes {
		return fmt.Errorf("%w: the key is %d bytes, at least %d are needed", ErrInvalidSecretKey, len(key), MinSecretKeyBytes)
	}
	if keyID == "" || len(keyID) > maxKeyIDBytes {
		return fmt.Errorf("%w: the key id must be 1 to %d characters", ErrInvalidSecretKey, maxKeyIDBytes)
	}
	for i := 0; i < len(keyID); i++ {
		c := keyID[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: key id %s: only A-Z a-z 0-9 . _ - are allowed", ErrInvalidSecretKey, quoteForError(keyID))
		}
	}
	return nil
}

// ParseSecretKey decodes a secret key as written in RECONCILER_SECRET_KEY:
// "hex:<hex digits>" or "base64:<standard or URL base64, padded or not>";
// without a prefix, a text of only hexadecimal digits (even length) is hex
// and anything else base64. Surrounding white space is ignored. The decoded
// key must be at least MinSecretKeyBytes long. The error never quotes the
// text.
func ParseSecretKey(text string) ([]byte, error) {
	s := strings.TrimSpace(text)
	var key []byte
	var err error
	switch {
	case strings.HasPrefix(s, "hex:"):
		key, err = hex.DecodeString(s[len("hex:"):])
	case strings.HasPrefix(s, "base64:"):
		key, err = decodeBase64(s[len("base64:"):])
	case isHexText(s):
		key, err = hex.DecodeString(s)
	default:
		key, err = decodeBase64(s)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: not hex or base64 (the text is not shown)", ErrInvalidSecretKey)
	}
	if len(key) < MinSecretKeyBytes {
		return nil, fmt.Errorf("%w: the key is %d bytes, at least %d are needed", ErrInvalidSecretKey, len(key), MinSecretKeyBytes)
	}
	return key, nil
}

func isHexText(s string) bool {
	if s == "" || len(s)%2 != 0 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isHex(s[i]) {
			return false
		}
	}
	return true
}

func decodeBase64(s string) ([]byte, error) {
	s = strings.TrimRight(s, "=")
	if strings.ContainsAny(s, "-_") {
		return base64.RawURLEncoding.DecodeString(s)
	}
	return base64.RawStdEncoding.DecodeString(s)
}

// DefaultKeyID is the key id used when none is configured: "k" followed by
// the first 12 hexadecimal digits of SHA-256(key). It changes with the key,
// so a rotation is visible in every stored keyed value.
func DefaultKeyID(key []byte) string {
	sum := sha256.Sum256(key)
	return "k" + hex.EncodeToString(sum[:6])
}

// SecretKeyFromEnv reads the deployment's key with getenv (os.Getenv):
// SecretKeyEnv holds the key (see ParseSecretKey) and SecretKeyIDEnv its id
// (DefaultKeyID when unset). ok is false when SecretKeyEnv is unset or
// empty; err reports a malformed key or id.
func SecretKeyFromEnv(getenv func(string) string) (keyID string, key []byte, ok bool, err error) {
	text := getenv(SecretKeyEnv)
	if strings.TrimSpace(text) == "" {
		return "", nil, false, nil
	}
	if key, err = ParseSecretKey(text); err != nil {
		return "", nil, false, fmt.Errorf("%s: %w", SecretKeyEnv, err)
	}
	keyID = strings.TrimSpace(getenv(SecretKeyIDEnv))
	if keyID == "" {
		keyID = DefaultKeyID(key)
	}
	if err := checkSecretKey(keyID, key); err != nil {
		return "", nil, false, fmt.Errorf("%s: %w", SecretKeyIDEnv, err)
	}
	return keyID, key, true, nil
}

// IsKeyedValue reports whether s has the form of a keyed secret value,
// "hmac-sha256:<key id>:<64 lowercase hex>".
func IsKeyedValue(s string) bool {
	rest, ok := strings.CutPrefix(s, KeyedPrefix)
	if !ok {
		return false
	}
	id, sum, ok := strings.Cut(rest, ":")
	if !ok || len(sum) != 2*sha256.Size || checkSecretKey(id, make([]byte, MinSecretKeyBytes)) != nil {
		return false
	}
	for i := 0; i < len(sum); i++ {
		if c := sum[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// HasSecrets reports whether a stored intent (Result.Intent) holds a secret
// field: a keyed value (IsKeyedValue) or RedactedMarker (receipts stored
// before keyed fingerprints) as a string anywhere in it. Such an intent's
// fingerprint cannot be recomputed from the fields an API returns without
// the deployment's key and the secret pointers; a readback that matches by
// recomputing the fingerprint must not match it (and must not call the
// absence of a match proof). Invalid JSON reports true, conservatively.
func HasSecrets(intent []byte) bool {
	p := getParser()
	defer p.release()
	root, err := p.parse(intent, false)
	if err != nil {
		return true
	}
	return hasSecretString(root)
}

func hasSecretString(n *node) bool {
	switch n.kind {
	case kindString:
		return n.text == RedactedMarker || IsKeyedValue(n.text)
	case kindArray:
		for _, e := range n.elems {
			if hasSecretString(e) {
				return true
			}
		}
	case kindObject:
		for _, m := range n.members {
			if hasSecretString(m.value) {
				return true
			}
		}
	}
	return false
}
