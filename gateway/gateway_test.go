package gateway_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// fakeUpstream is an API whose paths behave as the tests need, and which
// counts what reached it.
type fakeUpstream struct {
	mu    sync.Mutex
	hits  map[string]int
	auths []string
	other string // where /api/redirect points
}

func newFakeUpstream() *fakeUpstream { return &fakeUpstream{hits: map[string]int{}} }

func (u *fakeUpstream) count(path string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[path]
}

func (u *fakeUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.hits[r.URL.Path]++
	n := u.hits[r.URL.Path]
	u.auths = append(u.auths, r.Header.Get("Authorization"))
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	switch r.URL.Path {
	case "/api/articles":
		if r.Method == http.MethodGet {
			fmt.Fprint(w, `{"data":[]}`)
			return
		}
		w.Header().Set("Location", "/api/articles/art-"+strconv.Itoa(n))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"art-%d","status":"published"}`, n)
	case "/api/fail504":
		w.WriteHeader(http.StatusGatewayTimeout)
		fmt.Fprint(w, `{"error":"upstream timed out"}`)
	case "/api/invalid":
		w.WriteHeader(http.StatusUnprocessableEntity)
		fmt.Fprint(w, `{"error":"title is required"}`)
	case "/api/redirect":
		w.Header().Set("Location", u.other+"/elsewhere")
		w.WriteHeader(http.StatusFound)
	case "/api/echo":
		// An API that echoes the credential it was sent, in a kept
		// header and in the body.
		w.Header().Set("Location", "/api/echo/"+strconv.Itoa(n)+"?seen="+url.QueryEscape(r.Header.Get("Authorization")))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]string{"id": "echo-" + strconv.Itoa(n), "seen": r.Header.Get("Authorization")})
	default:
		w.WriteHeader(http.StatusNotFound)
	}
}

// Acceptance 2: each refusal, with its status and problem type; nothing is
// sent upstream for any of them.
func TestRefusals(t *testing.T) {
	up := newFakeUpstream()
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("the gateway followed a redirect to %s", r.URL)
	}))
	defer other.Close()
	up.other = other.URL
	e := newEnv(t, up, "")
	auth := []string{"Authorization", "Bearer " + tokenA}

	// Set-up for the two refusals that need history: a call that
	// succeeded under key-used, and one left unknown under key-unknown.
	if a := e.post(t, "/blog/articles", "key-used", `{"title":"one"}`); a.status != http.StatusCreated {
		t.Fatalf("set-up call: %d %s", a.status, a.body)
	}
	unknown := e.post(t, "/blog/fail504", "key-unknown", `{"title":"two"}`)
	if p := unknown.problem(t); unknown.status != http.StatusBadGateway || p.Type != gateway.ProblemOutcomeUnknown.URI() {
		t.Fatalf("set-up unknown call: %d %+v", unknown.status, p)
	}
	sentBefore := up.count("/api/articles") + up.count("/api/fail504")
	receiptsBefore := e.receiptCount(t)

	cases := []struct {
		name    string
		method  string
		path    string
		body    string
		headers []string
		want    gateway.ProblemType
		check   func(t *testing.T, p gateway.Problem)
	}{
		{name: "unknown route", method: "POST", path: "/nowhere/articles", body: `{}`,
			headers: append(auth, "Idempotency-Key", "k1"), want: gateway.ProblemUnknownRoute},
		{name: "missing key", method: "POST", path: "/blog/articles", body: `{"title":"x"}`,
			headers: auth, want: gateway.ProblemMissingKey},
		{name: "key reused with another intent", method: "POST", path: "/blog/articles", body: `{"title":"not one"}`,
			headers: append(auth, "Idempotency-Key", "key-used"), want: gateway.ProblemKeyReused},
		{name: "key of another agent", method: "POST", path: "/blog/articles", body: `{"title":"one"}`,
			headers: []string{"Authorization", "Bearer " + tokenB, "Idempotency-Key", "key-used"}, want: gateway.ProblemKeyReused},
		{name: "duplicate intent", method: "POST", path: "/blog/fail504", body: `{"title":"two"}`,
			headers: append(auth, "Idempotency-Key", "key-other"), want: gateway.ProblemDuplicateIntent,
			check: func(t *testing.T, p gateway.Problem) {
				if p.ExistingReceiptID != unknown.problem(t).ReceiptID || p.WaitURL == "" {
					t.Fatalf("duplicate names receipt %d (wait %q), want %d", p.ExistingReceiptID, p.WaitURL, unknown.problem(t).ReceiptID)
				}
			}},
		{name: "oversized body", method: "POST", path: "/blog/articles", body: `{"title":"` + strings.Repeat("x", 5000) + `"}`,
			headers: append(auth, "Idempotency-Key", "k2"), want: gateway.ProblemRequestTooLarge},
		{name: "token missing", method: "POST", path: "/blog/articles", body: `{}`,
			headers: []string{"Idempotency-Key", "k3"}, want: gateway.ProblemMissingToken},
		{name: "token wrong", method: "POST", path: "/blog/articles", body: `{}`,
			headers: []string{"Authorization", "Bearer " + tokenA + "x", "Idempotency-Key", "k4"}, want: gateway.ProblemInvalidToken},
		{name: "upstream credential as token", method: "POST", path: "/blog/articles", body: `{}`,
			headers: []string{"Authorization", "Bearer " + upstreamKey, "Idempotency-Key", "k5"}, want: gateway.ProblemInvalidToken},
		{name: "dot segment", method: "POST", path: "/blog/%2e%2e/admin", body: `{}`,
			headers: append(auth, "Idempotency-Key", "k6"), want: gateway.ProblemInvalidPath},
		{name: "reserved key suffix", method: "POST", path: "/blog/articles", body: `{}`,
			headers: append(auth, "Idempotency-Key", "k7#2"), want: gateway.ProblemInvalidKey},
		{name: "payload not JSON", method: "POST", path: "/blog/articles", body: `{"title":`,
			headers: append(auth, "Idempotency-Key", "k8"), want: gateway.ProblemInvalidIntent},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := e.do(t, tc.method, tc.path, tc.body, tc.headers...)
			p := a.problem(t)
			if a.status != tc.want.Status || p.Type != tc.want.URI() || p.Status != tc.want.Status || p.Retry != gateway.RetryNo {
				t.Fatalf("got %d %+v, want %d %s with retry no", a.status, p, tc.want.Status, tc.want.URI())
			}
			if tc.want.Status == http.StatusUnauthorized && a.header.Get("WWW-Authenticate") == "" {
				t.Fatal("401 without WWW-Authenticate")
			}
			if tc.check != nil {
				tc.check(t, p)
			}
		})
	}
	if n := up.count("/api/articles") + up.count("/api/fail504"); n != sentBefore {
		t.Fatalf("refused calls reached the upstream: %d requests, want %d", n, sentBefore)
	}
	if n := e.receiptCount(t); n != receiptsBefore {
		t.Fatalf("refused calls left %d receipts, want %d", n, receiptsBefore)
	}

	// A redirect from the upstream is never followed: the effect of the
	// POST is unknown, and the reconciler settles it.
	a := e.post(t, "/blog/redirect", "key-redirect", `{"title":"three"}`)
	p := a.problem(t)
	if a.status != http.StatusBadGateway || p.Type != gateway.ProblemUpstreamRedirect.URI() || p.UpstreamStatus != http.StatusFound ||
		p.ReceiptState != string(statemachine.OutcomeUnknown) || p.Retry != gateway.RetryAfterSettlement {
		t.Fatalf("redirect: %d %+v", a.status, p)
	}
	// A read is not followed either.
	a = e.do(t, "GET", "/blog/redirect", "", auth...)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.Type != gateway.ProblemUpstreamRedirect.URI() {
		t.Fatalf("read redirect: %d %+v", a.status, p)
	}
}

func TestSucceededIsReplayedWithoutSending(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	first := e.do(t, "POST", "/blog/articles", `{"title":"hello","request_id":"r-1"}`,
		"Authorization", "Bearer "+tokenA, "Idempotency-Key", "task-1:publish:articles.create")
	if first.status != http.StatusCreated || first.header.Get(gateway.HeaderReceiptState) != "succeeded" ||
		first.header.Get(gateway.HeaderReceiptID) == "" || first.header.Get("Location") != "/api/articles/art-1" {
		t.Fatalf("first call: %d %v %s", first.status, first.header, first.body)
	}
	up.mu.Lock()
	seen := up.auths[0]
	up.mu.Unlock()
	if seen != "Bearer "+upstreamKey {
		t.Fatalf("upstream saw Authorization %q, want the route's credential (never the agent's token)", seen)
	}
	// The same step again, with another volatile field: replayed.
	again := e.do(t, "POST", "/blog/articles", `{"title":"hello","request_id":"r-2"}`,
		"Authorization", "Bearer "+tokenA, "Idempotency-Key", "task-1:publish:articles.create")
	if again.status != http.StatusCreated || string(again.body) != string(first.body) ||
		again.header.Get(gateway.HeaderReplayed) != "true" || again.header.Get(gateway.HeaderReceiptID) != first.header.Get(gateway.HeaderReceiptID) ||
		again.header.Get("Location") != "/api/articles/art-1" {
		t.Fatalf("replay: %d %v %s", again.status, again.header, again.body)
	}
	if n := up.count("/api/articles"); n != 1 {
		t.Fatalf("the upstream got %d requests, want 1", n)
	}
	// A rejection is passed through and replayed too.
	rej := e.post(t, "/blog/invalid", "k-invalid", `{"x":1}`)
	rej2 := e.post(t, "/blog/invalid", "k-invalid", `{"x":1}`)
	if rej.status != http.StatusUnprocessableEntity || rej.header.Get(gateway.HeaderReceiptState) != "rejected" ||
		rej2.status != http.StatusUnprocessableEntity || rej2.header.Get(gateway.HeaderReplayed) != "true" || up.count("/api/invalid") != 1 {
		t.Fatalf("rejection: %d %v; again %d %v; upstream %d", rej.status, rej.header, rej2.status, rej2.header, up.count("/api/invalid"))
	}
	// Reads pass through without a receipt.
	before := e.receiptCount(t)
	read := e.do(t, "GET", "/blog/articles", "", "Authorization", "Bearer "+tokenA)
	if read.status != http.StatusOK || read.header.Get(gateway.HeaderReceiptID) != "" || e.receiptCount(t) != before {
		t.Fatalf("read: %d %v, receipts %d -> %d", read.status, read.header, before, e.receiptCount(t))
	}
}

// The upstream's credential is injected by the gateway, stripped from
// what it stores and answers even when the API echoes it, and the agent's
// token is never forwarded nor stored.
func TestCredentialsStayInTheGateway(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	a := e.post(t, "/blog/echo", "k-echo", `{"title":"echo"}`)
	up.mu.Lock()
	seen := up.auths[0]
	up.mu.Unlock()
	if a.status != http.StatusCreated || seen != "Bearer "+upstreamKey || strings.Contains(string(a.body), upstreamKey) ||
		strings.Contains(a.header.Get("Location"), upstreamKey) {
		t.Fatalf("echo call (the API saw %q): %d %v %s", seen, a.status, a.header, a.body)
	}
	for _, s := range []string{upstreamKey, tokenA} {
		if n := e.countText(t, s); n != 0 {
			t.Fatalf("a credential is stored in %d rows", n)
		}
	}
	replay := e.post(t, "/blog/echo", "k-echo", `{"title":"echo"}`)
	if replay.status != http.StatusCreated || strings.Contains(string(replay.body), upstreamKey) ||
		replay.header.Get("Location") == "" || strings.Contains(replay.header.Get("Location"), upstreamKey) {
		t.Fatalf("replay: %d %v %s", replay.status, replay.header, replay.body)
	}
}

// An unknown outcome: the problem says not to retry and where to wait; the
// same key answers "still unknown" without sending; ?wait= returns when the
// reconciler settles it (woken by NOTIFY, latency printed); then the same
// key answers with the settlement, and after safe_to_retry it becomes the
// next attempt.
func TestUnknownOutcomeWaitAndSettle(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	ctx := context.Background()
	first := e.post(t, "/blog/fail504", "k-504", `{"title":"maybe"}`)
	p := first.problem(t)
	if first.status != http.StatusBadGateway || p.Retry != gateway.RetryAfterSettlement || p.ReceiptState != "outcome_unknown" ||
		p.WaitURL != fmt.Sprintf("/receipts/%d?wait=30s", p.ReceiptID) || p.Code != "http_504" || p.UpstreamStatus != 504 {
		t.Fatalf("unknown outcome: %d %+v", first.status, p)
	}
	again := e.post(t, "/blog/fail504", "k-504", `{"title":"maybe"}`)
	if p2 := again.problem(t); again.status != http.StatusBadGateway || p2.ReceiptID != p.ReceiptID ||
		again.header.Get(gateway.HeaderReplayed) != "true" || up.count("/api/fail504") != 1 {
		t.Fatalf("same key while unknown: %d %+v, upstream %d", again.status, p2, up.count("/api/fail504"))
	}
	// Not waiting: the receipt as it stands.
	now := e.do(t, "GET", "/receipts/"+strconv.FormatInt(p.ReceiptID, 10), "", "Authorization", "Bearer "+tokenA)
	var doc gateway.ReceiptDoc
	if err := json.Unmarshal(now.body, &doc); err != nil || doc.Settled || doc.Next != gateway.RetryAfterSettlement {
		t.Fatalf("receipt: %d %s", now.status, now.body)
	}

	client, err := ledger.New(e.db, "reconciler:test")
	if err != nil {
		t.Fatal(err)
	}
	type waited struct {
		a  answer
		at time.Time
	}
	got := make(chan waited, 1)
	go func() {
		a := e.do(t, "GET", p.WaitURL, "", "Authorization", "Bearer "+tokenA)
		got <- waited{a, time.Now()}
	}()
	waitListening(t, e)
	start := time.Now()
	if _, err := client.Transition(ctx, ledger.Move{ID: p.ReceiptID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Transition(ctx, ledger.Move{ID: p.ReceiptID, From: statemachine.Reconciling, To: statemachine.SafeToRetry}); err != nil {
		t.Fatal(err)
	}
	w := <-got
	t.Logf("GET ?wait= returned %v after the settle statements were issued", w.at.Sub(start))
	if w.at.Sub(start) > 5*time.Second {
		t.Fatalf("the wait took %v after the settlement: not woken by the notification", w.at.Sub(start))
	}
	if err := json.Unmarshal(w.a.body, &doc); err != nil || doc.State != "safe_to_retry" || !doc.Settled || doc.Next != gateway.RetrySameKey {
		t.Fatalf("waited receipt: %d %s", w.a.status, w.a.body)
	}
	// Absence proven: the same key is attempt 2, sent, linked to attempt 1.
	retry := e.post(t, "/blog/fail504", "k-504", `{"title":"maybe"}`)
	p3 := retry.problem(t)
	if up.count("/api/fail504") != 2 || p3.ReceiptID == p.ReceiptID {
		t.Fatalf("after safe_to_retry: upstream %d, receipt %d (was %d)", up.count("/api/fail504"), p3.ReceiptID, p.ReceiptID)
	}
	var attempt int
	var retryOf int64
	if err := e.db.QueryRow(ctx, `SELECT attempt, retry_of FROM reconciler.receipts WHERE id = $1`, p3.ReceiptID).Scan(&attempt, &retryOf); err != nil {
		t.Fatal(err)
	}
	if attempt != 2 || retryOf != p.ReceiptID {
		t.Fatalf("attempt %d retrying %d, want 2 retrying %d", attempt, retryOf, p.ReceiptID)
	}
	// Settled succeeded by a readback: the same key answers with the receipt.
	if _, err := client.Transition(ctx, ledger.Move{ID: p3.ReceiptID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Transition(ctx, ledger.Move{ID: p3.ReceiptID, From: statemachine.Reconciling, To: statemachine.Succeeded, ExternalID: "art-9"}); err != nil {
		t.Fatal(err)
	}
	done := e.post(t, "/blog/fail504", "k-504", `{"title":"maybe"}`)
	if err := json.Unmarshal(done.body, &doc); err != nil || done.status != http.StatusOK || doc.State != "succeeded" ||
		doc.ExternalID != "art-9" || up.count("/api/fail504") != 2 {
		t.Fatalf("after succeeded: %d %s, upstream %d", done.status, done.body, up.count("/api/fail504"))
	}
}

// waitListening waits (bounded) until the gateway's settlement listener is
// connected.
func waitListening(t *testing.T, e *env) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for listening(t, e) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the gateway never listened for settlements")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
}

// listening counts the sessions LISTENing for settlements.
func listening(t *testing.T, e *env) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND query = 'LISTEN reconciler_settled'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Nothing sent (the upstream refuses connections): rejected, retryable,
// and the same key is the next attempt.
func TestNotSentIsRetryableWithTheSameKey(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close()
	e := newEnvAt(t, url, "")
	a := e.post(t, "/blog/articles", "k-dead", `{"title":"x"}`)
	p := a.problem(t)
	if a.status != http.StatusServiceUnavailable || p.Type != gateway.ProblemNotSent.URI() || p.Retry != gateway.RetrySameKey ||
		p.ReceiptState != "rejected" || a.header.Get("Retry-After") == "" {
		t.Fatalf("not sent: %d %+v", a.status, p)
	}
	b := e.post(t, "/blog/articles", "k-dead", `{"title":"x"}`)
	if pb := b.problem(t); pb.ReceiptID == p.ReceiptID || pb.Type != gateway.ProblemNotSent.URI() {
		t.Fatalf("the same key after not_sent: %+v, want the next attempt", pb)
	}
}

func TestOpenAPIListsEveryProblemType(t *testing.T) {
	var doc struct {
		OpenAPI    string `json:"openapi"`
		Components struct {
			Problems map[string]struct {
				Status int    `json:"status"`
				Retry  string `json:"retry"`
				Title  string `json:"title"`
			} `json:"x-problem-types"`
		} `json:"components"`
	}
	if err := json.Unmarshal(gateway.OpenAPI(), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.OpenAPI != "3.1.0" {
		t.Fatalf("openapi %q", doc.OpenAPI)
	}
	types := gateway.ProblemTypes()
	if len(doc.Components.Problems) != len(types) {
		t.Fatalf("openapi.json documents %d problem types, the gateway has %d", len(doc.Components.Problems), len(types))
	}
	for _, p := range types {
		d, ok := doc.Components.Problems[p.Name]
		if !ok || d.Status != p.Status || d.Retry != p.Retry || d.Title != p.Title {
			t.Fatalf("problem type %s: documented %+v, is %+v", p.Name, d, p)
		}
	}
	e := newEnv(t, newFakeUpstream(), "")
	a := e.do(t, "GET", "/openapi.json", "")
	if a.status != http.StatusOK || string(a.body) != string(gateway.OpenAPI()) {
		t.Fatalf("/openapi.json: %d", a.status)
	}
}
