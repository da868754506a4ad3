package rolestest

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// A worker role missing a grant (INSERT on readback_checks revoked, as a
// hand-edited role could be) makes every outcome's write fail with
// SQLSTATE 42501. Such outcomes used to be kept and retried forever: their
// rows stayed leased and the worker stopped claiming. Now each row is
// released with its next check a minute away (its check's record refused,
// it is logged with its verdict instead), an ERROR says which grant is
// missing, the refusals are counted, the pool reports its writes refused
// (/readyz) and claims one row at a time after a growing pause; once the
// grant is back (docs/roles.sql applied again) every receipt settles, each
// with its one recorded check.
func TestWorkerMissingAGrant(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for i := range 3 {
		ids = append(ids, unknown(t, agent, "g:"+strconv.Itoa(i), "static-api").ID)
	}
	if _, err := e.owner.Exec(ctx, `REVOKE INSERT ON reconciler.readback_checks FROM reconciler_worker`); err != nil {
		t.Fatal(err)
	}
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api",
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true},
		Policy:  readback.DefaultPolicy()}); err != nil {
		t.Fatal(err)
	}
	clk := testkit.NewClock(time.Now())
	logs := &testkit.LogBuffer{}
	prom := prometheus.NewRegistry()
	pool, err := reconcile.New(e.worker, reconcile.Config{Instance: workerID, Registry: reg, Now: clk.Now,
		PollInterval: 20 * time.Millisecond, Metrics: reconcile.NewMetrics(prom),
		Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan reconcile.Summary, 1)
	go func() {
		sum, err := pool.Run(runCtx)
		if err != nil {
			t.Errorf("run: %v", err)
		}
		done <- sum
	}()
	var stopOnce sync.Once
	var sum reconcile.Summary
	stop := func() reconcile.Summary {
		stopOnce.Do(func() { cancel(); sum = <-done })
		return sum
	}
	defer stop()

	// released reports whether every receipt of ids waits, unleased, for a
	// next check at least a minute after the clock's now (minus slack).
	released := func(ids []int64) bool {
		var n int
		if err := e.owner.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE id = ANY($1)
			AND state = 'reconciling' AND lease_owner IS NULL AND next_check_at >= $2`,
			ids, clk.Now().Add(reconcile.WriteRefusedRetry-5*time.Second)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == len(ids)
	}
	testkit.WaitFor(t, "the refused rows released, their next check pushed", func() bool {
		return released(ids) && pool.WritesRefused() != nil
	})
	err = pool.WritesRefused()
	if !errors.Is(err, reconcile.ErrWritesRefused) || !strings.Contains(err.Error(), "42501") ||
		!strings.Contains(err.Error(), "docs/roles.sql") {
		t.Fatalf("WritesRefused = %v, want ErrWritesRefused naming 42501 and docs/roles.sql", err)
	}
	if v := testkit.Metric(t, prom, "reconciler_writes_blocked", nil); v != 1 {
		t.Fatalf("reconciler_writes_blocked = %v, want 1", v)
	}
	if v := testkit.Metric(t, prom, "reconciler_writes_refused_total", map[string]string{"statement": "complete", "sqlstate_class": "42"}); v != 3 {
		t.Fatalf(`reconciler_writes_refused_total{statement="complete",sqlstate_class="42"} = %v, want 3`, v)
	}
	for _, id := range ids {
		l := testkit.LogLine(t, logs.String(), "outcome refused by the database", id)
		if l["level"] != "ERROR" || l["sqlstate"] != "42501" || !strings.Contains(l["hint"].(string), "docs/roles.sql") ||
			l["outcome"] != "succeeded" || l["check_verdict"] != "present" || l["external_id"] != "thing-1" {
			t.Fatalf("log line %v: want an ERROR with the SQLSTATE, the grant to add and the verdict", l)
		}
	}

	// Blocked, the pool probes with one row per claim. A statement trigger
	// records how many rows each claim leased.
	if _, err := e.owner.Exec(ctx, `
		CREATE TABLE public.claims (at timestamptz DEFAULT clock_timestamp(), n bigint);
		CREATE FUNCTION public.count_claims() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
		BEGIN
		    INSERT INTO public.claims (n)
		    SELECT count(*) FROM n JOIN o USING (id)
		    WHERE o.lease_owner IS NULL AND n.lease_owner IS NOT NULL HAVING count(*) > 0;
		    RETURN NULL;
		END $$;
		CREATE TRIGGER count_claims AFTER UPDATE ON reconciler.receipts
		    REFERENCING OLD TABLE AS o NEW TABLE AS n
		    FOR EACH STATEMENT EXECUTE FUNCTION public.count_claims()`); err != nil {
		t.Fatal(err)
	}
	more := []int64{unknown(t, agent, "g:3", "static-api").ID, unknown(t, agent, "g:4", "static-api").ID}
	clk.Advance(10 * time.Second) // past the new rows' creation, short of the refused rows' next check
	testkit.WaitFor(t, "the new rows refused and released too", func() bool { return released(more) })
	var claims []int64
	if err := e.owner.QueryRow(ctx, `SELECT coalesce(array_agg(n ORDER BY at), '{}') FROM public.claims`).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	if len(claims) != 2 || claims[0] != 1 || claims[1] != 1 {
		t.Fatalf("claims while the writes are refused leased %v rows: want one row per claim", claims)
	}

	// The operator applies docs/roles.sql again: the grant is back.
	roles, err := os.ReadFile(rolesFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.owner.Exec(ctx, string(roles)); err != nil {
		t.Fatal(err)
	}
	clk.Advance(2 * reconcile.WriteRefusedRetry)
	all := append(append([]int64{}, ids...), more...)
	testkit.WaitFor(t, "every receipt settled once the grant is back", func() bool {
		var n int
		if err := e.owner.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE id = ANY($1) AND state = 'succeeded'`,
			all).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == len(all)
	})
	if err := pool.WritesRefused(); err != nil {
		t.Fatalf("WritesRefused after the grant is back: %v", err)
	}
	if v := testkit.Metric(t, prom, "reconciler_writes_blocked", nil); v != 0 {
		t.Fatalf("reconciler_writes_blocked = %v after the grant is back, want 0", v)
	}
	var odd int
	if err := e.owner.QueryRow(ctx, `SELECT count(*) FROM unnest($1::bigint[]) AS u(id)
		WHERE (SELECT count(*) FROM reconciler.readback_checks c WHERE c.receipt_id = u.id) <> 1`, all).Scan(&odd); err != nil {
		t.Fatal(err)
	}
	if odd != 0 {
		t.Fatalf("%d receipts without exactly one recorded check", odd)
	}
	if sum := stop(); sum.Refused != 5 || sum.Settled["succeeded"] != 5 || sum.LeaseLost != 0 {
		t.Fatalf("summary %+v, want 5 refused then 5 settled, no lease lost", sum)
	}
}

