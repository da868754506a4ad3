package ledger_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// Issue 19, item 2 (SPEC §5a, "a native key protects only within its
// retention"): a safe_to_retry that rests on the API's native idempotency
// key (guarantee native_idempotency_key) allows a retry only while the
// retry's request is written before reuse_idempotency_key_before; after
// that the API no longer deduplicates the reused key against a straggler of
// the original, and the database refuses the retry (RL009: Retry's error
// matches ErrKeyRetentionPassed and ErrRetryRefused, and nothing is
// recorded), unless the absence was also read after the full window. Every
// retry's events say which guarantee it used (detail retry_basis).
func TestNativeKeyProtectsOnlyWithinRetention(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.NewPool(t)
	agent, err := ledger.New(pool, "agent:retention")
	if err != nil {
		t.Fatal(err)
	}
	var now time.Time // the database's clock
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	for i, c := range []struct {
		name string
		// The settlement's evidence: the key's retention end and the read's
		// start, relative to the database's clock now, and the declared
		// lifetime (the full window ends 5 s + lifetime after submission).
		reuse, readAt time.Duration
		lifetime      float64
		guarantee     string
		retryDelay    time.Duration // the retry's max_send_delay (0: 5 s)
		want          string        // the guarantee the retry records; "" refused
	}{
		{name: "within the retention", reuse: time.Hour, lifetime: 3600, guarantee: "native_idempotency_key",
			want: "native_idempotency_key"},
		{name: "retention passed", reuse: -time.Minute, lifetime: 3600, guarantee: "native_idempotency_key"},
		{name: "retry written after the retention", reuse: 2 * time.Minute, lifetime: 3600,
			guarantee: "native_idempotency_key", retryDelay: 5 * time.Minute},
		{name: "retention passed, absence read after the full window", reuse: -time.Minute, readAt: time.Hour,
			guarantee: "native_idempotency_key", want: "request_lifetime_elapsed"},
		{name: "full window", reuse: -time.Minute, lifetime: 0, readAt: time.Hour,
			guarantee: "request_lifetime_elapsed", want: "request_lifetime_elapsed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := ledger.Intent{IdempotencyKey: fmt.Sprintf("retention:%d", i), Operation: "charges.create",
				Dependency: "payments", Method: "POST", Target: "/v1/charges",
				Payload: []byte(fmt.Sprintf(`{"amount": %d}`, 100+i))}
			r, err := agent.PlanAndSubmit(ctx, in)
			if err != nil {
				t.Fatal(err)
			}
			rec := agent.As("reconciler:retention")
			ev := map[string]any{"guarantee": c.guarantee, "read_at": now.Add(c.readAt),
				"max_request_lifetime_s": c.lifetime, "consistency_window_s": 0}
			if c.guarantee == "native_idempotency_key" {
				ev["reuse_idempotency_key_before"] = now.Add(c.reuse)
			}
			for _, m := range []ledger.Move{{ID: r.ID, From: statemachine.Submitted, To: statemachine.OutcomeUnknown},
				{ID: r.ID, From: statemachine.OutcomeUnknown, To: statemachine.Reconciling},
				{ID: r.ID, From: statemachine.Reconciling, To: statemachine.SafeToRetry, Detail: ledger.Detail{Evidence: ev}}} {
				if r, err = rec.Transition(ctx, m); err != nil {
					t.Fatal(err)
				}
			}
			in.MaxSendDelay = c.retryDelay
			retry, err := agent.Retry(ctx, r, in)
			if c.want == "" {
				if !errors.Is(err, ledger.ErrKeyRetentionPassed) || !errors.Is(err, ledger.ErrRetryRefused) {
					t.Fatalf("Retry: %v, want ErrKeyRetentionPassed and ErrRetryRefused", err)
				}
				var n int
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE retry_of = $1`, r.ID).Scan(&n); err != nil || n != 0 {
					t.Fatalf("%d retries recorded (%v), want none", n, err)
				}
				// The same rule for an agent that plans in SQL.
				_, err = pool.Exec(ctx, `SELECT reconciler.plan(idempotency_key => $1, operation => $2, dependency => $3,
					method => 'POST', target => $4, fingerprint => $5, intent => '{}', actor => 'agent:sql', retry_of => $6,
					max_send_delay => $7::interval)`, ledger.LogicalKey(r.IdempotencyKey)+"#2", r.Operation, r.Dependency,
					r.Target, r.Fingerprint, r.ID, fmt.Sprintf("%f seconds", max(c.retryDelay, 5*time.Second).Seconds()))
				if pe := pgErr(err); pe == nil || pe.Code != "RL009" || pe.Detail != fmt.Sprint(r.ID) {
					t.Fatalf("reconciler.plan of the retry: %v, want RL009 naming receipt %d", err, r.ID)
				}
				return
			}
			if err != nil {
				t.Fatalf("Retry: %v, want it planned (guarantee %s)", err, c.want)
			}
			if _, err := agent.Submit(ctx, retry); err != nil {
				t.Fatalf("Submit of the retry: %v", err)
			}
			// Its proof is spent: a read of it could find the retry's effect.
			if _, err := agent.RequestFreshProof(ctx, r, "test"); !errors.Is(err, ledger.ErrStateConflict) {
				t.Errorf("a fresh proof of a receipt whose retry went out: %v, want ErrStateConflict", err)
			}
			events, err := agent.History(ctx, retry.ID)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range events {
				var d struct {
					Basis struct {
						RetryOf   int64  `json:"retry_of"`
						Guarantee string `json:"guarantee"`
					} `json:"retry_basis"`
				}
				if err := json.Unmarshal(e.Detail, &d); err != nil || d.Basis.RetryOf != r.ID || d.Basis.Guarantee != c.want {
					t.Errorf("retry event %s -> %s: detail %s (%v), want retry_basis {retry_of %d, guarantee %s}",
						e.From, e.To, e.Detail, err, r.ID, c.want)
				}
			}
		})
	}
}
