package reviewui

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/statemachine"
)

// These tests drive a real headless Chromium: Debian's chromium package
// (apt-get install -y chromium), or the browser RECONCILER_CHROMIUM names.
// Like the database, it is a dependency the tests need, not one they skip
// without.

// EnvChromium names the browser binary, when it is not on PATH.
const EnvChromium = "RECONCILER_CHROMIUM"

// EnvUpdateScreenshots, set to 1, makes TestBrowser write the screenshots
// of docs/img/ (committed, shown by docs/review-ui.md).
const EnvUpdateScreenshots = "RECONCILER_UPDATE_SCREENSHOTS"

// hostile is stored text out to fool a reviewer: markup that would run,
// and a right-to-left override that turns "exe.txt" around on screen.
const hostile = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">invoice\u202Etxt.exe"

func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv(EnvChromium); p != "" {
		if _, err := exec.LookPath(p); err != nil {
			t.Fatalf("%s=%s: %v: point it at a Chromium or Chrome binary, or unset it and install Debian's "+
				"package (apt-get install -y chromium)", EnvChromium, p, err)
		}
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless_shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatalf("no headless Chromium for the review page's browser tests: install Debian's package " +
		"(apt-get install -y chromium) or set " + EnvChromium + " to a Chromium or Chrome binary")
	return ""
}

// browser starts a headless Chromium with a fresh profile and returns the
// context of its first tab; it is stopped when the test ends.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromium(t)),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true), // tests run as root here, where the sandbox refuses to start
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("no-default-browser-check", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.WindowSize(1280, 900),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	t.Cleanup(cancelAlloc)
	tab, cancelTab := chromedp.NewContext(alloc)
	t.Cleanup(cancelTab)
	if err := chromedp.Do(tab); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	return tab
}

// as opens a new tab of the browser of ctx whose requests carry the
// proxy's header naming reviewer.
func as(t *testing.T, ctx context.Context, reviewer string) context.Context {
	t.Helper()
	tab, cancel := chromedp.NewContext(ctx)
	t.Cleanup(cancel)
	if _, err := chromedp.Call(tab, network.Enable, network.EnableParams{}); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Call(tab, network.SetExtraHTTPHeaders,
		network.SetExtraHTTPHeadersParams{Headers: network.Headers{"X-Forwarded-User": reviewer}}); err != nil {
		t.Fatal(err)
	}
	return tab
}

func run(t *testing.T, ctx context.Context, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatal(err)
	}
}

// eval returns the value of a JavaScript expression in the tab.
func eval[T any](t *testing.T, ctx context.Context, js string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](js))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// queueIDs returns the receipt ids the queue's table shows, in order.
func queueIDs(t *testing.T, ctx context.Context) []string {
	t.Helper()
	return eval[[]string](t, ctx, `Array.from(document.querySelectorAll("#queue tbody tr")).map(r => r.dataset.id)`)
}

func ids(ns ...int64) []string {
	var out []string
	for _, n := range ns {
		out = append(out, fmt.Sprint(n))
	}
	return out
}

// decide fills the receipt page's form and sends it.
func decide(decision, reason string) chromedp.Action[chromedp.Void] {
	return chromedp.Steps(
		chromedp.WaitVisible(chromedp.CSS("#decide")),
		chromedp.Click(chromedp.CSS("#d-"+decision)),
		chromedp.SetValue(chromedp.CSS("#reason"), reason),
		chromedp.Click(chromedp.CSS("#submit-decision")),
	)
}

