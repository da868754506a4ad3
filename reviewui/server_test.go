package reviewui

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/statemachine"
)

var csrfValue = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// do sends a request to the page and returns its status and body.
func do(t *testing.T, c *http.Client, method, u string, form url.Values, header http.Header) (int, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range header {
		req.Header[k] = v
	}
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return res.StatusCode, string(b)
}

func TestTrustedHeaderOnlyFromTrustedProxies(t *testing.T) {
	id, err := NewTrustedHeader("X-Forwarded-User", []string{"10.1.0.0/16", "192.0.2.7"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		remote string
		users  []string
		want   string // reviewer, or the error
	}{
		{"10.1.2.3:5000", []string{"alice"}, "alice"},
		{"192.0.2.7:5000", []string{" bob "}, "bob"},
		{"[::ffff:10.1.2.3]:5000", []string{"alice"}, "alice"},
		{"10.2.0.1:5000", []string{"alice"}, ErrUntrustedProxy.Error()},
		{"127.0.0.1:5000", []string{"alice"}, ErrUntrustedProxy.Error()},
		{"10.1.2.3:5000", nil, ErrNotSignedIn.Error()},
		{"10.1.2.3:5000", []string{"alice", "mallory"}, ErrNotSignedIn.Error()},
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = c.remote
		for _, u := range c.users {
			r.Header.Add("X-Forwarded-User", u)
		}
		got, err := id.Identify(r)
		if err != nil {
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s %v: %v, want %s", c.remote, c.users, err, c.want)
			}
			continue
		}
		if got.Reviewer != c.want {
			t.Errorf("%s %v: %q, want %s", c.remote, c.users, got.Reviewer, c.want)
		}
	}
	for _, bad := range [][]string{nil, {"not-an-address"}} {
		if _, err := NewTrustedHeader("X-Forwarded-User", bad); err == nil {
			t.Errorf("trusted proxies %q accepted", bad)
		}
	}
}

// The page behind its proxy: the proxy's header is believed from the proxy
// only, every answer carries the strict policy, and a form without its
// token (or with another reviewer's) changes nothing.
func TestPageRefusals(t *testing.T) {
	e := newLedger(t)
	id := e.held(t, "charges.create", "payments", "blind", nil, `{"amount":1}`)
	// A proxy address that is not this test's: the header is not believed.
	strict, err := NewTrustedHeader("X-Forwarded-User", []string{"192.0.2.1"})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{Pool: e.login(t, "reconciler_reviewer"), Identifier: strict})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	untrusted := httptest.NewServer(srv)
	t.Cleanup(untrusted.Close)
	alice := http.Header{"X-Forwarded-User": {"alice"}}
	if code, body := do(t, untrusted.Client(), http.MethodGet, untrusted.URL+"/", nil, alice); code != http.StatusForbidden ||
		!strings.Contains(body, "through the sign-in proxy") {
		t.Fatalf("header from an untrusted peer: %d\n%s", code, body)
	}

	ts := serve(t, e.login(t, "reconciler_reviewer"))
	c := ts.Client()
	page := fmt.Sprintf("%s/receipts/%d", ts.URL, id)
	req, _ := http.NewRequest(http.MethodGet, page, nil)
	req.Header.Set("X-Forwarded-User", "alice")
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	html, _ := io.ReadAll(res.Body)
	res.Body.Close()
	csp := res.Header.Get("Content-Security-Policy")
	if !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe-inline") || !strings.Contains(csp, "frame-ancestors 'none'") {
		t.Errorf("Content-Security-Policy %q", csp)
	}
	if strings.Contains(string(html), "<script>") || strings.Contains(string(html), " style=") || strings.Contains(string(html), " on") && regexp.MustCompile(` on[a-z]+=`).Match(html) {
		t.Errorf("the page has inline script or style")
	}
	m := csrfValue.FindStringSubmatch(string(html))
	if m == nil {
		t.Fatalf("no CSRF token on the receipt page:\n%s", html)
	}
	decision := url.Values{"decision": {"succeeded"}, "reason": {"checked the processor"}}
	for name, form := range map[string]url.Values{
		"no token":     decision,
		"wrong token":  withCSRF(decision, "x"+m[1]),
		"bob's token":  withCSRF(decision, m[1]), // sent as bob: tokens are bound to their reviewer
		"empty reason": withCSRF(url.Values{"decision": {"succeeded"}, "reason": {" "}}, m[1]),
	} {
		who := alice
		if name == "bob's token" {
			who = http.Header{"X-Forwarded-User": {"bob"}}
		}
		code, body := do(t, c, http.MethodPost, page+"/decide", form, who)
		if want := map[bool]int{true: http.StatusBadRequest, false: http.StatusForbidden}[name == "empty reason"]; code != want {
			t.Errorf("%s: %d, want %d\n%s", name, code, want, body)
		}
		if s, humans := e.state(t, id); s != statemachine.ManualReview || humans != 0 {
			t.Fatalf("%s: receipt %s with %d human moves", name, s, humans)
		}
	}
	// A cross-site form is refused before its token is looked at.
	cross := http.Header{"X-Forwarded-User": {"alice"}, "Sec-Fetch-Site": {"cross-site"}}
	if code, _ := do(t, c, http.MethodPost, page+"/decide", withCSRF(decision, m[1]), cross); code != http.StatusForbidden {
		t.Errorf("cross-site form: %d, want 403", code)
	}
	if code, body := do(t, c, http.MethodPost, page+"/decide", withCSRF(decision, m[1]), alice); code != http.StatusOK ||
		!strings.Contains(body, "Your decision was recorded") {
		t.Fatalf("the page's own form: %d\n%s", code, body)
	}
}

