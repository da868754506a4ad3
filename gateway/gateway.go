// Package gateway is the receipt gateway: a reverse proxy for side effects
// that gives agents in any language the ledger's protection with one change,
// their base URL.
//
// An agent calls POST http://localhost:7070/<prefix>/<path> with an
// Idempotency-Key header and its bearer token. The gateway plans the
// receipt, records it submitted, forwards the request through
// ledger.Caller.Do (which knows whether any byte left, SPEC §4), settles it,
// and answers with the upstream's response plus Receipt-Id and Receipt-State
// headers, or, when the outcome is unknown, with a problem document (RFC
// 9457) that says not to retry and where to wait. The same key sent again is
// answered from the ledger: the recorded response once settled, "still
// unknown" while unknown, and the next attempt once absence is proven.
//
// Upstream credentials live in the gateway's routes file only; the agent's
// Authorization is never forwarded unless a route allows it. Only
// configured routes reach only their upstream, redirects are never
// followed, and bodies are bounded both ways.
package gateway

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/receiptledger/reconciler/internal/contentcoding"
	"github.com/receiptledger/reconciler/internal/redact"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Headers the gateway reads and writes.
const (
	// HeaderIdempotencyKey names the agent's key for the call.
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderReceiptID and HeaderReceiptState describe the call's receipt
	// on every answer to a call made through the ledger.
	HeaderReceiptID    = "Receipt-Id"
	HeaderReceiptState = "Receipt-State"
	// HeaderReceiptRetryable is "true" on a rejection the agent may send
	// again with the same key (nothing was done: a 429, or nothing sent).
	HeaderReceiptRetryable = "Receipt-Retryable"
	// HeaderReplayed is "true" on an answer given from the ledger without
	// sending anything upstream.
	HeaderReplayed = "Idempotent-Replayed"
)

// maxWait is the longest GET /receipts/{id}?wait= the gateway holds.
const maxWait = 5 * time.Minute

// Options are a Gateway's collaborators.
type Options struct {
	// Logger receives structured logs (default: discard). Neither
	// credentials nor bodies are logged.
	Logger *slog.Logger
	// Metrics, if set, is updated per request.
	Metrics *Metrics
	// Transport sends upstream requests (default: a transport of the
	// gateway's own, which ignores proxy environment variables).
	Transport http.RoundTripper
	// WebhookTransport sends webhook events (default: as Transport's).
	WebhookTransport http.RoundTripper
	// WebhookRetryBase and WebhookRetryCap shape the retries of an event
	// (DefaultWebhookRetryBase, DefaultWebhookRetryCap); WebhookSweep is
	// how often pending events are looked for unprompted
	// (DefaultWebhookSweep).
	WebhookRetryBase, WebhookRetryCap, WebhookSweep time.Duration
	// ReadTimeout bounds reading a request, headers and body, in Run
	// (DefaultReadTimeout): an agent that trickles its body is cut off
	// before anything is recorded or sent. A wait on a receipt is not
	// bounded by it: its request has no body.
	ReadTimeout time.Duration
	// IdleTimeout closes a keep-alive connection left idle that long, in
	// Run (DefaultIdleTimeout), so idle connections, authenticated or
	// not, cannot pile up.
	IdleTimeout time.Duration
}

// The defaults of Options.ReadTimeout and Options.IdleTimeout.
const (
	DefaultReadTimeout = 30 * time.Second
	DefaultIdleTimeout = 2 * time.Minute
)

// Gateway serves the routes of a Config. It is an http.Handler.
type Gateway struct {
	cfg     *Config
	ledger  *ledger.Client
	store   store
	log     *slog.Logger
	metrics *Metrics
	clients map[*Route]*http.Client
	mux     *http.ServeMux
	hooks   *webhooks
	// draining ends when Run is told to stop: waits on receipts answer at
	// once. cut ends when Run's grace period is over: calls still in
	// flight are canceled, so each records its outcome (outcome_unknown
	// once a byte left) and answers the agent before Run returns.
	draining, cut      context.Context
	drain, cutInFlight context.CancelFunc
	// readTimeout and idleTimeout are Run's server's (Options).
	readTimeout, idleTimeout time.Duration
	// unrecorded keeps the outcomes whose recording failed (Run writes
	// them when the database takes writes again).
	unrecorded *unrecordedOutcomes
}

