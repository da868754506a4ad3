package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/internal/scratchdb"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
)

// scaleProbe times one database's hot paths a sample at a time, so that
// two databases can be measured interleaved (bench scale --compare).
type scaleProbe struct {
	db                   *pgxpool.Pool
	store                *reconcile.Store
	agent                *ledger.Client
	phase                string
	claims, plans, lists []time.Duration
}

func newScaleProbe(db *pgxpool.Pool, phase string) (*scaleProbe, error) {
	store, err := reconcile.NewStore(db, "scale-"+phase)
	if err != nil {
		return nil, err
	}
	agent, err := ledger.New(db, "agent:scale")
	if err != nil {
		return nil, err
	}
	return &scaleProbe{db: db, store: store, agent: agent, phase: phase}, nil
}

// claim times a claim of 32 due receipts.
func (p *scaleProbe) claim(ctx context.Context) error {
	t0 := time.Now()
	got, err := p.store.Claim(ctx, time.Now(), 32, time.Hour)
	if err != nil {
		return fmt.Errorf("claim: %w", err)
	}
	if len(got) != 32 {
		return fmt.Errorf("claim: %d rows, want 32 (too few due receipts: raise --receipts or --in-flight)", len(got))
	}
	p.claims = append(p.claims, time.Since(t0))
	return nil
}

// plan times the plan of a new intent (key and payload unique to i).
func (p *scaleProbe) plan(ctx context.Context, i int) error {
	payload, _ := json.Marshal(map[string]any{"phase": p.phase, "i": i})
	in := ledger.Intent{IdempotencyKey: fmt.Sprintf("scale-plan:%s:%d", p.phase, i), Operation: "things.create",
		Dependency: fmt.Sprintf("dep-%d", i%20), Method: "POST", Target: "/things", Payload: payload}
	t0 := time.Now()
	if _, err := p.agent.Plan(ctx, in); err != nil {
		return fmt.Errorf("plan: %w", err)
	}
	p.plans = append(p.plans, time.Since(t0))
	return nil
}

// list times a review list of the 50 oldest held receipts.
func (p *scaleProbe) list(ctx context.Context) error {
	t0 := time.Now()
	held, err := review.List(ctx, p.db, review.Filter{Limit: 50})
	if err != nil {
		return fmt.Errorf("review list: %w", err)
	}
	if len(held) != 50 {
		return fmt.Errorf("review list: %d held, want 50", len(held))
	}
	p.lists = append(p.lists, time.Since(t0))
	return nil
}

// print prints the percentiles of what was timed, each name prefixed.
func (p *scaleProbe) print(w io.Writer, prefix string) {
	printPercentiles(w, prefix+"_claim32", p.claims)
	printPercentiles(w, prefix+"_plan", p.plans)
	printPercentiles(w, prefix+"_review_list50", p.lists)
}

// sweep times the orphan sweep of every orphan, 512 a statement.
func (p *scaleProbe) sweep(ctx context.Context, w io.Writer, prefix string) error {
	t0 := time.Now()
	orphans, err := p.store.SweepOrphans(ctx, time.Now(), 5*time.Minute, 512, 0)
	if err != nil {
		return fmt.Errorf("sweep: %w", err)
	}
	fmt.Fprintf(w, "%s_sweep512_ms=%.1f (%d orphans)\n", prefix, ms(time.Since(t0)), len(orphans))
	return nil
}

// benchScaleCompare fills one database per size on one server, each with
// the same receipts in flight, and times their hot paths interleaved: each
// sample of a kind is taken on every database in turn (in an order that
// alternates), so the machine's load, which moves by the minute on a
// shared host, weighs on every size alike, and the ratios say what the
// size of the history alone costs.
func benchScaleCompare(c *cli.Context, sizes []int, inflight int) error {
	ctx := c.Context
	w := c.App.Writer
	fail := func(err error) error { return cli.Exit(fmt.Sprintf("bench scale: %v", err), 1) }
	serverURL, stop, err := serverOrThrowaway(c.App.ErrWriter, c.String("database-url"))
	if err != nil {
		return fail(err)
	}
	if stop != nil {
		defer stop()
	}
	fmt.Fprintf(w, "in_flight=%d\n", inflight)
	probes := make([]*scaleProbe, len(sizes))
	names := make([]string, len(sizes))
	for i, n := range sizes {
		d, err := scratchdb.Create(ctx, serverURL, "reconciler_bench")
		if err != nil {
			return fail(err)
		}
		bdb := &scratchDB{DB: d, log: c.App.ErrWriter, stop: func() {}}
		defer bdb.Close()
		db, err := bdb.pool(ctx, 8)
		if err != nil {
			return fail(err)
		}
		defer db.Close()
		names[i] = fmt.Sprintf("n%d", n)
		start := time.Now()
		if err := scaleFill(ctx, db, n, inflight); err != nil {
			return fail(fmt.Errorf("fill %d: %w", n, err))
		}
		fmt.Fprintf(w, "%s_fill_s=%.1f\n", names[i], time.Since(start).Seconds())
		if err := scaleSizes(ctx, w, db, names[i], n); err != nil {
			return fail(err)
		}
		if probes[i], err = newScaleProbe(db, names[i]); err != nil {
			return fail(err)
		}
	}
	fmt.Fprintf(c.App.ErrWriter, "measuring %d samples of each kind, interleaved ...\n", c.Int("samples"))
	for _, step := range []func(p *scaleProbe, i int) error{
		func(p *scaleProbe, _ int) error { return p.claim(ctx) },
		func(p *scaleProbe, i int) error { return p.plan(ctx, i) },
		func(p *scaleProbe, _ int) error { return p.list(ctx) },
	} {
		for i := range c.Int("samples") {
			for k := range probes {
				if i%2 == 1 {
					k = len(probes) - 1 - k
				}
				if err := step(probes[k], i); err != nil {
					return fail(err)
				}
			}
		}
	}
	for i, p := range probes {
		p.print(w, names[i])
		if err := p.sweep(ctx, w, names[i]); err != nil {
			return fail(err)
		}
	}
	base := probes[0]
	for i, p := range probes[1:] {
		for _, m := range []struct {
			name     string
			got, ref []time.Duration
		}{{"claim32", p.claims, base.claims}, {"plan", p.plans, base.plans}, {"review_list50", p.lists, base.lists}} {
			for _, q := range []float64{0.50, 0.99} {
				fmt.Fprintf(w, "ratio_%s_%s_over_%s_p%02.0f=%.2f\n", m.name, names[i+1], names[0], q*100,
					float64(quantile(m.got, q))/float64(quantile(m.ref, q)))
			}
		}
	}
	return nil
}