// A drain (`run --once`, from cron) whose outcomes the database refuses as
// such stops claiming after the first refused batch and ends with an error
// matching ErrWritesRefused (its exit status says so), its rows released.
func TestDrainEndsWhenWritesAreRefused(t *testing.T) {
	ctx := context.Background()
	e := setup(t)
	agent, err := ledger.New(e.agent, agentID)
	if err != nil {
		t.Fatal(err)
	}
	id := unknown(t, agent, "d:0", "static-api").ID
	if _, err := e.owner.Exec(ctx, `REVOKE INSERT ON reconciler.readback_checks FROM reconciler_worker`); err != nil {
		t.Fatal(err)
	}
	reg := readback.NewRegistry()
	if err := reg.Register(readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api",
		Adapter: readback.Static{Verdict: readback.VerdictPresent, Authoritative: true}, Policy: readback.DefaultPolicy()}); err != nil {
		t.Fatal(err)
	}
	pool, err := reconcile.New(e.worker, reconcile.Config{Instance: workerID, Registry: reg, Now: time.Now})
	if err != nil {
		t.Fatal(err)
	}
	sum, err := pool.Drain(ctx)
	if !errors.Is(err, reconcile.ErrWritesRefused) || !strings.Contains(err.Error(), "42501") {
		t.Fatalf("drain: %v, want ErrWritesRefused naming 42501", err)
	}
	if sum.Claimed != 1 || sum.Refused != 1 || sum.Waiting != 1 {
		t.Fatalf("summary %+v, want the one row claimed, refused and released", sum)
	}
	var leased bool
	if err := e.owner.QueryRow(ctx, `SELECT lease_owner IS NOT NULL FROM reconciler.receipts WHERE id = $1`, id).Scan(&leased); err != nil || leased {
		t.Fatalf("receipt %d still leased (%v) after the drain", id, err)
	}
}
