package integration

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// An update's pre-image is recorded at plan time (reconciler.plan's
// pre_image) and handed to the adapter with the claimed receipt.
func TestPlanRecordsPreImage(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	c, err := ledger.New(db, "agent:pre")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		preImage json.RawMessage
		want     string
	}{
		{"update", json.RawMessage(`{"title": "old"}`), `{"title": "old"}`},
		{"create", nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := c.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key("task", tt.name, "articles.update"),
				Operation: "articles.update", Dependency: "blog-api", Method: "PATCH", Target: "/articles/7",
				Payload: json.RawMessage(`{"title": "new"}`), PreImage: tt.preImage})
			if err != nil {
				t.Fatal(err)
			}
			var got *string
			if err := db.QueryRow(ctx, `SELECT pre_image::text FROM reconciler.receipts WHERE id = $1`, r.ID).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if (got == nil) != (tt.want == "") || (got != nil && *got != tt.want) {
				t.Fatalf("pre_image = %v, want %q", got, tt.want)
			}
		})
	}
}
