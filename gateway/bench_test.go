package gateway_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
)

// BenchmarkGateway measures what the gateway adds to a call against a
// local upstream, compared in the same run with calling the upstream
// directly and with the Go ledger client (Caller.Do in process, which
// writes the same receipts): per-call latency (p50, p99) and calls per
// second, with 1 and 8 agents calling at once. Each call is a POST with a
// key of its own, so every one is planned, submitted, sent, settled and
// (through the gateway) its response kept. added_* is the gateway over the
// direct call; over_do_* is the gateway over Caller.Do, the cost of the
// proxy itself beyond the ledger's writes.
//
//	go test ./gateway -run '^$' -bench Gateway -benchtime 2000x
func BenchmarkGateway(b *testing.B) {
	for _, agents := range []int{1, 8} {
		b.Run("agents="+strconv.Itoa(agents), func(b *testing.B) { benchGateway(b, agents) })
	}
}

func benchGateway(b *testing.B, agents int) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"art-1","status":"published"}`)
	}))
	defer up.Close()
	db := pgtest.NewPool(b)
	cfg, err := gateway.ParseConfig("routes.yaml", []byte(routesFile(up.URL, "")), testEnv)
	if err != nil {
		b.Fatal(err)
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		b.Fatal(err)
	}
	gw := httptest.NewServer(gateway.New(client, cfg, gateway.Options{}))
	defer gw.Close()
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	var seq atomic.Int64
	caller := &ledger.Caller{Ledger: client, HTTP: hc}
	call := func(url string, via path) error {
		n := seq.Add(1)
		key := "bench:" + strconv.FormatInt(n, 10) + ":articles.create"
		body := `{"title":"bench ` + strconv.FormatInt(n, 10) + `"}`
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if via == viaDo {
			_, err := caller.Do(context.Background(), ledger.Intent{IdempotencyKey: key, Operation: "articles.create",
				Dependency: "blog-api", Payload: []byte(body)}, req)
			return err
		}
		if via == viaGateway {
			req.Header.Set("Authorization", "Bearer "+tokenA)
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			return fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		return nil
	}
	measure := func(url string, via path) (lat []time.Duration, perSecond float64) {
		lat = make([]time.Duration, b.N)
		var next atomic.Int64
		var wg sync.WaitGroup
		var failed atomic.Value
		start := time.Now()
		for range agents {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if i >= int64(b.N) {
						return
					}
					t0 := time.Now()
					if err := call(url, via); err != nil {
						failed.Store(err)
						return
					}
					lat[i] = time.Since(t0)
				}
			}()
		}
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		return lat, float64(b.N) / time.Since(start).Seconds()
	}
	// Warm both paths (connections, the ledger's prepared statements).
	for range 20 {
		for _, w := range []struct {
			url string
			via path
		}{{up.URL + "/api/articles", viaDirect}, {up.URL + "/api/articles", viaDo}, {gw.URL + "/blog/articles", viaGateway}} {
			if err := call(w.url, w.via); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ResetTimer()
	direct, directRate := measure(up.URL+"/api/articles", viaDirect)
	do, doRate := measure(up.URL+"/api/articles", viaDo)
	via, viaRate := measure(gw.URL+"/blog/articles", viaGateway)
	b.StopTimer()
	dp50, dp99 := percentile(direct, 50), percentile(direct, 99)
	cp50, cp99 := percentile(do, 50), percentile(do, 99)
	gp50, gp99 := percentile(via, 50), percentile(via, 99)
	b.ReportMetric(float64(gp50-dp50)/1e6, "added_p50_ms")
	b.ReportMetric(float64(gp99-dp99)/1e6, "added_p99_ms")
	b.ReportMetric(float64(gp50-cp50)/1e6, "over_do_p50_ms")
	b.ReportMetric(float64(gp99-cp99)/1e6, "over_do_p99_ms")
	b.ReportMetric(viaRate, "gateway_calls/s")
	b.ReportMetric(doRate, "do_calls/s")
	b.ReportMetric(directRate, "direct_calls/s")
	b.Logf("agents=%d n=%d: direct p50=%v p99=%v %.0f calls/s; Caller.Do p50=%v p99=%v %.0f calls/s; "+
		"gateway p50=%v p99=%v %.0f calls/s; added over direct p50=%v p99=%v; over Caller.Do p50=%v p99=%v",
		agents, b.N, dp50, dp99, directRate, cp50, cp99, doRate, gp50, gp99, viaRate, gp50-dp50, gp99-dp99, gp50-cp50, gp99-cp99)
}

// path is how a benchmarked call reaches the upstream.
type path int

const (
	viaDirect  path = iota // plain HTTP, no ledger
	viaDo                  // the Go ledger client, Caller.Do
	viaGateway             // HTTP through the gateway
)

func percentile(d []time.Duration, p int) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}
