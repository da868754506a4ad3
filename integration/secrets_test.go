package integration

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// Credentials and secret field values of TestNoSecretAnywhere. Each is
// distinctive, so that finding it anywhere is a leak and not a coincidence.
const (
	secAgentToken   = "tok_AGENT_Zq81LmX0/+k"  // Authorization: Bearer on the agent's call
	secHookUser     = "hookuser_U1"            // URL user info of the agent's call
	secHookPass     = "hookpass_S3cr3t_P"      // URL user info of the agent's call
	secHookPath     = "whsec_PATH_9f8e7d6c5b"  // the webhook path segment that is its secret
	secQueryKey     = "qk_QUERY_55aa66bb"      // ?api_key= of the agent's call
	secAdapterToken = "sk_ADAPTER/BEARER+31xq" // the bearer adapter's key (env)
	secAdapterUser  = "rbuser_B9"              // the basic adapter's user (env)
	secAdapterPass  = "rbpass_BASIC_77zz"      // the basic adapter's password (env)
	secCardNumber   = "4111111111111111"       // secret field /card_number
	secPin          = "p1n-8642-x"             // secret field /pin
)

// secretForms returns every form of every credential and secret value
// TestNoSecretAnywhere must not find, by name.
func secretForms() map[string]string {
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	return map[string]string{
		"agent token":                         secAgentToken,
		"agent token, URL-encoded":            url.QueryEscape(secAgentToken),
		"agent token, base64":                 b64(secAgentToken),
		"hook password":                       secHookPass,
		"hook basic, base64":                  b64(secHookUser + ":" + secHookPass),
		"webhook path":                        secHookPath,
		"query key":                           secQueryKey,
		"adapter bearer token":                secAdapterToken,
		"adapter bearer token, URL-encoded":   url.QueryEscape(secAdapterToken),
		"adapter bearer token, base64":        b64(secAdapterToken),
		"adapter basic password":              secAdapterPass,
		"adapter basic, Basic form":           "Basic " + b64(secAdapterUser+":"+secAdapterPass),
		"adapter basic, base64":               b64(secAdapterUser + ":" + secAdapterPass),
		"adapter basic password, URL-encoded": url.QueryEscape(secAdapterUser + ":" + secAdapterPass),
		"card number":                         secCardNumber,
		"pin":                                 secPin,
	}
}

// echoEverything answers 401 with a body that echoes the request's
// Authorization header, URL and query in every form a careless API does.
func echoEverything(w http.ResponseWriter, r *http.Request) {
	auth := r.Header.Get("Authorization")
	_, cred, _ := strings.Cut(auth, " ")
	decoded, _ := base64.StdEncoding.DecodeString(cred)
	if len(decoded) == 0 {
		decoded = []byte(cred)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusUnauthorized)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"message": "invalid credentials " + auth + " raw=" + cred +
			" enc=" + url.QueryEscape(string(decoded)) + " b64=" + base64.StdEncoding.EncodeToString(decoded) +
			" url=" + r.URL.String(),
	}})
}

