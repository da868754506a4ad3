// Package httpadapter is the declarative HTTP readback adapter: an operator
// points the reconciler at a real API from the adapters file (type: http)
// without writing Go. One block says how to reach the API (base URL,
// credentials from an environment variable or a file, timeout), how to list
// or fetch what the receipt's call may have produced (path and query
// templates over the receipt, its time window and its intent; pagination by
// body cursor, Link header, page number or offset, with a bound; an
// absence read through a list that concurrent writes can shift is
// confirmed), where the items, ids and creation times are (JSON pointers),
// and how to recognize the
// effect (a marker the agent put in the resource, or the intent's
// fingerprint recomputed over the item's fields). Presets give the shapes of
// Stripe-style, GitHub-style and plain REST APIs.
//
// Everything is validated when the file is loaded: an unknown key, a bad
// JSON pointer or a template naming an undeclared intent field fails at
// start with the file, the adapter and the field. Credentials live only in
// request headers: never in a Result's Query or Evidence, in errors or in
// logs.
package httpadapter

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/internal/redact"
	"github.com/receiptledger/reconciler/readback"
)

// TypeName is the adapters file's `type` for this adapter.
const TypeName = "http"

// Option configures the adapters built by Types.
type Option func(*options)

type options struct {
	client    *http.Client
	now       func() time.Time
	lookupEnv func(string) (string, bool)
	sleep     func(ctx context.Context, d time.Duration) error
	jitter    func(ceiling time.Duration) time.Duration
}

// WithHTTPClient sets the client requests go through (default: a client
// without a global timeout; each request has the block's timeout).
func WithHTTPClient(c *http.Client) Option { return func(o *options) { o.client = c } }

// WithClock sets the clock that ends the time window (default time.Now);
// tests inject the reconciler's clock.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// WithRetryWait sets how an in-check retry waits (default: a timer that
// ctx ends early) and how its full-jitter backoff is drawn (default: a
// uniform random duration in [0, ceiling)). Tests inject both, so no test
// sleeps.
func WithRetryWait(sleep func(ctx context.Context, d time.Duration) error, jitter func(ceiling time.Duration) time.Duration) Option {
	return func(o *options) {
		if sleep != nil {
			o.sleep = sleep
		}
		if jitter != nil {
			o.jitter = jitter
		}
	}
}

// WithLookupEnv sets how auth.env is resolved (default os.LookupEnv).
func WithLookupEnv(f func(string) (string, bool)) Option {
	return func(o *options) { o.lookupEnv = f }
}

func newOptions(opts []Option) *options {
	o := &options{client: &http.Client{CheckRedirect: sameHostRedirects}, now: time.Now, lookupEnv: os.LookupEnv,
		sleep: sleepCtx, jitter: fullJitter}
	for _, f := range opts {
		f(o)
	}
	return o
}

// Types returns the adapter types of this package for readback.LoadFile:
// "http".
func Types(opts ...Option) readback.Types {
	o := newOptions(opts)
	return readback.Types{TypeName: func(name string, settings *yaml.Node) (readback.Adapter, error) {
		return newAdapter(name, settings, o)
	}}
}

// LoadFile is readback.LoadFile with the http type added to extra, and a
// check that each http adapter's block can read back its declared kind (a
// search block reads creates; fetch with compare reads updates; fetch alone
// reads deletes). Errors are *readback.ConfigError naming the file, the
// adapter and the field.
func LoadFile(path string, extra readback.Types, opts ...Option) (*readback.Registry, error) {
	types := readback.Types{}
	for k, v := range Types(opts...) {
		types[k] = v
	}
	for k, v := range extra {
		types[k] = v
	}
	reg, err := readback.LoadFile(path, types)
	if err != nil {
		return nil, err
	}
	if err := CheckKinds(path, reg); err != nil {
		return nil, err
	}
	return reg, nil
}

