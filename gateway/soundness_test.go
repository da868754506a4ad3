package gateway_test

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/andybalholm/brotli"

	"github.com/receiptledger/reconciler/gateway"
)

// Issue 19, item 6: an upstream may compress its answer whatever the
// gateway asked for. Every coding the gateway knows (deflate in its zlib
// and raw forms, br, x-gzip, and codings stacked) is decoded before the
// body is classified, redacted, passed on or kept, so an echoed credential
// reaches neither the agent nor gateway_responses; a body in a coding it
// cannot decode is neither passed on nor kept, and a side effect's 2xx in
// one is outcome_unknown.
func TestCompressedBodiesAreDecodedBeforeRedaction(t *testing.T) {
	type coder func(io.Writer) io.WriteCloser
	codings := map[string]coder{
		"gzip":    func(w io.Writer) io.WriteCloser { return gzip.NewWriter(w) },
		"x-gzip":  func(w io.Writer) io.WriteCloser { return gzip.NewWriter(w) },
		"deflate": func(w io.Writer) io.WriteCloser { return zlib.NewWriter(w) },
		"br":      func(w io.Writer) io.WriteCloser { return brotli.NewWriter(w) },
	}
	encode := func(body []byte, list string) []byte {
		for _, c := range strings.Split(list, ",") {
			c = strings.TrimSpace(c)
			var b bytes.Buffer
			var zw io.WriteCloser
			switch c {
			case "raw-deflate":
				zw, _ = flate.NewWriter(&b, flate.BestSpeed)
			default:
				zw = codings[c](&b)
			}
			_, _ = zw.Write(body)
			_ = zw.Close()
			body = b.Bytes()
		}
		return body
	}
	// The upstream answers with the coding named by the path's last
	// segment (raw-deflate: deflate without its zlib wrapper; stacked:
	// gzip then br), echoing the credential it was sent.
	var sent atomic.Int32
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent.Add(1)
		segs := strings.Split(r.URL.Path, "/")
		name := segs[len(segs)-1]
		status := http.StatusCreated
		if r.Method == http.MethodGet {
			status = http.StatusOK
		}
		if segs[len(segs)-2] == "no" {
			status = http.StatusUnprocessableEntity
		}
		body := []byte(`{"id":"z-` + name + `","seen":"` + r.Header.Get("Authorization") + `"}`)
		header := name
		switch name {
		case "raw-deflate":
			header = "deflate"
		case "stacked":
			name, header = "gzip, br", "gzip, br"
		case "unknown":
			header = "zstd"
		}
		if name != "unknown" {
			body = encode(body, name)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", header)
		w.WriteHeader(status)
		_, _ = w.Write(body)
	})
	e := newEnv(t, up, "")
	auth := []string{"Authorization", "Bearer " + tokenA}
	for i, name := range []string{"gzip", "x-gzip", "deflate", "raw-deflate", "br", "stacked"} {
		for _, kind := range []string{"ok", "no"} {
			key := "k-z-" + kind + "-" + strconv.Itoa(i)
			path := "/blog/" + kind + "/" + name
			want := http.StatusCreated
			if kind == "no" {
				want = http.StatusUnprocessableEntity
			}
			for round := range 2 {
				a := e.do(t, "POST", path, `{"title":"z"}`, append(auth, "Idempotency-Key", key)...)
				if a.status != want || a.header.Get("Content-Encoding") != "" || strings.Contains(string(a.body), upstreamKey) ||
					!strings.Contains(string(a.body), `"id":"z-`) {
					t.Fatalf("POST %s, round %d: %d %v %q; want %d, the body decoded and redacted", path, round, a.status, a.header, a.body, want)
				}
			}
		}
		a := e.do(t, "GET", "/blog/ok/"+name, "", auth...)
		if a.status != http.StatusOK || a.header.Get("Content-Encoding") != "" || strings.Contains(string(a.body), upstreamKey) ||
			!strings.Contains(string(a.body), `"id":"z-`) {
			t.Fatalf("GET %s: %d %v %q; want the body decoded and redacted", name, a.status, a.header, a.body)
		}
	}
	var kept int
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.gateway_responses
		WHERE position('"id":"z-' in convert_from(body, 'UTF8')) > 0`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != 12 {
		t.Fatalf("%d kept responses hold a decoded body, want 12", kept)
	}
	if n := e.countText(t, upstreamKey); n != 0 {
		t.Fatalf("the credential is stored in %d rows", n)
	}

	// A coding the gateway cannot decode: a 2xx to a side effect is
	// outcome_unknown, a 4xx is rejected without its body, a read is
	// refused; nothing of the body is passed on or kept.
	a := e.do(t, "POST", "/blog/ok/unknown", `{"title":"u"}`, append(auth, "Idempotency-Key", "k-z-unknown")...)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.Type != gateway.ProblemOutcomeUnknown.URI() ||
		p.ReceiptState != "outcome_unknown" || strings.Contains(string(a.body), upstreamKey) {
		t.Fatalf("a 2xx in an unknown coding: %d %s; want outcome-unknown", a.status, a.body)
	}
	a = e.do(t, "POST", "/blog/no/unknown", `{"title":"u"}`, append(auth, "Idempotency-Key", "k-z-unknown-no")...)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.Type != gateway.ProblemUndecodableResponse.URI() ||
		p.ReceiptState != "rejected" || p.UpstreamStatus != http.StatusUnprocessableEntity || strings.Contains(string(a.body), upstreamKey) {
		t.Fatalf("a 4xx in an unknown coding: %d %s; want undecodable-response, rejected", a.status, a.body)
	}
	a = e.do(t, "GET", "/blog/ok/unknown", "", auth...)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.Type != gateway.ProblemUndecodableResponse.URI() ||
		strings.Contains(string(a.body), upstreamKey) {
		t.Fatalf("a read in an unknown coding: %d %s; want undecodable-response", a.status, a.body)
	}
	if err := e.db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.gateway_responses g
		JOIN reconciler.receipts r ON r.id = g.receipt_id WHERE r.idempotency_key LIKE 'k-z-unknown%'`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != 0 {
		t.Fatalf("%d responses kept in a coding the gateway cannot decode", kept)
	}
}

