package ledger_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// settleDetail returns the detail of receipt id's last history event.
func settleDetail(t *testing.T, env *httpEnv, id int64) map[string]any {
	t.Helper()
	var d map[string]any
	if err := env.pool.QueryRow(context.Background(), `SELECT detail FROM reconciler.receipt_events
		WHERE receipt_id = $1 ORDER BY seq DESC LIMIT 1`, id).Scan(&d); err != nil {
		t.Fatal(err)
	}
	return d
}

// Issue 8, item 1: a 200 whose id holds a NUL, and one whose id is 1 MiB,
// settle succeeded (the 2xx proves the effect) instead of leaving the
// receipt submitted; the id, altered by any sanitizing, is not stored as
// the external id (readbacks would look it up), and the evidence keeps its
// hash and an excerpt, marked sanitized. Item 8: a 1 MiB id is bounded.
func TestHTTPDoUntrustedExternalID(t *testing.T) {
	pool := pgtest.NewPool(t)
	for name, body := range map[string]string{
		"nul":      `{"id":"art_1\u0000"}`,
		"raw-nul":  "{\"id\":\"art_1\x00\"}",
		"escape":   `{"id":"art_1\u001b[2J"}`,
		"one-mib":  `{"id":"` + strings.Repeat("a", 1<<20) + `"}`,
		"bad-utf8": "{\"id\":\"art_\xff\"}",
	} {
		t.Run(name, func(t *testing.T) {
			env := newHTTPEnvOn(t, pool)
			srv := env.serve(t, status(http.StatusCreated, body))
			in, req := articleCall(t, srv.URL+"/articles", "untrusted-id-"+name)
			caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0), MaxResponseBytes: 2 << 20}
			res, err := caller.Do(context.Background(), in, req)
			if name == "raw-nul" || name == "bad-utf8" {
				// Not JSON: a 2xx whose body is malformed is unknown.
				if res == nil || res.Receipt.State == statemachine.Submitted {
					t.Fatalf("Do = %+v, %v: the receipt stayed submitted", res, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Do: %v", err)
			}
			if res.Receipt.State != statemachine.Succeeded || res.Receipt.ExternalID != "" {
				t.Fatalf("receipt = %s with id %q, want succeeded without an id", res.Receipt.State, res.Receipt.ExternalID)
			}
			ev := settleDetail(t, env, res.Receipt.ID)["evidence"].(map[string]any)
			u, ok := ev["untrusted_external_id"].(map[string]any)
			if !ok || ev["sanitized"] != true || !strings.HasPrefix(u["sha256"].(string), "sha256:") {
				t.Fatalf("evidence = %v", ev)
			}
			if ex := u["excerpt"].(string); len(ex) > 255 || strings.ContainsAny(ex, "\x00\x1b") {
				t.Fatalf("excerpt = %q", ex)
			}
		})
	}
}

// Issue 8, item 8: a panicking Classify override leaves the receipt
// outcome_unknown (the request was sent) with the panic recorded, not
// submitted; and messages a Classify override returns are sanitized.
func TestHTTPDoClassifyPanics(t *testing.T) {
	env := newHTTPEnv(t)
	srv := env.serve(t, status(http.StatusOK, `{"id":"a-1"}`))
	in, req := articleCall(t, srv.URL+"/articles", "classify-panics")
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0),
		Classify: func(ledger.Exchange) (ledger.Verdict, bool) { panic("boom\x00\x1b[2J") }}
	res, err := caller.Do(context.Background(), in, req)
	if !errors.Is(err, ledger.ErrOutcomeUnknown) || res.Receipt.State != statemachine.OutcomeUnknown {
		t.Fatalf("Do = %v, %v; want outcome_unknown", res.Receipt.State, err)
	}
	d := settleDetail(t, env, res.Receipt.ID)
	e := d["error"].(map[string]any)
	if e["code"] != ledger.CodeClassifyPanic || !strings.HasPrefix(e["message"].(string), "Classify panicked: boom\uFFFD") {
		t.Fatalf("detail = %v", d)
	}

	env = newHTTPEnvOn(t, env.pool)
	srv2 := env.serve(t, status(http.StatusServiceUnavailable, "busy"))
	in2, req2 := articleCall(t, srv2.URL+"/articles", "classify-nul-message")
	caller.Classify = func(ledger.Exchange) (ledger.Verdict, bool) {
		return ledger.Verdict{Outcome: ledger.OutcomeUnknown, Code: "x\x00", Message: "busy\x00" + strings.Repeat("é", 1000)}, true
	}
	res, err = caller.Do(context.Background(), in2, req2)
	if res == nil || res.Receipt.State != statemachine.OutcomeUnknown {
		t.Fatalf("Do = %+v, %v; want outcome_unknown", res, err)
	}
	e = settleDetail(t, env, res.Receipt.ID)["error"].(map[string]any)
	if m := e["message"].(string); !strings.HasPrefix(m, "busy\uFFFD") || len(m) > 512 {
		t.Fatalf("message = %q (%d bytes)", m, len(m))
	}
}

