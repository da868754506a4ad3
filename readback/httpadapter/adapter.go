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
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/fingerprint"
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

// search lists the candidates page by page and matches them.
//
// An absence is authoritative only if the read covered every candidate
// (SPEC §5a): not truncated by max_pages, read to the list's declared end
// (a cursor list whose has_more is missing, or a page-number list whose
// server ignores the page parameter, is not); for an unpaged list (style
// none), known to be the whole list: declared so (whole_list), or narrowed
// to the receipt's key with every item returned carrying the marker, since
// one response of a paginated API is its first page and looks the same;
// and, for a list whose pages
// concurrent writes can shift (page numbers, offsets, Link headers carrying
// them), confirmed: the whole list came in one response, or the query is
// narrowed to the receipt's key and every item returned carries the marker,
// or a second full pass, begun after the first ended, saw the same items in
// the same order.
func (a *Adapter) search(ctx context.Context, sc *scope) (readback.Result, error) {
	s := a.cfg.search
	pg := a.cfg.pagination
	first, err := a.buildURL(sc, s.path, s.query)
	if err != nil {
		return readback.Result{}, err
	}
	if pg.Style == "page" || pg.Style == "offset" {
		// Ask for the first page explicitly: APIs differ on the default.
		q := first.Query()
		q.Set(pg.Param, strconv.Itoa(*pg.Start))
		first.RawQuery = q.Encode()
	}
	start, end := sc.start.UTC(), sc.end.UTC()
	ev := &Evidence{WindowStart: &start, WindowEnd: &end}
	res := readback.Result{Query: s.method + " " + first.Redacted(), Evidence: ev}
	m, err := a.matcher(sc)
	if err != nil {
		return readback.Result{}, err
	}
	present := func(p *pass) (readback.Result, error) {
		res.ExternalIDs, ev.MatchedBy = p.matches, p.matchedBy
		res.Verdict, res.Authoritative = readback.VerdictPresent, true
		return res, nil
	}
	// incomplete: nothing found in what was read, but the read did not
	// cover the list: never proof.
	incomplete := func(p *pass) (readback.Result, error) {
		ev.Truncated, ev.Reason = p.truncated, p.incomplete
		res.Verdict, res.Authoritative = readback.VerdictAbsent, false
		return res, nil
	}
	rt := a.retrier(ctx, ev)
	p1, err := a.readPass(ctx, rt, sc, first, m, ev)
	if err != nil {
		return readback.Result{}, err
	}
	switch {
	case len(p1.matches) > 0:
		return present(p1)
	case p1.incomplete != "":
		return incomplete(p1)
	case pg.Style == "none":
		return a.unpagedAbsence(res, ev, p1)
	case !a.cfg.shiftable():
		// Cursors (read until has_more is false) cannot skip an item.
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	case p1.requests == 1:
		// The first response was the whole list: no page boundary for a
		// concurrent write to shift an item across.
		ev.Confirmation = "single_response"
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	case s.narrowed && p1.nonEmpty <= 1 && p1.foreign == 0:
		// The query asks for the receipt's key and the server honoured it
		// (every item returned carries the marker, none in the window): only
		// the key's own resources could shift, and there was one page of them.
		ev.Confirmation = "narrowed"
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	}
	// A page-number or offset list can skip an item under concurrent
	// writes (one deleted on page 1 shifts ours back onto page 1 after it
	// was read): read it all again, after the first pass ended.
	p2, err := a.readPass(ctx, rt, sc, first, m, ev)
	if err != nil {
		return readback.Result{}, err
	}
	switch {
	case len(p2.matches) > 0:
		return present(p2)
	case p2.incomplete != "":
		return incomplete(p2)
	case !slices.Equal(p1.ids, p2.ids):
		ev.Reason = fmt.Sprintf("the list changed between two passes (%d items, then %d): "+
			"a %s list can skip items under concurrent writes, so its absence is not proof; "+
			"narrow the search to the receipt's key to avoid the second pass", len(p1.ids), len(p2.ids), pg.Style)
		res.Verdict, res.Authoritative = readback.VerdictInconclusive, false
		return res, nil
	}
	ev.Confirmation = "two_passes"
	res.Verdict, res.Authoritative = readback.VerdictAbsent, true
	return res, nil
}