// CheckKinds verifies that every http adapter in reg reads the kind its
// binding declares; file names the adapters file in the error.
func CheckKinds(file string, reg *readback.Registry) error {
	for _, b := range reg.Bindings() {
		a, ok := b.Adapter.(*Adapter)
		if !ok {
			continue
		}
		if k := a.Kind(); k != b.Kind {
			return &readback.ConfigError{File: file, Adapter: b.Name, Field: "kind",
				Err: fmt.Errorf("the http block reads %s operations (%s), not %s", k, a.shape(), b.Kind)}
		}
		if a.cfg.preset == "stripe" && b.Policy.IdempotencyKeys && b.Policy.IdempotencyRetention > 24*time.Hour {
			// Relying on a key Stripe has already forgotten would let a
			// straggler land after safe_to_retry.
			return &readback.ConfigError{File: file, Adapter: b.Name, Field: "idempotency.retention",
				Err: errors.New("Stripe keeps idempotency keys for 24h; a longer retention is unsafe")}
		}
	}
	return nil
}

// Adapter is one configured http block. Build it through Types or LoadFile.
type Adapter struct {
	cfg    *config
	client *http.Client
	now    func() time.Time
	opts   *options
	// red removes every encoded form of the block's credential (raw,
	// Basic, base64, URL- and percent-encoded, JSON-escaped) from text an
	// API may echo it in: error bodies, transport errors.
	red *redact.Redactor
}

func newAdapter(name string, settings *yaml.Node, o *options) (*Adapter, error) {
	cfg, err := parseSettings(name, settings, o)
	if err != nil {
		return nil, err
	}
	red := redact.New()
	if cfg.auth != nil {
		red.Add(cfg.auth.secret)
		red.AddHeader(cfg.auth.value)
	}
	return &Adapter{cfg: cfg, client: o.client, now: o.now, opts: o, red: red}, nil
}

// Kind returns the kind of operation the block reads back.
func (a *Adapter) Kind() readback.Kind { return a.cfg.kinds()[0] }

func (a *Adapter) shape() string {
	switch {
	case a.cfg.search != nil:
		return "search"
	case len(a.cfg.compare) > 0:
		return "fetch with compare"
	}
	return "fetch without compare"
}

// AbsenceNote says, for `reconciler adapters check`, what an absence read
// by this adapter relies on when the file's choices decide it, or "" when
// nothing needs saying. Today: an unpaged list (pagination style none),
// whose absence is authoritative only when declared whole or narrowed to
// the receipt's key.
func (a *Adapter) AbsenceNote() string {
	s := a.cfg.search
	if s == nil || a.cfg.pagination.Style != "none" {
		return ""
	}
	switch {
	case a.cfg.pagination.WholeList:
		return "unpaged list declared whole (search.pagination.whole_list): its absences rely on the endpoint " +
			"answering the whole collection in one response, never a first page"
	case s.narrowed:
		return "unpaged list narrowed to the receipt's key: an absence is authoritative only when no item " +
			"returned lacks the marker (the API honoured the filter)"
	}
	return "unpaged list neither narrowed to the receipt's key nor declared whole: no absence it reads is " +
		"authoritative, so none settles safe_to_retry; declare the pagination, name the key in the query, " +
		"or set search.pagination.whole_list if the endpoint answers the whole collection"
}

