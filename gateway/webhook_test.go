package gateway_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// The documented scheme: hex HMAC-SHA256 with the secret over
// "<t>.<body>", sent as "t=<t>,v1=<hex>". Verified here by hand, as a
// receiver in another language would.
func TestWebhookSignatureVerifiesWithTheDocumentedScheme(t *testing.T) {
	body := []byte(`{"id":"7:succeeded","receipt_id":7}`)
	at := time.Unix(1_767_000_000, 0)
	header := gateway.SignWebhook([]byte(hookSecret), at, body)
	m := hmac.New(sha256.New, []byte(hookSecret))
	m.Write([]byte("1767000000." + string(body)))
	if want := "t=1767000000,v1=" + hex.EncodeToString(m.Sum(nil)); header != want {
		t.Fatalf("signature %q, want %q", header, want)
	}
	if err := gateway.VerifyWebhook([]byte(hookSecret), header, body, at.Add(time.Minute), 5*time.Minute); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		secret, body string
		now          time.Time
	}{
		"tampered body": {hookSecret, `{"id":"7:succeeded","receipt_id":8}`, at},
		"other secret":  {hookSecret + "x", string(body), at},
		"too old":       {hookSecret, string(body), at.Add(6 * time.Minute)},
	} {
		if err := gateway.VerifyWebhook([]byte(tc.secret), header, []byte(tc.body), tc.now, 5*time.Minute); !errors.Is(err, gateway.ErrBadSignature) {
			t.Errorf("%s: %v, want ErrBadSignature", name, err)
		}
	}
}

// receiver is a webhook endpoint that verifies each event's signature and
// answers with the statuses scripted, then 200.
type receiver struct {
	t        *testing.T
	mu       sync.Mutex
	script   []int
	events   []gateway.WebhookEvent
	posts    int
	received chan gateway.WebhookEvent
}

func newReceiver(t *testing.T, script ...int) (*receiver, *httptest.Server) {
	rc := &receiver{t: t, script: script, received: make(chan gateway.WebhookEvent, 100)}
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	return rc, srv
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if err := gateway.VerifyWebhook([]byte(hookSecret), r.Header.Get(gateway.HeaderSignature), body, time.Now(), 5*time.Minute); err != nil {
		rc.t.Errorf("event %s: %v", body, err)
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.posts++
	if len(rc.script) > 0 {
		status := rc.script[0]
		rc.script = rc.script[1:]
		w.WriteHeader(status)
		return
	}
	var ev gateway.WebhookEvent
	if err := json.Unmarshal(body, &ev); err != nil || r.Header.Get(gateway.HeaderEventID) != ev.ID {
		rc.t.Errorf("event %s (id header %q): %v", body, r.Header.Get(gateway.HeaderEventID), err)
	}
	rc.events = append(rc.events, ev)
	rc.received <- ev
}

// next waits (bounded) for the next event received with a 2xx.
func (rc *receiver) next(t *testing.T) gateway.WebhookEvent {
	t.Helper()
	select {
	case ev := <-rc.received:
		return ev
	case <-time.After(20 * time.Second):
		t.Fatal("no webhook event arrived")
		return gateway.WebhookEvent{}
	}
}

// hookRoute is the webhook block of the test route.
func hookRoute(url string) string {
	return "    webhook: {url: '" + url + "/hooks', secret: {env: HOOK_SECRET}, timeout: 2s, max_attempts: 5}\n"
}

// hookGateway is a gateway over db whose route posts its settlements to
// hookURL; its deliverer runs until the test ends.
func hookGateway(t *testing.T, db *pgxpool.Pool, upstreamURL, hookURL string, deliver bool) (*httptest.Server, *prometheus.Registry) {
	t.Helper()
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routesFile(upstreamURL, hookRoute(hookURL))), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	g := gateway.New(client, cfg, gateway.Options{Metrics: gateway.NewMetrics(reg),
		WebhookRetryBase: time.Millisecond, WebhookRetryCap: 20 * time.Millisecond})
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	if deliver {
		startDeliverer(t, g)
	}
	return srv, reg
}

