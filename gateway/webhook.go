package gateway

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/receiptledger/reconciler/internal/sanitize"
)

// HeaderSignature carries a webhook event's signature:
// "t=<unix seconds>,v1=<hex HMAC-SHA256(secret, t + "." + body)>", as
// Stripe signs its webhooks. HeaderEventID names the event (the same on
// every retry of it): a receiver that keeps the ids it has handled handles
// each event once, deliveries being at least once.
const (
	HeaderSignature = "Reconciler-Signature"
	HeaderEventID   = "Reconciler-Event-Id"
)

// Webhook delivery defaults (Options).
const (
	// DefaultWebhookRetryBase and DefaultWebhookRetryCap shape the retries:
	// the n-th waits a uniformly random time below min(cap, base·2^(n-1))
	// ("full jitter"), so receivers coming back up are not hit in waves.
	DefaultWebhookRetryBase = time.Second
	DefaultWebhookRetryCap  = 10 * time.Minute
	// DefaultWebhookSweep is how often pending deliveries are looked for
	// without a notification: those queued while no gateway listened.
	DefaultWebhookSweep = 30 * time.Second
	// webhookBatch bounds the deliveries made at once by one gateway.
	webhookBatch = 16
	// webhookResponseBytes is how much of a receiver's answer is read.
	webhookResponseBytes = 4 << 10
	// webhookErrorBytes bounds a recorded delivery error.
	webhookErrorBytes = 500
)

// ErrBadSignature is returned by VerifyWebhook for a signature that does
// not match, is malformed, or is too old.
var ErrBadSignature = errors.New("gateway: webhook signature does not verify")

// WebhookEvent is the body of a settlement event, posted as JSON.
type WebhookEvent struct {
	// ID is "<receipt id>:<state>", the same on every retry of the event.
	ID        string `json:"id"`
	Type      string `json:"type"` // "receipt.settled"
	ReceiptID int64  `json:"receipt_id"`
	// State is the receipt's settled state: succeeded, safe_to_retry,
	// rejected or manual_review (which a human may later settle: that is
	// another event).
	State          string    `json:"state"`
	ExternalID     string    `json:"external_id,omitempty"`
	IdempotencyKey string    `json:"idempotency_key"`
	Operation      string    `json:"operation"`
	Dependency     string    `json:"dependency"`
	Attempt        int       `json:"attempt"`
	Route          string    `json:"route"`
	SettledAt      time.Time `json:"settled_at"`
}

// SignWebhook returns the Reconciler-Signature header value of body signed
// at t with secret.
func SignWebhook(secret []byte, t time.Time, body []byte) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	return "t=" + ts + ",v1=" + hex.EncodeToString(webhookMAC(secret, ts, body))
}

func webhookMAC(secret []byte, ts string, body []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return m.Sum(nil)
}

// VerifyWebhook checks a Reconciler-Signature header against body: one of
// its v1 signatures must match, and its timestamp be within tolerance of
// now (which bounds replays of a captured event). It returns an error
// matching ErrBadSignature otherwise.
func VerifyWebhook(secret []byte, header string, body []byte, now time.Time, tolerance time.Duration) error {
	var ts string
	var sigs [][]byte
	for _, part := range strings.Split(header, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(part), "=")
		switch k {
		case "t":
			ts = v
		case "v1":
			if b, err := hex.DecodeString(v); err == nil {
				sigs = append(sigs, b)
			}
		}
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || len(sigs) == 0 {
		return fmt.Errorf("%w: want t=<unix>,v1=<hex>", ErrBadSignature)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: signed %v away from now", ErrBadSignature, d.Round(time.Second))
	}
	want := webhookMAC(secret, ts, body)
	for _, s := range sigs {
		if hmac.Equal(s, want) {
			return nil
		}
	}
	return ErrBadSignature
}

// webhooks delivers the settlement events of the routes with a webhook.
type webhooks struct {
	routes map[string]*Route // by name
	names  []string
	client *http.Client
	lease  time.Duration
	base   time.Duration
	cap    time.Duration
	sweep  time.Duration
	// wake is signaled by a settlement's notification, by a call this
	// gateway settled at once and by a registration that queued an event.
	wake chan struct{}
}

func newWebhooks(cfg *Config, opts Options) *webhooks {
	w := &webhooks{routes: map[string]*Route{}, wake: make(chan struct{}, 1),
		base: opts.WebhookRetryBase, cap: opts.WebhookRetryCap, sweep: opts.WebhookSweep}
	if w.base <= 0 {
		w.base = DefaultWebhookRetryBase
	}
	if w.cap <= 0 {
		w.cap = DefaultWebhookRetryCap
	}
	if w.sweep <= 0 {
		w.sweep = DefaultWebhookSweep
	}
	var longest time.Duration
	for _, r := range cfg.Routes {
		if r.Webhook != nil {
			w.routes[r.Name] = r
			w.names = append(w.names, r.Name)
			longest = max(longest, r.Webhook.Timeout)
		}
	}
	// A delivery outlasting its lease could be made twice: each is bounded
	// by its route's timeout, well inside the lease.
	w.lease = longest + time.Minute
	tr := opts.WebhookTransport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.Proxy = nil
		tr = t
	}
	w.client = &http.Client{Transport: tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return w
}

// backoff is the wait before the attempt after the n-th (n ≥ 1): full
// jitter below min(cap, base·2^(n-1)).
func (w *webhooks) backoff(n int) time.Duration {
	ceil := w.cap
	if n-1 < 40 && w.base<<(n-1) > 0 && w.base<<(n-1) < w.cap {
		ceil = w.base << (n - 1)
	}
	return rand.N(ceil) + 1
}

