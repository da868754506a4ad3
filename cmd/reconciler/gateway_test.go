package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// `reconciler gateway` serves calls through the ledger, its metrics and its
// OpenAPI document, and exits 0 on SIGTERM (the context's end).
func TestGatewayCommand(t *testing.T) {
	url := pgtest.NewDatabase(t)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer upstream-secret-value" {
			http.Error(w, "no credential", http.StatusUnauthorized)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":"ch_1"}`)
	}))
	defer api.Close()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "agent-token")
	if err := os.WriteFile(tokenFile, []byte("agent-token-0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("GATEWAY_TEST_UPSTREAM_KEY", "upstream-secret-value")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	ml, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := ml.Addr().String()
	ml.Close()
	config := filepath.Join(dir, "routes.yaml")
	if err := os.WriteFile(config, []byte(`version: 1
listen: `+addr+`
agents:
  - {id: billing, token: {file: `+tokenFile+`}}
routes:
  - prefix: /payments
    upstream: `+api.URL+`
    dependency: payments
    operations:
      - {method: POST, path: /v1/charges, name: charges.create}
    auth: {env: GATEWAY_TEST_UPSTREAM_KEY}
`), 0o600); err != nil {
		t.Fatal(err)
	}

	if code, _, errOut := runCLI(t, "", "gateway", "--database-url", url, "--config", filepath.Join(dir, "missing.yaml")); code != 1 ||
		!strings.Contains(errOut, "missing.yaml") {
		t.Fatalf("a missing routes file: exit %d, %q", code, errOut)
	}

	var errOut bytes.Buffer
	stop := startCLI(t, &errOut, "gateway", "--database-url", url, "--config", config, "--metrics-addr", metricsAddr)
	base := "http://" + addr
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never answered: %v; stderr %s", err, errOut.String())
		}
		time.Sleep(20 * time.Millisecond) // polling a condition: the listener is up
	}
	req, _ := http.NewRequest("POST", base+"/payments/v1/charges", strings.NewReader(`{"amount":"500"}`))
	req.Header.Set("Authorization", "Bearer agent-token-0123456789abcdef")
	req.Header.Set("Idempotency-Key", "order-1:charge:charges.create")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Receipt-State") != "succeeded" || string(body) != `{"id":"ch_1"}` {
		t.Fatalf("call: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	// Issue 19, item 12: the metrics (every agent's activity per route)
	// are served on their own address, not on the agents' listener, where
	// any caller could read them without a token.
	for url, want := range map[string]string{
		"http://" + metricsAddr + "/metrics": `reconciler_gateway_requests_total{outcome="succeeded",route="/payments"} 1`,
		base + "/openapi.json":               `"openapi": "3.1.0"`,
		base + "/metrics":                    `"type":"/problems/unknown-route"`,
	} {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), want) {
			t.Fatalf("%s lacks %s: %s", url, want, b)
		}
	}
	if code := stop(); code != 0 {
		t.Fatalf("exit %d after SIGTERM: %s", code, errOut.String())
	}
	if strings.Contains(errOut.String(), "upstream-secret-value") || strings.Contains(errOut.String(), "agent-token-0123456789abcdef") {
		t.Fatal("a credential is in the logs")
	}
}