// New returns a gateway for cfg that records receipts through client (its
// actor is replaced, per request, by the calling agent's "agent:<id>").
func New(client *ledger.Client, cfg *Config, opts Options) *Gateway {
	g := &Gateway{cfg: cfg, ledger: client, store: store{db: client.Pool()}, log: opts.Logger,
		metrics: opts.Metrics, clients: map[*Route]*http.Client{}, hooks: newWebhooks(cfg, opts),
		unrecorded: newUnrecordedOutcomes()}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}
	g.readTimeout, g.idleTimeout = cmp.Or(opts.ReadTimeout, DefaultReadTimeout), cmp.Or(opts.IdleTimeout, DefaultIdleTimeout)
	g.draining, g.drain = context.WithCancel(context.Background())
	g.cut, g.cutInFlight = context.WithCancel(context.Background())
	tr := opts.Transport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.Proxy = nil // only the route's upstream, never a proxy from the environment
		t.MaxIdleConnsPerHost = 64
		tr = t
	}
	for _, r := range cfg.Routes {
		g.clients[r] = &http.Client{Transport: tr, Timeout: r.Timeout,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	g.mux = http.NewServeMux()
	g.mux.HandleFunc("GET /openapi.json", serveOpenAPI)
	g.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	g.mux.HandleFunc("GET /problems/{name}", serveProblemType)
	g.mux.HandleFunc("GET /receipts/{id}", g.serveReceipt)
	return g
}

// ServeHTTP serves the gateway's own endpoints and proxies everything else
// through the routes.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	if p == "/openapi.json" || p == "/healthz" || strings.HasPrefix(p, "/problems/") || strings.HasPrefix(p, "/receipts/") {
		g.mux.ServeHTTP(w, r)
		return
	}
	g.proxy(w, r)
}

// Run serves h on l until ctx ends, then stops accepting, answers waits on
// receipts at once, lets calls in flight finish within grace, and returns.
// A call still in flight when grace is over is canceled: it records its
// outcome (outcome_unknown if any byte left, not_sent otherwise) and
// answers the agent so, within cutGrace, before Run returns; nothing the
// gateway could know is left submitted. h is the gateway itself when nil;
// pass a handler around it to add endpoints (metrics belong on a listener
// of their own: the CLI's --metrics-addr). Run
// also deletes expired replay responses, a tenth of the retention apart,
// and delivers the routes' webhooks (DeliverWebhooks).
func (g *Gateway) Run(ctx context.Context, l net.Listener, h http.Handler, grace time.Duration) error {
	if h == nil {
		h = g
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: min(10*time.Second, g.readTimeout),
		ReadTimeout: g.readTimeout, IdleTimeout: g.idleTimeout,
		BaseContext: func(net.Listener) context.Context { return context.WithoutCancel(ctx) }}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	go g.expireLoop(ctx)
	hctx, stopHooks := context.WithCancel(ctx)
	hooksDone := make(chan struct{})
	go func() { defer close(hooksDone); g.DeliverWebhooks(hctx) }()
	defer func() { stopHooks(); <-hooksDone }()
	// Outcomes whose recording failed are written once the database
	// takes writes, until the calls in flight are done.
	uctx, stopUnrecorded := context.WithCancel(context.WithoutCancel(ctx))
	unrecordedDone := make(chan struct{})
	go func() { defer close(unrecordedDone); g.unrecordedLoop(uctx) }()
	defer func() { stopUnrecorded(); <-unrecordedDone }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	g.drain()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	err := srv.Shutdown(sctx)
	if err == nil {
		return nil
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("gateway: shutdown: %w", err)
	}
	g.cutInFlight()
	cctx, cancelCut := context.WithTimeout(context.WithoutCancel(ctx), cutGrace)
	defer cancelCut()
	if err := srv.Shutdown(cctx); err != nil {
		return fmt.Errorf("gateway: shutdown: calls in flight after %v, cut, were not all recorded within %v: %w", grace, cutGrace, err)
	}
	g.log.Warn("shutdown: calls still in flight after the grace period were cut and recorded", "grace", grace)
	return nil
}

// cutGrace bounds how long calls cut at the end of the grace period take
// to record their outcome and answer: a few ledger writes, each bounded
// by the ledger's settle timeout.
const cutGrace = 3 * ledger.DefaultSettleTimeout

// expireLoop deletes expired replay responses in batches, every tenth of
// the retention (between a minute and an hour).
func (g *Gateway) expireLoop(ctx context.Context) {
	every := min(max(g.cfg.Retention/10, time.Minute), time.Hour)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for {
			n, err := g.store.expire(ctx, 1000)
			if err != nil {
				g.log.Warn("expiring replay responses failed", "error", err)
				break
			}
			if n < 1000 {
				break
			}
		}
	}
}

// match returns the route whose prefix the escaped path starts with (the
// longest), and the rest of the path.
func (g *Gateway) match(escaped string) (*Route, string) {
	for _, r := range g.cfg.Routes {
		if escaped == r.Prefix {
			return r, "/"
		}
		if rest, ok := strings.CutPrefix(escaped, r.Prefix); ok && strings.HasPrefix(rest, "/") {
			return r, rest
		}
	}
	return nil, ""
}

// tokenFrom is where an agent's token was found.
type tokenFrom int

const (
	fromAuthorization tokenFrom = iota
	fromProxyAuthorization
)

