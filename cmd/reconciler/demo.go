package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

// demoCommand runs the product end to end against a local fake API that
// loses answers: agents create articles through the ledger, half the writes
// that fail do so after the article was stored, the reconciler reads the API
// back and settles every unknown outcome, and agents retry only what was
// proven absent. It ends by counting duplicates in the API (there must be
// none) and receipts by state.
func demoCommand() *cli.Command {
	return &cli.Command{
		Name:  "demo",
		Usage: "run agents, a faulty fake API and the reconciler end to end, then check for duplicates",
		Flags: []cli.Flag{
			// No EnvVars: RECONCILER_DATABASE_URL points at the real
			// ledger, and the demo never writes there.
			&cli.StringFlag{Name: "database-url",
				Usage: "Postgres server to use: the demo creates a database of its own there (reconciler_demo_<random>, needs CREATEDB) and drops it at the end; RECONCILER_DATABASE_URL is ignored (default: a throwaway cluster from the local server binaries)"},
			&cli.IntFlag{Name: "tasks", Value: 40, Usage: "articles the agents create"},
			&cli.Float64Flag{Name: "fault-rate", Value: 0.4, Usage: "share of writes whose answer is lost"},
			&cli.Uint64Flag{Name: "seed", Value: 7, Usage: "seed of the fault schedule"},
		},
		Action: func(c *cli.Context) error {
			if tasks, rate := c.Int("tasks"), c.Float64("fault-rate"); tasks < 1 || !(rate >= 0 && rate <= 1) {
				return cli.Exit(fmt.Sprintf("demo: --tasks must be at least 1 and --fault-rate within [0, 1], got %d and %v", tasks, rate), 2)
			}
			if err := runDemo(c.Context, c.App.Writer, c.String("database-url"), c.Int("tasks"),
				c.Float64("fault-rate"), c.Uint64("seed")); err != nil {
				return cli.Exit("demo: "+err.Error(), 1)
			}
			return nil
		},
	}
}

