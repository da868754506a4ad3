package reviewui

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
)

// csrfField is the hidden form field that carries the CSRF token.
const csrfField = "csrf"

// preSessionCookie carries the random value the sign-in form must echo
// (a double-submit token: there is no identity to bind one to yet).
const preSessionCookie = "reconciler_ui_signin"

// errCSRF means a form arrived without the token its page carried.
var errCSRF = errors.New("the form's CSRF token is missing or wrong")

// csrf makes and checks the tokens of forms. A token is an HMAC, under a key
// drawn when the server starts, of the reviewer and of what proved who they
// are: another site can neither read it (same-origin policy) nor compute it,
// so a form it makes a reviewer's browser send is refused. Tokens die with
// the process: a page left open across a restart must be reloaded.
type csrf struct {
	key []byte
}

func newCSRF() (*csrf, error) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	return &csrf{key: key}, nil
}

// token is the CSRF token of id's forms.
func (c *csrf) token(id Identity) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte("csrf\x00" + id.Reviewer + "\x00" + id.Credential))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// check refuses a form of id's that lacks its token.
func (c *csrf) check(r *http.Request, id Identity) error {
	got := r.PostFormValue(csrfField)
	if got == "" || !hmac.Equal([]byte(got), []byte(c.token(id))) {
		return errCSRF
	}
	return nil
}

// randomToken returns n random bytes, base64url-encoded.
func randomToken(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b), nil
}
