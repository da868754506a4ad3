package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/scratchdb"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// The ledger's timing for the local fake API: a request not written within
// maxSendDelay is not written at all, and the API decides a write's effect
// when the request arrives, so it can take effect no later than the hang
// that holds it.
const (
	// MaxConns bounds the connections of one strategy's database pool.
	MaxConns = 8

	maxSendDelay = 200 * time.Millisecond
	dependency   = "cms"
)

// runLedger is one task through the ledger: the reads as the article's
// retries, deadlines and validation make them, and each write through
// ledger.Caller. Without a reconciler an unknown outcome stays unknown and
// the task stops there; with one, the agent waits for the settlement and
// sends again only after a proven absence (safe_to_retry), through Do.
func (a *agent) runLedger(ctx context.Context, task int) (res taskResult) {
	ctx, cancel := context.WithTimeout(ctx, ledgerDeadline)
	defer cancel()
	jitter := rand.New(rand.NewPCG(a.seed, uint64(task)))
	answer := 0
	for _, tool := range []string{toolDocs, toolFacts} {
		v, err := a.read(ctx, jitter, task, tool)
		if err != nil {
			return taskResult{reason: fmt.Sprintf("%s: %v", tool, err)}
		}
		answer += v
	}
	res.answer = answer
	draft, err := a.ledgerWrite(ctx, jitter, task, toolDraft, writeBody{Task: task, Marker: marker(task, toolDraft), Answer: answer})
	if err == nil {
		_, err = a.ledgerWrite(ctx, jitter, task, toolPost, writeBody{Task: task, Marker: marker(task, toolPost), Answer: answer, DraftID: draft})
	}
	if err != nil {
		// Whether a receipt is left unsettled or held is read from the
		// ledger itself at the end of the run (ledgerState).
		res.reason = err.Error()
		return res
	}
	res.answered = true
	return res
}

var errManualReview = errors.New("held for manual review")

// ledgerWrite makes one write step through Caller.Do under the step's
// harness-owned key, and returns the record's id. Every resend follows a
// proof that the previous send took no effect (nothing was sent, or the
// reconciler proved it absent), so no attempt count bounds it: only the
// task's deadline does. A cap would only turn a draft into an orphan when
// its publish runs out of attempts.
func (a *agent) ledgerWrite(ctx context.Context, jitter *rand.Rand, task int, tool string, in writeBody) (string, error) {
	path := "/cms/drafts"
	if tool == toolPost {
		path = "/cms/posts"
	}
	payload, _ := json.Marshal(in)
	intent := ledger.Intent{IdempotencyKey: in.Marker, Operation: tool, Dependency: dependency,
		Method: http.MethodPost, Target: path, Payload: payload, MaxSendDelay: maxSendDelay}
	for n := 0; ; n++ {
		if n > 0 {
			t := time.NewTimer(time.Duration(jitter.Int64N(int64(min(backoffCap, backoffBase<<min(n-1, 8))) + 1)))
			select {
			case <-ctx.Done():
				t.Stop()
				return "", fmt.Errorf("%s: %d sends, each proven to have taken no effect, by the task's deadline", tool, n)
			case <-t.C:
			}
		}
		req, err := a.request(ctx, task, http.MethodPost, path, payload)
		if err != nil {
			return "", err
		}
		res, err := a.caller.Do(ctx, intent, req)
		switch {
		case err == nil:
			return res.Receipt.ExternalID, nil
		case errors.Is(err, ledger.ErrNotSent), errors.Is(err, ledger.ErrRejected) && res.Receipt.Retryable:
			continue // nothing took effect: Do plans the next attempt
		case errors.Is(err, ledger.ErrOutcomeUnknown) && a.settle:
			r, werr := a.waitSettled(ctx, res.Receipt.ID)
			if werr != nil {
				return "", fmt.Errorf("%s: receipt %d: %w", tool, res.Receipt.ID, werr)
			}
			switch r.State {
			case statemachine.Succeeded:
				return r.ExternalID, nil
			case statemachine.SafeToRetry:
				continue // absence proven: Do sends attempt n+1
			default:
				return "", fmt.Errorf("%s: receipt %d: %w", tool, r.ID, errManualReview)
			}
		default:
			return "", fmt.Errorf("%s: %w", tool, err)
		}
	}
}

// waitSettled waits until the reconciler has settled receipt id, reading
// it from the ledger; it gives up with ledger.ErrOutcomeUnknown when the
// task's deadline passes first.
func (a *agent) waitSettled(ctx context.Context, id int64) (*ledger.Receipt, error) {
	tick := time.NewTicker(settlePollPeriod)
	defer tick.Stop()
	for {
		r, err := a.caller.Ledger.Get(context.WithoutCancel(ctx), id)
		if err != nil {
			return nil, err
		}
		switch r.State {
		case statemachine.Succeeded, statemachine.SafeToRetry, statemachine.ManualReview:
			return r, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: still %s at the task's deadline", ledger.ErrOutcomeUnknown, r.State)
		case <-tick.C:
		}
	}
}