// Issue 19, item 6: the bound on a response holds after decompression: a
// small compressed body that inflates past it is refused, not held whole.
func TestDecompressedBodyIsBounded(t *testing.T) {
	const limit = 64 << 10
	var zipped bytes.Buffer
	zw := gzip.NewWriter(&zipped)
	_, _ = zw.Write([]byte(`{"id":"big","pad":"` + strings.Repeat("a", 4*limit) + `"}`))
	_ = zw.Close()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "x-gzip")
		_, _ = w.Write(zipped.Bytes())
	}))
	t.Cleanup(up.Close)
	e := newEnvRoutes(t, strings.Replace(routesFile(up.URL, ""), "limits: {max_request_bytes: 4096}",
		"limits: {max_request_bytes: 4096, max_response_bytes: "+strconv.Itoa(limit)+"}", 1))
	if zipped.Len() >= limit {
		t.Fatalf("set-up: the compressed body is %d bytes, not below the bound", zipped.Len())
	}
	a := e.do(t, "GET", "/blog/big", "", "Authorization", "Bearer "+tokenA)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.Type != gateway.ProblemResponseTooLarge.URI() {
		t.Fatalf("a read inflating past the bound: %d %s; want response-too-large", a.status, a.body)
	}
	a = e.post(t, "/blog/big", "k-big", `{"title":"b"}`)
	if p := a.problem(t); a.status != http.StatusBadGateway || p.ReceiptState != "outcome_unknown" || p.Code != "body_too_large" {
		t.Fatalf("a side effect's answer inflating past the bound: %d %s; want outcome_unknown, body_too_large", a.status, a.body)
	}
}

// Issue 19, item 7: Tomcat, Jetty and Spring strip ";params" from a
// segment before they resolve dot segments, so "..;x" is ".." to them: a
// dot segment with matrix parameters, in any encoding, is refused as the
// others are, and nothing reaches the upstream.
func TestMatrixParametersCannotHideADotSegment(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	assertPathsRefused(t, e, up, "k-matrix-",
		"/blog/..;/admin",
		"/blog/%2e%2e;x/admin",
		"/blog/.;/admin",
		"/blog/x/..;jsessionid=1/admin",
		"/blog/%2E%2E%3Bx/admin",
		"/blog/.%3b/admin",
	)
	// A semicolon in an ordinary segment is still forwarded.
	if a := e.do(t, "GET", "/blog/articles;v=1", "", "Authorization", "Bearer "+tokenA); a.status == http.StatusBadRequest {
		t.Fatalf("a matrix parameter on an ordinary segment was refused: %s", a.body)
	}
}

