package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/statemachine"
)

// The fault tests (issue 9, item 5) run the built binary against truthAPI,
// a fake external API that knows which effects really happened, and check
// every verdict against that truth.

// truthControlKey marks the resource truthAPI holds from the start: the
// positive control declared in the adapters file.
const truthControlKey = "fault-control:things.create"

// truthAPI is a local stand-in for an external API of "things":
//
//   - GET /v1/things/search?key=K[&cursor=N] lists, in pages, the things
//     carrying the marker K (metadata.key) among unrelated ones; a page
//     says has_more and the next cursor;
//   - POST /v1/things creates a thing from {"title", "metadata": {"key"}}
//     and answers 201 {"id"}.
//
// It knows the truth: which markers have a thing (Exists). Its faults are
// drawn from one seeded source: a share of reads fails with 503, a share is
// slow, and a share of writes loses its answer (before or after storing).
type truthAPI struct {
	srv *httptest.Server

	mu     sync.Mutex
	rng    *rand.Rand
	things map[string][]truthThing // by marker
	nextID int
	faults truthFaults

	reads, failedReads, slowReads atomic.Int64
	writes                        atomic.Int64
}

type truthThing struct {
	id string
	// visible is when reads start to list it (eventual consistency).
	visible time.Time
	created time.Time
}

// truthFaults are the faults a truthAPI injects; the zero value injects
// none and serves one page a search.
type truthFaults struct {
	// latency is added to every read.
	latency time.Duration
	// failReads is the share of reads answered 503.
	failReads float64
	// slowReads is the share of reads delayed by slow.
	slowReads float64
	slow      time.Duration
	// pages is the number of pages of a search (0: one); the marked
	// thing is on one of them, chosen by its marker.
	pages int
	// loseBefore and loseAfter are the shares of writes answered 503
	// without storing, and answered 504 after storing.
	loseBefore, loseAfter float64
}

func newTruthAPI(t testing.TB, seed uint64, f truthFaults) *truthAPI {
	a := &truthAPI{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), things: map[string][]truthThing{}, faults: f}
	long := time.Now().Add(-time.Hour)
	a.things[truthControlKey] = []truthThing{{id: "th_control", visible: long, created: long}}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

// setFaults replaces the faults from now on.
func (a *truthAPI) setFaults(f truthFaults) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.faults = f
}

// add records a thing carrying marker key that reads list from lag on.
func (a *truthAPI) add(key string, lag time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.addLocked(key, lag)
}

func (a *truthAPI) addLocked(key string, lag time.Duration) string {
	a.nextID++
	id := "th_" + strconv.Itoa(a.nextID)
	now := time.Now()
	a.things[key] = append(a.things[key], truthThing{id: id, visible: now.Add(lag), created: now})
	return id
}

// Exists reports how many things carry marker key: the truth.
func (a *truthAPI) count(key string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.things[key])
}

// draw returns a uniform number in [0, 1) from the API's seeded source.
func (a *truthAPI) draw() float64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rng.Float64()
}

func (a *truthAPI) serve(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/v1/things/search":
		a.search(w, r)
	case r.Method == http.MethodPost && r.URL.Path == "/v1/things":
		a.create(w, r)
	default:
		http.NotFound(w, r)
	}
}

