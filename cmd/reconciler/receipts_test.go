package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/review"
)

// receipts show prints any receipt, whatever its state.
func TestReceiptsShow(t *testing.T) {
	url := pgtest.NewDatabase(t)
	pool := pgtest.Pool(t, url)
	ctx := context.Background()
	agent, err := ledger.New(pool, "agent:t")
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: "k1", Operation: "articles.create", Dependency: "blog",
		Method: "POST", Target: "/articles", Payload: json.RawMessage(`{"title":"hello"}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Succeed(ctx, r, "art_1", ledger.Detail{}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "", "receipts", "show", "--database-url", url, fmt.Sprint(r.ID))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{fmt.Sprintf("receipt %d  succeeded", r.ID), `{"title":"hello"}`,
		"external id  art_1", "submitted -> succeeded  by agent:t", "external id: art_1"} {
		if !strings.Contains(out, want) {
			t.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	code, out, _ = runCLI(t, "", "receipts", "show", "--database-url", url, "--json", fmt.Sprint(r.ID))
	var tl review.Timeline
	if code != 0 || json.Unmarshal([]byte(out), &tl) != nil || tl.Receipt.ExternalID != "art_1" || len(tl.Events) != 3 {
		t.Fatalf("--json: exit %d %q", code, out)
	}
	if code, _, errOut := runCLI(t, "", "receipts", "show", "--database-url", url, "424242"); code != 1 ||
		!strings.Contains(errOut, "receipt 424242 not found") {
		t.Fatalf("unknown id: exit %d %q", code, errOut)
	}
	if code, _, _ := runCLI(t, "", "receipts", "show", "--database-url", url); code != 2 {
		t.Fatalf("no id: exit %d", code)
	}
}
