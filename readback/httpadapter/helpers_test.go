package httpadapter_test

import (
	"encoding/json"
	"testing"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/readback"
)

// fingerprintOf computes the fingerprint the agent recorded for r.
func fingerprintOf(t testing.TB, r readback.Receipt) string {
	t.Helper()
	var doc struct {
		Payload json.RawMessage `json:"payload"`
	}
	if err := json.Unmarshal(r.Intent, &doc); err != nil {
		t.Fatal(err)
	}
	fp, err := fingerprint.Compute(r.Method, r.Target, doc.Payload)
	if err != nil {
		t.Fatal(err)
	}
	return fp.Fingerprint
}
