package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

const adaptersSecret = "tok_cli_SECRET_never_printed"

func writeAdapters(t *testing.T, baseURL string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "adapters.yaml")
	body := fmt.Sprintf(`version: 1
adapters:
  - name: shop-items
    type: http
    kind: create
    dependency: shop-api
    consistency_window: 5s
    max_request_lifetime: 10s
    http:
      preset: rest
      base_url: %s
      auth: {env: SHOP_TOKEN}
  - name: shop-refunds
    type: blind
    dependency: shop-api
    operations: [refunds.create]
`, baseURL)
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestAdaptersCheckValidates(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	good := writeAdapters(t, "https://shop.example.com")
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte(`version: 1
adapters:
  - name: shop-items
    type: http
    kind: create
    dependency: shop-api
    http:
      preset: rest
      base_url: https://shop.example.com
      search: {items: "data"}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		args     []string
		code     int
		contains []string
	}{
		{"valid", []string{"adapters", "check", "--config", good}, 0, []string{"valid, 2 adapter(s)", "shop-items", "shop-refunds"}},
		{"malformed", []string{"adapters", "check", "--config", bad}, 1, []string{"bad.yaml", `adapter "shop-items"`, "http.search.items"}},
		{"receipt without database", []string{"adapters", "check", "--config", good, "--receipt", "1"}, 2, []string{"--database-url"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("RECONCILER_DATABASE_URL", "")
			code, out, errOut := runCLI(t, "", tt.args...)
			all := out + errOut
			if code != tt.code {
				t.Fatalf("exit %d, want %d: %s", code, tt.code, all)
			}
			for _, c := range tt.contains {
				if !strings.Contains(all, c) {
					t.Errorf("output lacks %q: %s", c, all)
				}
			}
			if strings.Contains(all, adaptersSecret) {
				t.Errorf("the secret is printed: %s", all)
			}
		})
	}
}

// Issue 7, adversarial review: `adapters check` says what an absence of an
// unpaged list relies on (or that none is authoritative), and which
// operation a declared control vouches for when the adapter reads more than
// one; a cursor list without has_more is refused, naming the field.
func TestAdaptersCheckPaginationAndControlNotes(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	t.Setenv("RECONCILER_DATABASE_URL", "")
	adapter := func(name, pagination, query, control string) string {
		return fmt.Sprintf(`  - name: %s
    type: http
    kind: create
    dependency: %s-api
    http:
      preset: rest
      base_url: https://shop.example.com
      auth: {env: SHOP_TOKEN}
      search: {pagination: %s, query: %s}
%s`, name, name, pagination, query, control)
	}
	control := `    control: {idempotency_key: k, target: /items, submitted_at: 2026-01-02T03:04:05Z, operation: items.create}
`
	tests := []struct {
		name     string
		adapters []string
		code     int
		contains []string
		lacks    []string
	}{
		{"unpaged lists", []string{
			adapter("plain", "{style: none}", "{}", ""),
			adapter("whole", "{style: none, whole_list: true}", "{}", ""),
			adapter("keyed", "{style: none}", `{key: "{receipt.logical_key}"}`, ""),
			adapter("paged", "{style: page}", "{}", control),
		}, 0, []string{
			"plain: unpaged list neither narrowed to the receipt's key nor declared whole: no absence",
			"whole: unpaged list declared whole (search.pagination.whole_list)",
			"keyed: unpaged list narrowed to the receipt's key",
			"declared for items.create, others: succeeded receipts",
		}, []string{"paged: "}},
		{"cursor without has_more", []string{adapter("cursor", "{style: cursor, cursor: /next, param: cursor}", "{}", "")},
			1, []string{`adapter "cursor"`, "http.search.pagination.has_more: is required with style cursor"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "adapters.yaml")
			if err := os.WriteFile(path, []byte("version: 1\nadapters:\n"+strings.Join(tt.adapters, "")), 0o600); err != nil {
				t.Fatal(err)
			}
			code, out, errOut := runCLI(t, "", "adapters", "check", "--config", path)
			all := out + errOut
			if code != tt.code {
				t.Fatalf("exit %d, want %d: %s", code, tt.code, all)
			}
			for _, c := range tt.contains {
				if !strings.Contains(all, c) {
					t.Errorf("output lacks %q: %s", c, all)
				}
			}
			for _, c := range tt.lacks {
				if strings.Contains(all, c) {
					t.Errorf("output has %q: %s", c, all)
				}
			}
		})
	}
}

// snapshot is everything a readback could change: the receipt row, its
// history and its check records.
func snapshot(t *testing.T, db *pgxpool.Pool, id int64) string {
	t.Helper()
	var s string
	err := db.QueryRow(context.Background(), `SELECT (SELECT row_to_json(r)::text FROM reconciler.receipts r WHERE id = $1)
		|| (SELECT count(*)::text FROM reconciler.receipt_events WHERE receipt_id = $1)
		|| (SELECT count(*)::text FROM reconciler.readback_checks WHERE receipt_id = $1)`, id).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestAdaptersCheckReceipt(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	client, err := ledger.New(db, "agent:cli-test")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := client.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key("task-1", "step-1", "items.create"),
		Operation: "items.create", Dependency: "shop-api", Method: "POST", Target: "/items",
		Payload: json.RawMessage(`{"title":"lamp"}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = client.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = client.MarkUnknown(ctx, r, ledger.Detail{Reason: "timeout"}); err != nil {
		t.Fatal(err)
	}

	var auths []string
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		auths = append(auths, req.Header.Get("Authorization"))
		items := []any{}
		if req.URL.Query().Get("page") == "1" {
			items = append(items, map[string]any{"id": "item-77", "created_at": time.Now().UTC().Format(time.RFC3339),
				"metadata": map[string]any{"idempotency_key": r.IdempotencyKey}})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"items": items})
	}))
	defer api.Close()
	path := writeAdapters(t, api.URL)

	before := snapshot(t, db, r.ID)
	code, out, errOut := runCLI(t, "", "adapters", "check", "--config", path,
		"--receipt", fmt.Sprint(r.ID), "--database-url", url)
	if code != 0 {
		t.Fatalf("exit %d: %s %s", code, out, errOut)
	}
	for _, want := range []string{"adapter: shop-items", "verdict: present (authoritative)", "matched: item-77",
		`"matched_by":"marker"`, "decision: succeeded (present)", "nothing was changed"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out+errOut, adaptersSecret) {
		t.Errorf("the secret is printed:\n%s%s", out, errOut)
	}
	if len(auths) == 0 || auths[0] != "Bearer "+adaptersSecret {
		t.Errorf("credentials not sent: %q", auths)
	}
	if after := snapshot(t, db, r.ID); after != before {
		t.Errorf("the database changed:\nbefore %s\nafter  %s", before, after)
	}
	if strings.Contains(before, adaptersSecret) {
		t.Error("the secret is in the database")
	}

	code, out, _ = runCLI(t, "", "adapters", "check", "--config", path, "--receipt", "999999", "--database-url", url)
	if code != 1 || strings.Contains(out, "decision") {
		t.Errorf("unknown receipt: exit %d, %s", code, out)
	}
}

