package integration

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// A permanent refusal of one row (here a trigger's plain RAISE, SQLSTATE
// P0001, for one receipt's settlement) used to be kept and retried forever:
// the whole batch stayed leased, renewed by the heartbeat, and the claims
// stopped behind it. Now the other rows of the batch settle, the refused
// row is released (a check error recorded, its next check a minute away,
// not in a hot loop), an ERROR names it with its SQLSTATE and verdict, the
// refusal is counted, and the worker goes on claiming other rows.
func TestRefusedRowDoesNotHoldItsBatch(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 5, "things.create", "static-api", "outcome_unknown")
	bad := ids[2]
	if _, err := db.Exec(ctx, fmt.Sprintf(`
		CREATE FUNCTION public.refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'receipt %% may not settle (test)', NEW.id; END $$;
		CREATE TRIGGER refuse_one BEFORE UPDATE ON reconciler.receipts FOR EACH ROW
		WHEN (NEW.state = 'succeeded' AND NEW.id = %d) EXECUTE FUNCTION public.refuse_one()`, bad)); err != nil {
		t.Fatal(err)
	}
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api", Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	reg := prometheus.NewRegistry()
	logs := &testkit.LogBuffer{}
	clk := newClock()
	pool := newPool(t, db, reconcile.Config{Instance: "refusing", Registry: registry(t, nil, shortPolicy(), present),
		Now: clk.Now, Metrics: reconcile.NewMetrics(reg), PollInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	stop := runPool(t, pool)

	settled := func(ids []int64) bool {
		for _, id := range ids {
			if receipt(t, db, id).State != "succeeded" {
				return false
			}
		}
		return true
	}
	good := []int64{ids[0], ids[1], ids[3], ids[4]}
	waitUntil(t, "the other rows settled and the refused one released", func() bool {
		return settled(good) && receipt(t, db, bad).LeaseOwner == "" && receipt(t, db, bad).Checks == 1
	})
	var next time.Time
	if err := db.QueryRow(ctx, `SELECT next_check_at FROM reconciler.receipts WHERE id = $1`, bad).Scan(&next); err != nil {
		t.Fatal(err)
	}
	if r := receipt(t, db, bad); r.State != "reconciling" || next.Before(clk.Now().Add(reconcile.WriteRefusedRetry-time.Second)) {
		t.Fatalf("refused receipt %+v, next check %s: want released, not settled, its next check a minute after its check (%s)",
			r, next, clk.Now())
	}

	// The worker goes on claiming: rows that become due now settle (the
	// clock moves past their creation, not to the refused row's next check).
	more := seed(t, db, 3, "things.create", "static-api", "outcome_unknown")
	clk.Advance(10 * time.Second)
	waitUntil(t, "later rows settled", func() bool { return settled(more) })
	if r := receipt(t, db, bad); r.Checks != 1 || r.LeaseOwner != "" {
		t.Fatalf("refused receipt %+v: want it left alone until its next check", r)
	}
	if err := pool.WritesRefused(); err != nil {
		t.Fatalf("one row's refusal blocks the worker: %v", err)
	}
	sum := stop()
	if sum.Refused != 1 || total(sum.Settled) != 7 || sum.LeaseLost != 0 {
		t.Fatalf("summary %+v, want 7 settled, 1 refused, no lease lost", sum)
	}
	if n := testkit.Metric(t, reg, "reconciler_writes_refused_total", map[string]string{"statement": "complete", "sqlstate_class": "P0"}); n != 1 {
		t.Fatalf(`reconciler_writes_refused_total{statement="complete",sqlstate_class="P0"} = %v, want 1`, n)
	}
	line := testkit.LogLine(t, logs.String(), "outcome refused by the database", bad)
	if line["level"] != "ERROR" || line["sqlstate"] != "P0001" || line["statement"] != "complete" ||
		line["outcome"] != "succeeded" || line["external_id"] != "thing-1" || line["hint"] == nil ||
		!strings.Contains(fmt.Sprint(line["fate"]), "released with a check error") {
		t.Fatalf("log line %v: want an ERROR naming the SQLSTATE, a hint, the fate and the verdict", line)
	}
}

// The split of a refused batch writes row by row, each statement committed
// on its own. A transient failure after one row was given up (released
// with a check error) made the whole batch be tried again, and that retry
// no longer saw the row it had released (no longer leased): its refusal,
// the ERROR with its verdict, and its count were dropped, and the row was
// reported as a lost lease. Here two rows are refused (P0001) and the
// settlement of the second, once the first is released, fails once with a
// serialization failure (40001, transient), whatever order the split takes.
func TestRefusalSurvivesATransientFailureMidSplit(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 2, "things.create", "static-api", "outcome_unknown")
	if _, err := db.Exec(ctx, fmt.Sprintf(`
		CREATE SEQUENCE public.flake_once;
		CREATE FUNCTION public.refuse_two() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF EXISTS (SELECT FROM reconciler.receipts
			           WHERE id IN (%[1]d, %[2]d) AND id <> NEW.id AND lease_owner IS NULL)
			   AND nextval('public.flake_once') = 1 THEN
				RAISE EXCEPTION 'receipt %% hit a serialization failure (test)', NEW.id USING ERRCODE = '40001';
			END IF;
			RAISE EXCEPTION 'receipt %% may not settle (test)', NEW.id;
		END $$;
		CREATE TRIGGER refuse_two BEFORE UPDATE ON reconciler.receipts FOR EACH ROW
		WHEN (NEW.state = 'succeeded' AND NEW.id IN (%[1]d, %[2]d)) EXECUTE FUNCTION public.refuse_two()`,
		ids[0], ids[1])); err != nil {
		t.Fatal(err)
	}
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api", Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	logs := &testkit.LogBuffer{}
	// Both rows are claimed together and, with a long flush interval, their
	// outcomes are written in one batch.
	pool := newPool(t, db, reconcile.Config{Instance: "flaky-split", Registry: registry(t, nil, shortPolicy(), present),
		Now: newClock().Now, FlushInterval: time.Minute, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	sum, err := pool.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var flaked int64
	if err := db.QueryRow(ctx, `SELECT last_value FROM public.flake_once`).Scan(&flaked); err != nil {
		t.Fatal(err)
	}
	if flaked < 1 {
		t.Fatal("the transient failure was never raised: the test did not exercise the split")
	}
	if sum.Refused != 2 || sum.LeaseLost != 0 || total(sum.Settled) != 0 {
		t.Fatalf("summary %+v, want 2 refused, none settled, no lease lost", sum)
	}
	for _, id := range ids {
		if r := receipt(t, db, id); r.State != "reconciling" || r.LeaseOwner != "" || r.Checks != 1 {
			t.Fatalf("receipt %d: %+v, want released with its check error counted", id, r)
		}
		line := testkit.LogLine(t, logs.String(), "outcome refused by the database", id)
		if line["level"] != "ERROR" || line["sqlstate"] != "P0001" || line["external_id"] != "thing-1" {
			t.Fatalf("log line %v: want an ERROR naming the SQLSTATE and the verdict", line)
		}
	}
}

// A receipt whose claim the database refuses for its own sake (here a
// trigger's RAISE on its move into reconciling) used to stop every claim:
// the claim takes rows in due order, so each one included it and failed
// alike, forever. Now the claim's candidates are claimed apart, the
// refused receipt is reported (an ERROR with its SQLSTATE, the count) and
// left out of claims for a while, untouched, and every other row settles.
func TestRefusedClaimDoesNotStopTheOthers(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 6, "things.create", "static-api", "outcome_unknown")
	// The earliest due, so every claim of the batch includes it.
	bad := ids[0]
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET next_check_at = next_check_at - interval '1 hour' WHERE id = $1`, bad); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, fmt.Sprintf(`
		CREATE FUNCTION public.refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'receipt %% may not be claimed (test)', NEW.id; END $$;
		CREATE TRIGGER refuse_claim BEFORE UPDATE ON reconciler.receipts FOR EACH ROW
		WHEN (NEW.state = 'reconciling' AND OLD.state = 'outcome_unknown' AND NEW.id = %d)
		EXECUTE FUNCTION public.refuse_claim()`, bad)); err != nil {
		t.Fatal(err)
	}
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api", Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	drain := func(name string) (reconcile.Summary, *prometheus.Registry, string) {
		reg := prometheus.NewRegistry()
		logs := &testkit.LogBuffer{}
		pool := newPool(t, db, reconcile.Config{Instance: name, Registry: registry(t, nil, shortPolicy(), present),
			Metrics: reconcile.NewMetrics(reg), Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		sum, err := pool.Drain(dctx)
		if err != nil {
			t.Fatalf("drain %s: %v", name, err)
		}
		return sum, reg, logs.String()
	}

	sum, reg, logs := drain("refused-claim")
	for _, id := range ids[1:] {
		if r := receipt(t, db, id); r.State != "succeeded" {
			t.Fatalf("receipt %d is %s: a receipt whose claim is refused stopped the others", id, r.State)
		}
	}
	if r := receipt(t, db, bad); r.State != "outcome_unknown" || r.LeaseOwner != "" {
		t.Fatalf("refused receipt %+v: want it untouched", r)
	}
	if sum.Refused != 1 || total(sum.Settled) != 5 {
		t.Fatalf("summary %+v, want 5 settled and 1 refused", sum)
	}
	if n := testkit.Metric(t, reg, "reconciler_writes_refused_total", map[string]string{"statement": "claim", "sqlstate_class": "P0"}); n != 1 {
		t.Fatalf(`reconciler_writes_refused_total{statement="claim",sqlstate_class="P0"} = %v, want 1 (refused once, then left out)`, n)
	}
	line := testkit.LogLine(t, logs, "claim refused by the database; the receipt is left out of claims for a while", bad)
	if line["level"] != "ERROR" || line["sqlstate"] != "P0001" || line["hint"] == nil || line["retry_at"] == nil {
		t.Fatalf("log line %v: want an ERROR naming the SQLSTATE, a hint and when it is tried again", line)
	}

	// Once the refusal is gone, the receipt is claimed and settled like any.
	if _, err := db.Exec(ctx, `DROP TRIGGER refuse_claim ON reconciler.receipts`); err != nil {
		t.Fatal(err)
	}
	if sum, _, _ := drain("after-the-fix"); sum.Refused != 0 || receipt(t, db, bad).State != "succeeded" {
		t.Fatalf("after the trigger was dropped: summary %+v, receipt %+v; want it settled", sum, receipt(t, db, bad))
	}
}

// refuseClaims makes the database refuse the claim (the move from
// outcome_unknown into reconciling) of the receipts where is true for, as
// a trigger's RAISE (P0001).
func refuseClaims(t *testing.T, db *pgxpool.Pool, where string) {
	t.Helper()
	if _, err := db.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION public.refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'receipt %% may not be claimed (test)', NEW.id; END $$;
		CREATE TRIGGER refuse_claim BEFORE UPDATE ON reconciler.receipts FOR EACH ROW
		WHEN (NEW.state = 'reconciling' AND OLD.state = 'outcome_unknown' AND (%s))
		EXECUTE FUNCTION public.refuse_claim()`, where)); err != nil {
		t.Fatal(err)
	}
}

