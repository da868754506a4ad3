package httpadapter_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
)

// waits records the in-check retry waits instead of sleeping; the jitter
// draws the backoff ceiling itself, so the waits are deterministic.
type waits struct {
	mu sync.Mutex
	d  []time.Duration
}

func (w *waits) sleep(_ context.Context, d time.Duration) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.d = append(w.d, d)
	return nil
}

func ceilingJitter(c time.Duration) time.Duration { return c }

func loadWith(t *testing.T, file string, w *waits) readback.Adapter {
	t.Helper()
	reg, err := readback.Load("adapters.yaml", strings.NewReader(file), httpadapter.Types(
		httpadapter.WithLookupEnv(env), httpadapter.WithClock(func() time.Time { return testNow }),
		httpadapter.WithRetryWait(w.sleep, ceilingJitter)))
	if err != nil {
		t.Fatal(err)
	}
	b, ok := reg.Lookup("any", "api")
	if !ok {
		t.Fatal("adapter not registered")
	}
	return b.Adapter
}

// thirtyPercent fails 3 requests in 10, two of them in a row, cycling
// through the transient failures an API or a proxy produces.
func thirtyPercent(n int) int {
	switch n % 10 {
	case 1:
		return http.StatusServiceUnavailable
	case 2:
		return http.StatusTooManyRequests // with Retry-After: 0
	case 6:
		return cutBody
	}
	return 0
}

// fakeRetrier is a protect.Retrier that allows allow retries, then
// refuses, and counts the requests reported Sent.
type fakeRetrier struct {
	mu                 sync.Mutex
	allow, asked, sent int
}

func (r *fakeRetrier) Sent() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sent++
}

func (r *fakeRetrier) Retry() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.asked++
	if r.asked > r.allow {
		return &protect.Deferral{Dependency: "api", Reason: protect.ReasonBudgetExhausted}
	}
	return nil
}

// Issue 9, item 1: with 30 % of page requests failing transiently, every
// check still answers, with the verdict the fake's truth dictates, the same
// pages and passes as a clean read (pages read before a failure are kept,
// the pass resumes at the failed page), and the retries in its evidence.
func TestFlakyPagesAreRetriedWithinTheCheck(t *testing.T) {
	for _, pc := range presetCases() {
		for _, ours := range []bool{true, false} {
			name := pc.preset + "/absent"
			if ours {
				name = pc.preset + "/present"
			}
			t.Run(name, func(t *testing.T) {
				extra := pc.extra
				if pc.listAll != "" {
					extra = pc.listAll
				}
				items := others(7)
				if ours {
					items = withOurs(items, 5)
				}
				run := func(flaky func(int) int) (readback.Result, *httpadapter.Evidence, int, *waits, error) {
					f := newFakeAPI(t, pc.preset, token)
					f.add(items...)
					f.flaky = flaky
					w := &waits{}
					a := loadWith(t, adapterFile("create", pc.preset, f.srv.URL, extra), w)
					res, err := a.Check(context.Background(), testReceipt(pc.target))
					uris, _ := f.seen()
					ev, _ := res.Evidence.(*httpadapter.Evidence)
					return res, ev, len(uris), w, err
				}
				clean, cleanEv, cleanReqs, _, err := run(nil)
				if err != nil {
					t.Fatal(err)
				}
				want := readback.VerdictAbsent
				if ours {
					want = readback.VerdictPresent
				}
				if clean.Verdict != want || !clean.Authoritative {
					t.Fatalf("clean read: %+v %+v, want an authoritative %s", clean, cleanEv, want)
				}

				res, ev, reqs, w, err := run(thirtyPercent)
				if err != nil {
					t.Fatalf("check failed under 30%% transient failures: %v", err)
				}
				if res.Verdict != clean.Verdict || res.Authoritative != clean.Authoritative ||
					strings.Join(res.ExternalIDs, ",") != strings.Join(clean.ExternalIDs, ",") {
					t.Fatalf("flaky read %+v, clean read %+v", res, clean)
				}
				if ev.Pages != cleanEv.Pages || ev.Passes != cleanEv.Passes || ev.Confirmation != cleanEv.Confirmation {
					t.Fatalf("flaky read: %d pages, %d passes, %q; clean: %d, %d, %q",
						ev.Pages, ev.Passes, ev.Confirmation, cleanEv.Pages, cleanEv.Passes, cleanEv.Confirmation)
				}
				if ev.PageRetries == 0 || ev.PageRetries != len(ev.Retries) || reqs != cleanReqs+ev.PageRetries {
					t.Fatalf("%d retries (%+v), %d requests against %d clean", ev.PageRetries, ev.Retries, reqs, cleanReqs)
				}
				if len(w.d) != ev.PageRetries {
					t.Fatalf("%d waits for %d retries", len(w.d), ev.PageRetries)
				}
				for i, r := range ev.Retries {
					if r.Page < 1 || r.Pass < 1 || r.Cause == "" || r.WaitMS > 1000 {
						t.Fatalf("retry %d: %+v", i, r)
					}
				}
			})
		}
	}
}

