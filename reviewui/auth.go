package reviewui

import (
	"bufio"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
)

// Errors of identity. Test with errors.Is.
var (
	// ErrNotSignedIn means the request carries no identity: no session
	// cookie, or a token no reviewer has.
	ErrNotSignedIn = errors.New("not signed in")
	// ErrUntrustedProxy means a request named its user in the trusted
	// header but did not come from a trusted proxy address.
	ErrUntrustedProxy = errors.New("request did not come through a trusted proxy")
	// ErrInvalidConfig means the identity configuration is unusable.
	ErrInvalidConfig = errors.New("invalid ui configuration")
)

// Identity says who a request is from. Credential names what proved it (a
// proxy's header, a token's hash), so that a CSRF token is bound to both.
type Identity struct {
	Reviewer   string
	Credential string
}

// Identifier tells who a request is from; a request it cannot place is an
// error matching ErrNotSignedIn or ErrUntrustedProxy.
type Identifier interface {
	Identify(r *http.Request) (Identity, error)
	// SignIn reports whether reviewers sign in with a token on the ui's
	// own page (TokenFile), rather than through a proxy.
	SignIn() bool
}

// TrustedHeader takes the reviewer's name from a header that an
// authenticating proxy (oauth2-proxy's X-Forwarded-User, for one) sets, and
// only on requests whose peer address is one of the proxies: anyone else
// could set the header themselves.
type TrustedHeader struct {
	Header  string
	Proxies []netip.Prefix
}

// NewTrustedHeader returns a TrustedHeader for header, trusted from the
// given addresses or CIDR prefixes (e.g. 127.0.0.1, 10.0.0.0/8).
func NewTrustedHeader(header string, proxies []string) (*TrustedHeader, error) {
	header = strings.TrimSpace(header)
	if header == "" {
		return nil, fmt.Errorf("%w: the trusted user header is empty", ErrInvalidConfig)
	}
	if len(proxies) == 0 {
		return nil, fmt.Errorf("%w: a trusted user header needs at least one trusted proxy address", ErrInvalidConfig)
	}
	t := &TrustedHeader{Header: http.CanonicalHeaderKey(header)}
	for _, p := range proxies {
		p = strings.TrimSpace(p)
		prefix, err := netip.ParsePrefix(p)
		if err != nil {
			addr, aerr := netip.ParseAddr(p)
			if aerr != nil {
				return nil, fmt.Errorf("%w: trusted proxy %q is neither an address nor a CIDR prefix", ErrInvalidConfig, p)
			}
			prefix = netip.PrefixFrom(addr, addr.BitLen())
		}
		t.Proxies = append(t.Proxies, prefix.Masked())
	}
	return t, nil
}

// Identify returns the header's value for a request from a trusted proxy.
func (t *TrustedHeader) Identify(r *http.Request) (Identity, error) {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return Identity{}, fmt.Errorf("%w: peer address %q", ErrUntrustedProxy, r.RemoteAddr)
	}
	addr = addr.Unmap()
	trusted := false
	for _, p := range t.Proxies {
		if p.Contains(addr) {
			trusted = true
			break
		}
	}
	if !trusted {
		return Identity{}, fmt.Errorf("%w: %s", ErrUntrustedProxy, addr)
	}
	values := r.Header.Values(t.Header)
	if len(values) != 1 || strings.TrimSpace(values[0]) == "" {
		return Identity{}, fmt.Errorf("%w: the proxy sent no single %s header", ErrNotSignedIn, t.Header)
	}
	return Identity{Reviewer: strings.TrimSpace(values[0]), Credential: "header:" + t.Header}, nil
}

// SignIn is false: the proxy signs reviewers in.
func (t *TrustedHeader) SignIn() bool { return false }

// sessionCookie holds a reviewer's token after they sign in on the ui's
// page. HttpOnly and SameSite=Strict: scripts cannot read it and no other
// site's form sends it.
const sessionCookie = "reconciler_ui_session"

// TokenFile knows each reviewer by a token of their own, read from a file
// (see LoadTokens). A reviewer signs in by typing it once; the browser then
// sends it in a session cookie.
type TokenFile struct {
	// byHash maps the SHA-256 of each token to its reviewer: the lookup
	// compares fixed-size digests, never the tokens themselves.
	byHash map[[sha256.Size]byte]string
}

// MinTokenLen is the shortest token LoadTokens accepts.
const MinTokenLen = 16

// LoadTokens reads a tokens file: one reviewer a line, "NAME TOKEN"
// separated by white space; blank lines and lines starting with # are
// skipped. Names and tokens must each be unique; a token is at least
// MinTokenLen characters.
func LoadTokens(path string) (*TokenFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: tokens file: %w", ErrInvalidConfig, err)
	}
	defer f.Close()
	t := &TokenFile{byHash: map[[sha256.Size]byte]string{}}
	names := map[string]bool{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			return nil, fmt.Errorf("%w: %s line %d: want NAME TOKEN", ErrInvalidConfig, path, n)
		}
		name, token := fields[0], fields[1]
		if len(token) < MinTokenLen {
			return nil, fmt.Errorf("%w: %s line %d: the token of %s is shorter than %d characters", ErrInvalidConfig, path, n, name, MinTokenLen)
		}
		h := sha256.Sum256([]byte(token))
		if _, dup := t.byHash[h]; dup || names[name] {
			return nil, fmt.Errorf("%w: %s line %d: a name or token appears twice", ErrInvalidConfig, path, n)
		}
		t.byHash[h], names[name] = name, true
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: tokens file: %w", ErrInvalidConfig, err)
	}
	if len(t.byHash) == 0 {
		return nil, fmt.Errorf("%w: %s names no reviewer", ErrInvalidConfig, path)
	}
	return t, nil
}

// lookup returns the reviewer whose token is token.
func (t *TokenFile) lookup(token string) (Identity, bool) {
	h := sha256.Sum256([]byte(token))
	name, ok := t.byHash[h]
	if !ok {
		return Identity{}, false
	}
	return Identity{Reviewer: name, Credential: fmt.Sprintf("token:%x", h)}, true
}

// Identify returns the reviewer whose token the session cookie holds.
func (t *TokenFile) Identify(r *http.Request) (Identity, error) {
	c, err := r.Cookie(sessionCookie)
	if err != nil || c.Value == "" {
		return Identity{}, ErrNotSignedIn
	}
	id, ok := t.lookup(c.Value)
	if !ok {
		return Identity{}, fmt.Errorf("%w: unknown token", ErrNotSignedIn)
	}
	return id, nil
}

// SignIn is true: reviewers type their token on the sign-in page.
func (t *TokenFile) SignIn() bool { return true }

// sameToken compares two secrets in constant time.
func sameToken(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}
