package gateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// lossyAPI is a blog API that loses the answer to a share of writes: half
// of those after storing the article (a 504, a dropped connection, a hang
// past the gateway's timeout), half before (a 503 from a load shedder).
type lossyAPI struct {
	mu       sync.Mutex
	rng      *rand.Rand
	fault    float64
	articles map[string][]int // marker -> ids
	writes   int
	next     int
	hang     chan struct{}
}

func newLossyAPI(seed uint64, fault float64) *lossyAPI {
	return &lossyAPI{rng: rand.New(rand.NewPCG(seed, seed)), fault: fault, articles: map[string][]int{}, hang: make(chan struct{})}
}

func (a *lossyAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	if r.Method == http.MethodGet {
		a.mu.Lock()
		ids := append([]int(nil), a.articles[r.URL.Query().Get("marker")]...)
		a.mu.Unlock()
		_ = json.NewEncoder(w).Encode(map[string]any{"data": ids})
		return
	}
	var in struct{ Title, Marker string }
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Marker == "" {
		http.Error(w, `{"error":"title and marker are required"}`, http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.writes++
	fault := a.rng.Float64() < a.fault
	applied := !fault || a.rng.IntN(2) == 0
	mode := a.rng.IntN(3)
	id := 0
	if applied {
		a.next++
		id = 7000 + a.next
		a.articles[in.Marker] = append(a.articles[in.Marker], id)
	}
	a.mu.Unlock()
	switch {
	case !fault:
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "title": in.Title, "marker": in.Marker})
	case !applied:
		http.Error(w, `{"error":"overloaded"}`, http.StatusServiceUnavailable)
	case mode == 0:
		http.Error(w, `{"error":"upstream timed out"}`, http.StatusGatewayTimeout)
	case mode == 1:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	default:
		select { // past the gateway's upstream timeout
		case <-a.hang:
		case <-r.Context().Done():
		}
	}
}

// audit returns the markers stored more than once and the expected ones
// never stored.
func (a *lossyAPI) audit(markers []string) (dups, missing []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for m, ids := range a.articles {
		if len(ids) > 1 {
			dups = append(dups, m)
		}
	}
	for _, m := range markers {
		if len(a.articles[m]) == 0 {
			missing = append(missing, m)
		}
	}
	return dups, missing
}

// markerReadback finds an article by the marker the agent put in it: the
// receipt's logical idempotency key.
type markerReadback struct {
	base   string
	client *http.Client
}

func (m markerReadback) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	marker := ledger.LogicalKey(r.IdempotencyKey)
	q := "/api/articles?marker=" + marker
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, m.base+q, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	var page struct{ Data []int }
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&page) != nil {
		return readback.Result{}, readback.TransientError(fmt.Errorf("readback: HTTP %d", resp.StatusCode), 0)
	}
	res := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET " + q}
	for _, id := range page.Data {
		res.ExternalIDs = append(res.ExternalIDs, strconv.Itoa(id))
	}
	if len(res.ExternalIDs) > 0 {
		res.Verdict = readback.VerdictPresent
	}
	return res, nil
}

// agentReport is what each agent prints when it is done, one JSON line.
type agentReport struct {
	Done   int      `json:"done"`
	Failed []string `json:"failed"`
	Sends  int      `json:"sends"`
	Waits  int      `json:"waits"`
}