func (a *truthAPI) search(w http.ResponseWriter, r *http.Request) {
	a.reads.Add(1)
	a.mu.Lock()
	f := a.faults
	fail, slow := a.rng.Float64() < f.failReads, a.rng.Float64() < f.slowReads
	a.mu.Unlock()
	delay := f.latency
	if slow {
		a.slowReads.Add(1)
		delay += f.slow
	}
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-r.Context().Done():
			return
		}
	}
	if fail {
		a.failedReads.Add(1)
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
		return
	}
	key := r.URL.Query().Get("key")
	pages := max(f.pages, 1)
	page, _ := strconv.Atoi(r.URL.Query().Get("cursor"))
	page = max(page, 1)
	// The marked thing is on a page chosen by its marker; the other
	// pages hold unrelated things, so every page is read.
	home := 1 + int(crc(key)%uint32(pages))
	items := []map[string]any{}
	for i := range 3 {
		items = append(items, map[string]any{"id": fmt.Sprintf("th_other_%d_%d", page, i),
			"created": time.Now().Unix(), "metadata": map[string]string{"key": fmt.Sprintf("other-%d-%d", page, i)}})
	}
	if page == home {
		a.mu.Lock()
		for _, th := range a.things[key] {
			if !time.Now().Before(th.visible) {
				items = append(items, map[string]any{"id": th.id, "created": th.created.Unix(),
					"metadata": map[string]string{"key": key}})
			}
		}
		a.mu.Unlock()
	}
	body := map[string]any{"data": items, "has_more": page < pages}
	if page < pages {
		body["next_cursor"] = strconv.Itoa(page + 1)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(body)
}

// crc is a small stable hash of s.
func crc(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint32(s[i])) * 16777619
	}
	return h
}