func withCSRF(v url.Values, token string) url.Values {
	out := url.Values{csrfField: {token}}
	for k, vs := range v {
		out[k] = vs
	}
	return out
}

// Reviewers without a proxy sign in with their own token: the session
// cookie then names them, and an unknown token or a sign-in form without
// its token is refused.
func TestTokenSignIn(t *testing.T) {
	e := newLedger(t)
	id := e.held(t, "charges.create", "payments", "blind", nil, `{"amount":1}`)
	path := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("# reviewers\nalice alice-token-0123456789\nbob   bob-token-0123456789abc\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens, err := LoadTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{Pool: e.login(t, "reconciler_reviewer"), Identifier: tokens})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}

	code, body := do(t, c, http.MethodGet, ts.URL+"/", nil, nil)
	if code != http.StatusOK || !strings.Contains(body, `action="/signin"`) {
		t.Fatalf("signed out, the queue sends to sign in: %d\n%s", code, body)
	}
	token := csrfValue.FindStringSubmatch(body)[1]
	if code, _ := do(t, c, http.MethodPost, ts.URL+"/signin", url.Values{"token": {"alice-token-0123456789"}}, nil); code != http.StatusForbidden {
		t.Errorf("sign-in without the form's token: %d, want 403", code)
	}
	code, body = do(t, c, http.MethodGet, ts.URL+"/signin", nil, nil)
	token = csrfValue.FindStringSubmatch(body)[1]
	if code, _ := do(t, c, http.MethodPost, ts.URL+"/signin", url.Values{"token": {"nobody-token-0123456789"}, csrfField: {token}}, nil); code != http.StatusUnauthorized {
		t.Errorf("sign-in with an unknown token: %d, want 401", code)
	}
	_, body = do(t, c, http.MethodGet, ts.URL+"/signin", nil, nil)
	token = csrfValue.FindStringSubmatch(body)[1]
	code, body = do(t, c, http.MethodPost, ts.URL+"/signin", url.Values{"token": {"bob-token-0123456789abc"}, csrfField: {token}}, nil)
	if code != http.StatusOK || !strings.Contains(body, `<strong id="reviewer">bob</strong>`) {
		t.Fatalf("signed in as bob: %d\n%s", code, body)
	}
	page := fmt.Sprintf("%s/receipts/%d", ts.URL, id)
	_, body = do(t, c, http.MethodGet, page, nil, nil)
	form := url.Values{"decision": {"requeue"}, "reason": {"the processor was down, check again"},
		csrfField: {csrfValue.FindStringSubmatch(body)[1]}}
	if code, body := do(t, c, http.MethodPost, page+"/decide", form, nil); code != http.StatusOK || !strings.Contains(body, "outcome_unknown") {
		t.Fatalf("requeue as bob: %d\n%s", code, body)
	}
	var actor string
	if err := e.owner.QueryRow(context.Background(), `SELECT actor FROM reconciler.receipt_events
		WHERE receipt_id = $1 ORDER BY seq DESC LIMIT 1`, id).Scan(&actor); err != nil || actor != "human:bob" {
		t.Fatalf("last move by %q (%v), want human:bob", actor, err)
	}

	for name, content := range map[string]string{
		"short token":    "alice short\n",
		"duplicate name": "alice alice-token-0123456789\nalice alice-token-9876543210\n",
		"three fields":   "alice alice-token-0123456789 extra\n",
		"empty":          "# nobody\n",
	} {
		p := filepath.Join(t.TempDir(), "tokens")
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadTokens(p); err == nil {
			t.Errorf("%s: tokens file accepted", name)
		}
	}
}

// tracer records the statements a pool runs, with their arguments.
type tracer struct {
	stmts []traced
}

type traced struct {
	sql  string
	args []any
}

func (tr *tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	tr.stmts = append(tr.stmts, traced{d.SQL, d.Args})
	return ctx
}

func (tr *tracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// With 100,000 receipts held (and 200,000 settled), every statement the queue page runs for a
// request (not the counts read in the background) reads receipts through
// an index, never a sequential scan: the plans of the statements as the
// page ran them, with their arguments.
func TestQueuePlansAt100kHeld(t *testing.T) {
	e := newLedger(t)
	fillHeld(t, e.owner, benchHeld, benchSettled)
	tr := &tracer{}
	cfg, err := pgxpool.ParseConfig(e.url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 1 // one connection: the tracer is not locked
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	srv, err := New(Config{Pool: pool, Identifier: &TrustedHeader{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	if _, err := srv.readCounts(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"", "?dependency=dep-7", "?operation=op-3", "?reason=diverged", "?reason=lifetime_exceeded", "?reason=false_absence",
		"?age=1000h", "?dependency=dep-7&operation=op-7&reason=bound_reached&age=24h", "?dependency=dep-none"} {
		tr.stmts = nil
		req := httptest.NewRequest(http.MethodGet, "/"+q, nil)
		id := Identity{Reviewer: "alice"}
		w := httptest.NewRecorder()
		srv.queue(w, req, id)
		if w.Code != http.StatusOK {
			t.Fatalf("%s: %d\n%s", q, w.Code, w.Body)
		}
		stmts := tr.stmts
		tr.stmts = nil
		for _, s := range stmts {
			if !strings.Contains(s.sql, "reconciler.receipts") {
				continue
			}
			var plan strings.Builder
			rows, err := pool.Query(context.Background(), "EXPLAIN "+s.sql, s.args...)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var line string
				if err := rows.Scan(&line); err != nil {
					t.Fatal(err)
				}
				plan.WriteString(line + "\n")
			}
			rows.Close()
			var scans []string
			for _, line := range strings.Split(plan.String(), "\n") {
				if strings.Contains(line, " Scan ") {
					f := strings.Fields(strings.TrimLeft(line, " ->"))
					scans = append(scans, strings.Join(f[:min(len(f), 5)], " "))
				}
			}
			t.Logf("%s %s: %v", q, strings.Fields(s.sql)[1], scans)
			if strings.Contains(plan.String(), "Seq Scan on receipts") {
				t.Errorf("%s: sequential scan of receipts:\n%s\n%s", q, s.sql, plan.String())
			}
		}
	}
}