// Evidence is what a check records besides its query: enough for a human
// to see why the adapter answered as it did.
type Evidence struct {
	// Pages is the number of pages read; Truncated is set when the page
	// bound stopped the search before the end of the list.
	Pages     int  `json:"pages,omitempty"`
	Truncated bool `json:"truncated,omitempty"`
	// Passes is how many times the whole list was read, PassItems the items
	// each pass saw. A list whose pages concurrent writes can shift (page
	// numbers, offsets) is read twice unless one read suffices.
	Passes    int   `json:"passes,omitempty"`
	PassItems []int `json:"pass_items,omitempty"`
	// Confirmation says why an absence read through such a list, or
	// through an unpaged list (pagination style none), is authoritative:
	// "single_response" (the first response was the whole list),
	// "narrowed" (the query asks for the receipt's key and every item
	// returned carries the marker), "two_passes" (two full reads saw the
	// same items in the same order) or, for an unpaged list, "whole_list"
	// (the adapters file declares that the endpoint answers the whole
	// collection in one response).
	Confirmation string `json:"confirmation,omitempty"`
	// Items is the number of items seen, OutsideWindow how many of them were
	// ignored because they were created outside the receipt's window.
	Items         int `json:"items,omitempty"`
	OutsideWindow int `json:"outside_window,omitempty"`
	// MarkedOutsideWindow lists the ids of items that carry the receipt's
	// marker but whose creation time lies outside the window: they match
	// all the same (the window filters only fingerprint matches), since
	// the marker names the receipt's step whatever the API's clock says.
	// An entry here usually means the API's clock is off by more than
	// window_skew, or an earlier attempt of the same step took effect.
	MarkedOutsideWindow []string `json:"marked_outside_window,omitempty"`
	// MatchedBy is "marker" or "fingerprint".
	MatchedBy string `json:"matched_by,omitempty"`
	// WindowStart and WindowEnd bound the creation times considered.
	WindowStart *time.Time `json:"window_start,omitempty"`
	WindowEnd   *time.Time `json:"window_end,omitempty"`
	// Status is the fetch's HTTP status.
	Status int `json:"status,omitempty"`
	// Fields compares an update's fields: for each resource pointer,
	// "intended", "pre_image" or "other".
	Fields map[string]string `json:"fields,omitempty"`
	// Reason explains a diverged, inconclusive or non-authoritative answer.
	Reason string `json:"reason,omitempty"`
	// PageRetries is how many requests of the check (pages of a search,
	// or the fetch) were retried within it after a transient failure, and
	// Retries says which and why (see the block's retry settings). The
	// pages read before a retried one are kept: the retry resumes at it.
	PageRetries int         `json:"page_retries,omitempty"`
	Retries     []RetryNote `json:"retries,omitempty"`
	// Sanitized is set when a string of the result (query, ids, evidence)
	// was altered to be stored: invalid UTF-8 or a NUL replaced, or cut.
	Sanitized bool `json:"sanitized,omitempty"`
}

// Check reads the receipt's effect back. It never changes the external
// system: only GET (or an operator-vouched read-only POST) is sent.
//
// Every string of the Result and of an error is valid UTF-8 without NUL
// and bounded (clean.go): the Result's query, ids and evidence, and any
// response text an error quotes.
func (a *Adapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	res, err := a.check(ctx, r)
	if err != nil {
		return readback.Result{}, cleanError(err)
	}
	return cleanResult(res), nil
}

func (a *Adapter) check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	sc, err := a.scope(r)
	if err != nil {
		return readback.Result{}, err
	}
	if a.cfg.search != nil {
		res, err := a.search(ctx, sc)
		if err == nil && res.Verdict != readback.VerdictPresent && a.cfg.fp != nil && holdsSecretMarker(sc.payload) {
			// The intent's secret fields are stored as markers, so no
			// item's fields can reproduce its fingerprint: not finding one
			// by fingerprint proves nothing.
			return readback.Result{}, readback.PermanentError(fmt.Errorf("receipt %d: %w: match.fingerprint cannot "+
				"recognize the effect of an intent with secret fields, and no item carries the marker", r.ID, errSecretField))
		}
		return res, err
	}
	return a.fetchOne(ctx, sc)
}

func (a *Adapter) scope(r readback.Receipt) (*scope, error) {
	from := r.SubmittedAt
	if from.IsZero() {
		from = r.CreatedAt
	}
	sc := &scope{r: r, start: from.Add(-a.cfg.skew), end: a.now().Add(a.cfg.skew), intentField: a.cfg.intent}
	if len(r.Intent) > 0 {
		var doc map[string]any
		if err := decodeJSON(r.Intent, &doc); err != nil {
			return nil, readback.PermanentError(fmt.Errorf("receipt %d: intent: %w", r.ID, err))
		}
		// The stored intent is {"method","payload","target"}; intent fields
		// point into the payload, as the agent wrote it.
		if p, ok := doc["payload"].(map[string]any); ok {
			sc.payload = p
		}
	}
	return sc, nil
}

func decodeJSON(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	return d.Decode(v)
}

