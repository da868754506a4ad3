package integration

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/reconcile"
)

// An agent's outcome commits without waiting for the WAL flush
// (ledger.Client.WithDurableOutcomes). The sequence that would make that
// lie: the call's effect happens, the agent records succeeded, and the
// database server crashes before the outcome reaches the disk. The record
// made before the bytes left (submitted) must survive it, and the receipt
// must then settle succeeded by readback, with the effect once: never
// safe_to_retry, never a second send. The WAL writer is held back (its
// longest delay, nothing else committing), so the crash right after the
// call finds the outcome unflushed, which the test requires.
func TestOutcomeLostInADatabaseCrashIsReadBack(t *testing.T) {
	ctx := context.Background()
	cluster, db := ownCluster(t)
	// (Autovacuum off too: an ANALYZE's synchronous commit, which the
	// history's many partitions make likelier, would flush the outcome.)
	for _, q := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `ALTER SYSTEM SET wal_writer_flush_after = '1GB'`,
		`ALTER SYSTEM SET autovacuum = off`, `SELECT pg_reload_conf()`} {
		if _, err := db.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}

	clk := newClock()
	api := newFakeAPI(t, clk.Now, 0)
	// The write endpoint: it makes the thing the call's marker names, once
	// per request (so a second send would show as a second thing).
	things := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ Marker string }
		raw, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(raw, &body); err != nil || body.Marker == "" {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		api.Create(body.Marker, "thing-1")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"thing-1"}`)
	}))
	t.Cleanup(things.Close)

	client, err := ledger.New(db, "agent:crash")
	if err != nil {
		t.Fatal(err)
	}
	key := "crash:1:things.create"
	payload := `{"marker":"` + key + `"}`
	in := ledger.Intent{IdempotencyKey: key, Operation: "things.create", Dependency: "fake-api",
		Method: http.MethodPost, Target: "/things", Payload: json.RawMessage(payload)}
	req, err := http.NewRequest(http.MethodPost, things.URL+"/things", strings.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	caller := &ledger.Caller{Ledger: client, HTTP: things.Client()}
	res, err := caller.Do(ctx, in, req)
	if err != nil || res.Receipt.State != "succeeded" {
		t.Fatalf("the call: %+v, %v", res, err)
	}
	id := res.Receipt.ID

	// The server crashes right after the outcome was recorded, and comes back.
	if err := cluster.Pause(); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Resume(); err != nil {
		t.Fatal(err)
	}
	db.Reset()
	after := receipt(t, db, id)
	switch after.State {
	case "submitted":
		t.Logf("the crash lost the unflushed outcome: receipt %d is back in submitted", id)
	case "succeeded":
		t.Fatalf("the outcome was flushed before the crash (the WAL writer ran, or something committed "+
			"synchronously after it): the test did not exercise the path it is for; receipt %d is succeeded", id)
	default:
		t.Fatalf("after the crash receipt %d is %q: the record made before the send must survive", id, after.State)
	}

	// The orphan sweep and a readback settle it, as for any lost answer.
	pool := newPool(t, db, reconcile.Config{Registry: registry(t, api, shortPolicy()), Now: clk.Now,
		OrphanTimeout: time.Second})
	clk.Advance(2 * time.Second)
	for i := 0; i < 5 && receipt(t, db, id).State != "succeeded"; i++ {
		if _, err := pool.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
	}
	if got := receipt(t, db, id); got.State != "succeeded" || got.ExternalID != "thing-1" {
		t.Fatalf("receipt %d = %+v, want succeeded with thing-1", id, got)
	}
	api.mu.Lock()
	n := len(api.resources[key])
	api.mu.Unlock()
	if n != 1 {
		t.Fatalf("the API holds %d things for the call, want exactly 1", n)
	}
	st := checkHistories(t, db)
	if st.final[id] != "succeeded" {
		t.Fatalf("history ends in %q", st.final[id])
	}
}