func (a *truthAPI) create(w http.ResponseWriter, r *http.Request) {
	a.writes.Add(1)
	var in struct {
		Metadata struct {
			Key string `json:"key"`
		} `json:"metadata"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Metadata.Key == "" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	f := a.faults
	d := a.rng.Float64()
	if d < f.loseBefore {
		a.mu.Unlock()
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
		return
	}
	id := a.addLocked(in.Metadata.Key, 0)
	a.mu.Unlock()
	if d < f.loseBefore+f.loseAfter {
		http.Error(w, "gateway timeout", http.StatusGatewayTimeout) // stored, answer lost
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]string{"id": id})
}

// truthAdapters writes an adapters file reading truthAPI at baseURL
// (the API itself, or a proxy in front of it): one http adapter for
// things.create with a cursor-paginated marker search, short windows
// (absence proves nothing until 2 s after the send deadline), the declared
// control, and deps as the body of dependencies.truth-api (protection
// fields; "" leaves the flags' defaults).
func truthAdapters(t *testing.T, baseURL, deps string) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, `version: 1
defaults:
  consistency_window: 1s
  max_request_lifetime: 1s
  max_checks: 20
  deadline: 24h
  backoff: {base: 200ms, cap: 5s}
adapters:
  - name: truth-things
    type: http
    kind: create
    dependency: truth-api
    operations: [things.create]
    http:
      base_url: %s
      timeout: 2s
      search:
        path: /v1/things/search
        query: {key: "{receipt.logical_key}"}
        items: /data
        id: /id
        created_at: /created
        created_at_format: unix
        pagination: {style: cursor, cursor: /next_cursor, has_more: /has_more, param: cursor, max_pages: 10}
      match:
        marker: {pointer: /metadata/key, equals: "{receipt.logical_key}"}
    control:
      idempotency_key: %q
      target: /v1/things
      submitted_at: %s
`, baseURL, truthControlKey, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339))
	if deps != "" {
		fmt.Fprintf(&b, "dependencies:\n  truth-api:\n")
		for _, line := range strings.Split(strings.TrimSpace(deps), "\n") {
			fmt.Fprintf(&b, "    %s\n", strings.TrimSpace(line))
		}
	}
	return writeFile(t, "adapters.yaml", b.String())
}

// seedTruth inserts n outcome_unknown receipts of things.create on
// truth-api with a 100 ms send deadline, as agents whose answers were lost
// would leave them; for a share exists of them (drawn from rng) the effect
// happened: the API gets a thing carrying the receipt's key, listed from a
// random lag under a second on (inside the absence window). It returns the
// truth: receipt id to "the effect exists".
func seedTruth(t testing.TB, db *pgxpool.Pool, api *truthAPI, rng *rand.Rand, n int, exists float64) map[int64]bool {
	t.Helper()
	ctx := context.Background()
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	rows, err := db.Query(ctx, `
		INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target,
		                                 fingerprint, intent, state_actor, max_send_delay)
		SELECT 'fault-' || $1 || ':' || g || ':things.create', 'things.create', 'truth-api', 'POST', '/v1/things',
		       'sha256:' || encode(sha256(($1 || ':' || g)::bytea), 'hex'), '{}', 'agent:test', interval '100 milliseconds'
		FROM generate_series(1, $2) g
		RETURNING id, idempotency_key`, tag, n)
	if err != nil {
		t.Fatal(err)
	}
	type idKey struct {
		id  int64
		key string
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (idKey, error) {
		var k idKey
		err := r.Scan(&k.id, &k.key)
		return k, err
	})
	if err != nil {
		t.Fatal(err)
	}
	truth := make(map[int64]bool, n)
	ids := make([]int64, 0, n)
	for _, k := range got {
		ids = append(ids, k.id)
		if rng.Float64() < exists {
			api.add(k.key, time.Duration(rng.Int64N(int64(time.Second))))
			truth[k.id] = true
		} else {
			truth[k.id] = false
		}
	}
	for _, to := range []string{"submitted", "outcome_unknown"} {
		if _, err := db.Exec(ctx, `UPDATE reconciler.receipts SET state = $1, state_actor = 'agent:test'
			WHERE id = ANY($2)`, to, ids); err != nil {
			t.Fatal(err)
		}
	}
	return truth
}

// ledgerState is the history of every receipt of a database, read back
// after a fault run.
type ledgerState struct {
	// final is each receipt's state and, for manual_review, the reason.
	final  map[int64]string
	reason map[int64]string
	// byActor counts the settlements each actor made.
	byActor map[string]int
	// last is the database time of the last settlement.
	last time.Time
}

// checkHistories reads the history of every receipt and checks that each
// is a legal path (gap-free from planned, each move from the state the
// previous one reached and allowed to its actor by statemachine.Check) with
// at most one settlement (a move to succeeded, safe_to_retry or
// manual_review).
func checkHistories(t *testing.T, db *pgxpool.Pool) ledgerState {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT receipt_id, seq, coalesce(from_state, ''), to_state,
		actor, coalesce(detail->>'reason', ''), at
		FROM reconciler.receipt_events ORDER BY receipt_id, seq`)
	if err != nil {
		t.Fatal(err)
	}
	type event struct {
		id         int64
		seq        int
		from, to   string
		actor, why string
		at         time.Time
	}
	events, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (event, error) {
		var e event
		err := r.Scan(&e.id, &e.seq, &e.from, &e.to, &e.actor, &e.why, &e.at)
		return e, err
	})
	if err != nil {
		t.Fatal(err)
	}
	st := ledgerState{final: map[int64]string{}, reason: map[int64]string{}, byActor: map[string]int{}}
	var problems []string
	fail := func(format string, args ...any) {
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	settled := map[int64]int{}
	next := map[int64]int{}
	for _, e := range events {
		state := st.final[e.id]
		next[e.id]++
		switch {
		case e.seq != next[e.id]:
			fail("receipt %d: event %d has seq %d (history not gap-free)", e.id, next[e.id], e.seq)
		case e.seq == 1 && (e.from != "" || e.to != string(statemachine.Planned)):
			fail("receipt %d: history starts %q -> %q, not at planned", e.id, e.from, e.to)
		case e.seq > 1 && e.from != state:
			fail("receipt %d: move %d from %q, but the receipt was %q", e.id, e.seq, e.from, state)
		case e.seq > 1:
			if err := statemachine.Check(statemachine.Actor(e.actor), statemachine.State(e.from), statemachine.State(e.to)); err != nil {
				fail("receipt %d: move %d: %v", e.id, e.seq, err)
			}
		}
		st.final[e.id] = e.to
		switch statemachine.State(e.to) {
		case statemachine.Succeeded, statemachine.SafeToRetry, statemachine.ManualReview:
			settled[e.id]++
			if settled[e.id] == 2 {
				fail("receipt %d: settled twice", e.id)
			}
			st.byActor[e.actor]++
			st.reason[e.id] = e.why
			if e.at.After(st.last) {
				st.last = e.at
			}
		}
	}
	if len(problems) > 0 {
		t.Fatalf("histories of %d receipts:\n%s", len(st.final), strings.Join(problems, "\n"))
	}
	return st
}