// Issue 8, acceptance 3 (items 5 and 6): after an agent's calls with
// credentials in headers and the URL and secret fields in the payload, an
// API that echoes them in error bodies, and the reconciler reading back
// with bearer and basic credentials from the environment, no form of any
// credential and no secret field value is in any table of the database,
// in the logs, or in the output of the CLI.
func TestNoSecretAnywhere(t *testing.T) {
	t.Setenv(fingerprint.SecretKeyEnv, "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
	t.Setenv(fingerprint.SecretKeyIDEnv, "itest-1")
	t.Setenv("ITEST_SEC_BEARER", secAdapterToken)
	t.Setenv("ITEST_SEC_BASIC", secAdapterUser+":"+secAdapterPass)
	ctx := context.Background()

	dbURL := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, dbURL)
	agent, err := ledger.New(db, "agent:secrets-test")
	if err != nil {
		t.Fatal(err)
	}
	if agent, err = agent.SecretKeyFromEnv(os.Getenv); err != nil {
		t.Fatal(err)
	}

	// The agent's API: 500 with everything echoed, or a connection cut
	// after the request was read (a *url.Error holding the URL).
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("mode") == "cut" {
			conn, _, _ := w.(http.Hijacker).Hijack()
			_ = conn.Close()
			return
		}
		echoEverything(w, r)
	}))
	defer api.Close()
	caller := &ledger.Caller{Ledger: agent}
	payload := `{"card_number":"` + secCardNumber + `","pin":"` + secPin + `","amount":500}`
	var ids []int64
	for i, mode := range []string{"echo", "cut"} {
		u, _ := url.Parse(api.URL)
		u.User = url.UserPassword(secHookUser, secHookPass)
		u.Path = "/services/T00/" + secHookPath
		u.RawQuery = url.Values{"api_key": {secQueryKey}, "mode": {mode}}.Encode()
		req, err := http.NewRequest("POST", u.String(), strings.NewReader(payload))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+secAgentToken)
		res, err := caller.Do(ctx, ledger.Intent{
			IdempotencyKey: ledger.Key(t.Name(), strconv.Itoa(i), "hooks.post"),
			Operation:      "hooks.post", Dependency: "hooks-" + mode, Target: "/services/webhook",
			Payload: json.RawMessage(payload), Secret: []string{"/card_number", "/pin"},
		}, req)
		if err == nil {
			t.Fatalf("%s: the call succeeded", mode)
		}
		if strings.Contains(err.Error(), secHookPath) || strings.Contains(err.Error(), secCardNumber) {
			t.Logf("%s: the agent's error holds a secret (not stored; printed only to the agent): %v", mode, err)
		}
		if res == nil || res.Receipt == nil {
			t.Fatalf("%s: no receipt: %v", mode, err)
		}
		ids = append(ids, res.Receipt.ID)
		if !fingerprint.HasSecrets(res.Receipt.Intent) || !strings.Contains(string(res.Receipt.Intent), "hmac-sha256:itest-1:") {
			t.Errorf("%s: the stored intent is not keyed: %s", mode, res.Receipt.Intent)
		}
	}

	// The reconciler reads back with bearer and basic credentials against
	// an API that answers 401 echoing them.
	readAPI := httptest.NewServer(http.HandlerFunc(echoEverything))
	defer readAPI.Close()
	adapters := fmt.Sprintf(`version: 1
defaults:
  consistency_window: 5s
  max_request_lifetime: 10s
  backoff: {base: 100ms, cap: 1s}
adapters:
  - name: bearer-charges
    type: http
    kind: create
    dependency: bearer-api
    http: {preset: stripe, base_url: %s, auth: {env: ITEST_SEC_BEARER}}
  - name: basic-charges
    type: http
    kind: create
    dependency: basic-api
    http: {preset: stripe, base_url: %s, auth: {env: ITEST_SEC_BASIC, scheme: basic}}
`, readAPI.URL, readAPI.URL)
	e := newAdEnv(t, adapters)
	e.db, e.agent = db, agent
	e.unknown("charges.create", "bearer-api", "/v1/charges", `{"amount":100}`, nil)
	e.unknown("charges.create", "basic-api", "/v1/charges", `{"amount":200}`, nil)
	// The clock starts now that the rows exist, so they are due.
	e.clk = newClock()
	e.drain()
	var checks int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.readback_checks WHERE error IS NOT NULL`).Scan(&checks); err != nil || checks < 2 {
		t.Fatalf("expected failed checks recorded (%d, %v): the test proves nothing", checks, err)
	}

	// Every table of every schema but the system ones, all columns.
	var tables []string
	rows, err := db.Query(ctx, `SELECT quote_ident(table_schema) || '.' || quote_ident(table_name)
		FROM information_schema.tables WHERE table_type = 'BASE TABLE'
		AND table_schema NOT IN ('pg_catalog', 'information_schema')`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, name)
	}
	rows.Close()
	var dump strings.Builder
	for _, table := range tables {
		var s string
		if err := db.QueryRow(ctx, `SELECT coalesce(string_agg(row_to_json(t)::text, e'\n'), '') FROM `+table+` t`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		dump.WriteString(s)
	}
	outputs := map[string]string{"database": dump.String(), "logs": e.logs.String()}

	// The CLI's human and JSON output of every receipt, and review list.
	bin := buildBinary(t)
	var cli strings.Builder
	run := func(args ...string) {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "RECONCILER_DATABASE_URL="+dbURL)
		out, _ := cmd.CombinedOutput()
		cli.Write(out)
	}
	var all []int64
	if err := db.QueryRow(ctx, `SELECT array_agg(id) FROM reconciler.receipts`).Scan(&all); err != nil {
		t.Fatal(err)
	}
	for _, id := range all {
		run("receipts", "show", strconv.FormatInt(id, 10))
		run("receipts", "show", "--json", strconv.FormatInt(id, 10))
	}
	run("review", "list")
	run("review", "list", "--json")
	outputs["cli"] = cli.String()
	if !strings.Contains(outputs["cli"], "hmac-sha256:itest-1:") {
		t.Errorf("the CLI output shows no keyed intent: the test proves nothing:\n%s", outputs["cli"])
	}

	for where, text := range outputs {
		for name, form := range secretForms() {
			if at := strings.Index(text, form); at >= 0 {
				t.Errorf("%s is in the %s: …%s…", name, where, text[max(at-120, 0):min(at+len(form)+40, len(text))])
			}
		}
	}
}
