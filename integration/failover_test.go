package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/statemachine"
)

// TestFailover loses the primary under load (issue 21, item 3): agents
// write through Caller.Do and through the gateway against an API that
// loses some answers, the daemon settles, and the primary's postmaster is
// SIGKILLed; everything follows the promoted standby through a multi-host
// URL (target_session_attrs=read-write). Afterwards the API's truth and the
// new primary's ledger must agree.
//
//   - Synchronous: pg_auto_failover (a monitor, a primary and its
//     synchronous secondary, pg_auto_failover's default): 0 sends without
//     a receipt, 0 duplicate effects, every task finished or in
//     manual_review with a reason, every history legal, nothing settled
//     twice.
//   - Asynchronous: a primary and a streaming standby (pg_basebackup, no
//     synchronous_standby_names), promoted with pg_ctl promote: the same
//     load, whose losses (sends without a receipt, duplicates) are
//     measured and logged, not required to be 0: what docs/failover.md
//     quotes.
func TestFailover(t *testing.T) {
	bin := buildBinary(t)
	// The two run side by side: most of the formation's setup is waiting.
	t.Run("Synchronous", func(t *testing.T) {
		t.Parallel()
		setup := time.Now()
		f := startFormation(t)
		t.Logf("pg_auto_failover formation up in %s", time.Since(setup).Round(100*time.Millisecond))
		fig := runFailover(t, bin, f.URL(), func() { f.killPostmaster(t, 0) }, func() { f.waitPromoted(t, 1) })
		t.Logf("synchronous (pg_auto_failover): %s", fig)
		if fig.withoutReceipt != 0 || fig.duplicates != 0 || fig.unfinished != 0 || fig.lost != 0 {
			t.Fatalf("synchronous replication lost receipts: %s", fig)
		}
	})
	t.Run("Asynchronous", func(t *testing.T) {
		t.Parallel()
		primary, err := pgcluster.Start()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = primary.Stop() })
		standby, err := primary.Standby("standby")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = standby.Stop() })
		url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?target_session_attrs=read-write&sslmode=disable&connect_timeout=2",
			primary.Port(), standby.Port())
		fig := runFailover(t, bin, url, func() {
			if err := primary.Kill(); err != nil {
				t.Fatal(err)
			}
		}, func() {
			if err := standby.Promote(); err != nil {
				t.Fatal(err)
			}
		})
		t.Logf("asynchronous (streaming standby, pg_ctl promote): %s", fig)
		if fig.unfinished != 0 {
			t.Fatalf("tasks left unfinished: %s", fig)
		}
	})
}

// failoverFigures are what one failover run measured.
type failoverFigures struct {
	tasks, receipts, sends int
	// withoutReceipt counts requests the API received for which the new
	// primary's ledger holds no submitted receipt; duplicates the effects
	// made more than once; unfinished the tasks neither succeeded nor in
	// manual_review with a reason.
	withoutReceipt, duplicates, unfinished int
	// lost counts the tasks done whose every receipt is missing on the new
	// primary.
	lost         int
	manualReview int
	// firstReceipt (the first call begun after the kill to succeed) and
	// lastSettlement are counted from the kill.
	promoted, firstReceipt, lastSettlement time.Duration
}

func (f failoverFigures) String() string {
	return fmt.Sprintf("1 kill; %d tasks, %d receipts, %d requests received by the API; %d sends without a receipt, "+
		"%d duplicate effects, %d tasks unfinished, %d tasks done whose receipts were all lost, %d in manual_review; "+
		"from the kill: promoted %s, first new call recorded and answered %s, last settlement %s",
		f.tasks, f.receipts, f.sends, f.withoutReceipt, f.duplicates, f.unfinished, f.lost, f.manualReview,
		f.promoted.Round(100*time.Millisecond), f.firstReceipt.Round(100*time.Millisecond), f.lastSettlement.Round(100*time.Millisecond))
}

// markerAPI counts, by marker (metadata.key), the creates a truthAPI
// received, whatever it then did with them.
type markerAPI struct {
	srv *httptest.Server

	mu       sync.Mutex
	received map[string]int
}

func newMarkerAPI(t *testing.T, api *truthAPI) *markerAPI {
	m := &markerAPI{received: map[string]int{}}
	m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			body, _ := io.ReadAll(r.Body)
			var in struct {
				Metadata struct {
					Key string `json:"key"`
				} `json:"metadata"`
			}
			_ = json.Unmarshal(body, &in)
			m.mu.Lock()
			m.received[in.Metadata.Key]++
			m.mu.Unlock()
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		api.serve(w, r)
	}))
	t.Cleanup(m.srv.Close)
	return m
}