func runDemo(ctx context.Context, out io.Writer, dbURL string, tasks int, faultRate float64, seed uint64) error {
	// A database of the demo's own, so its receipts never mix with a real
	// ledger's and two runs never meet.
	db, err := openScratchDB(ctx, out, dbURL, "reconciler_demo", false)
	if err != nil {
		return err
	}
	defer db.Close()
	if dbURL != "" {
		fmt.Fprintf(out, "working in database %s on that server (dropped at the end; the server's other databases are not touched)\n", db.Name)
	}
	pool, err := db.Pool(ctx, 4)
	if err != nil {
		return err
	}
	defer pool.Close()

	api := newFakeBlog(seed, faultRate)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: api}
	go srv.Serve(ln) //nolint:errcheck // ends with Close below
	defer srv.Close()
	defer api.release()
	base := "http://" + ln.Addr().String()
	fmt.Fprintf(out, "fake blog API on %s: %.0f%% of writes lose their answer (half of those after storing the article)\n", base, faultRate*100)

	agent, err := ledger.New(pool, "agent:demo")
	if err != nil {
		return err
	}
	caller := &ledger.Caller{Ledger: agent, HTTP: &http.Client{Timeout: 300 * time.Millisecond}}
	create := func(task int) error {
		key := ledger.Key("demo-task-"+strconv.Itoa(task), "publish", "articles.create")
		body, _ := json.Marshal(map[string]string{"title": fmt.Sprintf("Article %d", task), "marker": key})
		for attempt := 1; ; attempt++ {
			req, err := http.NewRequestWithContext(ctx, "POST", base+"/api/articles", bytes.NewReader(body))
			if err != nil {
				return err
			}
			// The API is local: a request not written within half a second
			// is not written at all, which keeps the absence window short.
			_, err = caller.Do(ctx, ledger.Intent{IdempotencyKey: key, Operation: "articles.create",
				Dependency: "blog-api", Method: "POST", Target: "/api/articles", Payload: body,
				MaxSendDelay: 500 * time.Millisecond}, req)
			// On a loaded machine the deadline can pass before a byte is
			// written: the receipt is rejected not_sent, nothing left, and
			// sending again (the next attempt) is safe, as an agent would.
			if !errors.Is(err, ledger.ErrSendDeadline) || attempt == 3 {
				return err
			}
		}
	}

	fmt.Fprintf(out, "\n1. %d agents each create one article\n", tasks)
	callAll(tasks, create)
	printStates(ctx, out, pool)

	fmt.Fprintln(out, "\n2. every agent runs its step again (a crash-restart, say): nothing is sent twice")
	before := api.writes()
	callAll(tasks, create)
	fmt.Fprintf(out, "   requests that reached the API: %d (outcome_unknown receipts stay blocked, succeeded ones replay)\n", api.writes()-before)

	registry := readback.NewRegistry()
	policy := readback.DefaultPolicy()
	policy.ConsistencyWindow, policy.MaxRequestLifetime = 200*time.Millisecond, 500*time.Millisecond
	policy.BackoffBase, policy.BackoffCap = 100*time.Millisecond, 400*time.Millisecond
	if err := registry.Register(readback.Binding{Name: "blog-articles", Type: "go", Kind: readback.Create,
		Dependency: "blog-api", Adapter: blogReadback{base: base, client: &http.Client{Timeout: 2 * time.Second}},
		Policy: policy}); err != nil {
		return err
	}
	settle := func(step string) error {
		fmt.Fprintf(out, "\n%s the reconciler reads the API back and settles every unknown outcome\n", step)
		rec, err := reconcile.New(pool, reconcile.Config{Instance: "demo", Registry: registry})
		if err != nil {
			return err
		}
		waited := 0
		for round := 1; ; round++ {
			sum, err := rec.Drain(ctx)
			if err != nil {
				return err
			}
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts
				WHERE state IN ('outcome_unknown', 'reconciling', 'submitted')`).Scan(&left); err != nil {
				return err
			}
			settled := sum.Settled[statemachine.Succeeded] + sum.Settled[statemachine.SafeToRetry] + sum.Settled[statemachine.ManualReview]
			if settled == 0 && left > 0 {
				// Absent answers wait for the absence window (send
				// deadline + request lifetime + consistency window).
				waited++
				if waited == 1 {
					fmt.Fprintf(out, "   waiting for the absence window: an absent article proves nothing until the original request can no longer land\n")
				}
			} else {
				fmt.Fprintf(out, "   round %d: settled succeeded=%d safe_to_retry=%d manual_review=%d; still unresolved: %d\n", round,
					sum.Settled[statemachine.Succeeded], sum.Settled[statemachine.SafeToRetry], sum.Settled[statemachine.ManualReview], left)
			}
			if left == 0 {
				return nil
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(300 * time.Millisecond):
			}
		}
	}
	if err := settle("3."); err != nil {
		return err
	}
	printStates(ctx, out, pool)

	fmt.Fprintln(out, "\n4. agents retry what was proven absent (safe_to_retry): attempt 2, linked to attempt 1")
	api.setFaultRate(0)
	callAll(tasks, create)
	if err := settle("5."); err != nil {
		return err
	}
	printStates(ctx, out, pool)

	dups, missing := api.audit(tasks)
	var succeeded int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT regexp_replace(idempotency_key, '#[0-9]+$', ''))
		FROM reconciler.receipts WHERE state = 'succeeded'`).Scan(&succeeded); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nresult: %d tasks, %d articles in the API, duplicates=%d, missing=%d, tasks with a succeeded receipt=%d\n",
		tasks, api.count(), dups, missing, succeeded)
	if dups != 0 || missing != 0 || succeeded != tasks {
		return fmt.Errorf("strict success failed: duplicates=%d missing=%d succeeded=%d of %d", dups, missing, succeeded, tasks)
	}
	fmt.Fprintln(out, "strict success: every task done exactly once, no duplicates, nothing lost")
	return nil
}

func callAll(n int, f func(int) error) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = f(i) // the outcome is in the receipt; the demo reads it from the ledger
		}()
	}
	wg.Wait()
}

func printStates(ctx context.Context, out io.Writer, pool *pgxpool.Pool) {
	rows, err := pool.Query(ctx, `SELECT state, count(*) FROM reconciler.receipts GROUP BY state ORDER BY state`)
	if err != nil {
		fmt.Fprintf(out, "   receipts: %v\n", err)
		return
	}
	defer rows.Close()
	var parts []string
	for rows.Next() {
		var state string
		var n int
		if rows.Scan(&state, &n) == nil {
			parts = append(parts, fmt.Sprintf("%s=%d", state, n))
		}
	}
	fmt.Fprintf(out, "   receipts: %s\n", strings.Join(parts, " "))
}

