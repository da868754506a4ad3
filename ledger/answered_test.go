package ledger_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Answered is called with the classified answer while the receipt is still
// submitted: what it writes is there before anyone can see the receipt
// settled (the gateway keeps the response for replays so).
func TestHTTPDoAnsweredBeforeTheOutcomeIsRecorded(t *testing.T) {
	env := newHTTPEnv(t)
	ctx := context.Background()
	srv := env.serve(t, status(201, `{"id":"art_a"}`))
	var calls int
	var state string
	var verdict ledger.Verdict
	caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0),
		Answered: func(ctx context.Context, r *ledger.Receipt, ex ledger.Exchange, v ledger.Verdict) {
			calls++
			verdict = v
			if err := env.pool.QueryRow(ctx, `SELECT state FROM reconciler.receipts WHERE id = $1`, r.ID).Scan(&state); err != nil {
				t.Error(err)
			}
			if string(ex.Body) != `{"id":"art_a"}` {
				t.Errorf("Answered got body %q", ex.Body)
			}
		}}
	in, req := articleCall(t, srv.URL+"/api/articles", "answered")
	res, err := caller.Do(ctx, in, req)
	if err != nil || res.Receipt.State != statemachine.Succeeded {
		t.Fatalf("Do = %+v, %v", res, err)
	}
	if calls != 1 || state != string(statemachine.Submitted) || verdict.Outcome != ledger.OutcomeSucceeded {
		t.Fatalf("Answered called %d times, receipt %s, verdict %+v; want once, while submitted, succeeded", calls, state, verdict)
	}
	// A replay sends nothing and answers nothing new.
	in, req = articleCall(t, srv.URL+"/api/articles", "answered")
	if _, err := caller.Do(ctx, in, req); err != nil || calls != 1 {
		t.Fatalf("replay: %v, Answered called %d times; want once in all", err, calls)
	}
}

// DecodeContent decodes a coding the transport did not ask for before the
// body is read and classified; a coding it cannot decode leaves a 2xx
// outcome_unknown (malformed_body), never succeeded on a body nobody read.
func TestHTTPDoDecodeContent(t *testing.T) {
	pool := newHTTPEnv(t).pool
	ctx := context.Background()
	var zipped bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	_, _ = zw.Write([]byte(`{"id":"art_z"}`))
	_ = zw.Close()
	for _, tc := range []struct{ coding, want string }{{"x-gzip", "art_z"}, {"zstd", ""}} {
		env := newHTTPEnvOn(t, pool)
		srv := env.serve(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Encoding", tc.coding)
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(zipped.Bytes())
		})
		caller := &ledger.Caller{Ledger: env.ledger, HTTP: testHTTPClient(t, 0), DecodeContent: true}
		in, req := articleCall(t, srv.URL+"/api/articles", "decode-"+tc.coding)
		res, err := caller.Do(ctx, in, req)
		if tc.want != "" {
			if err != nil || res.Receipt.ExternalID != tc.want || res.Response.Header.Get("Content-Encoding") != "" {
				t.Fatalf("%s: %+v, %v; want succeeded with external id %s, decoded", tc.coding, res, err, tc.want)
			}
			continue
		}
		var oe *ledger.OutcomeError
		if !errors.As(err, &oe) || res.Receipt.State != statemachine.OutcomeUnknown || oe.Cause == nil ||
			oe.Cause.Code != ledger.CodeMalformedBody || !errors.Is(err, ledger.ErrUndecodableBody) {
			t.Fatalf("%s: %+v, %v; want outcome_unknown, malformed_body", tc.coding, res, err)
		}
	}
}
