package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os/user"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

// reviewDB is a fresh ledger with three held receipts (oldest first:
// articles.update on blog held 3h, articles.create on blog held 1h,
// mail.send on mailer just now) and one in outcome_unknown.
type reviewDB struct {
	url                  string
	pool                 *pgxpool.Pool
	update, create, mail int64
	unknown              int64
}

func newReviewDB(t *testing.T) reviewDB {
	t.Helper()
	t.Setenv("RECONCILER_OPERATOR", "")
	url := pgtest.NewDatabase(t)
	db := reviewDB{url: url, pool: pgtest.Pool(t, url)}
	db.create = heldReceipt(t, db.pool, "articles.create", "blog", 1)
	db.mail = heldReceipt(t, db.pool, "mail.send", "mailer", 2)
	db.update = heldReceipt(t, db.pool, "articles.update", "blog", 3)
	db.unknown = unknownReceipt(t, db.pool, "articles.create", "blog", 4).ID
	for id, hours := range map[int64]int{db.update: 3, db.create: 1} {
		pgtest.Backdate(t, db.pool, id, time.Duration(hours)*time.Hour)
	}
	return db
}

func unknownReceipt(t *testing.T, pool *pgxpool.Pool, op, dep string, n int) *ledger.Receipt {
	t.Helper()
	ctx := context.Background()
	agent, err := ledger.New(pool, "agent:t")
	if err != nil {
		t.Fatal(err)
	}
	r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(t.Name(), fmt.Sprint(n), op),
		Operation: op, Dependency: dep, Method: "POST", Target: "/things",
		Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, n))})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout", Message: "read tcp: i/o timeout"}}); err != nil {
		t.Fatal(err)
	}
	return r
}

// heldReceipt plans a receipt and moves it to manual_review as a reconciler.
func heldReceipt(t *testing.T, pool *pgxpool.Pool, op, dep string, n int) int64 {
	t.Helper()
	r := unknownReceipt(t, pool, op, dep, n)
	rc, err := ledger.New(pool, "agent:t")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.As("reconciler:t").Transition(context.Background(), ledger.Move{ID: r.ID,
		From: statemachine.OutcomeUnknown, To: statemachine.ManualReview,
		Detail: ledger.Detail{Reason: "bound_reached", Evidence: map[string]any{"adapter": "blog", "checks": 20, "bound": "max_checks"}}}); err != nil {
		t.Fatal(err)
	}
	return r.ID
}

func TestReviewList(t *testing.T) {
	db := newReviewDB(t)
	url := db.url
	code, out, errOut := runCLI(t, "", "review", "list", "--database-url", url)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	t.Logf("review list:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[0], "REASON") {
		t.Fatalf("table:\n%s", out)
	}
	for i, want := range []struct {
		id      int64
		age, op string
	}{{db.update, "3h00m", "articles.update"}, {db.create, "1h00m", "articles.create"}, {db.mail, "s", "mail.send"}} {
		f := strings.Fields(lines[i+1])
		if f[0] != fmt.Sprint(want.id) || !strings.HasSuffix(f[1], want.age) || f[2] != want.op || f[4] != "1" || f[5] != "bound_reached" {
			t.Fatalf("row %d = %q, want receipt %d %s", i, lines[i+1], want.id, want.op)
		}
	}

	tests := []struct {
		args []string
		want []int64
	}{
		{nil, []int64{db.update, db.create, db.mail}},
		{[]string{"--operation", "articles.create"}, []int64{db.create}},
		{[]string{"--dependency", "blog"}, []int64{db.update, db.create}},
		{[]string{"--older-than", "2h"}, []int64{db.update}},
		{[]string{"--dependency", "blog", "--older-than", "30m", "--limit", "1"}, []int64{db.update}},
		{[]string{"--dependency", "nope"}, []int64{}},
	}
	for _, tt := range tests {
		args := append([]string{"review", "list", "--database-url", url, "--json"}, tt.args...)
		code, out, errOut := runCLI(t, "", args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", tt.args, code, errOut)
		}
		var held []review.Held
		if err := json.Unmarshal([]byte(out), &held); err != nil {
			t.Fatalf("%v: %v in %q", tt.args, err, out)
		}
		ids := []int64{}
		for _, h := range held {
			ids = append(ids, h.ID)
		}
		if fmt.Sprint(ids) != fmt.Sprint(tt.want) {
			t.Errorf("%v: ids %v, want %v", tt.args, ids, tt.want)
		}
	}
	if code, out, _ := runCLI(t, "", "review", "list", "--database-url", url, "--operation", "nope"); code != 0 || !strings.Contains(out, "no receipts") {
		t.Fatalf("empty table: exit %d %q", code, out)
	}
	if code, _, errOut := runCLI(t, "", "review", "list", "--database-url", url, "--limit", "0"); code != 2 {
		t.Fatalf("--limit 0: exit %d %q", code, errOut)
	}
}