// buildURL renders path and query against the receipt. Every substituted
// value but {receipt.target} is one path segment: escaped with
// url.PathEscape, and kept escaped (RawPath), so a key holding '/' never
// becomes two segments. A path with a "." or ".." segment is refused: it
// would read another resource than the one named.
func (a *Adapter) buildURL(sc *scope, path template, query map[string]template) (*url.URL, error) {
	p, err := path.render(sc, true)
	if err != nil {
		return nil, readback.PermanentError(err)
	}
	rel, err := url.Parse(p)
	if err != nil || rel.Host != "" || rel.Scheme != "" || rel.Opaque != "" || rel.User != nil || rel.Fragment != "" {
		return nil, readback.PermanentError(fmt.Errorf("path %q is not a path on %s", p, a.cfg.base.Host))
	}
	escaped := rel.EscapedPath()
	for _, seg := range strings.Split(escaped, "/") {
		if dec, err := url.PathUnescape(seg); err == nil && (dec == "." || dec == "..") {
			return nil, readback.PermanentError(fmt.Errorf("path %q has a %q segment: it would name another resource", p, dec))
		}
	}
	u := *a.cfg.base
	raw := strings.TrimRight(a.cfg.base.EscapedPath(), "/") + "/" + strings.TrimLeft(escaped, "/")
	if u.Path, err = url.PathUnescape(raw); err != nil {
		return nil, readback.PermanentError(fmt.Errorf("path %q: %w", p, err))
	}
	u.RawPath = raw
	q := rel.Query()
	for k, t := range query {
		v, err := t.render(sc, false)
		if err != nil {
			return nil, readback.PermanentError(err)
		}
		if v != "" { // an empty value omits the parameter (override a preset's with "")
			q.Set(k, v)
		}
	}
	u.RawQuery = q.Encode()
	return &u, nil
}

// response is one successful read.
type response struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request and classifies failures. gone lists statuses that
// are answers (a fetch's 404), not errors.
func (a *Adapter) do(ctx context.Context, method string, u *url.URL, gone []int) (*response, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, readback.PermanentError(fmt.Errorf("%s %s: %w", method, u.Redacted(), err))
	}
	for k, v := range a.cfg.headers {
		req.Header[k] = v
	}
	req.Header.Set("Accept", firstNonEmpty(a.cfg.headers.Get("Accept"), "application/json"))
	if a.cfg.auth != nil {
		req.Header.Set(a.cfg.auth.header, a.cfg.auth.value)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		// Timeouts, resets and refused connections may pass.
		return nil, readback.TransientError(fmt.Errorf("%s %s: %w", method, u.Redacted(), a.redactErr(err)), 0)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, int64(a.cfg.maxBytes)+1))
	if err != nil {
		return nil, readback.TransientError(fmt.Errorf("%s %s: reading the body: %w", method, u.Redacted(), err), 0)
	}
	if len(body) > a.cfg.maxBytes {
		return nil, readback.PermanentError(fmt.Errorf("%s %s: %w: larger than %d bytes (max_response_bytes)",
			method, u.Redacted(), errTooLarge, a.cfg.maxBytes))
	}
	for _, g := range gone {
		if resp.StatusCode == g {
			return &response{status: resp.StatusCode, header: resp.Header, body: body}, nil
		}
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return &response{status: resp.StatusCode, header: resp.Header, body: body}, nil
	}
	statusErr := &StatusError{Method: method, URL: u.Redacted(), Status: resp.StatusCode, Body: a.snippet(body)}
	wait := a.retryAfter(resp.Header)
	switch {
	case resp.StatusCode == http.StatusTooManyRequests:
		return nil, readback.TransientError(statusErr, wait)
	case resp.StatusCode == http.StatusForbidden && a.rateLimited(resp.Header):
		// GitHub answers an exhausted rate limit with 403, not 429.
		return nil, readback.TransientError(statusErr, wait)
	case resp.StatusCode >= 500 || resp.StatusCode == http.StatusRequestTimeout:
		return nil, readback.TransientError(statusErr, wait)
	}
	// 401/403 (credentials), 404 on the endpoint itself (bad path or base
	// URL) and every other 4xx: asking again cannot help.
	return nil, readback.PermanentError(statusErr)
}

// StatusError is an unexpected HTTP status from the API. Body is a short,
// credential-redacted excerpt of the response.
type StatusError struct {
	Method string
	URL    string
	Status int
	Body   string
}

