package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"regexp"
	"strconv"
	"sync"
	"time"

	"github.com/receiptledger/reconciler/ledger"
)

// patterns says which of the article's patterns an agent uses.
type patterns struct {
	retries     bool // up to Attempts attempts per call, full-jitter backoff, malformed answers retried
	idempotency bool // the harness's key in an Idempotency-Key header, deduplicated by the API
	timeouts    bool // a deadline per call and one per task
	breaker     bool // per dependency: open after breakerFailures failures in a row
	degradation bool // a failed read falls back to a cached snapshot; a failed write ends read-only, answer given
	compensate  bool // a failed task deletes the drafts it may have made (a human-written compensator)
	validate    bool // answers are checked against their schema before use
}

var articlePatterns = map[string]patterns{
	Baseline:           {},
	Retries:            {retries: true, validate: true},
	RetriesIdempotency: {retries: true, idempotency: true, validate: true},
	Timeouts:           {timeouts: true},
	Breaker:            {breaker: true},
	Degradation:        {degradation: true, validate: true},
	Compensation:       {compensate: true},
	AllPatterns: {retries: true, idempotency: true, timeouts: true, breaker: true, degradation: true,
		compensate: true, validate: true},
}

// The agent's timing. Hangs last hangFor unless a deadline cuts them.
const (
	callTimeout      = 100 * time.Millisecond // per call, with the timeouts pattern and through the ledger
	taskDeadline     = 3 * time.Second        // per task, with the timeouts pattern
	ledgerDeadline   = 30 * time.Second       // per task through the ledger: a wait for the reconciler included
	backoffBase      = 10 * time.Millisecond
	backoffCap       = 80 * time.Millisecond
	breakerFailures  = 3
	breakerCooldown  = 250 * time.Millisecond
	compensateTries  = 3
	settlePollPeriod = 25 * time.Millisecond
)

// Errors of one call as the agent sees them.
var (
	errFailed      = errors.New("call failed")
	errMalformed   = errors.New("malformed answer")
	errCircuitOpen = errors.New("circuit open")
)

// taskResult is how one task ended, as its agent saw it.
type taskResult struct {
	answer   int
	answered bool // the agent gave an answer (the right one or not)
	// unresolved: the agent ended with a write whose outcome it does not
	// know (the article's strategies; the ledger's are read from it).
	unresolved bool
	reason     string // why the task did not finish; "" when it did
	latency    time.Duration
}

// agent runs the tasks of one strategy against one API.
type agent struct {
	base     string
	seed     uint64
	attempts int
	p        patterns
	client   *http.Client // no deadline of its own: a hang lasts hangFor
	breakers map[string]*breaker

	// Through the ledger only; settle is set when a reconciler runs.
	caller *ledger.Caller
	settle bool
}

func newAgent(base string, seed uint64, attempts int, p patterns) *agent {
	return &agent{base: base, seed: seed, attempts: attempts, p: p,
		client:   &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}},
		breakers: map[string]*breaker{"kb": {}, "cms": {}}}
}

// marker is a task's harness-owned key for one write step: the article's
// idempotency key, the ledger's idempotency key, and the marker the
// reconciler finds the record by.
func marker(task int, tool string) string {
	return ledger.Key("task-"+strconv.Itoa(task), tool, tool)
}

// run is one task of an article strategy: two reads, a draft, a publish.
func (a *agent) run(ctx context.Context, task int) (res taskResult) {
	if a.p.timeouts {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, taskDeadline)
		defer cancel()
	}
	jitter := rand.New(rand.NewPCG(a.seed, uint64(task)))
	answer := 0
	for _, tool := range []string{toolDocs, toolFacts} {
		v, err := a.read(ctx, jitter, task, tool)
		if err != nil {
			if !a.p.degradation {
				return taskResult{reason: fmt.Sprintf("%s: %v", tool, err)}
			}
			v = snapshot(a.seed, tool, task)
		}
		answer += v
	}
	res.answer = answer
	draft, err := a.write(ctx, jitter, task, toolDraft, writeBody{Task: task, Marker: marker(task, toolDraft), Answer: answer})
	if err != nil {
		return a.abort(ctx, task, res, toolDraft, err)
	}
	if _, err := a.write(ctx, jitter, task, toolPost, writeBody{Task: task, Marker: marker(task, toolPost), Answer: answer, DraftID: draft}); err != nil {
		return a.abort(ctx, task, res, toolPost, err)
	}
	res.answered = true
	return res
}

// abort ends a task whose write step failed: compensation deletes its
// drafts, degradation answers read-only, and the agent is left not knowing
// whether a write it sent took effect unless a compensator settled it.
func (a *agent) abort(ctx context.Context, task int, res taskResult, step string, cause error) taskResult {
	sent := !errors.Is(cause, errCircuitOpen)
	res.reason = fmt.Sprintf("%s: %v", step, cause)
	compensated := false
	if a.p.compensate {
		for range compensateTries {
			_, err := a.do(ctx, task, http.MethodDelete, "/cms/drafts?marker="+marker(task, toolDraft), nil, "")
			if compensated = err == nil; compensated {
				res.reason += "; drafts compensated"
				break
			}
		}
		if !compensated {
			res.reason += "; compensation failed"
		}
	}
	res.unresolved = sent && (step == toolPost || !compensated)
	if a.p.degradation {
		res.answered = true
		res.reason += "; answered read-only"
	}
	return res
}

