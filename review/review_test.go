package review

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/statemachine"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// hold plans a receipt and moves it submitted → outcome_unknown →
// manual_review (as a reconciler, with reason "blind"), returning its id.
func hold(t *testing.T, pool *pgxpool.Pool, op, dep string) int64 {
	t.Helper()
	r := unknown(t, pool, op, dep)
	rc, err := ledger.New(pool, "reconciler:t")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Transition(context.Background(), ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown,
		To: statemachine.ManualReview, Detail: ledger.Detail{Reason: "blind",
			Evidence: map[string]any{"adapter": "mailer", "checks": 0}}}); err != nil {
		t.Fatal(err)
	}
	return r.ID
}

var planned int

// unknown plans a receipt and leaves it in outcome_unknown.
func unknown(t *testing.T, pool *pgxpool.Pool, op, dep string) *ledger.Receipt {
	t.Helper()
	ctx := context.Background()
	agent, err := ledger.New(pool, "agent:t")
	if err != nil {
		t.Fatal(err)
	}
	planned++
	r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(t.Name(), fmt.Sprint(planned), op),
		Operation: op, Dependency: dep, Method: "POST", Target: "/things",
		Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, planned))})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	return r
}

// backdate makes a receipt look held for d (a non-move UPDATE records nothing).
func backdate(t *testing.T, pool *pgxpool.Pool, id int64, d time.Duration) {
	t.Helper()
	pgtest.Backdate(t, pool, id, d)
}

func TestList(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	a := hold(t, pool, "articles.create", "blog")
	b := hold(t, pool, "mail.send", "mailer")
	c := hold(t, pool, "articles.update", "blog")
	backdate(t, pool, c, 3*time.Hour)
	backdate(t, pool, a, time.Hour)
	unknown(t, pool, "articles.create", "blog") // not held: never listed
	d := unknown(t, pool, "mail.send", "mailer").ID
	rc, err := ledger.New(pool, "reconciler:t")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Transition(ctx, ledger.Move{ID: d, From: statemachine.OutcomeUnknown,
		To: statemachine.ManualReview, Detail: ledger.Detail{Reason: "bound_reached"}}); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name string
		f    Filter
		want []int64
	}{
		{"all, longest held first", Filter{}, []int64{c, a, b, d}},
		{"reason", Filter{Reason: "blind"}, []int64{c, a, b}},
		{"other reason", Filter{Reason: "bound_reached"}, []int64{d}},
		{"reason and dependency", Filter{Reason: "bound_reached", Dependency: "blog"}, nil},
		{"operation", Filter{Operation: "articles.create"}, []int64{a}},
		{"dependency", Filter{Dependency: "blog"}, []int64{c, a}},
		{"older than", Filter{OlderThan: 30 * time.Minute}, []int64{c, a}},
		{"older than all", Filter{OlderThan: 4 * time.Hour}, nil},
		{"limit", Filter{Limit: 2}, []int64{c, a}},
		{"combined", Filter{Dependency: "blog", OlderThan: 2 * time.Hour}, []int64{c}},
		{"no match", Filter{Operation: "nope"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			held, err := List(ctx, pool, tt.f)
			if err != nil {
				t.Fatal(err)
			}
			var ids []int64
			for _, h := range held {
				ids = append(ids, h.ID)
			}
			if !slices.Equal(ids, tt.want) {
				t.Fatalf("ids %v, want %v", ids, tt.want)
			}
			// Count agrees with the list (without its limit), and stops
			// at its bound.
			f := tt.f
			f.Limit = 0
			all, err := List(ctx, pool, Filter{Operation: f.Operation, Dependency: f.Dependency, Reason: f.Reason,
				OlderThan: f.OlderThan, Limit: 100})
			if err != nil {
				t.Fatal(err)
			}
			if n, more, err := Count(ctx, pool, f, 0); err != nil || n != int64(len(all)) || more {
				t.Fatalf("count %d (more %v, %v), want %d", n, more, err, len(all))
			}
			if n, more, err := Count(ctx, pool, f, 1); err != nil || n != min(1, int64(len(all))) || more != (len(all) > 1) {
				t.Fatalf("count up to 1: %d (more %v, %v) of %d", n, more, err, len(all))
			}
		})
	}
	held, err := List(ctx, pool, Filter{Operation: "articles.update"})
	if err != nil || len(held) != 1 {
		t.Fatalf("%v %v", held, err)
	}
	h := held[0]
	if h.Reason != "blind" || h.HeldBy != "reconciler:t" || h.Dependency != "blog" || h.Attempt != 1 ||
		h.Age < 3*time.Hour || h.Age > 3*time.Hour+time.Minute {
		t.Fatalf("held = %+v", h)
	}
}

