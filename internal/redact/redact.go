// Package redact removes credentials from text that is about to be stored
// or shown (error messages, excerpts of response bodies), in every form an
// API or a library is known to echo them back: raw; the Basic form
// base64("user:password") with and without its scheme; base64 (standard
// and URL alphabets, padded or not) of the credential; and JSON string
// escaping. Percent-encoding is not listed form by form: a text is matched
// again once its escapes are decoded, so an echo with any of its bytes
// percent-encoded, in either hex case (sk%5Ftest%5f...), is redacted too.
//
// Build a Redactor from the credentials in play (Add, AddBasic,
// AddHeader, AddURL, or ForRequest for an outgoing request), then call
// String on every text before it is stored. Redact before cutting a text
// to a length: a cut can split a credential so that no form matches any
// more.
package redact

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/receiptledger/reconciler/internal/percent"
)

// Marker replaces every credential form found.
const Marker = "[redacted]"

// MinLen is the shortest credential part that is redacted on its own (a
// query value, a path segment, a user name): shorter ones would mask
// ordinary words. Whole credentials given to Add are redacted whatever
// their length, except the empty string.
const MinLen = 6

// Redactor replaces known credentials in text. The zero value redacts
// nothing; a nil *Redactor is valid and redacts nothing. It is not safe
// for concurrent Add; String may be called concurrently once built.
type Redactor struct {
	forms    map[string]struct{}
	replacer *strings.Replacer
	// sorted holds the forms, longest first, once String built replacer.
	sorted []string
}

// New returns a Redactor for the given credentials (see Add).
func New(secrets ...string) *Redactor {
	r := &Redactor{}
	for _, s := range secrets {
		r.Add(s)
	}
	return r
}

// Add registers a credential: every encoded form of it is redacted.
func (r *Redactor) Add(secret string) {
	if secret == "" {
		return
	}
	r.add(secret)
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		r.add(enc.EncodeToString([]byte(secret)))
	}
	if strings.Contains(secret, " ") {
		// A query's '+' for a space is not a percent escape: String's
		// decoding does not undo it.
		r.add(url.QueryEscape(secret))
	}
	if b, err := json.Marshal(secret); err == nil {
		js := string(b[1 : len(b)-1])
		r.add(js)
		r.add(strings.ReplaceAll(js, "/", `\/`))
	}
}

// AddPart registers a part of a credential (a user name, a query value, a
// path segment) when it is at least MinLen bytes long.
func (r *Redactor) AddPart(part string) {
	if len(part) >= MinLen {
		r.Add(part)
	}
}

// AddBasic registers HTTP Basic credentials: "user:password", the
// password, "Basic " + base64("user:password"), and the user name (when at
// least MinLen long).
func (r *Redactor) AddBasic(user, password string) {
	pair := user + ":" + password
	r.Add(pair)
	r.Add(password)
	r.AddPart(user)
	r.Add("Basic " + base64.StdEncoding.EncodeToString([]byte(pair)))
}

// AddHeader registers the value of a credential-bearing header
// (Authorization, Proxy-Authorization, an API key header, Cookie): the
// whole value and, after an auth scheme ("Bearer x", "Basic x", "Token
// x"), the credential; a Basic credential is decoded and registered with
// AddBasic as well.
func (r *Redactor) AddHeader(value string) {
	value = strings.TrimSpace(value)
	if value == "" {
		return
	}
	r.Add(value)
	scheme, cred, ok := strings.Cut(value, " ")
	if !ok {
		return
	}
	cred = strings.TrimSpace(cred)
	r.Add(cred)
	if strings.EqualFold(scheme, "basic") {
		if b, err := base64.StdEncoding.DecodeString(cred); err == nil {
			if user, pass, ok := strings.Cut(string(b), ":"); ok {
				r.AddBasic(user, pass)
			}
		}
	}
}

// AddURL registers the credentials a URL can carry: its user info (as
// Basic credentials), its raw query and every query value (AddPart), and,
// when pathSecret is set, its path (escaped and not) and every path
// segment (AddPart), for a URL whose path is the secret (a webhook).
func (r *Redactor) AddURL(u *url.URL, pathSecret bool) {
	if u == nil {
		return
	}
	if u.User != nil {
		pass, _ := u.User.Password()
		if pass != "" {
			r.AddBasic(u.User.Username(), pass)
		} else {
			r.AddPart(u.User.Username())
		}
		r.Add(u.User.String())
	}
	if u.RawQuery != "" {
		r.Add(u.RawQuery)
		for _, vs := range u.Query() {
			for _, v := range vs {
				r.AddPart(v)
			}
		}
	}
	if pathSecret && u.Path != "" && u.Path != "/" {
		r.Add(u.EscapedPath())
		r.Add(u.Path)
		for _, seg := range strings.Split(u.Path, "/") {
			r.AddPart(seg)
		}
	}
}

