// Package benchlife measures an agent's receipt lifecycle (plan, submit,
// succeed: three durable commits) through the ledger client, and the same
// durable work done with bare SQL (a receipts table and an events table,
// an insert or update of the receipt plus an event insert per commit, no
// triggers), so that `reconciler bench ledger` and the ledger package's
// BenchmarkLifecycle compare the ledger with one definition of the
// hand-written journal an agent platform would otherwise write.
package benchlife

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/ledger"
)

// The bare-SQL journal: what an agent platform would write by hand.
const (
	sqlBareSchema = `
		CREATE TABLE bare_receipts (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			idempotency_key text UNIQUE NOT NULL, fingerprint text NOT NULL, intent jsonb NOT NULL,
			state text NOT NULL, external_id text, version int NOT NULL, updated_at timestamptz NOT NULL);
		CREATE TABLE bare_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			receipt_id bigint NOT NULL REFERENCES bare_receipts (id), seq int NOT NULL,
			from_state text, to_state text NOT NULL, at timestamptz NOT NULL, actor text NOT NULL,
			detail jsonb NOT NULL, external_id text)`
	sqlBarePlan = `WITH r AS (
		INSERT INTO bare_receipts (idempotency_key, fingerprint, intent, state, version, updated_at)
		VALUES ($1, $2, $3, 'planned', 1, now()) RETURNING id)
		INSERT INTO bare_events (receipt_id, seq, to_state, at, actor, detail)
		SELECT id, 1, 'planned', now(), 'agent:bench', '{}' FROM r RETURNING receipt_id`
	sqlBareMove = `WITH r AS (
		UPDATE bare_receipts SET state = $2, version = version + 1, updated_at = now()
		WHERE id = $1 AND state = $3 RETURNING id, version)
		INSERT INTO bare_events (receipt_id, seq, from_state, to_state, at, actor, detail)
		SELECT id, version, $3, $2, now(), 'agent:bench', '{}' FROM r`
)

// Lifecycle runs one lifecycle, appending the latency of each of its calls
// to lat. n numbers the lifecycle (distinct intents, distinct keys).
type Lifecycle func(ctx context.Context, n int64, lat *[]time.Duration) error

// CreateBare creates the bare-SQL journal's two tables in db's current
// schema.
func CreateBare(ctx context.Context, db *pgxpool.Pool) error {
	if _, err := db.Exec(ctx, sqlBareSchema); err != nil {
		return fmt.Errorf("benchlife: create the bare tables: %w", err)
	}
	return nil
}

// Bare returns the bare-SQL lifecycle over the tables CreateBare made:
// three commits, each one statement that writes the receipt and its event.
func Bare(db *pgxpool.Pool) Lifecycle {
	return func(ctx context.Context, n int64, lat *[]time.Duration) error {
		var id int64
		err := Timed(lat, func() error {
			return db.QueryRow(ctx, sqlBarePlan, fmt.Sprintf("k-%d", n), "sha256:x", `{"title":"t"}`).Scan(&id)
		})
		if err != nil {
			return fmt.Errorf("benchlife: bare plan: %w", err)
		}
		for _, m := range [][2]string{{"planned", "submitted"}, {"submitted", "succeeded"}} {
			err := Timed(lat, func() error {
				_, err := db.Exec(ctx, sqlBareMove, id, m[1], m[0])
				return err
			})
			if err != nil {
				return fmt.Errorf("benchlife: bare %s: %w", m[1], err)
			}
		}
		return nil
	}
}

// Ledger returns the lifecycle through the ledger client c as Caller.Do
// makes it: PlanAndSubmit (planned and submitted, both events, one commit),
// then Succeed; distinct intents with the duplicate guard on, as agents
// doing different work would plan them.
func Ledger(c *ledger.Client) Lifecycle {
	return ledgerLifecycle(c, false)
}

// LedgerMoves returns the lifecycle through c as three moves, each its own
// commit: Plan, Submit, Succeed.
func LedgerMoves(c *ledger.Client) Lifecycle {
	return ledgerLifecycle(c, true)
}

func ledgerLifecycle(c *ledger.Client, moves bool) Lifecycle {
	return func(ctx context.Context, n int64, lat *[]time.Duration) error {
		payload := json.RawMessage(fmt.Sprintf(
			`{"title":"Outcome unknown %d","body":"An agent calls an external API.","tags":["a","b"]}`, n))
		in := ledger.Intent{IdempotencyKey: fmt.Sprintf("k-%d", n), Operation: "articles.create",
			Dependency: "blog-api", Method: "POST", Target: "/api/articles", Payload: payload}
		var r *ledger.Receipt
		steps := []func() error{
			func() (err error) { r, err = c.PlanAndSubmit(ctx, in); return err },
			func() (err error) { r, err = c.Succeed(ctx, r, "ext-1", ledger.Detail{}); return err },
		}
		if moves {
			steps = []func() error{
				func() (err error) { r, err = c.Plan(ctx, in); return err },
				func() (err error) { r, err = c.Submit(ctx, r); return err },
				steps[1],
			}
		}
		for _, step := range steps {
			if err := Timed(lat, step); err != nil {
				return err
			}
		}
		return nil
	}
}

// Timed runs f and appends how long it took to lat.
func Timed(lat *[]time.Duration, f func() error) error {
	start := time.Now()
	err := f()
	*lat = append(*lat, time.Since(start))
	return err
}

// Stats are one run's figures.
type Stats struct {
	// Lifecycles is how many ran; Rate is how many per second.
	Lifecycles int
	Rate       float64
	// P50 and P99 are percentiles of the latency of one call.
	P50, P99 time.Duration
}

// ErrNoLifecycles is returned by Run when asked to run none.
var ErrNoLifecycles = errors.New("benchlife: no lifecycles to run")

// Run runs n lifecycles numbered from first+1, spread over agents
// goroutines, and returns their rate and per-call latency percentiles. The
// first error stops the run.
func Run(ctx context.Context, agents, n int, first int64, lifecycle Lifecycle) (Stats, error) {
	if n < 1 || agents < 1 {
		return Stats{}, ErrNoLifecycles
	}
	var next atomic.Int64
	lats := make([][]time.Duration, agents)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The first error is the one to report: the others are its echo (the
	// cancelled context).
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	start := time.Now()
	for a := range agents {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(n) && ctx.Err() == nil; i = next.Add(1) {
				if err := lifecycle(ctx, first+i, &lats[a]); err != nil {
					once.Do(func() { firstErr = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return Stats{}, firstErr
	}
	if err := ctx.Err(); err != nil {
		return Stats{}, err
	}
	all := slices.Concat(lats...)
	slices.Sort(all)
	pct := func(p float64) time.Duration { return all[int(p*float64(len(all)-1))] }
	return Stats{Lifecycles: n, Rate: float64(n) / elapsed.Seconds(), P50: pct(0.50), P99: pct(0.99)}, nil
}