// register records a replayed receipt of a route with a webhook, so its
// settlement is delivered (see sqlRegisterWebhook).
func (g *Gateway) register(ctx context.Context, route *Route, id int64) {
	queued, err := g.store.registerWebhook(context.WithoutCancel(ctx), id, route.Name)
	if err != nil {
		g.log.Error("registering a receipt's webhook failed: its settlement will not be delivered",
			"route", route.Name, "receipt_id", id, "error", err)
		return
	}
	if queued {
		signal(g.hooks.wake)
	}
}

// DeliverWebhooks delivers the settlement events of the routes with a
// webhook until ctx ends: woken by the database's notification of each
// settlement, by the retries falling due, and every sweep interval for
// events queued while no gateway listened. Several gateways may run it on
// one database: each event is claimed by one at a time and recorded
// delivered once. Run calls it; call it yourself when serving the
// Gateway with a server of your own.
func (g *Gateway) DeliverWebhooks(ctx context.Context) {
	w := g.hooks
	if len(w.names) == 0 {
		return
	}
	// Woken through the ledger client's listening connection, the one
	// GET /receipts/{id}?wait= shares: on every settlement, and after
	// each reconnection (a settlement meanwhile was not notified).
	g.ledger.NotifySettled(ctx, w.wake)
	for ctx.Err() == nil {
		full := g.deliverDue(ctx)
		wait := w.sweep
		if full {
			wait = 0
		} else if due, ok, err := g.store.webhookNextDue(ctx, w.names); err != nil {
			if ctx.Err() == nil {
				g.log.Warn("reading the next webhook delivery failed", "error", err)
			}
		} else if ok {
			wait = min(max(due, 0), w.sweep)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-w.wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// deliverDue claims a batch of due deliveries and makes them at once; it
// reports whether the batch was full (more may be due).
func (g *Gateway) deliverDue(ctx context.Context) bool {
	w := g.hooks
	batch, err := g.store.claimWebhooks(ctx, w.names, webhookBatch, w.lease)
	if err != nil {
		if ctx.Err() == nil {
			g.log.Warn("claiming webhook deliveries failed", "error", err)
		}
		return false
	}
	var wg sync.WaitGroup
	for _, d := range batch {
		wg.Add(1)
		go func() { defer wg.Done(); g.deliver(context.WithoutCancel(ctx), d) }()
	}
	wg.Wait()
	return len(batch) == webhookBatch
}

// deliver makes one attempt of a claimed delivery and records its outcome.
func (g *Gateway) deliver(ctx context.Context, d claimedDelivery) {
	route := g.hooks.routes[d.Route]
	status, err := g.post(ctx, route, d)
	if err == nil {
		ok, rerr := g.store.webhookDelivered(ctx, d, status)
		switch {
		case rerr != nil:
			g.log.Error("recording a delivered webhook failed: it will be delivered again", "route", d.Route, "receipt_id", d.ReceiptID, "error", rerr)
		case ok:
			g.metrics.webhook(d.Route, webhookDelivered)
		}
		return
	}
	msg, _ := sanitize.Text(err.Error(), webhookErrorBytes)
	gaveUp, rerr := g.store.webhookFailed(ctx, d, status, msg, g.hooks.backoff(d.Attempts), route.Webhook)
	if rerr != nil {
		g.log.Error("recording a failed webhook failed", "route", d.Route, "receipt_id", d.ReceiptID, "error", rerr)
		return
	}
	outcome := webhookFailed
	if gaveUp {
		outcome = webhookGaveUp
		g.log.Warn("a webhook was given up", "route", d.Route, "receipt_id", d.ReceiptID, "state", d.State,
			"attempts", d.Attempts, "error", msg)
	}
	g.metrics.webhook(d.Route, outcome)
}

// post sends one event; a 2xx answer is success, anything else (a
// redirect, which is not followed, included) an error. The error never
// quotes the URL, which may hold a token of the receiver's.
func (g *Gateway) post(ctx context.Context, route *Route, d claimedDelivery) (int, error) {
	body, err := json.Marshal(WebhookEvent{ID: strconv.FormatInt(d.ReceiptID, 10) + ":" + d.State, Type: "receipt.settled",
		ReceiptID: d.ReceiptID, State: d.State, ExternalID: d.ExternalID, IdempotencyKey: d.IdempotencyKey,
		Operation: d.Operation, Dependency: d.Dependency, Attempt: d.Attempt, Route: d.Route, SettledAt: d.SettledAt.UTC()})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, route.Webhook.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, route.Webhook.URL.String(), bytes.NewReader(body))
	if err != nil {
		return 0, errors.New("the webhook request cannot be built")
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "reconciler-gateway")
	req.Header.Set(HeaderEventID, strconv.FormatInt(d.ReceiptID, 10)+":"+d.State)
	req.Header.Set(HeaderSignature, SignWebhook(route.Webhook.secret, time.Now(), body))
	resp, err := g.hooks.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return 0, fmt.Errorf("no answer: %w", err)
	}
	defer resp.Body.Close()
	// Read a bounded part so the connection may be reused; the rest is
	// dropped with the connection.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, webhookResponseBytes))
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode <= 299:
		return resp.StatusCode, nil
	case resp.StatusCode >= 300 && resp.StatusCode <= 399:
		return resp.StatusCode, fmt.Errorf("HTTP %d: redirects are not followed", resp.StatusCode)
	}
	return resp.StatusCode, fmt.Errorf("HTTP %d", resp.StatusCode)
}

// signal wakes the deliverer without blocking: one pending wake-up is
// enough, it claims whatever is due.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