func TestBrowser(t *testing.T) {
	e := newLedger(t)
	oldest := e.held(t, "charges.create", "payments", "blind", map[string]any{"adapter": "payments-http", "checks": 0},
		`{"amount":1200,"currency":"eur","card":"4242424242424242"}`, "/card")
	mail := e.held(t, "mail.send", "mailer", "bound_reached", map[string]any{"checks": 5}, `{"to":"a@example.com"}`)
	evil := e.held(t, "charges.create", "payments", "diverged", map[string]any{"note": hostile},
		`{"amount":5,"currency":"eur","card":"5555555555554444"}`, "/card")
	newest := e.held(t, "charges.refund", "payments", "blind", nil, `{"amount":7}`)
	e.check(t, evil, "diverged", 18250, map[string]any{"body_excerpt": hostile, "status": 200})
	pgtest.Backdate(t, e.owner, oldest, 72*time.Hour)
	pgtest.Backdate(t, e.owner, mail, 30*time.Hour)
	pgtest.Backdate(t, e.owner, evil, 2*time.Hour)
	if _, err := e.owner.Exec(context.Background(), `INSERT INTO reconciler.dependency_breakers
		(dependency, open_until, opened_by, reason) VALUES ('payments', now() + interval '1 hour', 'r1', '5 consecutive transient failures')`); err != nil {
		t.Fatal(err)
	}

	ts := serve(t, e.login(t, "reconciler_reviewer"))
	b := browser(t)
	alice := as(t, b, "alice")

	// The queue: every held receipt, oldest first, with counts.
	run(t, alice, chromedp.Navigate(ts.URL+"/"), chromedp.WaitVisible(chromedp.CSS("#queue")))
	if got, want := queueIDs(t, alice), ids(oldest, mail, evil, newest); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("queue shows %v, want %v (oldest first)", got, want)
	}
	if got := text(t, alice, "#held-count"); got != "4" {
		t.Errorf("summary bar counts %q held, want 4", got)
	}
	if got := text(t, alice, "#summary .breakers"); !strings.Contains(got, "payments: open until") {
		t.Errorf("summary bar shows breakers %q, want payments open", got)
	}
	if got := text(t, alice, "#reviewer"); got != "alice" {
		t.Errorf("signed in as %q, want alice", got)
	}
	if os.Getenv(EnvUpdateScreenshots) == "1" {
		screenshot(t, alice, "ui-queue.png")
	}

	// Filters: by dependency (chosen from a list with counts), then by
	// reason and by age on top.
	options := eval[[]string](t, alice, `Array.from(document.querySelectorAll("#f-dependency option")).map(o => o.textContent)`)
	if strings.Join(options, "|") != "all|payments (3)|mailer (1)" {
		t.Errorf("dependency filter offers %q", options)
	}
	// Choosing applies it at once: ui.js, loaded from this origin under the
	// page's policy, sends the form on the change (SetValue fires it).
	run(t, alice, chromedp.SetValue(chromedp.CSS("#f-dependency"), "payments"), chromedp.WaitVisible(chromedp.CSS("#clear")))
	if got, want := queueIDs(t, alice), ids(oldest, evil, newest); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("payments only: queue shows %v, want %v", got, want)
	}
	if got := text(t, alice, "#match-count"); got != "3" {
		t.Errorf("payments only: %q match, want 3", got)
	}
	run(t, alice, chromedp.Navigate(ts.URL+"/?dependency=payments&reason=blind&age=24h"),
		chromedp.WaitVisible(chromedp.CSS("#queue")))
	if got, want := queueIDs(t, alice), ids(oldest); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("payments, blind, a day or more: queue shows %v, want %v", got, want)
	}

	// Open a receipt from the queue: its whole story, its intent with the
	// secret card number shown as redacted.
	run(t, alice, chromedp.Click(chromedp.CSS(fmt.Sprintf(`#queue a[href="/receipts/%d"]`, oldest))),
		chromedp.WaitVisible(chromedp.CSS("#timeline")))
	if got := text(t, alice, "#state"); got != "manual_review" {
		t.Fatalf("receipt %d shows state %q", oldest, got)
	}
	moves := eval[int](t, alice, `document.querySelectorAll("#timeline li.move").length`)
	if moves != 4 {
		t.Errorf("timeline shows %d moves, want 4 (planned, submitted, outcome_unknown, manual_review)", moves)
	}
	intent := text(t, alice, "#intent")
	if strings.Contains(intent, "4242") || !strings.Contains(intent, "/payload/card") || !strings.Contains(strings.ToLower(intent), "redacted") {
		t.Errorf("intent does not show the card as redacted:\n%s", intent)
	}

	// Hostile text in evidence is shown, not run: no script element, no
	// image, the override visible as a code point instead of reordering.
	run(t, alice, chromedp.Navigate(fmt.Sprintf("%s/receipts/%d", ts.URL, evil)), chromedp.WaitVisible(chromedp.CSS("#timeline")))
	pwned := eval[bool](t, alice, `window.__pwned !== undefined`)
	injected := eval[int](t, alice, `document.querySelectorAll("main script, main img").length`)
	timeline := text(t, alice, "#timeline")
	if pwned || injected != 0 {
		t.Fatalf("stored markup ran or was parsed: pwned=%v, %d script/img elements", pwned, injected)
	}
	if !strings.Contains(timeline, "<script>window.__pwned=1</script>") || strings.Contains(timeline, "\u202E") ||
		!strings.Contains(timeline, "U+202E") || !strings.Contains(timeline, "latency 18.25ms") {
		t.Fatalf("hostile evidence not shown inert and visible:\n%s", timeline)
	}
	if os.Getenv(EnvUpdateScreenshots) == "1" {
		screenshot(t, alice, "ui-receipt.png")
	}

	// Without a reason: refused, nothing moved, the choice kept.
	run(t, alice, decide("rejected", "  "), chromedp.WaitVisible(chromedp.CSS("#problem")))
	if got := text(t, alice, "#problem"); !strings.Contains(got, "A reason is required") {
		t.Fatalf("decision without a reason: page says %q", got)
	}
	if s, humans := e.state(t, evil); s != statemachine.ManualReview || humans != 0 {
		t.Fatalf("after a decision without a reason: %s, %d human moves", s, humans)
	}

	// With one: recorded as alice, with her reason.
	run(t, alice, decide("rejected", "customer cancelled; the processor shows no charge"),
		chromedp.WaitVisible(chromedp.CSS("#decided")))
	if got := text(t, alice, "#state"); got != "rejected" {
		t.Fatalf("after deciding, the page shows %q", got)
	}
	var actor, reason, via string
	if err := e.owner.QueryRow(context.Background(), `SELECT actor, detail ->> 'reason', detail #>> '{extra,resolved_via}'
		FROM reconciler.receipt_events WHERE receipt_id = $1 ORDER BY seq DESC LIMIT 1`, evil).Scan(&actor, &reason, &via); err != nil {
		t.Fatal(err)
	}
	if actor != "human:alice" || reason != "customer cancelled; the processor shows no charge" || via != Via {
		t.Fatalf("last move by %q with reason %q via %q", actor, reason, via)
	}

	// Two reviewers on one receipt at once: one decision is recorded, the
	// other reviewer is told who won, and nothing is overwritten.
	bob := as(t, b, "bob")
	page := fmt.Sprintf("%s/receipts/%d", ts.URL, mail)
	run(t, alice, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS("#decide")))
	run(t, bob, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS("#decide")))
	outcome := map[string]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for name, tab := range map[string]context.Context{"alice": alice, "bob": bob} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := chromedp.Do(tab, decide("succeeded", name+" found the mail in the provider's log"),
				chromedp.WaitVisible(chromedp.CSS("#decided, #problem")))
			var msg string
			if err == nil {
				msg, err = chromedp.Run(tab, chromedp.Text(chromedp.CSS("#decided, #problem")))
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				msg = "error: " + err.Error()
			}
			outcome[name] = msg
		}()
	}
	wg.Wait()
	var winner, loser string
	for name, msg := range outcome {
		switch {
		case strings.HasPrefix(msg, "Your decision was recorded"):
			winner = name
		case strings.Contains(msg, "not recorded") && strings.Contains(msg, "is succeeded, not manual_review"):
			loser = name
		}
	}
	if winner == "" || loser == "" || winner == loser {
		t.Fatalf("two reviewers at once: %q", outcome)
	}
	if !strings.Contains(outcome[loser], "human:"+winner) {
		t.Errorf("the loser is not told who decided: %q", outcome[loser])
	}
	if s, humans := e.state(t, mail); s != statemachine.Succeeded || humans != 1 {
		t.Fatalf("after two decisions at once: %s with %d human moves, want succeeded with 1", s, humans)
	}

	// A form whose CSRF token was stripped is refused.
	run(t, alice, chromedp.Navigate(fmt.Sprintf("%s/receipts/%d", ts.URL, newest)), chromedp.WaitVisible(chromedp.CSS("#decide")),
		chromedp.Evaluate[chromedp.Void](`document.querySelector("#decide input[name=csrf]").remove()`),
		decide("succeeded", "looks fine"), chromedp.WaitVisible(chromedp.CSS("#problem")))
	if got := text(t, alice, "#problem"); !strings.Contains(got, "security token") {
		t.Fatalf("form without its CSRF token: page says %q", got)
	}
	if s, humans := e.state(t, newest); s != statemachine.ManualReview || humans != 0 {
		t.Fatalf("after a form without its token: %s, %d human moves", s, humans)
	}
}

// A page whose database login is not in reconciler_reviewer shows the
// queue (it may read) but the database refuses the decision.
func TestBrowserLoginWithoutReviewerRole(t *testing.T) {
	e := newLedger(t)
	id := e.held(t, "charges.create", "payments", "blind", nil, `{"amount":3}`)
	ts := serve(t, e.login(t, "reconciler_readonly"))
	carol := as(t, browser(t), "carol")
	run(t, carol, chromedp.Navigate(fmt.Sprintf("%s/receipts/%d", ts.URL, id)),
		decide("succeeded", "found it"), chromedp.WaitVisible(chromedp.CSS("#problem")))
	got := text(t, carol, "#problem")
	if !strings.Contains(got, "The database refused your decision") || !strings.Contains(got, "permission denied") {
		t.Fatalf("decision under a login without the role: page says %q", got)
	}
	if s, humans := e.state(t, id); s != statemachine.ManualReview || humans != 0 {
		t.Fatalf("after the refusal: %s, %d human moves", s, humans)
	}
}

// screenshot writes the tab's whole page to docs/img/name.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join("..", "docs", "img", name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s", path)
}
