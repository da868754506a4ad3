package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rogpeppe/go-internal/testscript"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
	"github.com/receiptledger/reconciler/statemachine"
)

// TestMain makes this test binary the `reconciler` command of the scripts
// (testscript runs it as that name and it runs main), and otherwise runs
// the tests on the test server of internal/pgtest.
func TestMain(m *testing.M) {
	testscript.Main(withTestServer{m}, map[string]func(){"reconciler": main})
}

// withTestServer runs the tests and then stops the server pgtest started.
type withTestServer struct{ m *testing.M }

func (w withTestServer) Run() int { return pgtest.Run(w.m) }

// scriptRoles are the roles of docs/roles.sql the scripts log in as, and
// the variable holding each login's URL: the login is a member of that
// group role only. NOROLE_URL is a login in none of them.
var scriptRoles = map[string]string{
	"reconciler_agent":    "AGENT_URL",
	"reconciler_worker":   "WORKER_URL",
	"reconciler_reviewer": "REVIEWER_URL",
	"reconciler_readonly": "READONLY_URL",
	"":                    "NOROLE_URL",
}

// TestScripts runs the CLI suites of testdata/script against the binary:
// every command and subcommand, its --json output parsed, every error with
// its exit code and its one line on stderr, flags wherever people put
// them, and every command under each role of docs/roles.sql. Each script
// gets a fresh migrated database (DATABASE_URL, the owner's), with
// docs/roles.sql applied and a login per role (AGENT_URL, WORKER_URL,
// REVIEWER_URL, READONLY_URL, NOROLE_URL) and BADLOGIN_URL, a login the
// server does not know; SCHEMA_VERSION is the version
// `migrate up` reaches. RECONCILER_DATABASE_URL is not set: a script sets
// it where it tests the variable.
//
// Commands added for the scripts (see the script* functions below):
//
//	exits N prog args...        run prog, want exit status N; for N > 0 want
//	                            stderr to be one line "reconciler: ..." with
//	                            no raw SQL error
//	json [PATH=V|PATH~RE|PATH]  stdout is one JSON value; PATH is dotted
//	                            (array indexes are numbers), ending in #
//	                            for a length or #keys for an object's keys
//	seed [-as URL] VAR STATE OP DEP
//	                            record a receipt of OP on DEP in STATE
//	                            (planned, submitted, unknown, held,
//	                            succeeded) and set VAR to its id; -as
//	                            makes the agent's moves as that login
//	backdate VAR AGE            make receipt $VAR AGE older: its creation,
//	                            submission and latest move
//	dbval [-db URL] [-wait] QUERY WANT
//	                            SELECT QUERY as text, as the owner (or on
//	                            the database URL); -wait: until it is WANT
//	emptydb VAR                 a database with no schema; VAR its URL
func TestScripts(t *testing.T) {
	logins := newScriptLogins(t)
	testscript.Run(t, testscript.Params{
		Dir:                 "testdata/script",
		RequireExplicitExec: true,
		RequireUniqueNames:  true,
		Setup: func(env *testscript.Env) error {
			return setupScript(env, logins)
		},
		Cmds: map[string]func(*testscript.TestScript, bool, []string){
			"exits":    scriptExits,
			"json":     scriptJSON,
			"seed":     scriptSeed,
			"backdate": scriptBackdate,
			"dbval":    scriptDBVal,
			"emptydb":  scriptEmptyDB,
		},
	})
}

// scriptLogin is a login role in one group role of docs/roles.sql.
type scriptLogin struct{ name, password string }

