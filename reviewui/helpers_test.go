package reviewui

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"net/url"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/statemachine"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// rolesFile is docs/roles.sql, applied to each test's database so the page
// runs under a login of the role it is meant for.
const rolesFile = "../docs/roles.sql"

// ledgerEnv is one fresh database with docs/roles.sql applied.
type ledgerEnv struct {
	url   string
	owner *pgxpool.Pool
	agent *ledger.Client
	n     int
}

func newLedger(t testing.TB) *ledgerEnv {
	t.Helper()
	ctx := context.Background()
	dbURL := pgtest.NewDatabase(t)
	owner := pgtest.Pool(t, dbURL)
	sql, err := os.ReadFile(rolesFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(ctx, string(sql)); err != nil {
		t.Fatalf("apply %s: %v", rolesFile, err)
	}
	agent, err := ledger.New(owner, "agent:billing")
	if err != nil {
		t.Fatal(err)
	}
	if agent, err = agent.WithSecretKey("k1", []byte("0123456789abcdef0123456789abcdef")); err != nil {
		t.Fatal(err)
	}
	return &ledgerEnv{url: dbURL, owner: owner, agent: agent}
}

// login creates a login in group (unique per run: roles are server-wide),
// dropped when the test ends, and returns a pool connected as it.
func (e *ledgerEnv) login(t testing.TB, group string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name, pw := "ui_"+hex.EncodeToString(b), hex.EncodeToString(b)+"pw"
	if _, err := e.owner.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD '%s' IN ROLE %s`,
		pgx.Identifier{name}.Sanitize(), pw, pgx.Identifier{group}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		id := pgx.Identifier{name}.Sanitize()
		for _, q := range []string{`DROP OWNED BY ` + id, `DROP ROLE ` + id} {
			if _, err := e.owner.Exec(ctx, q); err != nil {
				t.Errorf("cleanup %s: %v", q, err)
			}
		}
	})
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(name, pw)
	return pgtest.Pool(t, u.String())
}

// held plans a receipt, sends it, loses its answer and holds it for review
// as a reconciler would, with reason and evidence; it returns its id.
func (e *ledgerEnv) held(t *testing.T, op, dep, reason string, evidence any, payload string, secret ...string) int64 {
	t.Helper()
	ctx := context.Background()
	e.n++
	r, err := e.agent.Plan(ctx, ledger.Intent{IdempotencyKey: ledger.Key(t.Name(), fmt.Sprint(e.n), op),
		Operation: op, Dependency: dep, Method: "POST", Target: "/v1/" + dep,
		Payload: json.RawMessage(payload), Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	if r, err = e.agent.Submit(ctx, r); err != nil {
		t.Fatal(err)
	}
	if r, err = e.agent.MarkUnknown(ctx, r, ledger.Detail{Error: &ledger.CallError{Code: "timeout"}}); err != nil {
		t.Fatal(err)
	}
	rc, err := ledger.New(e.owner, "reconciler:r1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown,
		To: statemachine.ManualReview, Detail: ledger.Detail{Reason: reason, Evidence: evidence}}); err != nil {
		t.Fatal(err)
	}
	return r.ID
}

// check records a readback check of receipt id, as the reconciler's worker
// writes one.
func (e *ledgerEnv) check(t *testing.T, id int64, verdict string, latencyUS int64, evidence any) {
	t.Helper()
	ev, err := json.Marshal(evidence)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.owner.Exec(context.Background(), `INSERT INTO reconciler.readback_checks
		(receipt_id, check_no, at, instance, adapter, dependency, verdict, latency_us, evidence)
		VALUES ($1, 1, now(), 'r1', 'payments-http', 'payments', $2, $3, $4)`, id, verdict, latencyUS, ev); err != nil {
		t.Fatal(err)
	}
}

// state returns receipt id's state and the number of moves humans made.
func (e *ledgerEnv) state(t *testing.T, id int64) (statemachine.State, int) {
	t.Helper()
	var s string
	var humans int
	if err := e.owner.QueryRow(context.Background(), `SELECT r.state,
		(SELECT count(*) FROM reconciler.receipt_events e WHERE e.receipt_id = r.id AND e.actor LIKE 'human:%')
		FROM reconciler.receipts r WHERE r.id = $1`, id).Scan(&s, &humans); err != nil {
		t.Fatal(err)
	}
	return statemachine.State(s), humans
}

// serve runs the page on pool behind a trusted header from loopback.
func serve(t testing.TB, pool *pgxpool.Pool) *httptest.Server {
	t.Helper()
	id, err := NewTrustedHeader("X-Forwarded-User", []string{"127.0.0.1", "::1"})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{Pool: pool, Identifier: id})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	return ts
}