// authenticate returns the calling agent's id from its bearer token, in
// Proxy-Authorization if present, else in Authorization.
func (g *Gateway) authenticate(r *http.Request) (string, tokenFrom, *ProblemType) {
	from, h := fromProxyAuthorization, r.Header.Get("Proxy-Authorization")
	if h == "" {
		from, h = fromAuthorization, r.Header.Get("Authorization")
	}
	if h == "" {
		return "", from, &ProblemMissingToken
	}
	scheme, tok, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || tok == "" {
		return "", from, &ProblemInvalidToken
	}
	// A lookup by the token's hash: no comparison of the token itself
	// whose time would depend on how much of it matches.
	id, ok := g.cfg.Agents[sha256.Sum256([]byte(strings.TrimSpace(tok)))]
	if !ok {
		return "", from, &ProblemInvalidToken
	}
	return id, from, nil
}

// call is one request being proxied.
type call struct {
	route   *Route
	agent   string // the actor, "agent:<id>"
	start   time.Time
	upFirst atomic.Int64 // ns since start: the upstream's first response byte
	upStart atomic.Int64 // ns since start: the upstream connection asked for
	// kept is what the upstream's answer leaves for replays (keep), once
	// it arrived: written before the receipt settles, and again with an
	// outcome whose recording failed (keepUnrecorded).
	kept *storedResponse
}

// trace records when the upstream exchange began and answered, so the
// time the gateway adds can be told from the upstream's.
func (c *call) trace(ctx context.Context) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn:              func(string) { c.upStart.CompareAndSwap(0, int64(time.Since(c.start))) },
		GotFirstResponseByte: func() { c.upFirst.Store(int64(time.Since(c.start))) },
	})
}

// added is the time the gateway added: the whole handling minus the
// upstream's exchange (asking for a connection to the first response byte).
func (c *call) added() time.Duration {
	total := time.Since(c.start)
	if f, s := c.upFirst.Load(), c.upStart.Load(); f > 0 && s > 0 && f > s {
		return total - time.Duration(f-s)
	}
	return total
}

func (g *Gateway) refuse(w http.ResponseWriter, route string, pr Problem) {
	g.metrics.refusal(route, strings.TrimPrefix(pr.Type, "/problems/"))
	writeProblem(w, pr)
}

func (g *Gateway) proxy(w http.ResponseWriter, r *http.Request) {
	c := &call{start: time.Now()}
	// One spelling per resource, before anything is matched,
	// fingerprinted or forwarded (the query too: upstreamRequest).
	escaped := normalEscapes(r.URL.EscapedPath())
	route, rest := g.match(escaped)
	if route == nil {
		g.refuse(w, routeNone, newProblem(ProblemUnknownRoute, "no route's prefix matches "+strconv.Quote(truncate(escaped))))
		return
	}
	c.route = route
	id, from, bad := g.authenticate(r)
	if bad != nil {
		g.refuse(w, route.Name, newProblem(*bad, "send the agent's token as Authorization: Bearer <token>"))
		return
	}
	c.agent = "agent:" + id
	if hasDotSegment(rest) {
		g.refuse(w, route.Name, newProblem(ProblemInvalidPath, "a path with . or .. segments could leave the upstream's base path"))
		return
	}
	body, pr := g.readBody(r)
	if pr != nil {
		g.refuse(w, route.Name, *pr)
		return
	}
	up, err := g.upstreamRequest(r, route, rest, from, body)
	if err != nil {
		g.refuse(w, route.Name, newProblem(ProblemInvalidPath, err.Error()))
		return
	}
	write := r.Method != http.MethodGet && r.Method != http.MethodHead
	if !write && !route.ReceiptsForReads {
		g.passThrough(w, c, up)
		return
	}
	key := r.Header.Get(HeaderIdempotencyKey)
	if key == "" {
		g.refuse(w, route.Name, newProblem(ProblemMissingKey,
			"send an Idempotency-Key header that stays the same for every attempt of this step (task:step:operation)"))
		return
	}
	op, drop, secret, ok := route.operation(r.Method, rest)
	if !ok {
		g.refuse(w, route.Name, newProblem(ProblemUnknownOperation, r.Method+" "+truncate(rest)+" matches none of the route's operations"))
		return
	}
	target := up.URL.EscapedPath()
	if up.URL.RawQuery != "" {
		// The query is part of what the call means.
		target += "?" + up.URL.RawQuery
	}
	payload, err := payloadOf(r.Header.Get("Content-Type"), body)
	if err != nil {
		g.refuse(w, route.Name, newProblem(ProblemInvalidIntent, err.Error()))
		return
	}
	in := ledger.Intent{IdempotencyKey: key, Operation: op, Dependency: route.Dependency, Method: r.Method,
		Target: target, Payload: payload, Drop: drop, Secret: secret, MaxSendDelay: route.MaxSendDelay}
	if route.Webhook != nil {
		// Registered by the statement that records the receipt, before
		// anything is sent: no crash after the call can lose it.
		in.Webhook = route.Name
	}
	caller := &ledger.Caller{Ledger: g.ledger.As(statemachine.Actor(c.agent)), HTTP: g.clients[route],
		ExternalID: route.ExternalID, MaxResponseBytes: g.cfg.MaxResponseBytes, Known: g.ownKey(c.agent),
		// Whatever the upstream compressed its answer with: a body must be
		// decoded to be classified, and redacted before it goes anywhere.
		DecodeContent: true,
		// The response is kept before the receipt settles: a replay
		// between the two would otherwise find it settled without its
		// response, and answer otherwise than this call does.
		Answered: func(ctx context.Context, rc *ledger.Receipt, ex ledger.Exchange, v ledger.Verdict) {
			if c.kept = g.keep(c, ex, v); c.kept != nil {
				g.record(ctx, c, rc.ID, c.kept)
			}
		}}
	if !write {
		caller.Classify = notModified
	}
	// The call outlives the agent's connection: its outcome is recorded
	// (and replayed to the agent's next attempt) even if the agent left.
	ctx, cancel := context.WithTimeout(c.trace(context.WithoutCancel(r.Context())), route.Timeout+time.Minute)
	defer cancel()
	// ... unless the gateway stops and its grace period is over (Run).
	defer context.AfterFunc(g.cut, cancel)()
	res, err := caller.Do(ctx, in, up.WithContext(ctx))
	if res != nil && res.Unrecorded != nil {
		g.keepUnrecorded(c, caller, res)
	}
	if route.Webhook != nil && res != nil && res.Receipt != nil {
		switch {
		case res.Replayed:
			// A receipt recorded before registrations rode with the
			// receipt (migration 00011) may have lost its registration to
			// a crash after the call: a replay registers it (harmless when
			// it is).
			g.register(ctx, route, res.Receipt.ID)
		case !ledger.Awaiting(res.Receipt.State):
			// Settled by this call: its event was queued with the outcome,
			// and only a settlement of an unknown outcome is notified.
			signal(g.hooks.wake)
		}
	}
	g.answer(w, r, c, res, err)
	g.metrics.addedLatency(route.Name, c.added())
}