// Acceptance 1: agents in Go (over HTTP), Python and TypeScript make 200
// calls through the gateway to an API that loses 40 % of answers (half
// after applying the effect), retry only as the gateway's answers say,
// while a real reconcile.Pool settles the unknown outcomes: every call's
// effect ends up in the API exactly once.
func TestEndToEndAgentsInThreeLanguages(t *testing.T) {
	python, node, tsc := lookTool(t, "python3"), lookTool(t, "node"), lookTool(t, "tsc")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	api := newLossyAPI(13, 0.4)
	up := httptest.NewServer(api)
	defer up.Close()
	defer close(api.hang)
	db := pgtest.NewPool(t)
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(`version: 1
agents:
  - {id: go, token: {env: TOKEN_A}}
  - {id: py, token: {env: TOKEN_B}}
  - {id: ts, token: {env: TOKEN_TS}}
routes:
  - prefix: /blog
    upstream: `+up.URL+`/api
    dependency: blog-api
    operations:
      - {method: POST, path: /articles, name: articles.create}
    max_send_delay: 500ms
    timeout: 500ms
`), func(k string) (string, bool) {
		if k == "TOKEN_TS" {
			return tokenTS, true
		}
		return testEnv(k)
	})
	if err != nil {
		t.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(gateway.New(client, cfg, gateway.Options{}))
	defer gw.Close()

	registry := readback.NewRegistry()
	policy := readback.DefaultPolicy()
	policy.ConsistencyWindow, policy.MaxRequestLifetime = 200*time.Millisecond, 600*time.Millisecond
	policy.BackoffBase, policy.BackoffCap = 100*time.Millisecond, 400*time.Millisecond
	if err := registry.Register(readback.Binding{Name: "blog-articles", Type: "go", Kind: readback.Create,
		Dependency: "blog-api", Adapter: markerReadback{base: up.URL, client: &http.Client{Timeout: 2 * time.Second}},
		Policy: policy}); err != nil {
		t.Fatal(err)
	}
	pool, err := reconcile.New(db, reconcile.Config{Instance: "e2e", Registry: registry, PollInterval: 250 * time.Millisecond,
		ControlRetry: 200 * time.Millisecond, GracePeriod: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	pctx, stopPool := context.WithCancel(ctx)
	poolDone := make(chan error, 1)
	go func() { _, err := pool.Run(pctx); poolDone <- err }()
	defer func() {
		stopPool()
		if err := <-poolDone; err != nil {
			t.Errorf("reconciler: %v", err)
		}
	}()

	const goCalls, pyCalls, tsCalls = 100, 50, 50
	var markers []string
	for i := range goCalls {
		markers = append(markers, exampleKey("go", i))
	}
	for i := range pyCalls {
		markers = append(markers, exampleKey("py", i))
	}
	for i := range tsCalls {
		markers = append(markers, exampleKey("ts", i))
	}

	examples := filepath.Join("..", "examples")
	tsOut := t.TempDir()
	if out, err := exec.CommandContext(ctx, tsc, "--strict", "--target", "es2020", "--module", "commonjs",
		"--lib", "es2020,dom", "--outDir", tsOut, filepath.Join(examples, "typescript", "agent.ts")).CombinedOutput(); err != nil {
		t.Fatalf("tsc: %v\n%s", err, out)
	}
	run := func(name, tool, token string, n int, args ...string) (agentReport, error) {
		cmd := exec.CommandContext(ctx, tool, args...)
		cmd.Env = append(os.Environ(), "GATEWAY_URL="+gw.URL, "GATEWAY_TOKEN="+token, "AGENT_PREFIX="+name,
			"AGENT_CALLS="+strconv.Itoa(n), "AGENT_CONCURRENCY=5", "GATEWAY_PATH=/blog/articles")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return agentReport{}, fmt.Errorf("%s agent: %w\n%s", name, err, stderr.String())
		}
		var rep agentReport
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rep); err != nil {
			return rep, fmt.Errorf("%s agent printed %q: %w\n%s", name, out, err, stderr.String())
		}
		return rep, nil
	}

	reports := map[string]agentReport{}
	errs := make(chan error, 3)
	var mu sync.Mutex
	var wg sync.WaitGroup
	wg.Add(3)
	go func() {
		defer wg.Done()
		rep := goAgent(ctx, gw.URL, tokenA, "go", goCalls, 10)
		mu.Lock()
		reports["go"] = rep
		mu.Unlock()
	}()
	go func() {
		defer wg.Done()
		rep, err := run("py", python, tokenB, pyCalls, filepath.Join(examples, "python", "agent.py"))
		errs <- err
		mu.Lock()
		reports["py"] = rep
		mu.Unlock()
	}()
	go func() {
		defer wg.Done()
		rep, err := run("ts", node, tokenTS, tsCalls, filepath.Join(tsOut, "agent.js"))
		errs <- err
		mu.Lock()
		reports["ts"] = rep
		mu.Unlock()
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	total := 0
	for name, rep := range reports {
		t.Logf("%s agent: %+v", name, rep)
		if len(rep.Failed) > 0 {
			t.Errorf("%s agent: calls failed: %v", name, rep.Failed)
		}
		total += rep.Done
	}
	if total != goCalls+pyCalls+tsCalls {
		t.Errorf("agents completed %d calls, want %d", total, goCalls+pyCalls+tsCalls)
	}
	dups, missing := api.audit(markers)
	api.mu.Lock()
	t.Logf("the API received %d writes and holds %d articles for %d calls", api.writes, api.next, len(markers))
	api.mu.Unlock()
	if len(dups) > 0 || len(missing) > 0 {
		t.Fatalf("effects: duplicated %v, missing %v", dups, missing)
	}
	var states string
	if err := db.QueryRow(ctx, `SELECT string_agg(state || '=' || n, ' ' ORDER BY state)
		FROM (SELECT state, count(*) n FROM reconciler.receipts GROUP BY state) s`).Scan(&states); err != nil {
		t.Fatal(err)
	}
	t.Logf("receipts: %s", states)
}

const tokenTS = "token-of-agent-ts-0123456789"

// exampleKey is the key (and marker) of call i of an agent, as every
// example builds it: task, step and operation.
func exampleKey(prefix string, i int) string {
	return ledger.Key(prefix+"-task-"+strconv.Itoa(i), "publish", "articles.create")
}

func lookTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s is not installed: the example agents need python3, nodejs and node-typescript "+
			"(Debian: apt-get install -y python3 nodejs node-typescript): %v", name, err)
	}
	return p
}

