package benchgw_test

import (
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