// runFailover runs the load on url, kills the primary (kill), waits for
// the new one (promote), lets the load go on, then finishes every task and
// checks the ledger against the API's truth.
func runFailover(t *testing.T, bin, url string, kill, promote func()) failoverFigures {
	ctx := context.Background()
	started := time.Now()
	db, err := ledger.NewPool(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	seed := faultSeed(t, 21)
	truth := newTruthAPI(t, seed, truthFaults{loseBefore: 0.05, loseAfter: 0.1})
	api := newMarkerAPI(t, truth)
	adapters := truthAdapters(t, truth.srv.URL, "rate: .inf\nconcurrency: 8")
	d := startDaemon(t, bin, url, "--adapters", adapters, "--instance", "failover", "--poll-interval", "500ms",
		"--orphan-timeout", "3s", "--log-level", "warn")

	// The gateway, in this process, on its own pool.
	gwPool, err := ledger.NewPool(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer gwPool.Close()
	gwClient, err := ledger.New(gwPool, "agent:gateway")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(`version: 1
agents:
  - {id: gw, token: {env: TOKEN}}
routes:
  - prefix: /api
    upstream: `+api.srv.URL+`
    dependency: truth-api
    operations: [{method: POST, path: /v1/things, name: things.create}]
    max_send_delay: 1s
    timeout: 2s
`), func(string) (string, bool) { return "failover-agent-token-0123456789", true })
	if err != nil {
		t.Fatal(err)
	}
	g := gateway.New(gwClient, cfg, gateway.Options{})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gctx, stopGateway := context.WithCancel(ctx)
	gwDone := make(chan error, 1)
	go func() { gwDone <- g.Run(gctx, l, nil, 5*time.Second) }()
	defer func() { stopGateway(); <-gwDone }()
	gwURL := "http://" + l.Addr().String()

	// The agents: half through Caller.Do on a pool of their own, half
	// through the gateway. Each works its tasks one after another.
	agentPool, err := ledger.NewPool(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer agentPool.Close()
	agentClient, err := ledger.New(agentPool, "agent:failover")
	if err != nil {
		t.Fatal(err)
	}
	a := &failoverAgents{client: agentClient, apiURL: api.srv.URL, gwURL: gwURL, tag: strconv.FormatInt(time.Now().UnixNano(), 36),
		http: &http.Client{Timeout: 30 * time.Second}, done: map[string]bool{}}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); a.work(i, i%2 == 1, stop) }()
	}
	waitFor(t, time.Minute, "load under way", func() (bool, string) {
		n := countWhere(t, db, "state = 'succeeded'")
		return n >= 40, strconv.Itoa(n) + " succeeded"
	})
	t.Logf("load under way (%s since the start)", time.Since(started).Round(100*time.Millisecond))
	killed := time.Now()
	a.mu.Lock()
	a.killed = killed
	a.mu.Unlock()
	kill()
	promote()
	promoted := time.Since(killed)
	// The load goes on against the new primary for a while.
	waitFor(t, 2*time.Minute, "load on the new primary", func() (bool, string) {
		var n int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE state = 'succeeded' AND created_at > $1`, killed).Scan(&n); err != nil {
			return false, err.Error()
		}
		return n >= 40, strconv.Itoa(n) + " succeeded since the kill"
	})
	close(stop)
	wg.Wait()
	t.Logf("load stopped %s after the kill", time.Since(killed).Round(100*time.Millisecond))
	// Every task is finished: each left open is worked again (its
	// receipt settled by the daemon first) until it is.
	waitFor(t, 2*time.Minute, "every task finished", func() (bool, string) {
		open := a.open()
		var fw sync.WaitGroup
		for _, task := range open {
			fw.Add(1)
			go func() { defer fw.Done(); a.finish(task) }()
		}
		fw.Wait()
		return len(open) == 0, strconv.Itoa(len(open)) + " open"
	})
	waitFor(t, 2*time.Minute, "every receipt settled", func() (bool, string) {
		n := countWhere(t, db, "state IN ('planned', 'submitted', 'outcome_unknown', 'reconciling')")
		return n == 0, strconv.Itoa(n) + " open"
	})
	if exited, err := d.exited(); exited {
		t.Fatalf("the daemon exited: %v; stderr:\n%s", err, d.stderr.String())
	}

	st := checkHistories(t, db)
	fig := failoverFigures{promoted: promoted, lastSettlement: st.last.Sub(killed)}
	a.mu.Lock()
	fig.firstReceipt = a.firstAfter.Sub(killed)
	a.mu.Unlock()
	// Submitted receipts by logical key, on the new primary.
	rows, err := db.Query(ctx, `SELECT idempotency_key, state::text, coalesce(state_detail->>'reason', '') FROM reconciler.receipts
		WHERE submitted_at IS NOT NULL ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	submitted := map[string]int{}
	final := map[string]string{}
	for rows.Next() {
		var key, state, reason string
		if err := rows.Scan(&key, &state, &reason); err != nil {
			t.Fatal(err)
		}
		fig.receipts++
		lk := ledger.LogicalKey(key)
		submitted[lk]++
		final[lk] = state
		if state == string(statemachine.ManualReview) {
			fig.manualReview++
			if reason == "" {
				t.Errorf("receipt %s in manual_review without a reason", key)
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	api.mu.Lock()
	for key, n := range api.received {
		fig.sends += n
		if n > submitted[key] {
			fig.withoutReceipt += n - submitted[key]
		}
	}
	api.mu.Unlock()
	a.mu.Lock()
	fig.tasks = len(a.done)
	for key := range a.done {
		if c := truth.count(key); c > 1 {
			fig.duplicates += c - 1
		}
		switch s := final[key]; {
		case s == "":
			// Done by its agent, yet no receipt of it on the new primary:
			// every one was lost with the old one (asynchronous
			// replication's loss, which the figures report).
			fig.lost++
		case s != string(statemachine.Succeeded) && s != string(statemachine.ManualReview):
			fig.unfinished++
		}
	}
	a.mu.Unlock()
	if err, _ := d.stop(t, 30*time.Second); err != nil {
		t.Fatalf("the daemon exited with %v; stderr:\n%s", err, d.stderr.String())
	}
	return fig
}

// failoverAgents are the agents of a failover run.
type failoverAgents struct {
	client        *ledger.Client
	apiURL, gwURL string
	tag           string
	http          *http.Client

	mu sync.Mutex
	// done is every task's logical key, true once finished (succeeded,
	// or held in manual_review).
	done map[string]bool
	// killed is when the primary was killed; firstAfter when the first
	// task begun after it succeeded.
	killed, firstAfter time.Time
	n                  atomic.Int64
}

// work runs tasks one after another until stop.
func (a *failoverAgents) work(agent int, viaGateway bool, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		key := ledger.Key("fo-"+a.tag+"-"+strconv.Itoa(agent), strconv.FormatInt(a.n.Add(1), 10), "things.create")
		a.mu.Lock()
		a.done[key] = false
		a.mu.Unlock()
		for try := 0; try < 20; try++ {
			var ok bool
			start := time.Now()
			if viaGateway {
				ok = a.viaGateway(key)
			} else {
				ok = a.viaCaller(key)
			}
			if ok {
				a.mu.Lock()
				a.done[key] = true
				if !a.killed.IsZero() && start.After(a.killed) && a.firstAfter.IsZero() {
					a.firstAfter = time.Now()
				}
				a.mu.Unlock()
				break
			}
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// open returns the tasks not finished.
func (a *failoverAgents) open() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []string
	for k, ok := range a.done {
		if !ok {
			out = append(out, k)
		}
	}
	return out
}

// finish makes one more attempt at task (alternating the two paths).
func (a *failoverAgents) finish(task string) {
	ok := a.viaCaller(task)
	if !ok {
		ok = a.viaGateway(task)
	}
	if ok {
		a.mu.Lock()
		a.done[task] = true
		a.mu.Unlock()
	}
}

func payload(key string) []byte {
	return []byte(`{"title":"failover","metadata":{"key":` + strconv.Quote(key) + `}}`)
}

// viaCaller makes the task's call through Caller.Do, waits for the
// settlement of an unknown outcome, and reports whether the task is done.
func (a *failoverAgents) viaCaller(key string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequest(http.MethodPost, a.apiURL+"/v1/things", bytes.NewReader(payload(key)))
	req.Header.Set("Content-Type", "application/json")
	c := &ledger.Caller{Ledger: a.client, HTTP: a.http}
	res, err := c.Do(ctx, ledger.Intent{IdempotencyKey: key, Operation: "things.create", Dependency: "truth-api",
		Payload: payload(key), MaxSendDelay: time.Second}, req)
	if err == nil {
		return true
	}
	if res == nil || res.Receipt == nil || !errors.Is(err, ledger.ErrOutcomeUnknown) {
		return res != nil && res.Receipt != nil && res.Receipt.State == statemachine.ManualReview
	}
	rc, err := a.client.Await(ctx, res.Receipt.ID)
	if err != nil || rc.IdempotencyKey != res.Receipt.IdempotencyKey {
		return false // not settled yet, or lost: the same key again
	}
	return rc.State == statemachine.Succeeded || rc.State == statemachine.ManualReview
}

// viaGateway makes the task's call through the gateway and waits at its
// wait_url when the outcome is unknown.
func (a *failoverAgents) viaGateway(key string) bool {
	req, _ := http.NewRequest(http.MethodPost, a.gwURL+"/api/v1/things", bytes.NewReader(payload(key)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer failover-agent-token-0123456789")
	resp, err := a.http.Do(req)
	if err != nil {
		return false
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode/100 == 2 {
		return true
	}
	var p gateway.Problem
	_ = json.Unmarshal(body, &p)
	switch {
	case p.ReceiptState == string(statemachine.ManualReview):
		return true
	case p.Retry != gateway.RetryAfterSettlement || p.ReceiptID == 0:
		return false
	}
	wreq, _ := http.NewRequest(http.MethodGet, a.gwURL+"/receipts/"+strconv.FormatInt(p.ReceiptID, 10)+"?wait=15s", nil)
	wreq.Header.Set("Authorization", "Bearer failover-agent-token-0123456789")
	wresp, err := a.http.Do(wreq)
	if err != nil {
		return false
	}
	defer wresp.Body.Close()
	var doc gateway.ReceiptDoc
	if json.NewDecoder(wresp.Body).Decode(&doc) != nil || doc.IdempotencyKey != key && ledger.LogicalKey(doc.IdempotencyKey) != key {
		return false
	}
	return doc.State == string(statemachine.Succeeded) || doc.State == string(statemachine.ManualReview)
}