func TestReviewShow(t *testing.T) {
	db := newReviewDB(t)
	for _, cmd := range [][]string{{"review", "show"}, {"receipts", "show"}} {
		code, out, errOut := runCLI(t, "", append(cmd, "--database-url", db.url, fmt.Sprint(db.mail))...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", cmd, code, errOut)
		}
		for _, want := range []string{
			fmt.Sprintf("receipt %d  manual_review", db.mail), "mail.send on mailer: POST /things",
			"#1", "(new) -> planned  by agent:t", "submitted -> outcome_unknown  by agent:t",
			`"code":"timeout"`, "outcome_unknown -> manual_review  by reconciler:t",
			"reason:     bound_reached", `"bound":"max_checks"`,
		} {
			if !strings.Contains(out, want) {
				t.Fatalf("%v: output lacks %q:\n%s", cmd, want, out)
			}
		}
		code, out, errOut = runCLI(t, "", append(cmd, "--database-url", db.url, "--json", fmt.Sprint(db.mail))...)
		var tl review.Timeline
		if code != 0 || json.Unmarshal([]byte(out), &tl) != nil || len(tl.Events) != 4 || tl.Receipt.ID != db.mail ||
			tl.Events[3].Reason != "bound_reached" {
			t.Fatalf("%v --json: exit %d %q %q", cmd, code, out, errOut)
		}
	}
}

func TestReviewResolve(t *testing.T) {
	db := newReviewDB(t)
	url := db.url
	id := fmt.Sprint
	tests := []struct {
		name string
		args []string
		code int
		msg  string // in stdout when code is 0, else in stderr
	}{
		{"succeeded", []string{"resolve", id(db.update), "--as", "succeeded", "--reason", "found it in the CMS", "--external-id", "art_9", "--operator", "alice"},
			0, fmt.Sprintf("receipt %d: manual_review -> succeeded by human:alice", db.update)},
		{"again", []string{"resolve", id(db.update), "--as", "rejected", "--reason", "x", "--operator", "bob"},
			1, fmt.Sprintf("receipt %d is succeeded, not manual_review (moved there by human:alice", db.update)},
		{"not held", []string{"resolve", id(db.unknown), "--as", "rejected", "--reason", "x"},
			1, fmt.Sprintf("receipt %d is outcome_unknown, not manual_review", db.unknown)},
		{"unknown id", []string{"resolve", "999999", "--as", "rejected", "--reason", "x"}, 1, "receipt 999999 not found"},
		{"requeue unknown id", []string{"requeue", "999999", "--reason", "x"}, 1, "receipt 999999 not found"},
		{"no reason", []string{"resolve", id(db.create), "--as", "rejected"}, 2, "--reason is required"},
		{"blank reason", []string{"resolve", id(db.create), "--as", "rejected", "--reason", "  "}, 2, "--reason is required"},
		{"requeue without reason", []string{"requeue", id(db.create)}, 2, "--reason is required"},
		{"no --as", []string{"resolve", id(db.create), "--reason", "x"}, 2, "--as is required"},
		{"--as outside the three", []string{"resolve", id(db.create), "--as", "outcome_unknown", "--reason", "x"}, 2, "must be succeeded, safe_to_retry or rejected"},
		{"--as nonsense", []string{"resolve", id(db.create), "--as", "done", "--reason", "x"}, 2, "must be succeeded"},
		{"no id", []string{"resolve", "--as", "rejected", "--reason", "x"}, 2, "want exactly one receipt ID"},
		{"bad id", []string{"resolve", "abc", "--as", "rejected", "--reason", "x"}, 2, `"abc" is not a receipt ID`},
		{"two ids", []string{"resolve", id(db.create), id(db.mail), "--as", "rejected", "--reason", "x"}, 2, "want exactly one receipt ID"},
		{"unknown flag after the id", []string{"resolve", id(db.create), "--as", "rejected", "--reason", "x", "--force"}, 2, "flag provided but not defined: --force"},
		{"flag without its value", []string{"resolve", id(db.create), "--as", "rejected", "--reason"}, 2, "flag needs an argument: --reason"},
		{"rejected", []string{"resolve", id(db.create), "--as", "rejected", "--reason", "the API returned 422 in its logs", "--operator", "carol"},
			0, "manual_review -> rejected by human:carol"},
		{"safe_to_retry (OS user)", []string{"resolve", id(db.mail), "--as", "safe_to_retry", "--reason", "provider confirms nothing was sent"},
			0, "manual_review -> safe_to_retry by human:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := append([]string{"review", tt.args[0], "--database-url", url}, tt.args[1:]...)
			code, out, errOut := runCLI(t, "", args...)
			where := out
			if tt.code != 0 {
				where = errOut
				if strings.Count(strings.TrimSpace(errOut), "\n") > 0 {
					t.Errorf("error is not one line: %q", errOut)
				}
			}
			if code != tt.code || !strings.Contains(where, tt.msg) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want exit %d and %q", code, out, errOut, tt.code, tt.msg)
			}
		})
	}

	// History gained exactly the human events, with reason, operator and external id.
	ctx := context.Background()
	me, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		id         int64
		to         statemachine.State
		actor, ext string
	}{
		{db.update, statemachine.Succeeded, "human:alice", "art_9"},
		{db.create, statemachine.Rejected, "human:carol", ""},
		{db.mail, statemachine.SafeToRetry, "human:" + me.Username, ""},
	} {
		tl, err := review.Show(ctx, db.pool, want.id)
		if err != nil {
			t.Fatal(err)
		}
		var humans []review.Event
		for _, e := range tl.Events {
			if e.Actor.Kind() == statemachine.Human {
				humans = append(humans, e)
			}
		}
		if len(humans) != 1 || tl.Receipt.State != want.to {
			t.Fatalf("receipt %d: state %s, human events %+v", want.id, tl.Receipt.State, humans)
		}
		e := humans[0]
		if e.Actor != statemachine.Actor(want.actor) || e.To != want.to || e.Reason == "" || e.ExternalID != want.ext ||
			!strings.Contains(string(e.Extra), `"resolved_via": "reconciler review"`) {
			t.Fatalf("receipt %d: event %+v (extra %s)", want.id, e, e.Extra)
		}
	}
	// Refusals recorded nothing on the receipt that was never held.
	if tl, err := review.Show(ctx, db.pool, db.unknown); err != nil || len(tl.Events) != 3 {
		t.Fatalf("receipt %d: %v, %+v", db.unknown, err, tl)
	}
}

