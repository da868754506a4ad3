// Package benchgw measures what the receipt gateway adds to a call: the
// same POSTs against a local upstream sent directly, after one durable
// commit (the floor: what any ledger adds, since its record must be flushed
// before the bytes leave), through the Go ledger client (Caller.Do, which
// writes the same receipts in process) and through the gateway over HTTP,
// taking turns in one run, so that `reconciler bench gateway` and the
// gateway package's BenchmarkGateway share one definition.
package benchgw

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/ledger"
)

// The agent's token and the upstream's key live only in this run.
const (
	agentToken  = "bench-agent-token-0123456789"
	upstreamKey = "bench-upstream-key-0123456789"
)

const routes = `version: 1
agents:
  - {id: bench, token: {env: BENCH_TOKEN}}
routes:
  - prefix: /blog
    upstream: %s/api
    dependency: blog-api
    auth: {env: BENCH_KEY}
    max_send_delay: 500ms
`

// Path is how a measured call reaches the upstream.
type Path int

// The four paths, measured in this order.
const (
	Direct  Path = iota // plain HTTP, no ledger
	Commit              // one durable INSERT committed, then plain HTTP
	Do                  // the Go ledger client, Caller.Do
	Gateway             // HTTP through the gateway
)

// String names the path as the bench prints it.
func (p Path) String() string { return [...]string{"direct", "commit", "do", "gateway"}[p] }

// Stats are one path's figures: per-call latency percentiles and calls per
// second with every agent calling at once.
type Stats struct {
	P50, P99 time.Duration
	Rate     float64
}

// Result holds the paths' figures of one run.
type Result [4]Stats

// Bench is a local upstream and a gateway in front of it, over a ledger in
// db. Close it when done.
type Bench struct {
	db     *pgxpool.Pool
	up, gw *httptest.Server
	hc     *http.Client
	caller *ledger.Caller
	seq    atomic.Int64
}

// sqlFloor is the Commit path's record: one row, one durable commit, the
// least a ledger can write before a request leaves.
const (
	sqlFloorTable = `CREATE TABLE IF NOT EXISTS bench_floor (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL)`
	sqlFloor      = `INSERT INTO bench_floor (key) VALUES ($1)`
)

// New starts the upstream (which answers 201 to every POST) and the gateway,
// and creates the Commit path's table in db's current schema.
func New(db *pgxpool.Pool) (*Bench, error) {
	if _, err := db.Exec(context.Background(), sqlFloorTable); err != nil {
		return nil, fmt.Errorf("benchgw: create the floor's table: %w", err)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"art-1","status":"published"}`)
	}))
	env := map[string]string{"BENCH_TOKEN": agentToken, "BENCH_KEY": upstreamKey}
	cfg, err := gateway.ParseConfig("bench-routes.yaml", fmt.Appendf(nil, routes, up.URL),
		func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		up.Close()
		return nil, err
	}
	client, err := ledger.New(db, "agent:bench")
	if err != nil {
		up.Close()
		return nil, err
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	return &Bench{db: db, up: up, gw: httptest.NewServer(gateway.New(client, cfg, gateway.Options{})), hc: hc,
		caller: &ledger.Caller{Ledger: client, HTTP: hc}}, nil
}

// Close stops the servers.
func (b *Bench) Close() {
	b.gw.Close()
	b.up.Close()
	b.hc.CloseIdleConnections()
}

// call makes one POST with a key and a body of its own, so every call is
// planned, submitted, sent and settled (and, through the gateway, its
// response kept).
func (b *Bench) call(ctx context.Context, via Path) error {
	n := strconv.FormatInt(b.seq.Add(1), 10)
	key, body := "bench:"+n+":articles.create", `{"title":"bench `+n+`"}`
	url := b.up.URL + "/api/articles"
	if via == Gateway {
		url = b.gw.URL + "/blog/articles"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if via == Commit {
		if _, err := b.db.Exec(ctx, sqlFloor, key); err != nil {
			return fmt.Errorf("commit: %w", err)
		}
	}
	if via == Do {
		_, err := b.caller.Do(ctx, ledger.Intent{IdempotencyKey: key, Operation: "articles.create",
			Dependency: "blog-api", Payload: []byte(body)}, req)
		return err
	}
	if via == Gateway {
		req.Header.Set("Authorization", "Bearer "+agentToken)
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := b.hc.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("%s: HTTP %d", via, resp.StatusCode)
	}
	return nil
}

// Warm makes n calls on each path (connections, prepared statements).
func (b *Bench) Warm(ctx context.Context, n int) error {
	for range n {
		for via := range Gateway + 1 {
			if err := b.call(ctx, via); err != nil {
				return fmt.Errorf("warm-up: %w", err)
			}
		}
	}
	return nil
}

// rounds is how many turns each path takes in a Run. The machine's load
// drifts over seconds (other processes, the server's checkpoints): paths
// measured one after the other would each see a different load, and the
// difference of their percentiles would measure the drift. Taking turns in
// small rounds, in a rotating order, spreads whatever load there is over
// the paths alike.
const rounds = 20

// Run makes n calls on each path with agents calling at once. The paths
// take turns, in rounds of about n/20 calls each (never fewer than 5 per
// agent, so the agents overlap), in a rotating order; each path's
// latencies are pooled over its rounds and its rate is its calls over the
// time its rounds took.
func (b *Bench) Run(ctx context.Context, agents, n int) (Result, error) {
	per := max((n+rounds-1)/rounds, 5*agents)
	var lat [len(Result{})][]time.Duration
	var took [len(Result{})]time.Duration
	for round := 0; len(lat[Gateway]) < n; round++ {
		for i := range len(Result{}) {
			via := Path((round + i) % len(Result{}))
			k := min(per, n-len(lat[via]))
			l, d, err := b.measure(ctx, via, agents, k)
			if err != nil {
				return Result{}, err
			}
			lat[via] = append(lat[via], l...)
			took[via] += d
		}
	}
	var res Result
	for via := range res {
		l := lat[via]
		slices.Sort(l)
		at := func(p int) time.Duration { return l[min(len(l)-1, len(l)*p/100)] }
		res[via] = Stats{P50: at(50), P99: at(99), Rate: float64(len(l)) / took[via].Seconds()}
	}
	return res, nil
}

// measure makes n calls on one path with agents calling at once, and
// returns each call's latency and the time all n took.
func (b *Bench) measure(ctx context.Context, via Path, agents, n int) ([]time.Duration, time.Duration, error) {
	lat := make([]time.Duration, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, agents)
	start := time.Now()
	for a := range agents {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				t0 := time.Now()
				if err := b.call(ctx, via); err != nil {
					errs[a] = err
					return
				}
				lat[i] = time.Since(t0)
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return nil, 0, err
	}
	return lat, took, nil
}