// fakeBlog is a blog API whose writes lose their answer at a given rate:
// half of those store the article first (a timeout, a 504, a dropped
// connection after the commit), half fail before storing (a 503 from a load
// shedder, a reset before the handler ran).
type fakeBlog struct {
	mu       sync.Mutex
	rng      *rand.Rand
	fault    float64
	articles []demoArticle
	requests int
	hang     chan struct{}
	once     sync.Once
}

type demoArticle struct {
	ID     int    `json:"id"`
	Title  string `json:"title"`
	Marker string `json:"marker"`
}

func newFakeBlog(seed uint64, fault float64) *fakeBlog {
	return &fakeBlog{rng: rand.New(rand.NewPCG(seed, seed)), fault: fault, hang: make(chan struct{})}
}

func (b *fakeBlog) release()               { b.once.Do(func() { close(b.hang) }) }
func (b *fakeBlog) setFaultRate(f float64) { b.mu.Lock(); b.fault = f; b.mu.Unlock() }
func (b *fakeBlog) writes() int            { b.mu.Lock(); defer b.mu.Unlock(); return b.requests }
func (b *fakeBlog) count() int             { b.mu.Lock(); defer b.mu.Unlock(); return len(b.articles) }

func (b *fakeBlog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet:
		marker := r.URL.Query().Get("marker")
		b.mu.Lock()
		var found []demoArticle
		for _, a := range b.articles {
			if a.Marker == marker {
				found = append(found, a)
			}
		}
		b.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"data": found})
	case http.MethodPost:
		var a demoArticle
		if err := json.NewDecoder(r.Body).Decode(&a); err != nil {
			http.Error(w, "bad json", http.StatusBadRequest)
			return
		}
		b.mu.Lock()
		b.requests++
		fault := b.rng.Float64() < b.fault
		applied := !fault || b.rng.IntN(2) == 0
		mode := b.rng.IntN(3)
		if applied {
			a.ID = 4407000 + len(b.articles)
			b.articles = append(b.articles, a)
		}
		b.mu.Unlock()
		switch {
		case !fault:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(a)
		case !applied:
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
		case mode == 0:
			http.Error(w, "upstream timed out", http.StatusGatewayTimeout)
		case mode == 1:
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				conn.Close()
			}
		default:
			select { // past the client's timeout
			case <-b.hang:
			case <-r.Context().Done():
			}
		}
	default:
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
	}
}

// audit counts markers stored more than once and tasks with no article.
func (b *fakeBlog) audit(tasks int) (dups, missing int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	per := map[string]int{}
	for _, a := range b.articles {
		per[a.Marker]++
	}
	for _, n := range per {
		if n > 1 {
			dups += n - 1
		}
	}
	return dups, tasks - len(per)
}

// blogReadback finds an article by the marker the agent put in it: the
// receipt's idempotency key without its attempt suffix.
type blogReadback struct {
	base   string
	client *http.Client
}

func (a blogReadback) Check(ctx context.Context, r readback.Receipt) (readback.Result, error) {
	marker, _, _ := strings.Cut(r.IdempotencyKey, "#")
	query := "/api/articles?marker=" + marker
	req, err := http.NewRequestWithContext(ctx, "GET", a.base+query, nil)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return readback.Result{}, readback.TransientError(fmt.Errorf("readback: HTTP %d", resp.StatusCode), 0)
	}
	var page struct{ Data []demoArticle }
	if err := json.NewDecoder(resp.Body).Decode(&page); err != nil {
		return readback.Result{}, readback.TransientError(err, 0)
	}
	res := readback.Result{Verdict: readback.VerdictAbsent, Authoritative: true, Query: "GET " + query}
	for _, art := range page.Data {
		res.ExternalIDs = append(res.ExternalIDs, strconv.Itoa(art.ID))
	}
	sort.Strings(res.ExternalIDs)
	if len(res.ExternalIDs) > 0 {
		res.Verdict = readback.VerdictPresent
		res.Evidence = map[string]any{"matched": "marker", "marker": marker}
	}
	return res, nil
}