// The list walks the partial index receipts_held rather than the table.
func TestListUsesIndex(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	for _, f := range []Filter{{Limit: 50}, {Operation: "x", Dependency: "y", OlderThan: time.Minute, Limit: 50},
		{Reason: "blind", Limit: 50}} {
		q, args := listQuery(f)
		var plan strings.Builder
		rows, err := tx.Query(ctx, "EXPLAIN "+q, args)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan.WriteString(line + "\n")
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(plan.String(), "receipts_held") || strings.Contains(plan.String(), "Seq Scan") {
			t.Fatalf("plan does not walk receipts_held:\n%s", plan.String())
		}
	}
}

func TestShow(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := hold(t, pool, "mail.send", "mailer")
	tl, err := Show(ctx, pool, id)
	if err != nil {
		t.Fatal(err)
	}
	if tl.Receipt.ID != id || tl.Receipt.State != statemachine.ManualReview || tl.Receipt.SubmittedAt == nil {
		t.Fatalf("receipt = %+v", tl.Receipt)
	}
	want := []statemachine.State{statemachine.Planned, statemachine.Submitted, statemachine.OutcomeUnknown, statemachine.ManualReview}
	if len(tl.Events) != len(want) {
		t.Fatalf("%d events, want %d", len(tl.Events), len(want))
	}
	for i, e := range tl.Events {
		if e.Seq != i+1 || e.To != want[i] {
			t.Fatalf("event %d = %+v", i, e)
		}
	}
	if tl.Events[0].From != "" || tl.Events[2].From != statemachine.Submitted {
		t.Fatalf("from states: %+v", tl.Events)
	}
	if !strings.Contains(string(tl.Events[2].Error), `"timeout"`) {
		t.Fatalf("error of event 3 = %s", tl.Events[2].Error)
	}
	held := tl.Events[3]
	if held.Reason != "blind" || held.Actor != "reconciler:t" || !strings.Contains(string(held.Evidence), `"mailer"`) {
		t.Fatalf("held event = %+v", held)
	}
	if _, err := Show(ctx, pool, id+1000); !errors.Is(err, ErrNotFound) || err.Error() != fmt.Sprintf("receipt %d not found", id+1000) {
		t.Fatalf("unknown id: %v", err)
	}
}

func TestResolve(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	for _, to := range []statemachine.State{statemachine.Succeeded, statemachine.SafeToRetry, statemachine.Rejected} {
		t.Run(string(to), func(t *testing.T) {
			id := hold(t, pool, "mail.send", "mailer")
			r, err := Resolve(ctx, pool, Resolution{ID: id, To: to, Operator: "alice",
				Reason: "  checked the provider's console  ", ExternalID: "ext-" + string(to)})
			if err != nil {
				t.Fatal(err)
			}
			if r.State != to || r.ExternalID != "ext-"+string(to) {
				t.Fatalf("receipt = %+v", r)
			}
			tl, err := Show(ctx, pool, id)
			if err != nil {
				t.Fatal(err)
			}
			if len(tl.Events) != 5 {
				t.Fatalf("%d events, want 5", len(tl.Events))
			}
			e := tl.Events[4]
			var extra map[string]string
			if err := json.Unmarshal(e.Extra, &extra); err != nil {
				t.Fatal(err)
			}
			if e.From != statemachine.ManualReview || e.To != to || e.Actor != "human:alice" ||
				e.Reason != "checked the provider's console" || e.ExternalID != "ext-"+string(to) ||
				extra["resolved_via"] != Via || extra["operator"] != "alice" || extra["action"] != "resolve" {
				t.Fatalf("event = %+v, extra %v", e, extra)
			}
		})
	}
}

