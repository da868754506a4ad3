package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/statemachine"
)

// pathTo lists the legal moves that take a fresh receipt to each state.
var pathTo = map[statemachine.State][]statemachine.State{
	statemachine.Planned:        nil,
	statemachine.Submitted:      {"submitted"},
	statemachine.OutcomeUnknown: {"submitted", "outcome_unknown"},
	statemachine.Reconciling:    {"submitted", "outcome_unknown", "reconciling"},
	statemachine.Succeeded:      {"submitted", "succeeded"},
	statemachine.SafeToRetry:    {"submitted", "outcome_unknown", "reconciling", "safe_to_retry"},
	statemachine.Rejected:       {"rejected"},
	statemachine.ManualReview:   {"submitted", "outcome_unknown", "manual_review"},
}

// specLegal is SPEC §3 written out once more, independently of both the Go
// table and the SQL one, so a drift in either fails this test.
var specLegal = map[string]bool{
	"planned>submitted": true, "planned>rejected": true,
	"submitted>succeeded": true, "submitted>rejected": true, "submitted>outcome_unknown": true,
	"outcome_unknown>reconciling": true, "outcome_unknown>manual_review": true,
	"reconciling>succeeded": true, "reconciling>safe_to_retry": true, "reconciling>manual_review": true,
	"manual_review>succeeded": true, "manual_review>safe_to_retry": true,
	"manual_review>rejected": true, "manual_review>outcome_unknown": true,
}

const fp = "sha256:0000000000000000000000000000000000000000000000000000000000000000"

// rawReceipt plans a receipt through the SQL API and walks it to state.
func rawReceipt(t *testing.T, pool *pgxpool.Pool, key string, state statemachine.State) int64 {
	t.Helper()
	ctx := context.Background()
	var id int64
	err := pool.QueryRow(ctx, `SELECT id FROM reconciler.plan(idempotency_key => $1, operation => 'articles.create',
		dependency => 'blog-api', method => 'post', target => '/articles', fingerprint => $2,
		intent => '{}', actor => 'agent:test', allow_duplicate => true)`, key, fp).Scan(&id)
	if err != nil {
		t.Fatalf("plan: %v", err)
	}
	actor := "agent:test"
	for _, s := range pathTo[state] {
		if _, err := pool.Exec(ctx, `SELECT reconciler.transition(receipt_id => $1, to_state => $2, actor => $3)`,
			id, string(s), actor); err != nil {
			t.Fatalf("walk to %s: %v", s, err)
		}
	}
	return id
}

type snapshot struct {
	state   string
	version int
	events  int
}

func snap(t *testing.T, pool *pgxpool.Pool, id int64) snapshot {
	t.Helper()
	var s snapshot
	err := pool.QueryRow(context.Background(), `SELECT state, version,
		(SELECT count(*) FROM reconciler.receipt_events WHERE receipt_id = r.id)
		FROM reconciler.receipts r WHERE id = $1`, id).Scan(&s.state, &s.version, &s.events)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// TestDatabaseMatrix checks all 64 moves against the database, through
// reconciler.transition and through a raw UPDATE of the state: legal moves
// are accepted and recorded in history, illegal ones are refused with
// RL001 and leave the receipt exactly as it was. (An UPDATE that sets the
// state a receipt already has is not a move; here it also rewrites the
// actor, which only a move may: refused with RL006.)
func TestDatabaseMatrix(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	via := map[string]string{
		"function": `SELECT 1 FROM reconciler.transition(receipt_id => $1, to_state => $2, actor => $3)`,
		"update":   `UPDATE reconciler.receipts SET state = $2, state_actor = $3 WHERE id = $1`,
	}
	for _, from := range statemachine.States() {
		for _, to := range statemachine.States() {
			for name, stmt := range via {
				for _, actor := range []string{"reconciler:r1", "human:ann"} {
					key := fmt.Sprintf("%s-%s-%s-%s", from, to, name, actor)
					id := rawReceipt(t, pool, key, from)
					before := snap(t, pool, id)
					_, err := pool.Exec(ctx, stmt, id, string(to), actor)
					legal := specLegal[string(from)+">"+string(to)] &&
						(from != statemachine.ManualReview || strings.HasPrefix(actor, "human:"))
					goErr := statemachine.Check(statemachine.Actor(actor), from, to)
					if legal != (goErr == nil) {
						t.Errorf("statemachine.Check(%s, %s -> %s) = %v, spec says legal=%v", actor, from, to, goErr, legal)
					}
					after := snap(t, pool, id)
					if legal {
						if err != nil {
							t.Errorf("%s %s -> %s by %s refused: %v", name, from, to, actor, err)
							continue
						}
						want := snapshot{state: string(to), version: before.version + 1, events: before.events + 1}
						if after != want {
							t.Errorf("%s %s -> %s: got %+v, want %+v", name, from, to, after, want)
						}
						continue
					}
					if name == "update" && from == to {
						// Setting the state a receipt already has is no move,
						// so it may not rewrite the latest move's actor
						// either (issue 7, path 9): refused, nothing changes.
						if sqlState(err) != "RL006" || after != before {
							t.Errorf("update %s -> %s by %s: got %v, %+v -> %+v; want RL006 and no change", from, to, actor, err, before, after)
						}
						continue
					}
					if sqlState(err) != "RL001" || !strings.Contains(err.Error(), string(from)+" -> "+string(to)) {
						t.Errorf("%s %s -> %s by %s: got %v, want RL001 naming the move", name, from, to, actor, err)
					}
					if after != before {
						t.Errorf("%s %s -> %s refused but receipt changed: %+v -> %+v", name, from, to, before, after)
					}
				}
			}
		}
	}
}

func TestUnknownStateRefused(t *testing.T) {
	pool := pgtest.NewPool(t)
	id := rawReceipt(t, pool, "k", statemachine.Submitted)
	before := snap(t, pool, id)
	_, err := pool.Exec(context.Background(), `UPDATE reconciler.receipts SET state = 'failed' WHERE id = $1`, id)
	if err == nil || sqlState(err) != "23514" && sqlState(err) != "RL001" {
		t.Fatalf("unknown state: got %v, want a refusal", err)
	}
	if after := snap(t, pool, id); after != before {
		t.Fatalf("receipt changed: %+v -> %+v", before, after)
	}
}

func TestHistoryIsAppendOnly(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := rawReceipt(t, pool, "k", statemachine.Succeeded)
	before := snap(t, pool, id)
	for _, stmt := range []string{
		`UPDATE reconciler.receipt_events SET actor = 'human:mallory'`,
		`UPDATE reconciler.receipt_events SET to_state = 'rejected' WHERE receipt_id = ` + fmt.Sprint(id),
		`DELETE FROM reconciler.receipt_events`,
		`DELETE FROM reconciler.receipt_events WHERE receipt_id = ` + fmt.Sprint(id),
		`TRUNCATE reconciler.receipt_events`,
		`TRUNCATE reconciler.receipts CASCADE`,
		`DELETE FROM reconciler.receipts`,
	} {
		if _, err := pool.Exec(ctx, stmt); sqlState(err) != "RL006" {
			t.Errorf("%s: got %v, want RL006 (append-only)", stmt, err)
		}
	}
	if after := snap(t, pool, id); after != before {
		t.Fatalf("history changed: %+v -> %+v", before, after)
	}
}
