package httpadapter_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// ticketAdapter is a Go readback adapter for an API the declarative
// adapter cannot describe: GET /tickets/by-ref/{idempotency key} answers
// the ticket the agent created with that reference, or 404.
type ticketAdapter struct {
	base   string
	client *http.Client
}

// Check reads one receipt back. It classifies every failure: transient
// (asking again later may help) or permanent (a human must look).
func (a ticketAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	u := a.base + "/tickets/by-ref/" + r.IdempotencyKey
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	res := readback.Result{Query: "GET /tickets/by-ref/" + r.IdempotencyKey, Authoritative: true}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		res.Verdict = readback.VerdictAbsent
		return res, nil
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		secs, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		return readback.Result{}, readback.TransientError(fmt.Errorf("tickets: %s", resp.Status), time.Duration(secs)*time.Second)
	case resp.StatusCode != http.StatusOK:
		return readback.Result{}, readback.PermanentError(fmt.Errorf("tickets: %s", resp.Status))
	}
	var t struct {
		ID string `json:"id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&t); err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	res.Verdict, res.ExternalIDs = readback.VerdictPresent, []string{t.ID}
	return res, nil
}

// newTicketAdapter is the adapter's factory for the adapters file: it
// decodes its own block (the mapping under `tickets:`) strictly.
func newTicketAdapter(client *http.Client) readback.Factory {
	return func(name string, settings *yaml.Node) (readback.Adapter, error) {
		var s struct {
			BaseURL string `yaml:"base_url"`
		}
		if settings == nil {
			return nil, &readback.FieldError{Field: "base_url", Err: errors.New("is required")}
		}
		if err := settings.Decode(&s); err != nil {
			return nil, err
		}
		if !strings.HasPrefix(s.BaseURL, "http") {
			return nil, &readback.FieldError{Field: "base_url", Err: fmt.Errorf("want an http(s) URL, got %q", s.BaseURL)}
		}
		return ticketAdapter{base: s.BaseURL, client: client}, nil
	}
}

// Example_goAdapter registers a Go adapter type next to the declarative
// http type, loads an adapters file using both, and runs one check.
func Example_goAdapter() {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/tickets/by-ref/task-7:step-2:tickets.create" {
			fmt.Fprint(w, `{"id": "T-1001"}`)
			return
		}
		http.NotFound(w, r)
	}))
	defer api.Close()

	file := `
version: 1
adapters:
  - name: helpdesk-tickets
    type: tickets
    kind: create
    dependency: helpdesk
    consistency_window: 10s
    max_request_lifetime: 30s
    tickets:
      base_url: ` + api.URL + `
`
	types := httpadapter.Types()
	types["tickets"] = newTicketAdapter(api.Client())
	reg, err := readback.Load("adapters.yaml", strings.NewReader(file), types)
	if err != nil {
		fmt.Println(err)
		return
	}
	b, _ := reg.Lookup("tickets.create", "helpdesk")
	for _, key := range []string{"task-7:step-2:tickets.create", "task-8:step-1:tickets.create"} {
		res, err := b.Adapter.Check(context.Background(), readback.Receipt{ID: 1, IdempotencyKey: key})
		fmt.Println(b.Name, res.Verdict, res.ExternalIDs, err)
	}
	// Output:
	// helpdesk-tickets present [T-1001] <nil>
	// helpdesk-tickets absent [] <nil>
}
