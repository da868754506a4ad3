package rolestest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// TestGatewayWebhooksAsAgent: the gateway, running as reconciler_agent,
// registers its receipts, claims and records their webhook deliveries; and
// a settlement made by reconciler_worker, which may not write the webhook
// tables, still queues its event (the trigger runs as its owner).
func TestGatewayWebhooksAsAgent(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	const secret = "whsec_rolestest_0123456789abcdef0123"
	got := make(chan string, 10)
	hooks := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if gateway.VerifyWebhook([]byte(secret), r.Header.Get(gateway.HeaderSignature), body, time.Now(), time.Minute) == nil {
			got <- r.Header.Get(gateway.HeaderEventID)
		}
	}))
	t.Cleanup(hooks.Close)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/slow") {
			w.WriteHeader(http.StatusGatewayTimeout)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":"ext-1"}`)
	}))
	t.Cleanup(up.Close)
	file := `version: 1
agents: [{id: billing, token: {env: TOKEN}}]
routes:
  - prefix: /api
    upstream: ` + up.URL + `
    dependency: static-api
    webhook: {url: ` + hooks.URL + `, secret: {env: SECRET}}
`
	env := map[string]string{"TOKEN": "rolestest-agent-token-0123", "SECRET": secret}
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(file), func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(e.agent, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(client, cfg, gateway.Options{})
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	dctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); g.DeliverWebhooks(dctx) }()
	t.Cleanup(func() { cancel(); <-done })

	call := func(path, key string) int64 {
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+path, strings.NewReader(`{"n":1}`))
		req.Header.Set("Authorization", "Bearer rolestest-agent-token-0123")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		var id int64
		if _, err := fmt.Sscan(resp.Header.Get(gateway.HeaderReceiptID), &id); err != nil {
			t.Fatalf("%s: %d without a receipt id", path, resp.StatusCode)
		}
		return id
	}
	wait := func(want string) {
		t.Helper()
		select {
		case id := <-got:
			if id != want {
				t.Fatalf("event %s, want %s", id, want)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("event %s never arrived", want)
		}
	}
	ok := call("/api/charges", "rt:hook:1")
	wait(fmt.Sprintf("%d:succeeded", ok))

	slow := call("/api/slow", "rt:hook:2")
	worker, err := ledger.New(e.worker, "reconciler:"+workerID)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []ledger.Move{{ID: slow, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling},
		{ID: slow, From: statemachine.Reconciling, To: statemachine.SafeToRetry}} {
		if _, err := worker.Transition(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	wait(fmt.Sprintf("%d:safe_to_retry", slow))
}