// goAgent is the example agent in Go, over plain HTTP: it publishes n
// articles through the gateway, retrying only as the gateway's answers say.
func goAgent(ctx context.Context, base, token, prefix string, n, concurrency int) agentReport {
	var mu sync.Mutex
	rep := agentReport{}
	work := make(chan int)
	var wg sync.WaitGroup
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				sends, waits, err := publish(ctx, base, token, exampleKey(prefix, i), fmt.Sprintf("Article %s %d", prefix, i))
				mu.Lock()
				rep.Sends += sends
				rep.Waits += waits
				if err != nil {
					rep.Failed = append(rep.Failed, fmt.Sprintf("%d: %v", i, err))
				} else {
					rep.Done++
				}
				mu.Unlock()
			}
		}()
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	return rep
}

// publish makes one call until it is done: a 2xx ends it; an answer whose
// "retry" is after_settlement waits at wait_url, then sends the same key
// again; same_key sends it again after Retry-After; anything else fails.
func publish(ctx context.Context, base, token, key, title string) (sends, waits int, err error) {
	body, _ := json.Marshal(map[string]string{"title": title, "marker": key})
	for range 30 {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/blog/articles", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		sends++
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return sends, waits, err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode >= 200 && resp.StatusCode <= 299 {
			return sends, waits, nil
		}
		var p gateway.Problem
		if resp.Header.Get("Content-Type") == "application/problem+json" {
			_ = json.Unmarshal(b, &p)
		} else if resp.Header.Get(gateway.HeaderReceiptRetryable) == "true" {
			p.Retry = gateway.RetrySameKey
		}
		switch p.Retry {
		case gateway.RetryAfterSettlement:
			waits++
			if err := waitSettled(ctx, base, token, p.WaitURL); err != nil {
				return sends, waits, err
			}
		case gateway.RetrySameKey:
			select {
			case <-ctx.Done():
				return sends, waits, ctx.Err()
			case <-time.After(100 * time.Millisecond): // the gateway's Retry-After, shortened
			}
		default:
			return sends, waits, fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
		}
	}
	return sends, waits, errors.New("not done after 30 answers")
}

// waitSettled long-polls the receipt until it is settled.
func waitSettled(ctx context.Context, base, token, waitURL string) error {
	for ctx.Err() == nil {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+waitURL, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		var doc gateway.ReceiptDoc
		err = json.NewDecoder(resp.Body).Decode(&doc)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			return fmt.Errorf("wait: HTTP %d: %v", resp.StatusCode, err)
		}
		if doc.Settled {
			return nil
		}
	}
	return ctx.Err()
}