// readBody reads the agent's body within the gateway's bound.
func (g *Gateway) readBody(r *http.Request) ([]byte, *Problem) {
	max := g.cfg.MaxRequestBytes
	tooLarge := func() *Problem {
		pr := newProblem(ProblemRequestTooLarge, fmt.Sprintf("the gateway takes bodies of at most %d bytes", max))
		return &pr
	}
	if r.ContentLength > max {
		return nil, tooLarge()
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, max+1))
	if err != nil {
		pr := newProblem(ProblemInvalidIntent, "reading the request body failed")
		return nil, &pr
	}
	if int64(len(body)) > max {
		return nil, tooLarge()
	}
	return body, nil
}

// hopHeaders are never forwarded in either direction (RFC 9110 §7.6.1),
// nor are the agent's credentials for the gateway.
func hopHeaders() []string {
	return []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length"}
}

func stripHop(h http.Header) {
	for _, f := range h.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			h.Del(strings.TrimSpace(name))
		}
	}
	for _, name := range hopHeaders() {
		h.Del(name)
	}
}

// upstreamRequest builds the request sent upstream: the route's base URL
// plus the rest of the path and the query, the agent's headers without
// hop-by-hop ones and without its Authorization (unless the route allows
// it and the agent authenticated with Proxy-Authorization), and the route's
// credential.
func (g *Gateway) upstreamRequest(r *http.Request, route *Route, rest string, from tokenFrom, body []byte) (*http.Request, error) {
	u := *route.Upstream
	path, err := url.PathUnescape(rest)
	if err != nil {
		return nil, fmt.Errorf("the path does not unescape: %w", err)
	}
	u.Path = strings.TrimSuffix(route.Upstream.Path, "/") + path
	u.RawPath = strings.TrimSuffix(route.Upstream.EscapedPath(), "/") + rest
	if rest == "/" && route.Upstream.Path != "" {
		u.Path, u.RawPath = route.Upstream.Path, route.Upstream.RawPath
	}
	u.RawQuery = normalEscapes(r.URL.RawQuery)
	var rd io.Reader
	if len(body) > 0 {
		rd = bytes.NewReader(body)
	}
	up, err := http.NewRequestWithContext(r.Context(), r.Method, u.String(), rd)
	if err != nil {
		return nil, fmt.Errorf("the upstream request cannot be built: %w", err)
	}
	up.Header = r.Header.Clone()
	stripHop(up.Header)
	// The transport asks for gzip itself and decompresses: a body the
	// agent's Accept-Encoding had compressed could not be classified, its
	// external id read, nor a credential echoed in it removed.
	up.Header.Del("Accept-Encoding")
	if !route.PassAuthorization || from == fromAuthorization {
		up.Header.Del("Authorization")
	}
	if route.authHeader != "" {
		up.Header.Set(route.authHeader, route.authValue)
	}
	return up, nil
}

