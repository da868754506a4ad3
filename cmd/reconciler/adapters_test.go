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
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
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