// SensitiveHeader reports whether a header carries credentials: the auth
// headers, cookies, and any header whose name says key, token, secret,
// password, signature, session, auth or credential.
func SensitiveHeader(name string) bool {
	n := strings.ToLower(name)
	switch n {
	case "authorization", "proxy-authorization", "cookie", "set-cookie":
		return true
	}
	for _, w := range []string{"key", "token", "secret", "password", "passwd", "signature", "session", "auth", "credential"} {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

// ForRequest returns a Redactor for the credentials of an outgoing
// request: its credential-bearing headers (see AddHeader), its URL's user
// info and query, and its path when pathSecret is set (see AddURL).
func ForRequest(req *http.Request, pathSecret bool) *Redactor {
	r := &Redactor{}
	if req == nil {
		return r
	}
	for name, vs := range req.Header {
		if SensitiveHeader(name) {
			for _, v := range vs {
				r.AddHeader(v)
			}
		}
	}
	r.AddURL(req.URL, pathSecret)
	return r
}

// String returns s with every registered credential form replaced by
// Marker, longest forms first: as written, and then once s's percent
// escapes are decoded (see decodedMatches), whatever bytes were encoded.
func (r *Redactor) String(s string) string {
	if r == nil || len(r.forms) == 0 || s == "" {
		return s
	}
	if r.replacer == nil {
		r.sorted = make([]string, 0, len(r.forms))
		for f := range r.forms {
			r.sorted = append(r.sorted, f)
		}
		// Longest first: strings.Replacer tries the old strings in
		// argument order at each position, so "Basic <b64>" goes before
		// the parts it contains.
		slices.SortFunc(r.sorted, func(a, b string) int {
			if len(a) != len(b) {
				return len(b) - len(a)
			}
			return strings.Compare(a, b)
		})
		pairs := make([]string, 0, 2*len(r.sorted))
		for _, f := range r.sorted {
			pairs = append(pairs, f, Marker)
		}
		r.replacer = strings.NewReplacer(pairs...)
	}
	spans, decoded := r.decodedMatches(s)
	if !decoded {
		return r.replacer.Replace(s)
	}
	var b strings.Builder
	b.Grow(len(s))
	at := 0
	for _, sp := range spans {
		b.WriteString(s[at:sp[0]])
		b.WriteString(Marker)
		at = sp[1]
	}
	b.WriteString(s[at:])
	return b.String()
}

// decodedMatches returns the spans of s (sorted, disjoint, [start, end))
// that are a registered form once their percent escapes are decoded, or
// as written (a form holding a '%' itself); decoded is false when s holds
// no escape (String then replaces the forms as written). It decodes s
// once: a view of s with every valid %XX replaced by its byte, each view
// position mapped back to s through the positions of the escapes, so a
// match in the view is cut from s whole, escapes and all. Overlapping
// matches are cut as one.
func (r *Redactor) decodedMatches(s string) (spans [][2]int, decoded bool) {
	if strings.IndexByte(s, '%') < 0 {
		return nil, false
	}
	view := make([]byte, 0, len(s))
	var escapes []int // view positions holding a decoded escape, ascending
	for i := 0; i < len(s); i++ {
		if d, ok := percent.At(s, i); ok {
			escapes = append(escapes, len(view))
			view = append(view, d)
			i += 2
			continue
		}
		view = append(view, s[i])
	}
	if len(escapes) == 0 {
		return nil, false
	}
	// orig maps a view position to s: each escape before it took 3 bytes.
	orig := func(k int) int { n, _ := slices.BinarySearch(escapes, k); return k + 2*n }
	v := string(view)
	for _, f := range r.sorted {
		for _, at := range indexAll(v, f) {
			spans = append(spans, [2]int{orig(at), orig(at + len(f))})
		}
		if strings.IndexByte(f, '%') >= 0 {
			for _, at := range indexAll(s, f) {
				spans = append(spans, [2]int{at, at + len(f)})
			}
		}
	}
	if len(spans) == 0 {
		return nil, true
	}
	slices.SortFunc(spans, func(x, y [2]int) int { return x[0] - y[0] })
	merged := spans[:1]
	for _, sp := range spans[1:] {
		if last := &merged[len(merged)-1]; sp[0] <= last[1] {
			last[1] = max(last[1], sp[1])
			continue
		}
		merged = append(merged, sp)
	}
	return merged, true
}

// indexAll returns where f occurs in s, overlapping occurrences included.
func indexAll(s, f string) []int {
	var at []int
	for from := 0; ; {
		i := strings.Index(s[from:], f)
		if i < 0 {
			return at
		}
		at = append(at, from+i)
		from += i + 1
	}
}

// Empty reports whether r redacts nothing.
func (r *Redactor) Empty() bool { return r == nil || len(r.forms) == 0 }

// add registers one literal form.
func (r *Redactor) add(form string) {
	if form == "" || form == Marker {
		return
	}
	if r.forms == nil {
		r.forms = make(map[string]struct{})
	}
	r.forms[form] = struct{}{}
	r.replacer = nil
}