// A drain ended as soon as a claim brought no row, even when that was only
// because every candidate of the claim was refused and left out: with a
// claim of one row (or as many refused receipts as the claim takes) at the
// head of the due order, the rows behind them were never claimed.
func TestDrainGoesOnPastRefusedClaims(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	ids := seed(t, db, 4, "things.create", "static-api", "outcome_unknown")
	bad := ids[:2]
	if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET next_check_at = next_check_at - interval '1 hour' WHERE id = ANY($1)`, bad); err != nil {
		t.Fatal(err)
	}
	refuseClaims(t, db, fmt.Sprintf("NEW.id IN (%d, %d)", bad[0], bad[1]))
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api", Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	pool := newPool(t, db, reconcile.Config{Instance: "drain-past-refused", Registry: registry(t, nil, shortPolicy(), present),
		Workers: 1, BatchSize: 1})
	dctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	sum, err := pool.Drain(dctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids[2:] {
		if r := receipt(t, db, id); r.State != "succeeded" {
			t.Fatalf("receipt %d is %s after the drain (summary %+v): the drain stopped at the refused claims", id, r.State, sum)
		}
	}
	if sum.Refused != 2 || total(sum.Settled) != 2 {
		t.Fatalf("summary %+v, want 2 settled and 2 refused", sum)
	}
}

// A refusal of every claim (a trigger that refuses the move into
// reconciling for every receipt, a refusal that is the statement's in all
// but its SQLSTATE) made the pool claim every due row apart, log and
// count each, and remember each in a set without bound, sent back with
// every claim: a million due receipts, a million statements and a million
// ids per claim. At most MaxUnclaimable receipts are left out; past that
// the claim's refusal is the claim's, as before: the drain stops with it.
func TestRefusingEveryClaimIsBounded(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	seed(t, db, reconcile.MaxUnclaimable+100, "things.create", "static-api", "outcome_unknown")
	refuseClaims(t, db, "true")
	present := readback.Binding{Name: "static", Kind: readback.Create, Dependency: "static-api", Policy: shortPolicy(),
		Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-1", Authoritative: true}}
	reg := prometheus.NewRegistry()
	pool := newPool(t, db, reconcile.Config{Instance: "refuse-all", Registry: registry(t, nil, shortPolicy(), present),
		Metrics: reconcile.NewMetrics(reg), PollInterval: 50 * time.Millisecond})
	dctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	sum, err := pool.Drain(dctx)
	if err == nil || !strings.Contains(err.Error(), "may not be claimed") {
		t.Fatalf("drain: %v (summary %+v), want the claim's refusal", err, sum)
	}
	if sum.Refused > reconcile.MaxUnclaimable || total(sum.Settled) != 0 || sum.Claimed != 0 {
		t.Fatalf("summary %+v: want at most %d receipts refused and left out, none claimed", sum, reconcile.MaxUnclaimable)
	}
	if n := testkit.Metric(t, reg, "reconciler_writes_refused_total", map[string]string{"statement": "claim"}); n > reconcile.MaxUnclaimable {
		t.Fatalf(`reconciler_writes_refused_total{statement="claim"} = %v, want at most %d`, n, reconcile.MaxUnclaimable)
	}
}