var lenientValue = regexp.MustCompile(`"value":\s*(\d+)`)

// read calls a read tool and parses its value: strictly with validation,
// else the way an omnivorous parser does (a cut body yields a wrong number).
func (a *agent) read(ctx context.Context, jitter *rand.Rand, task int, tool string) (int, error) {
	path := "/kb/docs/"
	if tool == toolFacts {
		path = "/kb/facts/"
	}
	var v int
	err := a.retry(ctx, jitter, "kb", func() error {
		body, err := a.do(ctx, task, http.MethodGet, path+strconv.Itoa(task), nil, "")
		if err != nil {
			return err
		}
		if a.p.validate {
			var doc struct {
				Value    int    `json:"value"`
				Checksum string `json:"checksum"`
			}
			if json.Unmarshal(body, &doc) != nil || doc.Checksum != fmt.Sprintf("%x", doc.Value*31) {
				return errMalformed
			}
			v = doc.Value
			return nil
		}
		m := lenientValue.FindSubmatch(body)
		if m == nil {
			return errMalformed
		}
		v, _ = strconv.Atoi(string(m[1]))
		return nil
	})
	return v, err
}

// write creates a draft or a post and returns its id.
func (a *agent) write(ctx context.Context, jitter *rand.Rand, task int, tool string, in writeBody) (string, error) {
	path := "/cms/drafts"
	if tool == toolPost {
		path = "/cms/posts"
	}
	key := ""
	if a.p.idempotency {
		key = in.Marker
	}
	payload, _ := json.Marshal(in)
	var id string
	err := a.retry(ctx, jitter, "cms", func() error {
		body, err := a.do(ctx, task, http.MethodPost, path, payload, key)
		if err != nil {
			return err
		}
		var rec struct{ ID string }
		if json.Unmarshal(body, &rec) != nil || rec.ID == "" {
			return errMalformed
		}
		id = rec.ID
		return nil
	})
	return id, err
}

// retry makes one call with the patterns in force: the breaker of dep
// first, then up to Attempts attempts with full jitter if retries are on.
func (a *agent) retry(ctx context.Context, jitter *rand.Rand, dep string, call func() error) error {
	attempts := 1
	if a.p.retries {
		attempts = a.attempts
	}
	var last error
	for n := range attempts {
		if n > 0 {
			ceil := min(backoffCap, backoffBase<<(n-1))
			t := time.NewTimer(time.Duration(jitter.Int64N(int64(ceil) + 1)))
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("%w after %d attempts (last: %w)", ctx.Err(), n, last)
			case <-t.C:
			}
		}
		b := a.breakers[dep]
		if a.p.breaker && !b.allow() {
			last = errCircuitOpen
			continue
		}
		last = call()
		if a.p.breaker {
			b.record(last == nil)
		}
		if last == nil {
			return nil
		}
		if !a.p.validate && errors.Is(last, errMalformed) {
			break // without validation a bad answer is not recognised as retryable
		}
	}
	if attempts > 1 {
		return fmt.Errorf("%d attempts, last: %w", attempts, last)
	}
	return last
}

// do sends one request to the API and returns the body of a 2xx.
func (a *agent) do(ctx context.Context, task int, method, path string, payload []byte, key string) ([]byte, error) {
	if a.p.timeouts {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, callTimeout)
		defer cancel()
	}
	req, err := a.request(ctx, task, method, path, payload)
	if err != nil {
		return nil, err
	}
	if key != "" {
		req.Header.Set(headerKey, key)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errFailed, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errFailed, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("%w: HTTP %d", errFailed, resp.StatusCode)
	}
	return body, nil
}

func (a *agent) request(ctx context.Context, task int, method, path string, payload []byte) (*http.Request, error) {
	var body io.Reader
	if payload != nil {
		body = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(ctx, method, a.base+path, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set(headerTask, strconv.Itoa(task))
	req.Header.Set(headerCaller, "agent")
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// breaker is the article's circuit breaker for one dependency, shared by
// every task of a run: breakerFailures failures in a row open it for
// breakerCooldown; after that calls go through again, and one more failure
// opens it again.
type breaker struct {
	mu        sync.Mutex
	failures  int
	openUntil time.Time
}

func (b *breaker) allow() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !time.Now().Before(b.openUntil)
}

func (b *breaker) record(ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if ok {
		b.failures = 0
		return
	}
	b.failures++
	if b.failures >= breakerFailures {
		b.openUntil = time.Now().Add(breakerCooldown)
	}
}