// Flags may come before or after the ID, --database-url included.
func TestReviewFlagPlacement(t *testing.T) {
	db := newReviewDB(t)
	t.Setenv("RECONCILER_DATABASE_URL", "")
	code, out, errOut := runCLI(t, "", "review", "show", fmt.Sprint(db.mail), "--json", "--database-url="+db.url)
	if code != 0 || !strings.HasPrefix(out, "{") {
		t.Fatalf("show ID --json --database-url=URL: exit %d %q %q", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "review", "resolve", "--as", "rejected", fmt.Sprint(db.mail), "--database-url", db.url,
		"--operator=erin", "--reason", "duplicate of an earlier mail")
	if code != 0 || !strings.Contains(out, "by human:erin") {
		t.Fatalf("mixed flags: exit %d %q %q", code, out, errOut)
	}
	for _, args := range [][]string{
		{"review", "show", fmt.Sprint(db.mail)},
		{"review", "list"},
		{"receipts", "show", fmt.Sprint(db.mail)},
	} {
		if code, _, errOut := runCLI(t, "", args...); code != 2 || !strings.Contains(errOut, "--database-url") {
			t.Errorf("%v without a database URL: exit %d %q", args, code, errOut)
		}
	}
}

func TestReviewRequeue(t *testing.T) {
	db := newReviewDB(t)
	t.Setenv("RECONCILER_OPERATOR", "dave")
	code, out, errOut := runCLI(t, "", "review", "requeue", "--database-url", db.url, fmt.Sprint(db.mail),
		"--reason", "the mailer's log was late; check again")
	if code != 0 || !strings.Contains(out, "manual_review -> outcome_unknown by human:dave") {
		t.Fatalf("exit %d %q %q", code, out, errOut)
	}
	tl, err := review.Show(context.Background(), db.pool, db.mail)
	if err != nil {
		t.Fatal(err)
	}
	last := tl.Events[len(tl.Events)-1]
	if tl.Receipt.State != statemachine.OutcomeUnknown || tl.Receipt.NextCheckAt == nil || last.Actor != "human:dave" ||
		last.Reason != "the mailer's log was late; check again" {
		t.Fatalf("receipt %+v, last event %+v", tl.Receipt, last)
	}
	// It is no longer listed.
	code, out, _ = runCLI(t, "", "review", "list", "--database-url", db.url, "--json", "--operation", "mail.send")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("list after requeue: exit %d %q", code, out)
	}
}