func startDeliverer(t *testing.T, g *gateway.Gateway) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.DeliverWebhooks(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// delivery is a row of reconciler.webhook_deliveries.
type delivery struct {
	attempts   int
	lastStatus *int
	lastError  *string
	delivered  bool
}

func deliveryOf(t *testing.T, db *pgxpool.Pool, id int64, state string) delivery {
	t.Helper()
	var d delivery
	err := db.QueryRow(context.Background(), `SELECT attempts, last_status, last_error, delivered_at IS NOT NULL
		FROM reconciler.webhook_deliveries WHERE receipt_id = $1 AND state = $2`, id, state).
		Scan(&d.attempts, &d.lastStatus, &d.lastError, &d.delivered)
	if err != nil {
		t.Fatalf("delivery of receipt %d (%s): %v", id, state, err)
	}
	return d
}

// A call that succeeds at once, and one settled later by the reconciler
// (through the settlement trigger), each deliver one signed event.
func TestWebhookDeliveredOnSettlement(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t)
	gw, reg := hookGateway(t, db, up.URL, hooks.URL, true)
	e := &env{db: db, gw: gw, metrics: reg}

	ok := e.post(t, "/blog/articles", "k-hook-1", `{"title":"hello"}`)
	if ok.status != http.StatusCreated {
		t.Fatalf("call: %d %s", ok.status, ok.body)
	}
	ev := rc.next(t)
	if ev.State != "succeeded" || ev.ExternalID != "art-1" || ev.IdempotencyKey != "k-hook-1" || ev.Dependency != "blog-api" ||
		ev.Type != "receipt.settled" || ev.Route != routesPrefix || ev.SettledAt.IsZero() ||
		fmt.Sprint(ev.ReceiptID) != ok.header.Get(gateway.HeaderReceiptID) {
		t.Fatalf("event %+v for receipt %s", ev, ok.header.Get(gateway.HeaderReceiptID))
	}

	unknown := e.post(t, "/blog/fail504", "k-hook-2", `{"title":"maybe"}`)
	p := unknown.problem(t)
	client, err := ledger.New(db, "reconciler:test")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := client.Transition(ctx, ledger.Move{ID: p.ReceiptID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Transition(ctx, ledger.Move{ID: p.ReceiptID, From: statemachine.Reconciling, To: statemachine.SafeToRetry}); err != nil {
		t.Fatal(err)
	}
	if ev := rc.next(t); ev.ReceiptID != p.ReceiptID || ev.State != "safe_to_retry" || ev.ID != fmt.Sprintf("%d:safe_to_retry", p.ReceiptID) {
		t.Fatalf("event %+v, want receipt %d safe_to_retry", ev, p.ReceiptID)
	}
	if d := waitDelivered(t, db, p.ReceiptID, "safe_to_retry"); d.attempts != 1 || !d.delivered || d.lastStatus == nil || *d.lastStatus != 200 {
		t.Fatalf("delivery %+v", d)
	}
}

// On a route with a webhook the response is kept in the registration's
// statement: a succeeded and a rejected call are each replayed with the
// upstream's answer, and each settlement is delivered once.
func TestWebhookRouteReplaysTheKeptResponse(t *testing.T) {
	db := pgtest.NewPool(t)
	fake := newFakeUpstream()
	up := httptest.NewServer(fake)
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t)
	gw, reg := hookGateway(t, db, up.URL, hooks.URL, true)
	e := &env{db: db, gw: gw, metrics: reg}
	for _, c := range []struct{ path, key, state string }{
		{"/blog/articles", "k-kept-ok", "succeeded"},
		{"/blog/invalid", "k-kept-rej", "rejected"},
	} {
		first := e.post(t, c.path, c.key, `{"title":"kept"}`)
		again := e.post(t, c.path, c.key, `{"title":"kept"}`)
		if first.header.Get(gateway.HeaderReceiptState) != c.state || again.status != first.status ||
			string(again.body) != string(first.body) || again.header.Get(gateway.HeaderReplayed) != "true" ||
			again.header.Get("Location") != first.header.Get("Location") ||
			again.header.Get(gateway.HeaderReceiptID) != first.header.Get(gateway.HeaderReceiptID) {
			t.Fatalf("%s: first %d %v %s; again %d %v %s", c.key, first.status, first.header, first.body,
				again.status, again.header, again.body)
		}
		if n := fake.count("/api" + strings.TrimPrefix(c.path, "/blog")); n != 1 {
			t.Fatalf("%s: the upstream got %d requests, want 1", c.key, n)
		}
		ev := rc.next(t)
		id, _ := strconv.ParseInt(first.header.Get(gateway.HeaderReceiptID), 10, 64)
		if ev.ReceiptID != id || ev.State != c.state {
			t.Fatalf("%s: event %+v, want receipt %d %s", c.key, ev, id, c.state)
		}
	}
}

// A receiver failing twice (500) then answering 200 gets the event on the
// third attempt, recorded with attempts = 3; the failures are counted.
func TestWebhookRetriedUntilDelivered(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t, 500, 500)
	gw, reg := hookGateway(t, db, up.URL, hooks.URL, true)
	e := &env{db: db, gw: gw, metrics: reg}
	ok := e.post(t, "/blog/articles", "k-retry", `{"title":"hello"}`)
	ev := rc.next(t)
	d := waitDelivered(t, db, ev.ReceiptID, "succeeded")
	if d.attempts != 3 || *d.lastStatus != 200 || d.lastError != nil || fmt.Sprint(ev.ReceiptID) != ok.header.Get(gateway.HeaderReceiptID) {
		t.Fatalf("delivery %+v of event %+v", d, ev)
	}
	if failed, delivered := hookCounter(t, reg, "failed"), hookCounter(t, reg, "delivered"); failed != 2 || delivered != 1 {
		t.Fatalf("metrics: failed %v, delivered %v", failed, delivered)
	}
}