// unpagedAbsence decides whether nothing found in the one response of an
// unpaged list (style none) is proof. The response says nothing about
// whether it is the whole list or the first page of a paginated one (a
// misconfiguration: the API pages, the file says none), and a positive
// control does not tell them apart when the control's item is on that
// first page. So the absence is authoritative only when the file vouches
// that the endpoint answers the whole collection (whole_list), or when the
// query names the receipt's key and the API honoured it (every item
// returned carries the marker; since a marked item matches, that means
// none came back): a first page of the key's own items holds ours if any.
func (a *Adapter) unpagedAbsence(res readback.Result, ev *Evidence, p *pass) (readback.Result, error) {
	res.Verdict = readback.VerdictAbsent
	switch {
	case a.cfg.pagination.WholeList:
		ev.Confirmation, res.Authoritative = "whole_list", true
	case a.cfg.search.narrowed && p.foreign == 0:
		ev.Confirmation, res.Authoritative = "narrowed", true
	case a.cfg.search.narrowed:
		ev.Reason = fmt.Sprintf("unpaged list (pagination style none): the query names the receipt's key but %d item(s) "+
			"returned do not carry its marker, so the API ignored the filter and the response may be the first page "+
			"of a longer list; declare the pagination, or search.pagination.whole_list if the endpoint always "+
			"answers the whole collection", p.foreign)
	default:
		ev.Reason = "unpaged list (pagination style none) not narrowed to the receipt's key: one response may be " +
			"the first page of a paginated list, so it does not prove an absence; declare the pagination, name " +
			"the key in the query, or set search.pagination.whole_list if the endpoint always answers the whole collection"
	}
	return res, nil
}

// pass is one read of the whole list, from its first page to its end.
type pass struct {
	requests int
	// nonEmpty counts the pages that held at least one item.
	nonEmpty int
	// ids are every item's identity, in the order served (duplicates
	// kept): two passes agree when these are equal.
	ids []string
	// foreign counts the items that do not carry the receipt's marker.
	foreign   int
	matches   []string
	matchedBy string
	// truncated: max_pages stopped the pass; incomplete says why the pass
	// did not reach the end of the list ("" when it did).
	truncated  bool
	incomplete string
	// insane counts unmarked items whose creation time is outside any
	// sane range (saneTime); insaneReason describes the first. Such a
	// pass proves no absence (incompleteAfter, applied once the pass ends).
	insane          int
	insaneReason    string
	incompleteAfter string
}

// readPass reads the list once, from first to its end or the page bound,
// adding what it saw to ev. A pass that saw an unmarked item with an absurd
// creation time is incomplete: its absence proves nothing.
func (a *Adapter) readPass(ctx context.Context, rt *retrier, sc *scope, first *url.URL, m *itemMatcher, ev *Evidence) (*pass, error) {
	p, err := a.readPassOnce(ctx, rt, sc, first, m, ev)
	if err == nil && p.incomplete == "" && p.incompleteAfter != "" {
		p.incomplete = p.incompleteAfter
	}
	return p, err
}