func TestRequeue(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	id := hold(t, pool, "mail.send", "mailer")
	r, err := Requeue(ctx, pool, id, "bob", "the provider had an outage; check again")
	if err != nil {
		t.Fatal(err)
	}
	if r.State != statemachine.OutcomeUnknown {
		t.Fatalf("state %s", r.State)
	}
	tl, err := Show(ctx, pool, id)
	if err != nil {
		t.Fatal(err)
	}
	e := tl.Events[len(tl.Events)-1]
	if e.Actor != "human:bob" || e.To != statemachine.OutcomeUnknown || e.Reason == "" || tl.Receipt.NextCheckAt == nil {
		t.Fatalf("event %+v, next check %v", e, tl.Receipt.NextCheckAt)
	}
	// The reconciler claims it again.
	store, err := reconcile.NewStore(pool, "t")
	if err != nil {
		t.Fatal(err)
	}
	claimed, err := store.Claim(ctx, time.Now().Add(time.Second), 10, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(claimed) != 1 || claimed[0].ID != id {
		t.Fatalf("claimed %+v, want receipt %d", claimed, id)
	}
}

func TestDecisionErrors(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	held := hold(t, pool, "mail.send", "mailer")
	notHeld := unknown(t, pool, "mail.send", "mailer").ID
	ok := Resolution{ID: held, To: statemachine.Succeeded, Operator: "alice", Reason: "seen it"}
	with := func(f func(*Resolution)) Resolution { r := ok; f(&r); return r }
	tests := []struct {
		name string
		r    Resolution
		is   error
		msg  string
	}{
		{"blank reason", with(func(r *Resolution) { r.Reason = " \t" }), ErrReasonRequired, ""},
		{"no operator", with(func(r *Resolution) { r.Operator = "" }), ErrInvalidOperator, ""},
		{"padded operator", with(func(r *Resolution) { r.Operator = " alice" }), ErrInvalidOperator, ""},
		{"not a resolution", with(func(r *Resolution) { r.To = statemachine.OutcomeUnknown }), ErrInvalidResolution, ""},
		{"unknown state", with(func(r *Resolution) { r.To = "done" }), ErrInvalidResolution, ""},
		{"unknown id", with(func(r *Resolution) { r.ID = held + 1000 }), ErrNotFound, fmt.Sprintf("receipt %d not found", held+1000)},
		{"not held", with(func(r *Resolution) { r.ID = notHeld }), ErrNotHeld,
			fmt.Sprintf("receipt %d is outcome_unknown, not manual_review", notHeld)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Resolve(ctx, pool, tt.r)
			if !errors.Is(err, tt.is) {
				t.Fatalf("err = %v, want %v", err, tt.is)
			}
			if tt.msg != "" && !strings.HasPrefix(err.Error(), tt.msg) {
				t.Fatalf("message %q, want prefix %q", err.Error(), tt.msg)
			}
		})
	}
	var conflict *ledger.ConflictError
	if _, err := Requeue(ctx, pool, notHeld, "alice", "x"); !errors.As(err, &conflict) || conflict.Actual != statemachine.OutcomeUnknown {
		t.Fatalf("requeue of a receipt not held: %v", err)
	}
	// Nothing was recorded by any refusal.
	for _, id := range []int64{held, notHeld} {
		tl, err := Show(ctx, pool, id)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range tl.Events {
			if e.Actor.Kind() == statemachine.Human {
				t.Fatalf("receipt %d: refused decision recorded: %+v", id, e)
			}
		}
	}
}