// A redirect is not followed: it is a failed attempt, and once the
// attempts run out the event is given up, recorded so.
func TestWebhookRedirectNotFollowedAndGivenUp(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	var mu sync.Mutex
	elsewhere := 0
	hooks := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/elsewhere" {
			mu.Lock()
			elsewhere++
			mu.Unlock()
			return
		}
		http.Redirect(w, r, "/elsewhere", http.StatusFound)
	}))
	t.Cleanup(hooks.Close)
	gw, reg := hookGateway(t, db, up.URL, hooks.URL, true)
	e := &env{db: db, gw: gw, metrics: reg}
	ok := e.post(t, "/blog/articles", "k-redirect", `{"title":"hello"}`)
	id := ok.header.Get(gateway.HeaderReceiptID)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var attempts int
		var status *int
		var lastErr *string
		var gaveUp bool
		err := db.QueryRow(context.Background(), `SELECT attempts, last_status, last_error, gave_up_at IS NOT NULL
			FROM reconciler.webhook_deliveries WHERE receipt_id = $1::bigint`, id).Scan(&attempts, &status, &lastErr, &gaveUp)
		if err == nil && gaveUp {
			if attempts != 5 || status == nil || *status != 302 || lastErr == nil || !strings.Contains(*lastErr, "redirects are not followed") {
				t.Fatalf("given up after %d attempts, status %v, error %v", attempts, status, lastErr)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not given up in time (attempts %d, err %v)", attempts, err)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
	mu.Lock()
	defer mu.Unlock()
	if elsewhere != 0 {
		t.Fatalf("the redirect was followed %d times", elsewhere)
	}
	if hookCounter(t, reg, "gave_up") != 1 {
		t.Fatal("the gave_up outcome is not counted")
	}
}

// A receiver that does not answer: the error recorded for each attempt
// names neither the receiver's token (in the URL's query) nor the
// webhook's secret.
func TestWebhookErrorStoresNoCredential(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	const receiverToken = "rcv_token_0123456789abcdef"
	// hookRoute appends "/hooks": here it ends the token's query value.
	gw, reg := hookGateway(t, db, up.URL, dead.URL+"/in?token="+receiverToken, true)
	e := &env{db: db, gw: gw, metrics: reg}
	ok := e.post(t, "/blog/articles", "k-no-answer", `{"title":"hello"}`)
	id, err := strconv.ParseInt(ok.header.Get(gateway.HeaderReceiptID), 10, 64)
	if err != nil {
		t.Fatalf("call: %d %v", ok.status, ok.header)
	}
	deadline := time.Now().Add(20 * time.Second)
	for d := deliveryOf(t, db, id, "succeeded"); d.attempts < 2 || d.lastError == nil; d = deliveryOf(t, db, id, "succeeded") {
		if time.Now().After(deadline) {
			t.Fatalf("no failed attempt recorded: %+v", d)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
	if d := deliveryOf(t, db, id, "succeeded"); !strings.HasPrefix(*d.lastError, "no answer") {
		t.Fatalf("last error %q", *d.lastError)
	}
	for _, s := range []string{receiverToken, hookSecret, upstreamKey, tokenA} {
		if n := e.countText(t, s); n != 0 {
			t.Fatalf("a credential is stored in %d rows", n)
		}
	}
}

// Two gateways over one database, both delivering: each event is received
// once.
func TestWebhookTwoGatewaysDeliverOnce(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t)
	gw1, reg := hookGateway(t, db, up.URL, hooks.URL, true)
	gw2, _ := hookGateway(t, db, up.URL, hooks.URL, true)
	const calls = 30
	for i := range calls {
		gw := gw1
		if i%2 == 1 {
			gw = gw2
		}
		e := &env{db: db, gw: gw, metrics: reg}
		if a := e.post(t, "/blog/articles", fmt.Sprintf("k-two-%d", i), fmt.Sprintf(`{"title":"t%d"}`, i)); a.status != http.StatusCreated {
			t.Fatalf("call %d: %d %s", i, a.status, a.body)
		}
	}
	for range calls {
		rc.next(t)
	}
	// The receiver answered each; the gateways record it just after.
	var delivered int
	for deadline := time.Now().Add(20 * time.Second); ; {
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.webhook_deliveries
			WHERE delivered_at IS NOT NULL AND attempts = 1`).Scan(&delivered); err != nil {
			t.Fatal(err)
		}
		if delivered >= calls || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	seen := map[string]int{}
	for _, ev := range rc.events {
		seen[ev.ID]++
	}
	if len(seen) != calls || rc.posts != calls || delivered != calls {
		t.Fatalf("%d events posted, %d distinct, %d recorded delivered; want %d each", rc.posts, len(seen), delivered, calls)
	}
}

// Settlements made while no gateway delivered (its process was down) are
// delivered by a gateway started afterwards.
func TestWebhookDeliveredBySweepAfterDowntime(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t)
	gw, reg := hookGateway(t, db, up.URL, hooks.URL, false)
	e := &env{db: db, gw: gw, metrics: reg}
	ok := e.post(t, "/blog/articles", "k-down", `{"title":"hello"}`)
	if d := deliveryOf(t, db, mustID(t, ok), "succeeded"); d.attempts != 0 || d.delivered {
		t.Fatalf("queued delivery %+v", d)
	}
	// Another gateway process, started after the settlement.
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routesFile(up.URL, hookRoute(hooks.URL))), testEnv)
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	startDeliverer(t, gateway.New(client, cfg, gateway.Options{}))
	if ev := rc.next(t); ev.ReceiptID != mustID(t, ok) || ev.State != "succeeded" {
		t.Fatalf("event %+v", ev)
	}
}

func mustID(t *testing.T, a answer) int64 {
	t.Helper()
	var id int64
	if _, err := fmt.Sscan(a.header.Get(gateway.HeaderReceiptID), &id); err != nil {
		t.Fatalf("no receipt id: %d %s", a.status, a.body)
	}
	return id
}

// waitDelivered waits (bounded) until a delivery is recorded delivered.
func waitDelivered(t *testing.T, db *pgxpool.Pool, id int64, state string) delivery {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if d := deliveryOf(t, db, id, state); d.delivered {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatal("the delivery is not recorded")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
}

// hookCounter is reconciler_gateway_webhook_deliveries_total for outcome.
func hookCounter(t *testing.T, reg *prometheus.Registry, outcome string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() != "reconciler_gateway_webhook_deliveries_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" && l.GetValue() == outcome {
					v += m.GetCounter().GetValue()
				}
			}
		}
	}
	return v
}

// One gateway holds one listening connection: its webhook deliverer is
// told of settlements through the connection its ?wait= requests use, and
// both are woken by it.
func TestWebhookDelivererSharesTheWaitsConnection(t *testing.T) {
	db := pgtest.NewPool(t)
	up := httptest.NewServer(newFakeUpstream())
	t.Cleanup(up.Close)
	rc, hooks := newReceiver(t)
	g, srv := newGateway(t, db, routesFile(up.URL, hookRoute(hooks.URL)), gateway.Options{})
	e := &env{db: db, gw: srv}
	awaited := e.post(t, "/blog/fail504", "k-share-1", `{"title":"maybe"}`).problem(t)
	other := e.post(t, "/blog/fail504", "k-share-2", `{"title":"other"}`).problem(t)
	waited := make(chan answer, 1)
	go func() { waited <- e.do(t, "GET", awaited.WaitURL, "", "Authorization", "Bearer "+tokenA) }()
	waitListening(t, e)
	startDeliverer(t, g)

	reconciler, err := ledger.New(db, "reconciler:test")
	if err != nil {
		t.Fatal(err)
	}
	settle := func(id int64) {
		t.Helper()
		ctx := context.Background()
		if _, err := reconciler.Transition(ctx, ledger.Move{ID: id, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling}); err != nil {
			t.Fatal(err)
		}
		if _, err := reconciler.Transition(ctx, ledger.Move{ID: id, From: statemachine.Reconciling, To: statemachine.SafeToRetry}); err != nil {
			t.Fatal(err)
		}
	}
	settle(other.ReceiptID)
	if ev := rc.next(t); ev.ReceiptID != other.ReceiptID {
		t.Fatalf("event %+v, want receipt %d", ev, other.ReceiptID)
	}
	if n := listening(t, e); n != 1 {
		t.Fatalf("the gateway holds %d listening sessions while it waits and delivers, want 1", n)
	}
	settle(awaited.ReceiptID)
	if ev := rc.next(t); ev.ReceiptID != awaited.ReceiptID {
		t.Fatalf("event %+v, want receipt %d", ev, awaited.ReceiptID)
	}
	var doc gateway.ReceiptDoc
	if a := <-waited; json.Unmarshal(a.body, &doc) != nil || doc.State != "safe_to_retry" {
		t.Fatalf("the wait answered %d %s", a.status, a.body)
	}
}