func (a *Adapter) readPassOnce(ctx context.Context, rt *retrier, sc *scope, first *url.URL, m *itemMatcher, ev *Evidence) (*pass, error) {
	s := a.cfg.search
	pg := a.cfg.pagination
	p := &pass{}
	ev.Passes++
	defer func() { ev.PassItems = append(ev.PassItems, len(p.ids)) }()
	seen := map[string]bool{}
	var prevPage []string
	u := first
	page := *pg.Start
	for {
		// A failed page (timeout, 5xx, a short Retry-After, a cut or
		// garbled body: a proxy's fault) is asked again within the pass,
		// at the same URL: the pages before it stay read, and the pass
		// goes on from it exactly as if the first answer had been good.
		var resp *response
		var doc any
		err := rt.do(ctx, ev.Passes, p.requests+1, func() error {
			r, err := a.do(ctx, s.method, u, nil)
			if err != nil {
				return err
			}
			d, err := a.decode(u, r.body, &s.items, s.maxItems)
			if err != nil {
				return err
			}
			resp, doc = r, d
			return nil
		})
		if err != nil {
			return nil, err
		}
		p.requests++
		ev.Pages++
		raw, ok := s.items.get(doc)
		list, isList := raw.([]any)
		if !ok || !isList {
			return nil, readback.PermanentError(fmt.Errorf("%s: items pointer %q does not name a list in the response", u.Redacted(), s.items.text))
		}
		if len(list) > 0 {
			p.nonEmpty++
		}
		pageIDs := make([]string, 0, len(list))
		for i, item := range list {
			ev.Items++
			pageIDs = append(pageIDs, identity(item, s.id))
			marked := m.marker(item)
			if !marked {
				p.foreign++
			}
			// A marked item is the receipt's step's whatever its creation
			// time: the window (an API clock off by more than window_skew
			// would put ours outside it) filters only fingerprint matches,
			// which cannot tell two identical calls apart. So its time may
			// even be missing or absurd.
			created, err := a.createdAt(item)
			if err != nil && !marked {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if why := saneTime(created, sc.end); err == nil && why != "" && !marked && a.cfg.fp != nil {
				// Not a time this item can have (milliseconds read as
				// seconds, seconds as milliseconds, a placeholder): whether
				// it lies in the window is unknown, so it might be ours
				// (a fingerprint match). Unmarked items matter only to the
				// fingerprint: with a marker alone, their time is moot.
				p.insane++
				if p.insaneReason == "" {
					p.insaneReason = fmt.Sprintf("item %d: created-at %s at %q is %s (created_at_format %q?): "+
						"an item whose creation time is unknown may be the receipt's, so no absence is proven",
						i, created.UTC().Format(time.RFC3339), s.createdAt.text, why, firstNonEmpty(s.createdAtFormat, "rfc3339"))
				}
				continue
			}
			outside := err != nil || created.Before(sc.start) || created.After(sc.end)
			by := ""
			if marked {
				by = "marker"
			} else if outside {
				ev.OutsideWindow++
				continue
			} else if by, err = m.fingerprint(item); err != nil {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if by == "" {
				continue
			}
			id, err := idOf(item, s.id)
			if err != nil {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if why := usableID(id); why != "" {
				// The effect is there, but its id cannot be recorded as is.
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d matched by %s, but its id at %q %s: "+
					"it cannot be recorded as the external id", u.Redacted(), i, by, s.id.text, why))
			}
			if !seen[id] { // pages may overlap when the list moves under us
				seen[id] = true
				p.matches = append(p.matches, id)
				p.matchedBy = by
				if outside && !slices.Contains(ev.MarkedOutsideWindow, id) {
					ev.MarkedOutsideWindow = append(ev.MarkedOutsideWindow, id)
				}
			}
		}
		p.ids = append(p.ids, pageIDs...)
		if p.insane > 0 && p.incomplete == "" {
			p.incompleteAfter = p.insaneReason
		}
		if (pg.Style == "page" || pg.Style == "offset") && len(pageIDs) > 0 && slices.Equal(pageIDs, prevPage) {
			// A static list: the server answers every page with the same
			// items, so the list has no end to read up to.
			p.incomplete = fmt.Sprintf("page %d holds the same items as the page before it: the server ignores the %q parameter "+
				"(check search.pagination.param), so the list cannot be read to its end", p.requests, pg.Param)
			return p, nil
		}
		prevPage = pageIDs
		next, why, err := a.nextPage(first, u, doc, resp.header, len(list), &page)
		if err != nil {
			return nil, err
		}
		if why != "" {
			p.incomplete = fmt.Sprintf("page %d: %s", p.requests, why)
			return p, nil
		}
		if next == nil {
			return p, nil
		}
		if next.String() == u.String() {
			p.incomplete = fmt.Sprintf("page %d: the next page is the page just read, so the list cannot be read to its end", p.requests)
			return p, nil
		}
		if p.requests >= pg.MaxPages {
			p.truncated = true
			p.incomplete = fmt.Sprintf("page bound (%d) reached before the end of the list", pg.MaxPages)
			return p, nil
		}
		u = next
	}
}

// identity names an item for comparing two passes: its id, or its JSON
// when it has none.
func identity(item any, id pointer) string {
	if s, err := idOf(item, id); err == nil {
		return "id:" + s
	}
	b, _ := json.Marshal(item)
	return "json:" + string(b)
}

// nextPage returns the next page's URL, or nil at the end of the list.
// why is set when the page does not say whether the list goes on: the
// list was not read to its end.
func (a *Adapter) nextPage(first, cur *url.URL, doc any, h http.Header, n int, page *int) (next *url.URL, why string, err error) {
	pg := a.cfg.pagination
	switch pg.Style {
	case "cursor":
		// has_more is required with style cursor (compilePagination): the
		// end of the list is where the API says so, never where a cursor
		// pointer happens to name nothing.
		v, ok := lookup(doc, pg.HasMore)
		more, isBool := v.(bool)
		if !ok || !isBool {
			// A missing indicator is not "no more": a proxy, an API
			// version or an error shape may have dropped it.
			return nil, fmt.Sprintf("no boolean at has_more %q, so the list may go on", pg.HasMore), nil
		}
		if !more {
			return nil, "", nil
		}
		v, ok = lookup(doc, pg.Cursor)
		cursor := ""
		if ok && v != nil {
			cursor, _ = scalarString(v)
		}
		if cursor == "" {
			return nil, fmt.Sprintf("has_more is true but there is no cursor at %q", pg.Cursor), nil
		}
		u := *first
		q := u.Query()
		q.Set(pg.Param, cursor)
		u.RawQuery = q.Encode()
		return &u, "", nil
	case "link":
		target := linkNext(h.Values("Link"))
		if target == "" {
			return nil, "", nil
		}
		u, err := cur.Parse(target)
		if err != nil {
			return nil, "", readback.PermanentError(fmt.Errorf("%s: bad Link header: %w", cur.Redacted(), err))
		}
		// Credentials go only to the configured host.
		if u.Scheme != a.cfg.base.Scheme || u.Host != a.cfg.base.Host {
			return nil, "", readback.PermanentError(fmt.Errorf("%s: Link rel=next points to another host (%s)", cur.Redacted(), u.Host))
		}
		return u, "", nil
	case "page", "offset":
		if n == 0 {
			return nil, "", nil
		}
		if pg.Style == "page" {
			*page++
		} else {
			*page += n
		}
		u := *first
		q := u.Query()
		q.Set(pg.Param, strconv.Itoa(*page))
		u.RawQuery = q.Encode()
		return &u, "", nil
	}
	return nil, "", nil
}

// linkNext returns the rel="next" target of RFC 8288 Link header values.
func linkNext(values []string) string {
	for _, v := range values {
		for _, link := range strings.Split(v, ",") {
			segs := strings.Split(link, ";")
			target := strings.TrimSpace(segs[0])
			if !strings.HasPrefix(target, "<") || !strings.HasSuffix(target, ">") {
				continue
			}
			for _, p := range segs[1:] {
				k, val, _ := strings.Cut(strings.TrimSpace(p), "=")
				if strings.EqualFold(k, "rel") {
					for _, rel := range strings.Fields(strings.Trim(val, `"`)) {
						if strings.EqualFold(rel, "next") {
							return target[1 : len(target)-1]
						}
					}
				}
			}
		}
	}
	return ""
}

func (a *Adapter) createdAt(item any) (time.Time, error) {
	s := a.cfg.search
	v, ok := s.createdAt.get(item)
	if !ok {
		return time.Time{}, fmt.Errorf("no created-at at %q", s.createdAt.text)
	}
	switch x := v.(type) {
	case json.Number:
		n, err := x.Float64()
		if err != nil || s.createdAtFormat == "rfc3339" {
			return time.Time{}, fmt.Errorf("created-at %q at %q is not %s", x, s.createdAt.text, firstNonEmpty(s.createdAtFormat, "a time"))
		}
		if s.createdAtFormat == "unix_ms" {
			return time.UnixMilli(int64(n)), nil
		}
		return time.Unix(int64(n), 0), nil
	case string:
		if s.createdAtFormat == "unix" || s.createdAtFormat == "unix_ms" {
			n, err := strconv.ParseInt(x, 10, 64)
			if err != nil {
				return time.Time{}, fmt.Errorf("created-at %q at %q is not %s", x, s.createdAt.text, s.createdAtFormat)
			}
			if s.createdAtFormat == "unix_ms" {
				return time.UnixMilli(n), nil
			}
			return time.Unix(n, 0), nil
		}
		t, err := time.Parse(time.RFC3339Nano, x)
		if err != nil {
			return time.Time{}, fmt.Errorf("created-at %q at %q is not RFC 3339", x, s.createdAt.text)
		}
		return t, nil
	}
	return time.Time{}, fmt.Errorf("created-at at %q is %s, want a time", s.createdAt.text, jsonType(v))
}

// minSaneTime is the earliest creation time taken at face value: nothing a
// readback looks for was created before 2000.
var minSaneTime = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// maxFutureSkew is how far past the window's end a creation time may lie
// before it is absurd rather than a clock offset.
const maxFutureSkew = 24 * time.Hour

// saneTime says why t cannot be a creation time seen by a check whose
// window ends at end ("" when it can): before 2000, or more than a day
// after the window.
func saneTime(t, end time.Time) string {
	switch {
	case t.Before(minSaneTime):
		return "before 2000"
	case t.After(end.Add(maxFutureSkew)):
		return "more than a day after the window's end"
	}
	return ""
}

func idOf(item any, p pointer) (string, error) {
	v, ok := p.get(item)
	if !ok {
		return "", fmt.Errorf("no id at %q", p.text)
	}
	id, err := scalarString(v)
	if err != nil || id == "" {
		return "", fmt.Errorf("id at %q is %s, want a string or number", p.text, jsonType(v))
	}
	return id, nil
}

// itemMatcher recognizes the receipt's effect among listed items.
type itemMatcher struct {
	a                *Adapter
	sc               *scope
	equals, contains string // the rendered marker
}

// matcher renders the receipt's marker once per check.
func (a *Adapter) matcher(sc *scope) (*itemMatcher, error) {
	m := &itemMatcher{a: a, sc: sc}
	var err error
	if mc := a.cfg.marker; mc != nil {
		if m.equals, err = mc.equals.render(sc, false); err != nil {
			return nil, readback.PermanentError(err)
		}
		if m.contains, err = mc.contains.render(sc, false); err != nil {
			return nil, readback.PermanentError(err)
		}
	}
	return m, nil
}

// marker reports whether item carries the receipt's marker.
func (m *itemMatcher) marker(item any) bool {
	mc := m.a.cfg.marker
	if mc == nil {
		return false
	}
	v, ok := mc.pointer.get(item)
	if !ok {
		return false
	}
	s, err := scalarString(v)
	if err != nil {
		return false
	}
	return (m.equals != "" && s == m.equals) || (m.contains != "" && strings.Contains(s, m.contains))
}

// fingerprint says "fingerprint" when item matches the receipt's intent
// fingerprint, "" when it does not (or no fingerprint is configured). The
// marker is tried before it (readPass): it is the stronger evidence.
func (m *itemMatcher) fingerprint(item any) (string, error) {
	if m.a.cfg.fp != nil {
		ok, err := m.a.fingerprintMatches(m.sc, item)
		if err != nil || !ok {
			return "", err
		}
		return "fingerprint", nil
	}
	return "", nil
}

// fingerprintMatches rebuilds the payload from the item's fields and
// recomputes the intent fingerprint with the agent's normalization.
func (a *Adapter) fingerprintMatches(sc *scope, item any) (bool, error) {
	fp, err := a.itemFingerprint(sc.r.Method, sc.r.Target, item)
	return fp != "" && fp == sc.r.Fingerprint, err
}

// itemFingerprint is the intent fingerprint a call of method to target
// whose payload held item's fields would have: "" for an item that cannot
// be any agent's (a field missing, a number the fingerprint refuses).
func (a *Adapter) itemFingerprint(method, target string, item any) (string, error) {
	f := a.cfg.fp
	payload := map[string]any{}
	for _, p := range f.fields {
		v, ok := p.resource.get(item)
		if !ok {
			return "", nil // an item without the field is not ours
		}
		if err := p.payload.set(payload, v); err != nil {
			return "", err
		}
	}
	b, err := json.Marshal(payload)
	if err != nil {
		return "", err
	}
	fp, err := fingerprint.Compute(method, target, b, fingerprint.WithDrop(f.drop...))
	if err != nil {
		// An item the fingerprint refuses (an imprecise number) cannot be
		// the agent's: its own payload was accepted.
		return "", nil
	}
	return fp.Fingerprint, nil
}

// fetchOne reads one resource: existence for deletes, fields for updates.
func (a *Adapter) fetchOne(ctx context.Context, sc *scope) (readback.Result, error) {
	f := a.cfg.fetch
	u, err := a.buildURL(sc, f.path, f.query)
	if err != nil {
		return readback.Result{}, err
	}
	ev := &Evidence{}
	res := readback.Result{Query: f.method + " " + u.Redacted(), Evidence: ev, Authoritative: true}
	var resp *response
	err = a.retrier(ctx, ev).do(ctx, 0, 0, func() error {
		r, err := a.do(ctx, f.method, u, f.gone)
		if err == nil && r.status >= 200 && r.status <= 299 {
			// A body that does not decode is retried like a failed read.
			_, err = a.decode(u, r.body, nil, defaultMaxPageItems)
		}
		resp = r
		return err
	})
	if err != nil {
		return readback.Result{}, err
	}
	ev.Status = resp.status
	if resp.status < 200 || resp.status > 299 {
		if len(a.cfg.compare) > 0 {
			// The update's target is gone: neither done nor untouched.
			res.Verdict = readback.VerdictDiverged
			ev.Reason = fmt.Sprintf("the resource is gone (HTTP %d)", resp.status)
			return res, nil
		}
		res.Verdict = readback.VerdictAbsent
		return res, nil
	}
	doc, err := a.decode(u, resp.body, nil, defaultMaxPageItems)
	if err != nil {
		return readback.Result{}, err
	}
	id, err := idOf(doc, f.id)
	if err != nil {
		return readback.Result{}, readback.PermanentError(fmt.Errorf("%s: %w", u.Redacted(), err))
	}
	if why := usableID(id); why != "" {
		return readback.Result{}, readback.PermanentError(fmt.Errorf("%s: the id at %q is %s: it cannot be recorded "+
			"as the external id", u.Redacted(), f.id.text, why))
	}
	for _, p := range a.cfg.compare {
		if want, ok := p.payload.get(sc.payload); ok && holdsSecretMarker(want) {
			// The intended value is not in the receipt: "other" would read
			// as diverged, and "pre_image" as an absence it cannot prove.
			return readback.Result{}, readback.PermanentError(fmt.Errorf("receipt %d: compare field %s: %w",
				sc.r.ID, p.payload.text, errSecretField))
		}
	}
	res.ExternalIDs = []string{id}
	if len(a.cfg.compare) == 0 {
		res.Verdict = a.guard(sc, doc, ev)
		return res, nil
	}
	res.Verdict = a.compare(sc, doc, ev)
	if res.Verdict != readback.VerdictPresent {
		res.ExternalIDs = nil
	}
	return res, nil
}

// guard classifies a delete's still-present resource: present (the delete
// did not happen) while the guarded fields hold the pre-image, diverged when
// someone else changed them (retrying the delete would destroy their work).
// Without a guard or a pre-image, present.
func (a *Adapter) guard(sc *scope, doc any, ev *Evidence) readback.Verdict {
	if len(a.cfg.guard) == 0 || len(sc.r.PreImage) == 0 {
		return readback.VerdictPresent
	}
	var pre any
	if err := decodeJSON(sc.r.PreImage, &pre); err != nil {
		return readback.VerdictPresent
	}
	ev.Fields = map[string]string{}
	verdict := readback.VerdictPresent
	for _, p := range a.cfg.guard {
		cur, curOK := p.get(doc)
		old, oldOK := p.get(pre)
		state := "pre_image"
		if curOK != oldOK || (curOK && !sameJSON(cur, old)) {
			state, verdict = "other", readback.VerdictDiverged
			ev.Reason = "the resource is still there and was changed since plan time"
		}
		ev.Fields[p.text] = state
	}
	return verdict
}

// compare classifies an update: every field as intended (present), every
// field as the pre-image (absent), else diverged.
func (a *Adapter) compare(sc *scope, doc any, ev *Evidence) readback.Verdict {
	var pre any
	if len(sc.r.PreImage) > 0 {
		if err := decodeJSON(sc.r.PreImage, &pre); err != nil {
			pre = nil
		}
	}
	ev.Fields = map[string]string{}
	allIntended, allPre := true, pre != nil
	for _, p := range a.cfg.compare {
		cur, curOK := p.resource.get(doc)
		want, wantOK := p.payload.get(sc.payload)
		old, oldOK := p.resource.get(pre)
		state := "other"
		switch {
		case curOK && wantOK && sameJSON(cur, want):
			state = "intended"
			// A field the update does not change is both intended and
			// pre-image; it must not spoil either verdict.
			if !(oldOK && sameJSON(cur, old)) {
				allPre = false
			}
		case curOK && oldOK && sameJSON(cur, old):
			state = "pre_image"
			allIntended = false
		default:
			allIntended, allPre = false, false
		}
		ev.Fields[p.resource.text] = state
	}
	switch {
	case allIntended:
		return readback.VerdictPresent
	case allPre:
		return readback.VerdictAbsent
	case pre == nil:
		ev.Reason = "no pre-image was recorded at plan time: the update's absence cannot be proven"
	default:
		ev.Reason = "the resource holds neither the intended fields nor the pre-image"
	}
	return readback.VerdictDiverged
}

// sameJSON compares two decoded JSON values canonically (1.0 equals 1).
func sameJSON(a, b any) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	if err1 != nil || err2 != nil {
		return false
	}
	ca, err1 := fingerprint.Canonicalize(ja)
	cb, err2 := fingerprint.Canonicalize(jb)
	if err1 != nil || err2 != nil {
		return bytes.Equal(ja, jb)
	}
	return bytes.Equal(ca, cb)
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