// Issue 19, item 8: another agent's key gets one answer, whether or not
// the payload guessed is the one it was used with: the owner is checked
// before the fingerprint, and the answer names no other agent.
func TestAnotherAgentsKeyGetsOneAnswer(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	asB := func(key, body string) answer {
		return e.do(t, "POST", "/blog/articles", body, "Authorization", "Bearer "+tokenB, "Idempotency-Key", key)
	}
	if a := e.post(t, "/blog/articles", "a-secret-step", `{"title":"the real one"}`); a.status != http.StatusCreated {
		t.Fatalf("set-up call: %d %s", a.status, a.body)
	}
	right := asB("a-secret-step", `{"title":"the real one"}`)
	wrong := asB("a-secret-step", `{"title":"a guess"}`)
	for _, a := range []answer{right, wrong} {
		if p := a.problem(t); a.status != http.StatusUnprocessableEntity || p.Type != gateway.ProblemKeyReused.URI() ||
			strings.Contains(strings.ToLower(p.Detail), "agent") {
			t.Fatalf("B with A's key: %d %s; want idempotency-key-reused naming no agent", a.status, a.body)
		}
	}
	if !bytes.Equal(right.body, wrong.body) {
		t.Fatalf("B learns whether its guess matched A's payload:\n right %s\n wrong %s", right.body, wrong.body)
	}
	// A itself still hears why its own key does not fit.
	own := e.post(t, "/blog/articles", "a-secret-step", `{"title":"another"}`)
	if p := own.problem(t); p.Type != gateway.ProblemKeyReused.URI() || !strings.Contains(p.Detail, "payload") {
		t.Fatalf("A's own conflicting reuse: %d %s", own.status, own.body)
	}
	if n := up.count("/api/articles"); n != 1 {
		t.Fatalf("the upstream got %d requests, want 1", n)
	}
}

// Issue 19, item 9: /blog/f%61il504 and /blog/fail504 are the same
// resource (RFC 3986 §6.2.2): percent-encoded unreserved characters are
// decoded and the hex of other escapes upper-cased before fingerprinting,
// operation matching and forwarding, so the same call under a second key
// is a duplicate, not a second request. An encoded separator (%2F) stays
// as it is.
func TestEquivalentPathsAreOneCall(t *testing.T) {
	var raw []string
	up := newFakeUpstream()
	e := newEnv(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		up.mu.Lock()
		raw = append(raw, r.URL.EscapedPath()+"?"+r.URL.RawQuery)
		up.mu.Unlock()
		up.ServeHTTP(w, r)
	}), `    operations:
      - {method: POST, path: /fail504, name: fail.create}
      - {method: POST, path: /articles, name: articles.create}
      - {method: POST, path: "/files/{name}", name: files.create}
`)
	if a := e.post(t, "/blog/fail504", "k-eq-1", `{"title":"e"}`); a.status != http.StatusBadGateway {
		t.Fatalf("set-up call: %d %s", a.status, a.body)
	}
	for i, p := range []string{"/blog/f%61il504", "/blog/%66%61%69%6C504", "/bl%6fg/fail504"} {
		a := e.post(t, p, "k-eq-"+strconv.Itoa(i+2), `{"title":"e"}`)
		if pr := a.problem(t); pr.Type != gateway.ProblemDuplicateIntent.URI() {
			t.Fatalf("%s under a new key: %d %s; want duplicate-intent", p, a.status, a.body)
		}
	}
	if n := up.count("/api/fail504"); n != 1 {
		t.Fatalf("the upstream got %d requests for one call, want 1", n)
	}
	// Operation matching and forwarding see the normal form; %2F stays
	// one segment, its hex upper-cased.
	if a := e.post(t, "/blog/%61rticles?x=%7e%41", "k-eq-op", `{"title":"o"}`); a.status != http.StatusCreated {
		t.Fatalf("/blog/%%61rticles: %d %s; want it matched as articles.create", a.status, a.body)
	}
	if a := e.post(t, "/blog/files/a%2fb", "k-eq-sep", `{"title":"s"}`); a.status != http.StatusNotFound {
		t.Fatalf("/blog/files/a%%2fb: %d %s", a.status, a.body)
	}
	var op, target string
	if err := e.db.QueryRow(context.Background(), `SELECT operation, target FROM reconciler.receipts WHERE idempotency_key = 'k-eq-op'`).Scan(&op, &target); err != nil {
		t.Fatal(err)
	}
	if op != "articles.create" || target != "/api/articles?x=~A" {
		t.Fatalf("receipt: operation %q target %q; want articles.create at /api/articles?x=~A", op, target)
	}
	if err := e.db.QueryRow(context.Background(), `SELECT target FROM reconciler.receipts WHERE idempotency_key = 'k-eq-sep'`).Scan(&target); err != nil {
		t.Fatal(err)
	}
	if target != "/api/files/a%2Fb" {
		t.Fatalf("target %q; want /api/files/a%%2Fb", target)
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	if got := strings.Join(raw, " "); got != "/api/fail504? /api/articles?x=~A /api/files/a%2Fb?" {
		t.Fatalf("the upstream saw %s", got)
	}
}