// notModified classifies a 304 to a read with a receipt: it answers a
// conditional read ("the agent's copy is current"), a success, not a
// redirect whose effect is unknown.
func notModified(ex ledger.Exchange) (ledger.Verdict, bool) {
	if ex.Response != nil && ex.Response.StatusCode == http.StatusNotModified {
		return ledger.Verdict{Outcome: ledger.OutcomeSucceeded}, true
	}
	return ledger.Verdict{}, false
}

// passThrough forwards a read without a receipt.
func (g *Gateway) passThrough(w http.ResponseWriter, c *call, up *http.Request) {
	ctx := c.trace(up.Context())
	resp, err := g.clients[c.route].Do(up.WithContext(ctx))
	if err != nil {
		g.metrics.request(c.route.Name, outcomeError)
		writeProblem(w, newProblem(ProblemUpstreamUnavailable, "the upstream did not answer the read; a read changes nothing and may be sent again"))
		return
	}
	defer resp.Body.Close()
	if err := contentcoding.Decode(resp); err != nil {
		g.refuse(w, c.route.Name, undecodable(resp.StatusCode))
		return
	}
	// A 304 answers a conditional read (If-None-Match, If-Modified-Since):
	// "your copy is current", not a redirect.
	if resp.StatusCode >= 300 && resp.StatusCode <= 399 && resp.StatusCode != http.StatusNotModified {
		g.refuse(w, c.route.Name, Problem{Type: ProblemUpstreamRedirect.URI(), Title: ProblemUpstreamRedirect.Title,
			Status: ProblemUpstreamRedirect.Status, Retry: RetryNo, UpstreamStatus: resp.StatusCode,
			Detail: "the gateway does not follow redirects"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, g.cfg.MaxResponseBytes+1))
	if int64(len(body)) > g.cfg.MaxResponseBytes {
		g.refuse(w, c.route.Name, newProblem(ProblemResponseTooLarge, fmt.Sprintf("more than %d bytes", g.cfg.MaxResponseBytes)))
		return
	}
	if errors.Is(err, contentcoding.ErrUndecodable) {
		g.refuse(w, c.route.Name, undecodable(resp.StatusCode))
		return
	}
	if err != nil {
		g.metrics.request(c.route.Name, outcomeError)
		writeProblem(w, newProblem(ProblemUpstreamUnavailable, "reading the upstream's answer failed; a read changes nothing and may be sent again"))
		return
	}
	g.metrics.request(c.route.Name, outcomePassthrough)
	writeUpstream(w, c.route.redactor, resp.StatusCode, resp.Header, body)
	g.metrics.addedLatency(c.route.Name, c.added())
}

// undecodable refuses a read's answer in a content coding the gateway
// cannot decode: a credential echoed in it could not be removed.
func undecodable(status int) Problem {
	pr := newProblem(ProblemUndecodableResponse, "the upstream answered the read with a body in a content coding the gateway cannot decode: it is not passed on")
	pr.UpstreamStatus = status
	return pr
}

// gatewayHeaders are the response headers only the gateway writes: an
// upstream's own are dropped, so it cannot speak for the ledger.
func gatewayHeaders() []string {
	return []string{HeaderReceiptID, HeaderReceiptState, HeaderReceiptRetryable, HeaderReplayed}
}

// writeUpstream writes an upstream response to the agent: its headers
// without hop-by-hop ones (stripped from a copy, so a Connection header
// naming the gateway's own cannot remove them) and without the gateway's
// own, and every form of the route's credential removed from headers and
// body (an API may echo it; agents never hold it).
func writeUpstream(w http.ResponseWriter, red *redact.Redactor, status int, h http.Header, body []byte) {
	up := h.Clone()
	stripHop(up)
	for _, name := range gatewayHeaders() {
		up.Del(name)
	}
	out := w.Header()
	for k, vs := range up {
		for i, v := range vs {
			vs[i] = red.String(v)
		}
		out[k] = vs
	}
	if !red.Empty() {
		body = []byte(red.String(string(body)))
	}
	out.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// answer turns the outcome of Caller.Do into the agent's answer.
func (g *Gateway) answer(w http.ResponseWriter, r *http.Request, c *call, res *ledger.Result, err error) {
	name := c.route.Name
	if res != nil && res.Replayed {
		g.replay(w, r, c, res.Receipt)
		return
	}
	var dup *ledger.DuplicateError
	var oe *ledger.OutcomeError
	switch {
	case err == nil:
		g.metrics.request(name, outcomeSucceeded)
		setReceipt(w.Header(), res.Receipt)
		writeUpstream(w, c.route.redactor, res.Response.StatusCode, res.Response.Header, res.Body)
	case errors.As(err, &dup):
		// The intent's guard is every agent's (the same call is one
		// effect, whoever sends it), but its receipt is named only to the
		// agent that made it (ownKey); an owner that cannot be read is
		// taken for another's.
		if g.ownKey(c.agent)(r.Context(), dup.Existing) != nil {
			g.refuse(w, name, newProblem(ProblemDuplicateIntent, "the same call is unresolved under another agent's key: this call is not sent"))
			return
		}
		pr := newProblem(ProblemDuplicateIntent, fmt.Sprintf("receipt %d holds the same call (%s), and its outcome is not settled: "+
			"this call is not sent. Wait for that receipt instead of sending it again under another key", dup.Existing.ID, dup.Existing.State))
		pr.ExistingReceiptID = dup.Existing.ID
		pr.WaitURL = waitURL(dup.Existing.ID)
		g.refuse(w, name, pr)
	case errors.Is(err, errOtherAgent) || (errors.Is(err, ledger.ErrKeyConflict) && !g.ownsKey(r.Context(), c.agent, r.Header.Get(HeaderIdempotencyKey))):
		// Another agent's key is answered the same whether or not the
		// payload sent is the one it was used with (its owner is asked
		// before its fingerprint is told): an agent cannot confirm
		// another's payload one guess at a time.
		g.refuse(w, name, newProblem(ProblemKeyReused, "this Idempotency-Key is taken: use a key of its own for each step"))
	case errors.Is(err, ledger.ErrKeyConflict):
		g.refuse(w, name, newProblem(ProblemKeyReused, "this Idempotency-Key names a call with another operation, target or payload: use a key of its own for each step"))
	case errors.Is(err, ledger.ErrInvalidKey):
		g.refuse(w, name, newProblem(ProblemInvalidKey, "a key is printable, at most 255 bytes, and does not end in #<digits> (the suffix of retries)"))
	case errors.Is(err, ledger.ErrInvalidIntent):
		g.refuse(w, name, newProblem(ProblemInvalidIntent, ledgerDetail(err)))
	case errors.Is(err, ledger.ErrKeyRetentionPassed) && res != nil && res.Receipt != nil &&
		res.Receipt.State == statemachine.OutcomeUnknown:
		// Caller.Do sent nothing and sent the previous attempt back to the
		// reconciler for a fresh proof (SPEC §5a): ask again once it settles.
		pr := newProblem(ProblemInProgress, fmt.Sprintf("the previous attempt's absence was proven on the API's idempotency key, "+
			"whose retention has passed: nothing was sent, and receipt %d went back to the reconciler for a fresh proof; "+
			"send the call again with the same Idempotency-Key once it settles", res.Receipt.ID))
		pr.ReceiptID, pr.ReceiptState = res.Receipt.ID, string(res.Receipt.State)
		pr.WaitURL = waitURL(res.Receipt.ID)
		g.refuse(w, name, pr)
	case errors.Is(err, ledger.ErrRetryRefused):
		pr := newProblem(ProblemRetryRefused, "the previous attempt received a late answer after it was settled: its effect exists or may exist; a human must look")
		if res != nil && res.Receipt != nil {
			pr.ReceiptID, pr.ReceiptState = res.Receipt.ID, string(res.Receipt.State)
		}
		g.refuse(w, name, pr)
	case res != nil && res.Unrecorded != nil && res.Receipt != nil && res.Receipt.State == statemachine.Submitted:
		g.unrecordedAnswer(w, c, res)
	case errors.As(err, &oe) && oe.Receipt != nil:
		g.settledOtherwise(w, r, c, res, oe)
	default:
		// Planning or submitting failed: nothing was sent.
		g.log.Error("ledger write failed, nothing sent", "route", name, "agent", c.agent, "error", err)
		g.metrics.request(name, outcomeError)
		detail := "the receipt could not be recorded, so nothing was sent; send the call again with the same Idempotency-Key"
		if errors.Is(err, ledger.ErrNoSynchronousStandby) || errors.Is(err, ledger.ErrNotReplicated) {
			detail = ledgerDetail(err) + "; send the call again with the same Idempotency-Key once a synchronous standby is back"
			w.Header().Set("Retry-After", "5")
		}
		pr := newProblem(ProblemLedger, detail)
		if res != nil && res.Receipt != nil {
			pr.ReceiptID, pr.ReceiptState = res.Receipt.ID, string(res.Receipt.State)
		}
		writeProblem(w, pr)
	}
}

// settledOtherwise answers a fresh call whose receipt did not succeed.
func (g *Gateway) settledOtherwise(w http.ResponseWriter, r *http.Request, c *call, res *ledger.Result, oe *ledger.OutcomeError) {
	name, rc := c.route.Name, oe.Receipt
	code := ""
	if oe.Cause != nil {
		code = oe.Cause.Code
	}
	switch {
	case rc.State == statemachine.Rejected && res != nil && res.Response != nil && errors.Is(oe, ledger.ErrUndecodableBody):
		// A refusal whose body cannot be decoded: a credential echoed in
		// it could not be removed, so none of it is passed on (nor kept:
		// keep).
		g.metrics.request(name, outcomeRejected)
		pr := newProblem(ProblemUndecodableResponse, "the upstream rejected the call ("+code+") with a body the gateway cannot decode: "+
			"it is not passed on. Nothing will be sent under this Idempotency-Key")
		pr.ReceiptID, pr.ReceiptState, pr.Code, pr.UpstreamStatus = rc.ID, string(rc.State), code, res.Response.StatusCode
		writeProblem(w, pr)
	case rc.State == statemachine.Rejected && res != nil && res.Response != nil:
		// A deterministic refusal (4xx) or a 429: the upstream's answer.
		g.metrics.request(name, outcomeRejected)
		setReceipt(w.Header(), rc)
		writeUpstream(w, c.route.redactor, res.Response.StatusCode, res.Response.Header, res.Body)
	case rc.State == statemachine.Rejected:
		g.metrics.request(name, outcomeNotSent)
		pr := newProblem(ProblemNotSent, "nothing left the gateway ("+code+"): send the call again with the same Idempotency-Key; it becomes the next attempt")
		pr.ReceiptID, pr.ReceiptState, pr.Code = rc.ID, string(rc.State), code
		w.Header().Set("Retry-After", "1")
		writeProblem(w, pr)
	default:
		g.metrics.request(name, outcomeUnknown)
		p := ProblemOutcomeUnknown
		if res != nil && res.Response != nil && res.Response.StatusCode >= 300 && res.Response.StatusCode <= 399 {
			p = ProblemUpstreamRedirect
		}
		pr := newProblem(p, "the request was sent and its outcome is unknown ("+code+"). Do not send it again under another key: "+
			"the reconciler is settling it. Wait at wait_url; then send it again with the same Idempotency-Key for the settled outcome")
		pr.ReceiptID, pr.ReceiptState, pr.WaitURL, pr.Code = rc.ID, string(rc.State), waitURL(rc.ID), code
		if res != nil && res.Response != nil {
			pr.UpstreamStatus = res.Response.StatusCode
		}
		writeProblem(w, pr)
	}
}

// errOtherAgent refuses a key that names another agent's call (ownKey).
var errOtherAgent = errors.New("the key names another agent's call")

// ownKey is the Caller's Known hook for agent: a key is its agent's own,
// so another agent's reuse of it neither learns of that call (its receipt,
// its state, its kept response) nor, once the call may be retried, sends
// its next attempt. The owner is the actor of the receipt's first event
// (history is append-only). Only a known key pays for the read: Do calls
// the hook with the receipt the key names before it replays, submits or
// retries anything.
func (g *Gateway) ownKey(agent string) func(context.Context, *ledger.Receipt) error {
	return func(ctx context.Context, r *ledger.Receipt) error {
		owner, err := g.store.owner(ctx, r.ID)
		if err != nil {
			return err
		}
		if owner != agent {
			return errOtherAgent
		}
		return nil
	}
}

// ownsKey reports whether agent made the receipt key names; a key whose
// owner cannot be read is taken for another's.
func (g *Gateway) ownsKey(ctx context.Context, agent, key string) bool {
	owner, err := g.store.keyOwner(ctx, key)
	if err != nil {
		g.log.Warn("reading a key's owner failed", "agent", agent, "error", err)
	}
	return err == nil && owner == agent
}

// replay answers a call whose key names a receipt already past planned
// (and owned by the caller's agent: ownKey): nothing is sent upstream.
func (g *Gateway) replay(w http.ResponseWriter, r *http.Request, c *call, rc *ledger.Receipt) {
	name := c.route.Name
	g.metrics.replay(name, string(rc.State))
	w.Header().Set(HeaderReplayed, "true")
	switch rc.State {
	case statemachine.Succeeded, statemachine.Rejected:
		kept, err := g.store.lookup(r.Context(), rc.ID)
		if err != nil {
			g.log.Warn("reading a kept response failed", "route", name, "receipt_id", rc.ID, "error", err)
		}
		setReceipt(w.Header(), rc)
		if kept != nil && kept.Body != nil && keptFits(rc.State, kept.Status) {
			writeUpstream(w, c.route.redactor, kept.Status, kept.Headers, kept.Body)
			return
		}
		if rc.State == statemachine.Succeeded {
			// Settled by a readback (the answer was lost), or the body
			// was too large or too old to keep: the receipt says it all.
			writeReceipt(w, http.StatusOK, rc)
			return
		}
		pr := newProblem(ProblemRejected, "this call was settled rejected; nothing will be sent under this Idempotency-Key")
		pr.ReceiptID, pr.ReceiptState = rc.ID, string(rc.State)
		writeProblem(w, pr)
	case statemachine.Submitted, statemachine.Planned:
		pr := newProblem(ProblemInProgress, "a call with this Idempotency-Key is in flight; wait at wait_url, then send it again with the same key")
		pr.ReceiptID, pr.ReceiptState, pr.WaitURL = rc.ID, string(rc.State), waitURL(rc.ID)
		writeProblem(w, pr)
	case statemachine.ManualReview:
		pr := newProblem(ProblemManualReview, "the reconciler could not prove the outcome; a human decides. Nothing is sent under this key until then")
		pr.ReceiptID, pr.ReceiptState, pr.WaitURL = rc.ID, string(rc.State), waitURL(rc.ID)
		writeProblem(w, pr)
	default:
		pr := newProblem(ProblemOutcomeUnknown, "still unknown: the reconciler is settling it. Do not send it under another key; "+
			"wait at wait_url, then send it again with the same Idempotency-Key")
		pr.ReceiptID, pr.ReceiptState, pr.WaitURL = rc.ID, string(rc.State), waitURL(rc.ID)
		writeProblem(w, pr)
	}
}

// keep returns what a fresh call's response leaves for replays, nil when
// there is nothing to keep: an answer whose outcome is unknown, or whose
// body could not be read whole (or decoded). An answer classified
// succeeded or rejected keeps its status, the headers the file names and
// the body when within the replay bound, both with every form of the
// route's credential removed. It is kept before the receipt settles
// (ledger.Caller.Answered); replay uses it only for the outcome it was
// kept for.
func (g *Gateway) keep(c *call, ex ledger.Exchange, v ledger.Verdict) *storedResponse {
	if ex.Response == nil || ex.Err != nil || (v.Outcome != ledger.OutcomeSucceeded && v.Outcome != ledger.OutcomeRejected) {
		return nil
	}
	kept := &storedResponse{Agent: c.agent, Status: ex.Response.StatusCode, Headers: http.Header{}, BodyBytes: int64(len(ex.Body))}
	for _, h := range g.cfg.ReplayHeaders {
		for _, v := range ex.Response.Header.Values(h) {
			// An API may echo the credential in a kept header too
			// (a Location with the key in its query).
			kept.Headers[h] = append(kept.Headers[h], c.route.redactor.String(v))
		}
	}
	if int64(len(ex.Body)) <= g.cfg.ReplayBodyBytes {
		kept.Body = ex.Body
		if !c.route.redactor.Empty() {
			kept.Body = []byte(c.route.redactor.String(string(ex.Body)))
		}
		if kept.Body == nil {
			kept.Body = []byte{}
		}
	}
	return kept
}

// keptFits reports whether a response kept for replays is the answer of
// a receipt in state: kept before the receipt settled, it is another
// outcome's when the settlement differed (recording it failed, and the
// reconciler settled the receipt).
func keptFits(state statemachine.State, status int) bool {
	ok := status >= 200 && status <= 299 || status == http.StatusNotModified
	return ok == (state == statemachine.Succeeded)
}

// record keeps a settled call's response for replays.
func (g *Gateway) record(ctx context.Context, c *call, id int64, kept *storedResponse) {
	if err := g.store.record(context.WithoutCancel(ctx), id, *kept, g.cfg.Retention); err != nil {
		g.log.Warn("keeping the response for replays failed", "route", c.route.Name, "receipt_id", id, "error", err)
	}
}

func setReceipt(h http.Header, rc *ledger.Receipt) {
	h.Set(HeaderReceiptID, strconv.FormatInt(rc.ID, 10))
	h.Set(HeaderReceiptState, string(rc.State))
	if rc.Retryable {
		h.Set(HeaderReceiptRetryable, "true")
	}
}

// payloadOf is the JSON payload fingerprinted for a body: a JSON body as
// is; a form body as an object of its fields (a string per single value,
// an array for repeated ones); an empty body as {}; any other body as its
// media type and SHA-256.
func payloadOf(contentType string, body []byte) (json.RawMessage, error) {
	mt, _, _ := mime.ParseMediaType(contentType)
	trimmed := bytes.TrimSpace(body)
	switch {
	case len(trimmed) == 0:
		return json.RawMessage(`{}`), nil
	case mt == "application/x-www-form-urlencoded":
		vals, err := url.ParseQuery(string(body))
		if err != nil {
			return nil, fmt.Errorf("the form body does not parse: %w", err)
		}
		obj := map[string]any{}
		for k, vs := range vals {
			if len(vs) == 1 {
				obj[k] = vs[0]
			} else {
				obj[k] = vs
			}
		}
		return json.Marshal(obj)
	case mt == "application/json" || strings.HasSuffix(mt, "+json") || (mt == "" && (trimmed[0] == '{' || trimmed[0] == '[')):
		return body, nil
	}
	sum := sha256.Sum256(body)
	return json.Marshal(map[string]string{"content_type": mt, "sha256": hex.EncodeToString(sum[:])})
}

// ledgerDetail is the ledger's refusal without its "ledger: " prefix.
func ledgerDetail(err error) string {
	return truncate(strings.TrimPrefix(err.Error(), "ledger: "))
}

// truncate bounds text from the agent that a problem document quotes.
func truncate(s string) string {
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return strings.ToValidUTF8(s, "\uFFFD")
}