// Several people resolve the same receipt at once: exactly one wins, the
// others are told what it became, and history holds one human event.
func TestConcurrentResolve(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	states := []statemachine.State{statemachine.Succeeded, statemachine.SafeToRetry, statemachine.Rejected}
	const rounds, people = 5, 6
	for round := range rounds {
		id := hold(t, pool, "mail.send", "mailer")
		start := make(chan struct{})
		errs := make([]error, people)
		var wg sync.WaitGroup
		for p := range people {
			wg.Go(func() {
				<-start
				_, errs[p] = Resolve(ctx, pool, Resolution{ID: id, To: states[p%len(states)],
					Operator: fmt.Sprintf("person%d", p), Reason: "race"})
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for p, err := range errs {
			var conflict *ledger.ConflictError
			var nh *NotHeldError
			switch {
			case err == nil && winner >= 0:
				t.Fatalf("round %d: person %d and %d both won", round, winner, p)
			case err == nil:
				winner = p
			case !errors.As(err, &conflict) || !errors.As(err, &nh) || !errors.Is(err, ledger.ErrStateConflict):
				t.Fatalf("round %d: person %d: %v, want a conflict", round, p, err)
			case conflict.Actual == statemachine.ManualReview || nh.By == "":
				t.Fatalf("round %d: person %d: %v", round, p, err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: nobody won: %v", round, errs)
		}
		tl, err := Show(ctx, pool, id)
		if err != nil {
			t.Fatal(err)
		}
		var humans []Event
		for _, e := range tl.Events {
			if e.Actor.Kind() == statemachine.Human {
				humans = append(humans, e)
			}
		}
		want := statemachine.Actor(fmt.Sprintf("human:person%d", winner))
		if len(humans) != 1 || humans[0].Actor != want || tl.Receipt.State != states[winner%len(states)] {
			t.Fatalf("round %d: human events %+v, state %s; want one by %s", round, humans, tl.Receipt.State, want)
		}
		for p, err := range errs {
			if err != nil && !strings.Contains(err.Error(), fmt.Sprintf("is %s, not manual_review (moved there by %s", tl.Receipt.State, want)) {
				t.Fatalf("round %d: person %d's error %q does not name the winner", round, p, err)
			}
		}
	}
}

// Decide resolves or requeues, recording the tool it was given.
func TestDecide(t *testing.T) {
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	for _, c := range []struct {
		r       Resolution
		action  string
		wantVia string
	}{
		{Resolution{To: statemachine.OutcomeUnknown, Operator: "bob", Reason: "check again", Via: "reconciler ui"}, "requeue", "reconciler ui"},
		{Resolution{To: statemachine.Rejected, Operator: "bob", Reason: "cancelled", Via: "reconciler ui"}, "resolve", "reconciler ui"},
		{Resolution{To: statemachine.Succeeded, Operator: "bob", Reason: "found it"}, "resolve", Via},
	} {
		c.r.ID = hold(t, pool, "mail.send", "mailer")
		got, err := Decide(ctx, pool, c.r)
		if err != nil || got.State != c.r.To {
			t.Fatalf("%+v: %+v, %v", c.r, got, err)
		}
		tl, err := Show(ctx, pool, c.r.ID)
		if err != nil {
			t.Fatal(err)
		}
		var extra map[string]string
		if err := json.Unmarshal(tl.Events[len(tl.Events)-1].Extra, &extra); err != nil {
			t.Fatal(err)
		}
		if extra["resolved_via"] != c.wantVia || extra["action"] != c.action || extra["operator"] != "bob" {
			t.Errorf("%+v: extra %v", c.r, extra)
		}
	}
	id := hold(t, pool, "mail.send", "mailer")
	if _, err := Decide(ctx, pool, Resolution{ID: id, To: statemachine.OutcomeUnknown, Operator: "bob",
		Reason: "x", ExternalID: "msg-1"}); !errors.Is(err, ErrInvalidResolution) {
		t.Errorf("requeue with an external id: %v", err)
	}
	if _, err := Decide(ctx, pool, Resolution{ID: id, To: statemachine.Planned, Operator: "bob", Reason: "x"}); !errors.Is(err, ErrInvalidResolution) {
		t.Errorf("decide to planned: %v", err)
	}
}
