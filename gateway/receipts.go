package gateway

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

// openAPI is the OpenAPI document of the gateway's own endpoints.
//
//go:embed openapi.json
var openAPI []byte

// OpenAPI returns the OpenAPI 3.1 document of the gateway's endpoints and
// problem types, as served at /openapi.json.
func OpenAPI() []byte { return append([]byte(nil), openAPI...) }

func serveOpenAPI(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(openAPI)
}

// serveProblemType describes a problem type at its URI.
func serveProblemType(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	for _, p := range ProblemTypes() {
		if p.Name == name {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			fmt.Fprintf(w, "%s (HTTP %d)\nretry: %s\nSee /openapi.json, components.x-problem-types.\n", p.Title, p.Status, p.Retry)
			return
		}
	}
	http.NotFound(w, r)
}

// ReceiptDoc is the gateway's JSON view of a receipt.
type ReceiptDoc struct {
	ID             int64      `json:"id"`
	IdempotencyKey string     `json:"idempotency_key"`
	Operation      string     `json:"operation"`
	Dependency     string     `json:"dependency"`
	State          string     `json:"state"`
	ExternalID     string     `json:"external_id,omitempty"`
	Attempt        int        `json:"attempt"`
	RetryOf        int64      `json:"retry_of,omitempty"`
	Retryable      bool       `json:"retryable"`
	CreatedAt      time.Time  `json:"created_at"`
	SubmittedAt    *time.Time `json:"submitted_at,omitempty"`
	UpdatedAt      time.Time  `json:"updated_at"`
	// Settled is false while the outcome is not known yet (planned,
	// submitted, outcome_unknown, reconciling): a wait would go on.
	Settled bool `json:"settled"`
	// Next says what the agent may do now, in the words of a problem
	// document's "retry": "no" once succeeded or rejected for good,
	// "same_key" after safe_to_retry or a retryable rejection (send the call
	// again with the same key: it becomes the next attempt),
	// "after_settlement" while unknown, "after_review" while held.
	Next string `json:"next"`
}

func receiptDoc(rc *ledger.Receipt) ReceiptDoc {
	d := ReceiptDoc{ID: rc.ID, IdempotencyKey: rc.IdempotencyKey, Operation: rc.Operation, Dependency: rc.Dependency,
		State: string(rc.State), ExternalID: rc.ExternalID, Attempt: rc.Attempt, RetryOf: rc.RetryOf,
		Retryable: rc.Retryable, CreatedAt: rc.CreatedAt, UpdatedAt: rc.UpdatedAt, Settled: !ledger.Awaiting(rc.State)}
	if !rc.SubmittedAt.IsZero() {
		t := rc.SubmittedAt
		d.SubmittedAt = &t
	}
	switch {
	case rc.State == statemachine.SafeToRetry || rc.Retryable:
		d.Next = RetrySameKey
	case rc.State == statemachine.ManualReview:
		d.Next = RetryAfterReview
	case ledger.Awaiting(rc.State):
		d.Next = RetryAfterSettlement
	default:
		d.Next = RetryNo
	}
	return d
}

func writeReceipt(w http.ResponseWriter, status int, rc *ledger.Receipt) {
	setReceipt(w.Header(), rc)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	body, _ := json.Marshal(receiptDoc(rc))
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// serveReceipt answers GET /receipts/{id}[?wait=30s]: the receipt, after
// waiting (at most maxWait) until it settles when wait is given. The wait
// is woken by the database's NOTIFY when an unknown outcome settles; a
// receipt still in flight is re-read on a timer (ledger.Client.Await).
func (g *Gateway) serveReceipt(w http.ResponseWriter, r *http.Request) {
	const route = routeReceipts
	agent, _, bad := g.authenticate(r)
	if bad != nil {
		g.refuse(w, route, newProblem(*bad, "send the agent's token as Authorization: Bearer <token>"))
		return
	}
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		g.refuse(w, route, newProblem(ProblemReceiptNotFound, "a receipt id is a positive integer"))
		return
	}
	var wait time.Duration
	if v := r.URL.Query().Get("wait"); v != "" {
		if wait, err = time.ParseDuration(v); err != nil || wait < 0 || wait > maxWait {
			g.refuse(w, route, newProblem(ProblemInvalidWait, fmt.Sprintf("wait=%q: want a duration such as 30s, at most %v", truncate(v), maxWait)))
			return
		}
	}
	// Another agent's receipt is answered as one that does not exist: an
	// agent learns nothing of another's calls, not even that they exist.
	owner, err := g.store.owner(r.Context(), id)
	if err != nil {
		g.log.Error("reading a receipt's owner failed", "receipt_id", id, "error", err)
		writeProblem(w, newProblem(ProblemLedger, "the receipt could not be read; ask again"))
		return
	}
	if owner != "agent:"+agent {
		g.refuse(w, route, newProblem(ProblemReceiptNotFound, "no receipt "+strconv.FormatInt(id, 10)))
		return
	}
	var rc *ledger.Receipt
	if wait > 0 {
		ctx, cancel := context.WithTimeout(r.Context(), wait)
		defer cancel()
		// A gateway that stops answers its waits at once.
		defer context.AfterFunc(g.draining, cancel)()
		rc, err = g.ledger.Await(ctx, id)
		if ctx.Err() != nil && r.Context().Err() == nil {
			// Still unsettled after the wait: say so (read again if the
			// wait ended before its first read).
			if err = nil; rc == nil {
				rc, err = g.ledger.Get(r.Context(), id)
			}
		}
	} else {
		rc, err = g.ledger.Get(r.Context(), id)
	}
	switch {
	case errors.Is(err, ledger.ErrNotFound):
		g.refuse(w, route, newProblem(ProblemReceiptNotFound, "no receipt "+strconv.FormatInt(id, 10)))
		return
	case err != nil:
		if r.Context().Err() == nil {
			g.log.Error("reading a receipt failed", "receipt_id", id, "error", err)
			writeProblem(w, newProblem(ProblemLedger, "the receipt could not be read; ask again"))
		}
		return
	}
	g.metrics.request(route, outcomeRead)
	writeReceipt(w, http.StatusOK, rc)
}