// Error says which request got which status, with the excerpt.
func (e *StatusError) Error() string {
	msg := fmt.Sprintf("%s %s: HTTP %d %s", e.Method, e.URL, e.Status, http.StatusText(e.Status))
	if e.Body != "" {
		msg += ": " + e.Body
	}
	return msg
}

// snippet is a short excerpt of an error body with the secret removed, in
// case the API echoes the request's credentials back.
func (a *Adapter) snippet(body []byte) string {
	// Redacted before it is cut: a cut could split a credential so that
	// no form of it matches any more.
	s := a.red.String(strings.TrimSpace(string(body)))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return clean(s, maxExcerptBytes+len("..."))
}

// decode checks body against the response bounds (items names the list
// whose elements count against maxItems; nil for a fetch), then decodes
// it. A page that is not JSON is transient (a proxy may have cut it); one
// over a bound is permanent: never an absence.
func (a *Adapter) decode(u *url.URL, body []byte, items *pointer, maxItems int) (any, error) {
	maxValues := valuesPerItem*maxItems + baseValues
	if err := scanBounds(body, items, maxItems, maxValues); err != nil {
		if errors.Is(err, errTooLarge) {
			return nil, readback.PermanentError(fmt.Errorf("%s: %w (raise search.max_page_items or ask for smaller pages)", u.Redacted(), err))
		}
		return nil, readback.TransientError(fmt.Errorf("%s: %w: %w", u.Redacted(), errNotJSON, err), 0)
	}
	var doc any
	if err := decodeJSON(body, &doc); err != nil {
		return nil, readback.TransientError(fmt.Errorf("%s: %w: %w", u.Redacted(), errNotJSON, err), 0)
	}
	return doc, nil
}

// getList asks for the list at u and decodes the answer (see decode): one
// attempt, for a retrier to repeat.
func (a *Adapter) getList(ctx context.Context, method string, u *url.URL, items *pointer, maxItems int) (*response, any, error) {
	r, err := a.do(ctx, method, u, nil)
	if err != nil {
		return nil, nil, err
	}
	d, err := a.decode(u, r.body, items, maxItems)
	if err != nil {
		return nil, nil, err
	}
	return r, d, nil
}

func (a *Adapter) redactErr(err error) error { return readback.RedactError(err, a.red) }

func (a *Adapter) rateLimited(h http.Header) bool {
	rl := a.cfg.rateLimit
	return rl.RemainingHeader != "" && strings.TrimSpace(h.Get(rl.RemainingHeader)) == "0"
}

// retryAfter reads Retry-After (seconds or an HTTP date) and the declared
// rate-limit reset header; the longer wait wins.
func (a *Adapter) retryAfter(h http.Header) time.Duration {
	now := a.now()
	var wait time.Duration
	if v := strings.TrimSpace(h.Get("Retry-After")); v != "" {
		if s, err := strconv.ParseFloat(v, 64); err == nil && s > 0 {
			wait = time.Duration(s * float64(time.Second))
		} else if t, err := http.ParseTime(v); err == nil {
			wait = t.Sub(now)
		}
	}
	rl := a.cfg.rateLimit
	if rl.ResetHeader != "" && (rl.RemainingHeader == "" || a.rateLimited(h)) {
		if v, err := strconv.ParseInt(strings.TrimSpace(h.Get(rl.ResetHeader)), 10, 64); err == nil {
			var d time.Duration
			if rl.ResetFormat == "seconds" {
				d = time.Duration(v) * time.Second
			} else {
				d = time.Unix(v, 0).Sub(now)
			}
			wait = max(wait, d)
		}
	}
	return max(wait, 0)
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// sameHostRedirects refuses a redirect to another host or scheme (https to
// http would send the credential in clear): a custom auth header
// (scheme: header) would otherwise follow it, and Go's client only strips
// Authorization and Cookie. The refused redirect is returned as the response,
// whose 3xx status the adapter reports as an error.
func sameHostRedirects(req *http.Request, via []*http.Request) error {
	if len(via) >= 10 {
		return errors.New("stopped after 10 redirects")
	}
	if req.URL.Host != via[0].URL.Host || req.URL.Scheme != via[0].URL.Scheme {
		return http.ErrUseLastResponse
	}
	return nil
}
