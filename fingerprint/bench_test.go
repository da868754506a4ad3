package fingerprint

import "testing"

// benchPayload is a realistic ~1 KB intent: a refund with line items,
// metadata, a volatile request id and nonce, and a secret token.
const benchPayload = `{
  "request_id": "req_01HZX3Q9V7J2K8M4N6P0R2T4W6",
  "idempotency_hint": "task-8812:step-3:refunds.create",
  "charge": "ch_3PqL2b2eZvKYlo2C1x8Yx0aB",
  "amount": 129900,
  "currency": "eur",
  "reason": "requested_by_customer",
  "customer": {
    "id": "cus_Q2w3E4r5T6y7U8",
    "email": "ana.lopez@example.com",
    "name": "Ana L\u00f3pez",
    "address": {"line1": "Calle Mayor 12", "city": "Madrid", "postal_code": "28013", "country": "ES"}
  },
  "items": [
    {"sku": "SKU-1001", "description": "Wireless headphones", "quantity": 1, "unit_amount": 89900, "tax_rate": 0.21, "ts": "2024-05-01T10:15:00Z"},
    {"sku": "SKU-2002", "description": "Carrying case", "quantity": 2, "unit_amount": 20000, "tax_rate": 0.21, "ts": "2024-05-01T10:15:01Z"}
  ],
  "metadata": {
    "order_id": "ord_558812",
    "agent": "support-bot",
    "ticket": "ZD-44120",
    "notes": "Customer reports a defect on arrival; refund approved by policy R-7.",
    "nonce": "7f3c9a1e5b2d4f60"
  },
  "auth": {"token": "sk_live_51HqL2b2eZvKYlo2CabcdefGhijklMnop"},
  "flags": [true, false, null],
  "refund_application_fee": false
}`

func BenchmarkCompute(b *testing.B) {
	payload := []byte(benchPayload)
	opts := []Option{
		WithDrop("/request_id", "/metadata/nonce", "/items/0/ts", "/items/1/ts"),
		WithSecret("/auth/token"), WithSecretKey("bench", []byte("0123456789abcdef0123456789abcdef")),
	}
	if _, err := Compute("post", "/v1/refunds", payload, opts...); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Compute("post", "/v1/refunds", payload, opts...); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCanonicalize(b *testing.B) {
	payload := []byte(benchPayload)
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Canonicalize(payload); err != nil {
			b.Fatal(err)
		}
	}
}
