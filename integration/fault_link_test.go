package integration

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// Issue 9, item 5: a flaky link between the daemon and the API, made by
// Toxiproxy in-process: every connection gets 50 ms (±25) of latency, a
// fifth of them are reset once the API's answer starts (the request was
// written and served), a twentieth are blackholed (nothing comes back; the
// adapter's 2 s timeout ends the read), and for 3 s in the middle every
// connection is blackholed. Every receipt settles with the API's verdict,
// none in manual_review.
func testFlakyLink(t *testing.T, bin string) {
	const backlog = 400
	seed := faultSeed(t, 17)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	rng := rand.New(rand.NewPCG(seed, 1))
	api := newTruthAPI(t, seed, truthFaults{})
	truth := seedTruth(t, db, api, rng, backlog, 0.5)

	proxies := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	link := toxiproxy.NewProxy(proxies, "truth-api", "127.0.0.1:0", strings.TrimPrefix(api.srv.URL, "http://"))
	if err := link.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(link.Stop)
	toxic := func(name, typ, stream string, toxicity float64, attrs string) {
		t.Helper()
		body := fmt.Sprintf(`{"name": %q, "type": %q, "stream": %q, "toxicity": %g, "attributes": %s}`,
			name, typ, stream, toxicity, attrs)
		if _, err := link.Toxics.AddToxicJson(strings.NewReader(body)); err != nil {
			t.Fatalf("toxic %s: %v", name, err)
		}
	}
	toxic("latency", "latency", "downstream", 1, `{"latency": 50, "jitter": 25}`)
	toxic("reset", "reset_peer", "downstream", 0.2, `{"timeout": 0}`)
	toxic("blackhole", "timeout", "downstream", 0.05, `{"timeout": 0}`)

	adapters := truthAdapters(t, "http://"+link.Listen, "rate: .inf")
	start := time.Now()
	d := startDaemon(t, bin, url, "--adapters", adapters, "--instance", "flaky", "--log-level", "warn")
	waitFor(t, time.Minute, "a quarter settled", func() (bool, string) {
		n := unsettled(t, db, truth)
		return n <= backlog*3/4, fmt.Sprint(n, " unsettled")
	})
	toxic("blackout", "timeout", "downstream", 1, `{"timeout": 0}`)
	time.Sleep(3 * time.Second) // the blackout's length
	if err := link.Toxics.RemoveToxic(t.Context(), "blackout"); err != nil {
		t.Fatal(err)
	}
	waitSettled(t, db, truth, 3*time.Minute)
	took := time.Since(start)
	if err, _ := d.stop(t, 30*time.Second); err != nil {
		t.Fatalf("the daemon exited with %v; stderr:\n%s", err, d.stderr.String())
	}
	_, v := verifyNoReview(t, db, truth, "")
	t.Logf("%d receipts settled in %s through the flaky link: succeeded=%d safe_to_retry=%d manual_review=0, 0 false verdicts; "+
		"API reads %d, readback_checks %d", backlog, took.Round(100*time.Millisecond), v.succeeded, v.safeToRetry,
		api.reads.Load(), recordedChecks(t, db, truth))
}
