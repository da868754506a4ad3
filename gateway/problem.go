package gateway

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// ProblemType is one kind of answer the gateway gives in an RFC 9457
// problem document (application/problem+json). Its URI is "/problems/<name>",
// relative to the gateway, which serves a description there.
type ProblemType struct {
	Name   string
	Status int
	Title  string
	// Retry says what the agent may do next (the document's "retry").
	Retry string
}

// What an agent may do after an answer: the "retry" member of every problem
// document the gateway writes for a side-effecting call.
const (
	// RetryNo: do not send this call again; fix it or give up.
	RetryNo = "no"
	// RetrySameKey: send it again, with the same Idempotency-Key (after
	// Retry-After, when given); nothing was done upstream.
	RetrySameKey = "same_key"
	// RetryAfterSettlement: do not send it again yet. Wait at wait_url
	// (GET /receipts/{id}?wait=30s) until the receipt settles, then send
	// it again with the same Idempotency-Key: the gateway answers with the
	// settled outcome, or makes the next attempt once absence is proven.
	RetryAfterSettlement = "after_settlement"
	// RetryAfterReview: a human must decide (manual_review); then as
	// after_settlement.
	RetryAfterReview = "after_review"
)

// The gateway's problem types, documented in openapi.json.
var (
	ProblemUnknownRoute        = ProblemType{"unknown-route", http.StatusNotFound, "No route for this path", RetryNo}
	ProblemUnknownOperation    = ProblemType{"unknown-operation", http.StatusNotFound, "The route declares no operation for this method and path", RetryNo}
	ProblemInvalidPath         = ProblemType{"invalid-path", http.StatusBadRequest, "The path holds a dot segment", RetryNo}
	ProblemMissingToken        = ProblemType{"missing-token", http.StatusUnauthorized, "No agent token", RetryNo}
	ProblemInvalidToken        = ProblemType{"invalid-token", http.StatusUnauthorized, "The agent token is not valid", RetryNo}
	ProblemMissingKey          = ProblemType{"missing-idempotency-key", http.StatusBadRequest, "A side-effecting call needs an Idempotency-Key header", RetryNo}
	ProblemInvalidKey          = ProblemType{"invalid-idempotency-key", http.StatusBadRequest, "The Idempotency-Key cannot be used", RetryNo}
	ProblemInvalidIntent       = ProblemType{"invalid-intent", http.StatusBadRequest, "The request's payload cannot be fingerprinted", RetryNo}
	ProblemRequestTooLarge     = ProblemType{"request-too-large", http.StatusRequestEntityTooLarge, "The request body is larger than the gateway takes", RetryNo}
	ProblemKeyReused           = ProblemType{"idempotency-key-reused", http.StatusUnprocessableEntity, "The Idempotency-Key already names another call", RetryNo}
	ProblemDuplicateIntent     = ProblemType{"duplicate-intent", http.StatusConflict, "The same call is unresolved under another Idempotency-Key", RetryNo}
	ProblemRetryRefused        = ProblemType{"retry-refused", http.StatusConflict, "The call may not be sent again", RetryNo}
	ProblemInProgress          = ProblemType{"request-in-progress", http.StatusConflict, "A call with this Idempotency-Key is in flight", RetryAfterSettlement}
	ProblemRejected            = ProblemType{"rejected", http.StatusConflict, "The call was settled rejected", RetryNo}
	ProblemOutcomeUnknown      = ProblemType{"outcome-unknown", http.StatusBadGateway, "The request was sent and its outcome is unknown", RetryAfterSettlement}
	ProblemUpstreamRedirect    = ProblemType{"upstream-redirect", http.StatusBadGateway, "The upstream answered with a redirect, which the gateway does not follow", RetryAfterSettlement}
	ProblemManualReview        = ProblemType{"manual-review", http.StatusBadGateway, "The outcome is held for a human to decide", RetryAfterReview}
	ProblemNotSent             = ProblemType{"not-sent", http.StatusServiceUnavailable, "Nothing was sent upstream", RetrySameKey}
	ProblemUpstreamUnavailable = ProblemType{"upstream-unavailable", http.StatusBadGateway, "The upstream did not answer a read", RetrySameKey}
	ProblemResponseTooLarge    = ProblemType{"response-too-large", http.StatusBadGateway, "The upstream's response is larger than the gateway takes", RetryNo}
	ProblemUndecodableResponse = ProblemType{"undecodable-response", http.StatusBadGateway, "The upstream's response is in a content coding the gateway cannot decode", RetryNo}
	ProblemLedger              = ProblemType{"ledger-unavailable", http.StatusServiceUnavailable, "The receipt ledger could not be written", RetrySameKey}
	ProblemReceiptNotFound     = ProblemType{"receipt-not-found", http.StatusNotFound, "No such receipt", RetryNo}
	ProblemInvalidWait         = ProblemType{"invalid-wait", http.StatusBadRequest, "wait must be a duration from 0s to 5m", RetryNo}
)

