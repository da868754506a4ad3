package gateway_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
)

// Issue 21, item 4: the upstream answers 201 while the database refuses
// the outcome's write (made read-only, as mid-failover, and the gateway's
// connections cut). The gateway keeps the outcome, tells the agent what is
// true (the answer was not recorded, the receipt is submitted), and writes
// it once the database takes writes again: the receipt succeeds and the
// same key replays the upstream's answer, not a 409 for the orphan
// timeout.
func TestUnrecordedOutcomeIsKept(t *testing.T) {
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	var name string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	// readOnly sets the database's default and cuts every other session,
	// so the gateway's next connection gets it.
	readOnly := func(on bool) {
		set := "SET default_transaction_read_only = on"
		if !on {
			set = "RESET default_transaction_read_only"
		}
		if _, err := admin.Exec(ctx, `ALTER DATABASE `+name+` `+set); err != nil {
			t.Error(err)
		}
		if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`); err != nil {
			t.Error(err)
		}
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		readOnly(true) // the receipt is submitted by now
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"post_1"}`))
	}))
	defer up.Close()
	g, srv := newGateway(t, db, routesFile(up.URL, ""), gateway.Options{})
	call := func() answer {
		a, err := send(http.MethodPost, srv.URL+routesPrefix+"/posts", `{"title":"t"}`,
			"Authorization", "Bearer "+tokenA, gateway.HeaderIdempotencyKey, "task:1:posts.create")
		if err != nil {
			t.Fatal(err)
		}
		return a
	}

	a := call()
	p := a.problem(t)
	if a.status != http.StatusBadGateway || p.ReceiptState != "submitted" || p.Code != "succeeded" || p.UpstreamStatus != 201 ||
		!strings.Contains(p.Detail, "could not be recorded") || strings.Contains(p.Detail, "the reconciler is settling it") {
		t.Fatalf("answer %d %+v: want 502 saying the 201 was not recorded yet and the receipt is submitted", a.status, p)
	}
	if n := g.Unrecorded(); n != 1 {
		t.Fatalf("%d outcomes kept, want 1", n)
	}
	readOnly(false)
	// The first attempt may meet a connection cut above; the next one
	// connects afresh.
	for i := 0; g.RecordUnrecorded(ctx) > 0; i++ {
		if i == 5 {
			t.Fatal("the kept outcome was not recorded once the database took writes")
		}
	}
	var state string
	if err := db.QueryRow(ctx, `SELECT state FROM reconciler.receipts WHERE id = $1`, p.ReceiptID).Scan(&state); err != nil || state != "succeeded" {
		t.Fatalf("receipt %d is %q (%v), want succeeded", p.ReceiptID, state, err)
	}
	again := call()
	if again.status != http.StatusCreated || again.header.Get(gateway.HeaderReplayed) != "true" || string(again.body) != `{"id":"post_1"}` {
		t.Fatalf("the same key again: %d %s %s, want the upstream's 201 replayed", again.status, again.header, again.body)
	}
}