// startReconciler runs the real reconciler (reconcile.Pool) over db with
// an adapter that reads the fake API's lists back by marker, until stop is
// called. Its policy declares the fake API's timing: the visibility lag
// (plus a margin) as the consistency window, and the longest hang as the
// request lifetime.
func startReconciler(ctx context.Context, db *pgxpool.Pool, base string, p Profile, hangFor time.Duration) (stop func() error, err error) {
	policy := readback.Policy{ConsistencyWindow: p.Lag + 50*time.Millisecond, MaxRequestLifetime: hangFor + 100*time.Millisecond,
		MaxChecks: 200, Deadline: time.Minute, BackoffBase: 50 * time.Millisecond, BackoffCap: 300 * time.Millisecond}
	reg := readback.NewRegistry()
	client := &http.Client{Timeout: 2 * callTimeout}
	for _, b := range []struct{ op, path string }{{toolDraft, "/cms/drafts"}, {toolPost, "/cms/posts"}} {
		if err := reg.Register(readback.Binding{Name: b.op, Type: "go", Kind: readback.Create, Dependency: dependency,
			Operations: []string{b.op}, Adapter: listAdapter{base: base, path: b.path, client: client}, Policy: policy}); err != nil {
			return nil, err
		}
	}
	pool, err := reconcile.New(db, reconcile.Config{Instance: "sim", Registry: reg, Workers: 16,
		PollInterval: 100 * time.Millisecond, CheckTimeout: time.Second, ControlRetry: 100 * time.Millisecond,
		GracePeriod: time.Second, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := pool.Run(ctx)
		done <- err
	}()
	return func() error {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
		return nil
	}, nil
}

// listAdapter reads one kind of record back by the marker the agent put in
// it (the receipt's logical key). The list filters on the marker, so an
// empty answer covers every candidate: authoritative.
type listAdapter struct {
	base, path string
	client     *http.Client
}

// Check implements readback.Adapter.
func (l listAdapter) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	m := ledger.LogicalKey(r.IdempotencyKey)
	query := l.path + "?marker=" + m
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, l.base+query, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	req.Header.Set(headerCaller, "reconciler")
	resp, err := l.client.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return readback.Result{}, readback.TransientError(fmt.Errorf("readback: HTTP %d", resp.StatusCode), 0)
	}
	var page struct{ Data []record }
	if err := json.NewDecoder(resp.Body).Decode(&page); err != nil || page.Data == nil {
		return readback.Result{}, readback.TransientError(fmt.Errorf("readback: malformed page: %v", err), 0)
	}
	res := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET " + query}
	for _, rec := range page.Data {
		res.ExternalIDs = append(res.ExternalIDs, rec.ID)
	}
	if len(res.ExternalIDs) > 0 {
		res.Verdict = readback.VerdictPresent
		res.Evidence = map[string]any{"matched": "marker", "marker": m}
	}
	return res, nil
}

// externalID takes a record's id from a created record's body; a body
// without one (cut short by a proxy) leaves the outcome unknown.
func externalID(body []byte) (string, error) {
	var rec struct{ ID string }
	if err := json.Unmarshal(body, &rec); err != nil {
		return "", err
	}
	if rec.ID == "" {
		return "", errors.New("no id in the answer")
	}
	return rec.ID, nil
}

// ServerDatabases is an Options.Database that creates, for each strategy, a
// database of its own (reconciler_sim_<random>) on the server serverURL
// names, migrates it, and drops it at the end: receipts of a simulation
// never mix with a real ledger's, and two strategies never see each other's.
// The role needs CREATEDB.
func ServerDatabases(serverURL string) func(context.Context, string) (*pgxpool.Pool, func(), error) {
	return func(ctx context.Context, strategy string) (*pgxpool.Pool, func(), error) {
		return serverDatabase(ctx, serverURL, strategy)
	}
}

func serverDatabase(ctx context.Context, serverURL, strategy string) (*pgxpool.Pool, func(), error) {
	d, err := scratchdb.Create(ctx, serverURL, "reconciler_sim")
	if err != nil {
		return nil, nil, fmt.Errorf("database for %s: %w", strategy, err)
	}
	pool, err := d.Pool(ctx, MaxConns)
	if err != nil {
		_ = d.Drop()
		return nil, nil, fmt.Errorf("database for %s: %w", strategy, err)
	}
	return pool, func() {
		pool.Close()
		_ = d.Drop()
	}, nil
}

// ledgerState counts the task's receipts that are not settled, as the
// ledger holds them at the end of a run, by task.
func ledgerState(ctx context.Context, db *pgxpool.Pool) (unsettled, held map[int]int, err error) {
	rows, err := db.Query(ctx, `SELECT idempotency_key, state FROM reconciler.receipts
		WHERE state IN ('submitted', 'outcome_unknown', 'reconciling', 'manual_review')`)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	unsettled, held = map[int]int{}, map[int]int{}
	for rows.Next() {
		var key, state string
		if err := rows.Scan(&key, &state); err != nil {
			return nil, nil, err
		}
		task := taskOfKey(key)
		if state == string(statemachine.ManualReview) {
			held[task]++
		} else {
			unsettled[task]++
		}
	}
	return unsettled, held, rows.Err()
}

// taskOfKey is the task number in a key marker made.
func taskOfKey(key string) int {
	var n int
	for _, c := range strings.TrimPrefix(key, "task-") {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
	}
	return n
}