// ProblemTypes lists every problem type, for the OpenAPI document's check
// and for /problems/{name}.
func ProblemTypes() []ProblemType {
	return []ProblemType{ProblemUnknownRoute, ProblemUnknownOperation, ProblemInvalidPath, ProblemMissingToken,
		ProblemInvalidToken, ProblemMissingKey, ProblemInvalidKey, ProblemInvalidIntent, ProblemRequestTooLarge,
		ProblemKeyReused, ProblemDuplicateIntent, ProblemRetryRefused, ProblemInProgress, ProblemRejected,
		ProblemOutcomeUnknown, ProblemUpstreamRedirect, ProblemManualReview, ProblemNotSent, ProblemUpstreamUnavailable, ProblemResponseTooLarge,
		ProblemUndecodableResponse, ProblemLedger, ProblemReceiptNotFound, ProblemInvalidWait}
}

// URI is the problem type's "type" member.
func (p ProblemType) URI() string { return "/problems/" + p.Name }

// Problem is an RFC 9457 problem document with the gateway's extension
// members.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Retry is what the agent may do next: RetryNo, RetrySameKey,
	// RetryAfterSettlement or RetryAfterReview.
	Retry string `json:"retry"`
	// ReceiptID and ReceiptState describe the call's receipt, when there
	// is one; WaitURL is where to wait for its settlement.
	ReceiptID    int64  `json:"receipt_id,omitempty"`
	ReceiptState string `json:"receipt_state,omitempty"`
	WaitURL      string `json:"wait_url,omitempty"`
	// ExistingReceiptID is the unresolved receipt of a duplicate intent.
	ExistingReceiptID int64 `json:"existing_receipt_id,omitempty"`
	// Code is the ledger's recorded cause (timeout, http_504, not_sent, ...).
	Code string `json:"code,omitempty"`
	// UpstreamStatus is the upstream's status, when it answered.
	UpstreamStatus int `json:"upstream_status,omitempty"`
}

// newProblem starts a problem document of type p.
func newProblem(p ProblemType, detail string) Problem {
	return Problem{Type: p.URI(), Title: p.Title, Status: p.Status, Detail: detail, Retry: p.Retry}
}

// waitURL is where an agent waits for receipt id's settlement.
func waitURL(id int64) string { return "/receipts/" + strconv.FormatInt(id, 10) + "?wait=30s" }

// writeProblem writes pr with its status and the receipt headers.
func writeProblem(w http.ResponseWriter, pr Problem) {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	if pr.ReceiptID != 0 {
		h.Set(HeaderReceiptID, strconv.FormatInt(pr.ReceiptID, 10))
		h.Set(HeaderReceiptState, pr.ReceiptState)
	}
	if pr.Status == http.StatusUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="reconciler-gateway"`)
	}
	body, _ := json.Marshal(pr)
	w.WriteHeader(pr.Status)
	_, _ = w.Write(append(body, '\n'))
}