// controlAPI is a fake REST API that knows the truth: it holds exactly the
// items given, at /items, and answers 404 anywhere else.
func controlAPI(t *testing.T, items ...map[string]any) (*httptest.Server, *[]string) {
	t.Helper()
	var mu sync.Mutex
	var seen []string
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		seen = append(seen, req.URL.RequestURI())
		mu.Unlock()
		if req.URL.Path != "/items" || req.Header.Get("Authorization") != "Bearer "+adaptersSecret {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		out := []map[string]any{}
		if req.URL.Query().Get("page") == "1" {
			out = items
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"items": out})
	}))
	t.Cleanup(api.Close)
	return api, &seen
}

// Issue 7, "a misconfigured adapter must not produce proof": `adapters
// check --control` runs every declared control against the real API; a
// wrong path or a wrong marker fails it (exit 1, with why), a correct
// configuration passes, and an adapter without one is told how to bootstrap.
func TestAdaptersCheckControl(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	made := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	api, _ := controlAPI(t, map[string]any{"id": "item-control", "created_at": made.Format(time.RFC3339),
		"metadata": map[string]any{"idempotency_key": "bootstrap:shop-control:items.create"}})
	adapter := func(name, op, target, extra string) string {
		return fmt.Sprintf(`  - name: %s
    type: http
    kind: create
    dependency: shop-api
    operations: [%s]
    http:
      preset: rest
      base_url: %s
      auth: {env: SHOP_TOKEN}
%s    control:
      idempotency_key: "bootstrap:shop-control:items.create#2"
      target: %s
      intent: {title: control lamp}
      submitted_at: %s
`, name, op, api.URL, extra, target, made.Format(time.RFC3339))
	}
	correct := adapter("shop-items", "items.create", "/items", "")
	wrongPath := adapter("shop-wrong-path", "items.copy", "/itemz", "")
	wrongMarker := adapter("shop-wrong-marker", "items.move", "/items",
		"      match: {marker: {pointer: /metadata/ref, equals: \"{receipt.logical_key}\"}}\n")
	rest := `  - name: shop-undeclared
    type: http
    kind: create
    dependency: shop-api
    operations: [items.other]
    http: {preset: rest, base_url: ` + api.URL + `, auth: {env: SHOP_TOKEN}}
  - name: shop-refunds
    type: blind
    dependency: shop-api
    operations: [refunds.create]
`
	write := func(adapters ...string) string {
		path := filepath.Join(t.TempDir(), "adapters.yaml")
		if err := os.WriteFile(path, []byte("version: 1\nadapters:\n"+strings.Join(adapters, "")), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	tests := []struct {
		name     string
		file     string
		code     int
		contains []string
		lacks    []string
	}{
		{"correct", write(correct, rest), 0,
			[]string{"shop-items: passed: found item-control", "shop-undeclared: " + noControl, "shop-refunds: blind",
				"declared", "succeeded receipts only"},
			[]string{"failed"}},
		{"wrong path and wrong marker", write(correct, wrongPath, wrongMarker, rest), 1,
			[]string{"shop-items: passed", "shop-wrong-path: failed: positive control failed", "HTTP 404",
				"shop-wrong-marker: failed: positive control failed", "answered absent",
				"2 control(s) failed"},
			nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runCLI(t, "", "adapters", "check", "--config", tt.file, "--control")
			all := out + errOut
			if code != tt.code {
				t.Fatalf("exit %d, want %d:\n%s", code, tt.code, all)
			}
			for _, c := range tt.contains {
				if !strings.Contains(all, c) {
					t.Errorf("output lacks %q:\n%s", c, all)
				}
			}
			for _, c := range tt.lacks {
				if strings.Contains(all, c) {
					t.Errorf("output has %q:\n%s", c, all)
				}
			}
			if strings.Contains(all, adaptersSecret) {
				t.Errorf("the secret is printed:\n%s", all)
			}
		})
	}
	// Without --control nothing is sent.
	_, seen := controlAPI(t)
	if code, out, _ := runCLI(t, "", "adapters", "check", "--config", write(correct)); code != 0 || strings.Contains(out, "passed") || len(*seen) != 0 {
		t.Errorf("without --control: exit %d, %s", code, out)
	}
}

// Issue 7, "a misconfigured adapter must not produce proof": `adapters
// check --receipt` on a receipt already settled says how, when and by whom,
// and decides nothing: no readback, no change.
func TestAdaptersCheckSettledReceipt(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	agent, err := ledger.New(db, "agent:cli-test")
	if err != nil {
		t.Fatal(err)
	}
	worker := agent.As("reconciler:cli-test")
	ctx := context.Background()
	unknown := func(step string) *ledger.Receipt {
		t.Helper()
		r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key("task-s", step, "items.create"),
			Operation: "items.create", Dependency: "shop-api", Method: "POST", Target: "/items",
			Payload: json.RawMessage(`{"title":"` + step + `"}`)})
		if err != nil {
			t.Fatal(err)
		}
		if r, err = agent.Submit(ctx, r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	succeeded, err := agent.Succeed(ctx, unknown("ok"), "item-9", ledger.Detail{Reason: "http_2xx"})
	if err != nil {
		t.Fatal(err)
	}
	rejected, err := agent.Reject(ctx, unknown("no"), ledger.Detail{Reason: "http_4xx"})
	if err != nil {
		t.Fatal(err)
	}
	safe, err := agent.MarkUnknown(ctx, unknown("lost"), ledger.Detail{Reason: "timeout"})
	if err != nil {
		t.Fatal(err)
	}
	for _, to := range []statemachine.State{statemachine.Reconciling, statemachine.SafeToRetry} {
		if safe, err = worker.Transition(ctx, ledger.Move{ID: safe.ID, From: safe.State, To: to,
			Detail: ledger.Detail{Reason: "absent (" + string(to) + ")"}}); err != nil {
			t.Fatal(err)
		}
	}
	api, seen := controlAPI(t)
	path := writeAdapters(t, api.URL)
	for _, tt := range []struct {
		r    *ledger.Receipt
		want []string
	}{
		{succeeded, []string{"already settled: succeeded at ", "by agent:cli-test (http_2xx), external id item-9"}},
		{rejected, []string{"already settled: rejected at ", "by agent:cli-test (http_4xx)"}},
		{safe, []string{"already settled: safe_to_retry at ", "by reconciler:cli-test (absent (safe_to_retry))"}},
	} {
		t.Run(string(tt.r.State), func(t *testing.T) {
			before := snapshot(t, db, tt.r.ID)
			code, out, errOut := runCLI(t, "", "adapters", "check", "--config", path,
				"--receipt", fmt.Sprint(tt.r.ID), "--database-url", url)
			if code != 0 {
				t.Fatalf("exit %d: %s %s", code, out, errOut)
			}
			for _, w := range append(tt.want, "nothing to decide", "no readback was run") {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			if strings.Contains(out, "decision:") || strings.Contains(out, "verdict:") {
				t.Errorf("a settled receipt was decided again:\n%s", out)
			}
			if after := snapshot(t, db, tt.r.ID); after != before {
				t.Errorf("the database changed:\nbefore %s\nafter  %s", before, after)
			}
		})
	}
	if len(*seen) != 0 {
		t.Errorf("the API was read for settled receipts: %q", *seen)
	}
}
