package integration

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/migrations"
)

// Issue 9, item 5: the database crashes (an immediate shutdown of the
// test's own throwaway cluster) while `reconciler run` works a backlog of
// 1,500 receipts, stays down a few seconds, and comes back on the same
// address. The daemon stays up and recovers by itself: /readyz answers 503
// while the database is gone and 200 once it is back, and every receipt
// settles exactly once with the API's verdict: nothing lost (outcomes
// whose write failed are kept and written), nothing doubled.
func testDatabaseRestart(t *testing.T, bin string) {
	const backlog = 1500
	seed := faultSeed(t, 11)
	cluster, db := ownCluster(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 1))
	api := newTruthAPI(t, seed, truthFaults{latency: 20 * time.Millisecond})
	truth := seedTruth(t, db, api, rng, backlog, 0.5)
	adapters := truthAdapters(t, api.srv.URL, "rate: .inf\nconcurrency: 4")
	metrics := freeAddr(t)
	readyz := "http://" + metrics + "/readyz"
	d := startDaemon(t, bin, cluster.URL, "--adapters", adapters, "--instance", "survivor",
		"--metrics-addr", metrics, "--log-level", "warn")
	waitFor(t, time.Minute, "the daemon ready, a third settled", func() (bool, string) {
		n := unsettled(t, db, truth)
		return httpStatus(readyz) == 200 && n <= backlog*2/3, strconv.Itoa(n) + " unsettled"
	})

	if err := cluster.Pause(); err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	waitFor(t, 30*time.Second, "/readyz to say 503", func() (bool, string) {
		s := httpStatus(readyz)
		return s == 503, "status " + strconv.Itoa(s)
	})
	// The outage lasts a few seconds past the moment /readyz reports it,
	// so claims, lease renewals and completions all fail meanwhile.
	time.Sleep(3 * time.Second)
	if exited, err := d.exited(); exited {
		t.Fatalf("the daemon exited during the outage: %v; stderr:\n%s", err, d.stderr.String())
	}
	if err := cluster.Resume(); err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	waitFor(t, time.Minute, "/readyz to say 200 again", func() (bool, string) {
		s := httpStatus(readyz)
		return s == 200, "status " + strconv.Itoa(s)
	})
	ready := time.Since(up)
	waitSettled(t, db, truth, 3*time.Minute)
	settled := time.Since(up)
	if err, _ := d.stop(t, 30*time.Second); err != nil {
		t.Fatalf("the daemon exited with %v; stderr:\n%s", err, d.stderr.String())
	}
	_, v := verifyNoReview(t, db, truth, "")
	var leased int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE lease_owner IS NOT NULL`).Scan(&leased); err != nil || leased != 0 {
		t.Fatalf("%d rows left leased (%v)", leased, err)
	}
	t.Logf("%d receipts; database down %s; /readyz 200 again %s after it was back, every receipt settled %s after; "+
		"succeeded=%d safe_to_retry=%d manual_review=0, 0 false verdicts; kept outcomes logged: %v",
		backlog, up.Sub(down).Round(100*time.Millisecond), ready.Round(10*time.Millisecond),
		settled.Round(100*time.Millisecond), v.succeeded, v.safeToRetry,
		strings.Contains(d.stderr.String(), "outcomes kept until the database answers"))
}

// ownCluster starts a throwaway cluster of the test's own, which the test
// may crash and restart (Pause, Resume), and returns it with a pool on its
// migrated postgres database; both go at the test's end.
func ownCluster(t *testing.T) (*pgcluster.Cluster, *pgxpool.Pool) {
	t.Helper()
	cluster, err := pgcluster.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cluster.Stop() })
	db, err := pgxpool.New(context.Background(), cluster.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if err := migrations.Up(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	return cluster, db
}