// verdicts counts the settlements of the receipts compared with the truth.
type verdicts struct {
	succeeded, safeToRetry, manualReview int
	// manualReasons counts the reasons of the manual_review settlements.
	manualReasons map[string]int
}

// verifyAgainstTruth checks, for the receipts of truth (id to "the effect
// exists"), that each has settled (is no longer outcome_unknown or
// reconciling) and that each verdict agrees with the truth: never
// safe_to_retry for an effect that exists (a retry would duplicate it),
// never succeeded for one that does not (the effect would be lost).
// manual_review is counted; the caller decides how many it accepts.
func verifyAgainstTruth(t *testing.T, st ledgerState, truth map[int64]bool) verdicts {
	t.Helper()
	v := verdicts{manualReasons: map[string]int{}}
	var problems []string
	for id, exists := range truth {
		if len(problems) >= 20 {
			break
		}
		switch statemachine.State(st.final[id]) {
		case statemachine.Succeeded:
			v.succeeded++
			if !exists {
				problems = append(problems, fmt.Sprintf("receipt %d: succeeded, but its effect does not exist (a false success)", id))
			}
		case statemachine.SafeToRetry:
			v.safeToRetry++
			if exists {
				problems = append(problems, fmt.Sprintf("receipt %d: safe_to_retry, but its effect exists (a retry would duplicate it)", id))
			}
		case statemachine.ManualReview:
			v.manualReview++
			v.manualReasons[st.reason[id]]++
		default:
			problems = append(problems, fmt.Sprintf("receipt %d: left %q", id, st.final[id]))
		}
	}
	if len(problems) > 0 {
		t.Fatalf("%d receipts checked against the API's truth:\n%s", len(truth), strings.Join(problems, "\n"))
	}
	return v
}

// verifyNoReview is checkHistories and verifyAgainstTruth for a run in
// which every receipt can be proven: it fails if any went to manual_review,
// saying why none should have (why, appended to the message).
func verifyNoReview(t *testing.T, db *pgxpool.Pool, truth map[int64]bool, why string) (ledgerState, verdicts) {
	t.Helper()
	st := checkHistories(t, db)
	v := verifyAgainstTruth(t, st, truth)
	if v.manualReview != 0 {
		t.Fatalf("%d receipts sent to manual_review (%s)%s", v.manualReview, reasons(v.manualReasons), why)
	}
	return st, v
}

// unsettled counts the receipts of truth not yet settled.
func unsettled(t *testing.T, db *pgxpool.Pool, truth map[int64]bool) int {
	t.Helper()
	ids := make([]int64, 0, len(truth))
	for id := range truth {
		ids = append(ids, id)
	}
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts
		WHERE id = ANY($1) AND state IN ('outcome_unknown', 'reconciling')`, ids).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// recordedChecks counts the readback_checks rows of truth's receipts.
func recordedChecks(t *testing.T, db *pgxpool.Pool, truth map[int64]bool) int {
	t.Helper()
	ids := make([]int64, 0, len(truth))
	for id := range truth {
		ids = append(ids, id)
	}
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.readback_checks
		WHERE receipt_id = ANY($1)`, ids).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// dbNow is the database's clock, the one settlement times are stamped with.
func dbNow(t *testing.T, db *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	if err := db.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// kill ends the daemon with SIGKILL and waits for its exit.
func (d *daemon) kill(t *testing.T) {
	t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := <-d.done
	d.done <- err // for the cleanup
}

// exited reports whether the daemon's process has ended, and how.
func (d *daemon) exited() (bool, error) {
	select {
	case err := <-d.done:
		d.done <- err
		return true, err
	default:
		return false, nil
	}
}

// httpStatus is the status of GET url, or 0 when nothing answers.
func httpStatus(url string) int {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// reasons formats a count by reason, sorted, for logs.
func reasons(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b bytes.Buffer
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%d ", k, m[k])
	}
	return strings.TrimSpace(b.String())
}