// Issue 19, item 10: a call's receipt settles and its response is kept for
// replays; a replay in between never gives another final answer than the
// call's own (before, it gave the receipt document, 200, while the call
// answered 201 with the body). The test holds the response's write with a
// table lock, deterministically: the replay comes while it waits.
func TestReplayWhileTheResponseIsBeingKept(t *testing.T) {
	up := newFakeUpstream()
	e := newEnv(t, up, "")
	ctx := context.Background()
	tx, err := e.db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE reconciler.gateway_responses IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	first := make(chan answer, 1)
	go func() {
		a, err := send("POST", e.gw.URL+"/blog/articles", `{"title":"kept"}`, "Authorization", "Bearer "+tokenA,
			"Idempotency-Key", "k-kept")
		if err != nil {
			a = answer{status: -1, body: []byte(err.Error())}
		}
		first <- a
	}()
	// Wait (on a condition) until the call's write of its response waits
	// on the lock.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		if err := e.db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%gateway_responses%' AND pid <> pg_backend_pid())`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the call's response was never written")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not a race
	}
	mid := e.post(t, "/blog/articles", "k-kept", `{"title":"kept"}`)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-first
	if a.status != http.StatusCreated || !strings.Contains(string(a.body), `"id":"art-1"`) {
		t.Fatalf("the call: %d %s", a.status, a.body)
	}
	// In between: the same answer, or "ask again" (in progress), never
	// another final answer.
	if mid.status != a.status && !(mid.status == http.StatusConflict && mid.problem(t).Type == gateway.ProblemInProgress.URI()) {
		t.Fatalf("a replay while the response was being kept: %d %s; the call answered %d %s", mid.status, mid.body, a.status, a.body)
	}
	if mid.status == a.status && !bytes.Equal(mid.body, a.body) {
		t.Fatalf("a replay while the response was being kept: %s; the call answered %s", mid.body, a.body)
	}
	again := e.post(t, "/blog/articles", "k-kept", `{"title":"kept"}`)
	if again.status != http.StatusCreated || !bytes.Equal(again.body, a.body) || again.header.Get(gateway.HeaderReplayed) != "true" {
		t.Fatalf("the replay after: %d %s", again.status, again.body)
	}
	if n := up.count("/api/articles"); n != 1 {
		t.Fatalf("the upstream got %d requests, want 1", n)
	}
}

// Issue 19, item 11: a 304 answering a conditional read is not a
// redirect: it is passed through with its validators.
// On a route with receipts for reads, the 304 settles the read succeeded.
func TestConditionalReadPassesThrough(t *testing.T) {
	up := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v1"`)
		if r.Header.Get("If-None-Match") == `"v1"` {
			w.WriteHeader(http.StatusNotModified)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"a-1"}`))
	})
	for _, extra := range []string{"", "    receipts_for_reads: true\n"} {
		e := newEnv(t, up, extra)
		a := e.do(t, "GET", "/blog/articles/a-1", "", "Authorization", "Bearer "+tokenA, "If-None-Match", `"v1"`,
			"Idempotency-Key", "k-read")
		if a.status != http.StatusNotModified || a.header.Get("ETag") != `"v1"` || len(a.body) != 0 {
			t.Fatalf("a conditional read (%q): %d %v %q; want 304 with its ETag", extra, a.status, a.header, a.body)
		}
		if extra != "" && a.header.Get(gateway.HeaderReceiptState) != "succeeded" {
			t.Fatalf("a conditional read with a receipt: %v; want it succeeded", a.header)
		}
	}
}