// Issue 8, item 8: sizes and control characters are refused at plan time,
// by ledger.Plan (one clear error, before any round trip) and by the
// database (reconciler.plan and a plain INSERT), so a 10 KB dependency no
// longer plans and then fails at submit.
func TestPlanInputLimits(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	c, err := ledger.New(pool, "agent:limits")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		mod     func(*ledger.Intent)
		want    error
		sqlcode string
	}{
		{"10 MB operation", func(in *ledger.Intent) { in.Operation = strings.Repeat("o", 10<<20) }, ledger.ErrInvalidIntent, "23514"},
		{"10 KB dependency", func(in *ledger.Intent) { in.Dependency = strings.Repeat("d", 10<<10) }, ledger.ErrInvalidIntent, "23514"},
		{"long method", func(in *ledger.Intent) { in.Method = strings.Repeat("M", 201) }, ledger.ErrInvalidIntent, "23514"},
		{"3 KB target", func(in *ledger.Intent) { in.Target = "/" + strings.Repeat("t", 3<<10) }, ledger.ErrInvalidIntent, "23514"},
		{"3 KB key", func(in *ledger.Intent) { in.IdempotencyKey = strings.Repeat("k", 3<<10) }, ledger.ErrInvalidKey, "RL007"},
		{"ESC in key", func(in *ledger.Intent) { in.IdempotencyKey = "k\x1b[2J" }, ledger.ErrInvalidKey, "RL007"},
		{"C1 in operation", func(in *ledger.Intent) { in.Operation = "op\u009b" }, ledger.ErrInvalidIntent, "23514"},
		{"bidi in dependency", func(in *ledger.Intent) { in.Dependency = "dep\u202e" }, ledger.ErrInvalidIntent, "23514"},
		{"newline in target", func(in *ledger.Intent) { in.Target = "/a\nb" }, ledger.ErrInvalidIntent, "23514"},
		{"tab in method", func(in *ledger.Intent) { in.Method = "PO\tST" }, ledger.ErrInvalidIntent, "23514"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := article("limits-" + string(rune('a'+i)))
			tc.mod(&in)
			if _, err := c.Plan(ctx, in); !errors.Is(err, tc.want) {
				t.Fatalf("Plan: %v, want %v", err, tc.want)
			} else if len(err.Error()) > 400 {
				t.Fatalf("Plan's error is %d bytes: not one clear line", len(err.Error()))
			}
			_, err := pool.Exec(ctx, `SELECT reconciler.plan(idempotency_key => $1, operation => $2,
				dependency => $3, method => $4, target => $5, fingerprint => 'sha256:'||repeat('0', 64),
				intent => '{}', actor => 'agent:limits')`,
				in.IdempotencyKey, in.Operation, in.Dependency, strings.ToUpper(in.Method), in.Target)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != tc.sqlcode {
				t.Fatalf("reconciler.plan: %v, want SQLSTATE %s", err, tc.sqlcode)
			}
			_, err = pool.Exec(ctx, `INSERT INTO reconciler.receipts (idempotency_key, operation, dependency,
				method, target, fingerprint, intent, state_actor)
				VALUES ($1, $2, $3, $4, $5, 'sha256:'||repeat('0', 64), '{}', 'agent:limits')`,
				in.IdempotencyKey, in.Operation, in.Dependency, strings.ToUpper(in.Method), in.Target)
			if !errors.As(err, &pe) || pe.Code != tc.sqlcode {
				t.Fatalf("INSERT: %v, want SQLSTATE %s", err, tc.sqlcode)
			}
		})
	}
	// The bounds themselves still plan.
	in := article("limits-ok")
	in.Operation, in.Target = strings.Repeat("o", ledger.MaxNameBytes), "/"+strings.Repeat("t", ledger.MaxTargetBytes-1)
	if _, err := c.Plan(ctx, in); err != nil {
		t.Fatalf("Plan at the bounds: %v", err)
	}
}
