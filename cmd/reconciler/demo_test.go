package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestDemo runs the README's demo end to end: agents against a fake API
// that loses answers, the reconciler settling them, retries of what was
// proven absent. It fails if any task is duplicated or lost.
func TestDemo(t *testing.T) {
	var out bytes.Buffer
	if err := runDemo(context.Background(), &out, pgtest.NewDatabase(t), 30, 0.5, 3); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "duplicates=0, missing=0") {
		t.Fatalf("demo output lacks the audit line:\n%s", out.String())
	}
}
