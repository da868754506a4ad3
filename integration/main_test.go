// Package integration holds the end-to-end tests of the reconciler against
// a real Postgres (internal/pgtest) and local fake APIs.
package integration

import (
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