func TestInCheckRetryBounds(t *testing.T) {
	always := func(status int) func(int) int { return func(int) int { return status } }
	tests := []struct {
		name     string
		extra    string
		flaky    func(int) int
		ctx      func() (context.Context, context.CancelFunc)
		gate     *fakeRetrier
		requests int
		waits    []time.Duration
		wantErr  string
		minWait  time.Duration
	}{
		{name: "hard down: two retries, then the check fails transiently",
			flaky: always(http.StatusServiceUnavailable), requests: 3,
			waits: []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}, wantErr: "after 2 in-check retries"},
		{name: "configured attempts and backoff", extra: "retry: {attempts: 3, initial: 50ms, max: 120ms}",
			flaky: always(http.StatusBadGateway), requests: 4,
			waits: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 120 * time.Millisecond}, wantErr: "after 3 in-check retries"},
		{name: "retries off", extra: "retry: {attempts: 0}", flaky: always(http.StatusServiceUnavailable), requests: 1},
		{name: "a long Retry-After is left to the reconciler", flaky: func(int) int { return 0 },
			requests: 1, minWait: 5 * time.Second},
		{name: "the retry budget refuses", flaky: always(http.StatusServiceUnavailable),
			gate: &fakeRetrier{allow: 1}, requests: 2, waits: []time.Duration{100 * time.Millisecond},
			wantErr: "the dependency refused a retry (budget_exhausted)"},
		{name: "the check's deadline leaves no time", flaky: always(http.StatusServiceUnavailable), requests: 1,
			ctx: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 150*time.Millisecond)
			}},
		{name: "permanent failures are not retried", flaky: always(http.StatusUnauthorized), requests: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.add(others(5)...)
			f.flaky = tc.flaky
			if tc.minWait > 0 {
				f.fail(http.StatusTooManyRequests, http.Header{"Retry-After": {"5"}})
			}
			w := &waits{}
			a := loadWith(t, adapterFile("create", "rest", f.srv.URL, tc.extra), w)
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if tc.ctx != nil {
				ctx, cancel = tc.ctx()
			}
			defer cancel()
			if tc.gate != nil {
				ctx = protect.WithRetrier(ctx, tc.gate)
			}
			_, err := a.Check(ctx, testReceipt("/items"))
			class, wait := readback.Classify(err)
			if err == nil || class != readback.Transient && tc.name != "permanent failures are not retried" {
				t.Fatalf("got %v (%s), want a failed check", err, class)
			}
			if uris, _ := f.seen(); len(uris) != tc.requests {
				t.Fatalf("%d requests, want %d: %v", len(uris), tc.requests, err)
			}
			if len(w.d) != len(tc.waits) {
				t.Fatalf("waits %v, want %v", w.d, tc.waits)
			}
			for i := range w.d {
				if w.d[i] != tc.waits[i] {
					t.Fatalf("waits %v, want %v", w.d, tc.waits)
				}
			}
			if tc.wantErr != "" && !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %q does not say %q", err, tc.wantErr)
			}
			if wait < tc.minWait {
				t.Fatalf("Retry-After %v lost, want at least %v", wait, tc.minWait)
			}
		})
	}
}

// A real protect.Permit in the context: the adapter's retries are charged
// to the dependency's retry budget and counted on the permit.
func TestInCheckRetriesAreChargedToTheGuard(t *testing.T) {
	g, err := protect.New(protect.NewMemStore(), protect.DefaultConfig(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := newFakeAPI(t, "rest", token)
	f.add(withOurs(others(5), 4)...)
	f.flaky = thirtyPercent
	a := loadWith(t, adapterFile("create", "rest", f.srv.URL, ""), &waits{})
	p, err := g.Acquire(context.Background(), "api", protect.First)
	if err != nil {
		t.Fatal(err)
	}
	res, err := a.Check(protect.WithRetrier(context.Background(), p), testReceipt("/items"))
	if err != nil {
		t.Fatal(err)
	}
	p.Done(protect.Success, 0)
	ev := res.Evidence.(*httpadapter.Evidence)
	if ev.PageRetries == 0 || p.Retries() != ev.PageRetries {
		t.Fatalf("permit counted %d retries, evidence %d", p.Retries(), ev.PageRetries)
	}
	var d *protect.Deferral
	if err := p.Retry(); err == nil || !errors.As(err, &d) && !strings.Contains(err.Error(), "after Done") {
		t.Fatalf("Retry after Done: %v", err)
	}
}

// Issue 9: the retry budget grows with the requests a check makes. Every
// request after the check's first (each next page, each page of a second
// pass) is reported Sent, and only those: a retried page is reported to
// Retry, not Sent, so a flaky read reports exactly as many new requests as
// a clean one.
func TestEveryRequestAfterTheFirstIsReportedSent(t *testing.T) {
	for _, flaky := range []struct {
		name string
		fn   func(int) int
	}{{"clean", nil}, {"30% failures", thirtyPercent}} {
		t.Run(flaky.name, func(t *testing.T) {
			f := newFakeAPI(t, "rest", token)
			f.add(others(7)...)
			f.flaky = flaky.fn
			a := loadWith(t, adapterFile("create", "rest", f.srv.URL, ""), &waits{})
			gate := &fakeRetrier{allow: 100}
			res, err := a.Check(protect.WithRetrier(context.Background(), gate), testReceipt("/items"))
			if err != nil {
				t.Fatal(err)
			}
			ev := res.Evidence.(*httpadapter.Evidence)
			uris, _ := f.seen()
			if ev.Pages < 4 {
				t.Fatalf("%d pages read: the case needs a paginated read", ev.Pages)
			}
			if gate.sent != ev.Pages-1 || gate.asked != ev.PageRetries || len(uris) != ev.Pages+ev.PageRetries {
				t.Fatalf("%d pages, %d retries, %d requests: reported %d sent and %d retries, want %d and %d",
					ev.Pages, ev.PageRetries, len(uris), gate.sent, gate.asked, ev.Pages-1, ev.PageRetries)
			}
			if flaky.fn != nil && ev.PageRetries == 0 {
				t.Fatal("no page was retried: the case does not exercise retries")
			}
		})
	}
}