// newScriptLogins creates one login per role of scriptRoles for the whole
// run (roles are server-wide; each script's database grants them through
// docs/roles.sql) and drops them when every script is done. The group
// roles come from docs/roles.sql itself, applied to a database of their
// own first.
func newScriptLogins(t *testing.T) map[string]scriptLogin {
	t.Helper()
	ctx := context.Background()
	owner := pgtest.Pool(t, pgtest.NewDatabase(t))
	applyRoles(t, owner)
	logins := map[string]scriptLogin{}
	for group := range scriptRoles {
		l := scriptLogin{name: "ts_" + strings.ToLower(rand.Text()[:12]), password: rand.Text()}
		in := ""
		if group != "" {
			in = " IN ROLE " + pgx.Identifier{group}.Sanitize()
		}
		if _, err := owner.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD '%s'%s`,
			pgx.Identifier{l.name}.Sanitize(), l.password, in)); err != nil {
			t.Fatal(err)
		}
		// Registered after the pool, so it runs before the pool closes
		// and once every script's database is gone.
		t.Cleanup(func() {
			if _, err := owner.Exec(ctx, `DROP ROLE `+pgx.Identifier{l.name}.Sanitize()); err != nil {
				t.Errorf("drop login %s: %v", l.name, err)
			}
		})
		logins[group] = l
	}
	return logins
}

// applyRoles applies docs/roles.sql to the database of owner.
func applyRoles(tb testing.TB, owner *pgxpool.Pool) {
	tb.Helper()
	sql, err := os.ReadFile("../../docs/roles.sql")
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := owner.Exec(context.Background(), string(sql)); err != nil {
		tb.Fatalf("apply docs/roles.sql: %v", err)
	}
}

// scriptDB is a script's database, for the commands that seed and inspect
// it.
type scriptDB struct {
	tb    testing.TB
	url   string
	owner *pgxpool.Pool
}

type scriptDBKey struct{}

func setupScript(env *testscript.Env, logins map[string]scriptLogin) error {
	tb, ok := env.T().(testing.TB)
	if !ok {
		return fmt.Errorf("testscript gave a %T, not a testing.TB", env.T())
	}
	dbURL := pgtest.NewDatabase(tb)
	owner := pgtest.Pool(tb, dbURL)
	applyRoles(tb, owner)
	env.Setenv("DATABASE_URL", dbURL)
	env.Setenv("SCHEMA_VERSION", strconv.FormatInt(migrations.Latest(), 10))
	for group, l := range logins {
		u, err := url.Parse(dbURL)
		if err != nil {
			return err
		}
		u.User = url.UserPassword(l.name, l.password)
		env.Setenv(scriptRoles[group], u.String())
	}
	// A login the server does not know, with a password: what a mistyped
	// user or a wrong password gets (the test server may trust every
	// known login whatever its password).
	u, err := url.Parse(dbURL)
	if err != nil {
		return err
	}
	u.User = url.UserPassword("ts_nobody_"+strings.ToLower(rand.Text()[:8]), "wrong")
	env.Setenv("BADLOGIN_URL", u.String())
	env.Values[scriptDBKey{}] = &scriptDB{tb: tb, url: dbURL, owner: owner}
	return nil
}

func dbOf(ts *testscript.TestScript) *scriptDB {
	return ts.Value(scriptDBKey{}).(*scriptDB)
}

// scriptExits runs a command and wants its exit status; a failure must be
// one line on stderr that a person can act on: prefixed with the program's
// name, no help page, no raw SQL error.
func scriptExits(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) < 2 {
		ts.Fatalf("usage: exits N prog [args...]")
	}
	want, err := strconv.Atoi(args[0])
	if err != nil {
		ts.Fatalf("exits: %q is not an exit status", args[0])
	}
	err = ts.Exec(args[1], args[2:]...)
	got := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		got = ee.ExitCode()
	case err != nil:
		ts.Fatalf("exits: %v", err)
	}
	if got != want {
		ts.Fatalf("exit status %d, want %d", got, want)
	}
	if want == 0 {
		return
	}
	stderr := ts.ReadFile("stderr")
	line, rest, _ := strings.Cut(stderr, "\n")
	switch {
	case rest != "" || !strings.HasSuffix(stderr, "\n"):
		ts.Fatalf("stderr is not one line")
	case !strings.HasPrefix(line, "reconciler: "):
		ts.Fatalf("stderr does not start with %q", "reconciler: ")
	case strings.Contains(line, "SQLSTATE"), strings.Contains(line, "USAGE:"), strings.Contains(line, "Incorrect Usage"):
		ts.Fatalf("stderr is a raw SQL error or a help page, not a sentence")
	}
}

// scriptJSON parses stdout as exactly one JSON value and checks the
// values at the paths given.
func scriptJSON(ts *testscript.TestScript, neg bool, args []string) {
	if neg {
		ts.Fatalf("usage: json [PATH=VALUE|PATH~REGEXP|PATH ...]")
	}
	dec := json.NewDecoder(strings.NewReader(ts.ReadFile("stdout")))
	dec.UseNumber()
	var doc any
	if err := dec.Decode(&doc); err != nil {
		ts.Fatalf("stdout is not JSON: %v", err)
	}
	if _, err := dec.Token(); err == nil {
		ts.Fatalf("stdout holds more than one JSON value")
	}
	for _, a := range args {
		i := strings.IndexAny(a, "=~")
		path, op, want := a, byte(0), ""
		if i >= 0 {
			path, op, want = a[:i], a[i], a[i+1:]
		}
		got, err := jsonAt(doc, path)
		if err != nil {
			ts.Fatalf("json %s: %v", path, err)
		}
		switch op {
		case '=':
			if got != want {
				ts.Fatalf("json %s is %s, want %s", path, got, want)
			}
		case '~':
			if !regexp.MustCompile(want).MatchString(got) {
				ts.Fatalf("json %s is %s, want it to match %s", path, got, want)
			}
		}
	}
}

// jsonAt is the value at a dotted path of doc, as text: a string as is,
// anything else as compact JSON; "#" is a length and "#keys" an object's
// sorted keys, comma-separated.
func jsonAt(doc any, path string) (string, error) {
	v := doc
	for _, seg := range strings.Split(path, ".") {
		switch x := v.(type) {
		case map[string]any:
			switch seg {
			case "#":
				return strconv.Itoa(len(x)), nil
			case "#keys":
				keys := make([]string, 0, len(x))
				for k := range x {
					keys = append(keys, k)
				}
				slices.Sort(keys)
				return strings.Join(keys, ","), nil
			}
			var ok bool
			if v, ok = x[seg]; !ok {
				return "", fmt.Errorf("no key %q", seg)
			}
		case []any:
			if seg == "#" {
				return strconv.Itoa(len(x)), nil
			}
			n, err := strconv.Atoi(seg)
			if err != nil || n < 0 || n >= len(x) {
				return "", fmt.Errorf("no element %q in an array of %d", seg, len(x))
			}
			v = x[n]
		default:
			return "", fmt.Errorf("%q: not an object or array", seg)
		}
	}
	if s, ok := v.(string); ok {
		return s, nil
	}
	b, err := json.Marshal(v)
	return string(b), err
}

// scriptSeed records a receipt in a given state, as an agent would (as
// the -as login, else the owner), then, for held, moves it to
// manual_review as the reconciler would.
func scriptSeed(ts *testscript.TestScript, neg bool, args []string) {
	const usage = "usage: seed [-as URL] VAR planned|submitted|unknown|held|succeeded OP DEP"
	db := dbOf(ts)
	ctx := context.Background()
	agentPool := db.owner
	if len(args) > 2 && args[0] == "-as" {
		p, err := pgxpool.New(ctx, args[1])
		ts.Check(err)
		defer p.Close()
		agentPool, args = p, args[2:]
	}
	if neg || len(args) != 4 {
		ts.Fatalf(usage)
	}
	name, state, op, dep := args[0], args[1], args[2], args[3]
	agent, err := ledger.New(agentPool, "agent:script")
	ts.Check(err)
	r, err := agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(ts.Name(), name, op),
		Operation: op, Dependency: dep, Method: "POST", Target: "/things",
		Payload: json.RawMessage(fmt.Sprintf(`{"seed":%q}`, name))})
	ts.Check(err)
	moves := map[string][]statemachine.State{
		"planned":   nil,
		"submitted": {statemachine.Submitted},
		"succeeded": {statemachine.Submitted, statemachine.Succeeded},
		"unknown":   {statemachine.Submitted, statemachine.OutcomeUnknown},
		"held":      {statemachine.Submitted, statemachine.OutcomeUnknown},
	}
	steps, ok := moves[state]
	if !ok {
		ts.Fatalf(usage)
	}
	for _, to := range steps {
		m := ledger.Move{ID: r.ID, From: r.State, To: to}
		switch to {
		case statemachine.Succeeded:
			m.ExternalID = "ext-" + name
		case statemachine.OutcomeUnknown:
			m.Detail = ledger.Detail{Error: &ledger.CallError{Code: "timeout", Message: "read tcp: i/o timeout"}}
		}
		r, err = agent.Transition(ctx, m)
		ts.Check(err)
	}
	if state == "held" {
		rc, err := ledger.New(db.owner, "reconciler:script")
		ts.Check(err)
		_, err = rc.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown, To: statemachine.ManualReview,
			Detail: ledger.Detail{Reason: "bound_reached", Evidence: map[string]any{"adapter": "blog", "checks": 20, "bound": "max_checks"}}})
		ts.Check(err)
	}
	ts.Setenv(name, strconv.FormatInt(r.ID, 10))
}

// scriptBackdate makes a receipt look as if everything in it happened age
// earlier. The schema refuses to rewrite the times of past moves, so the
// script's own database lets its owner switch the receipts triggers off
// for this one transaction (as pgtest.Backdate does).
func scriptBackdate(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 2 {
		ts.Fatalf("usage: backdate VAR AGE")
	}
	id, err := strconv.ParseInt(ts.Getenv(args[0]), 10, 64)
	ts.Check(err)
	age, err := time.ParseDuration(args[1])
	ts.Check(err)
	ctx := context.Background()
	ts.Check(pgx.BeginFunc(ctx, dbOf(ts).owner, func(tx pgx.Tx) error {
		for _, q := range []string{
			`ALTER TABLE reconciler.receipts DISABLE TRIGGER USER`,
			`UPDATE reconciler.receipts SET created_at = created_at - $2::interval, updated_at = updated_at - $2::interval,
				submitted_at = submitted_at - $2::interval, unknown_since = unknown_since - $2::interval WHERE id = $1`,
			`ALTER TABLE reconciler.receipts ENABLE TRIGGER USER`,
		} {
			var err error
			if strings.Contains(q, "$1") {
				_, err = tx.Exec(ctx, q, id, age.String())
			} else {
				_, err = tx.Exec(ctx, q)
			}
			if err != nil {
				return err
			}
		}
		return nil
	}))
}

// scriptDBVal checks a value in the database; with -wait it waits, up to
// 20 s, for the value to become WANT (a daemon's work).
func scriptDBVal(ts *testscript.TestScript, neg bool, args []string) {
	db := dbOf(ts)
	pool := db.owner
	if len(args) > 2 && args[0] == "-db" {
		pool = pgtest.Pool(db.tb, args[1])
		args = args[2:]
	}
	wait := len(args) > 0 && args[0] == "-wait"
	if wait {
		args = args[1:]
	}
	if len(args) != 2 || (wait && neg) {
		ts.Fatalf("usage: dbval [-db URL] [-wait] QUERY WANT")
	}
	ctx := context.Background()
	read := func() string {
		var got *string
		ts.Check(pool.QueryRow(ctx, `SELECT (`+args[0]+`)::text`).Scan(&got))
		if got == nil {
			return "NULL"
		}
		return *got
	}
	got := read()
	if wait {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for deadline := time.After(20 * time.Second); got != args[1]; got = read() {
			select {
			case <-deadline:
				ts.Fatalf("%s is still %q after 20 s; want %q", args[0], got, args[1])
			case <-tick.C:
			}
		}
	}
	if (got == args[1]) == neg {
		ts.Fatalf("%s is %q; want %s%q", args[0], got, map[bool]string{true: "not "}[neg], args[1])
	}
}

func scriptEmptyDB(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: emptydb VAR")
	}
	ts.Setenv(args[0], pgtest.NewEmptyDatabase(dbOf(ts).tb))
}
