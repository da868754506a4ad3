package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/internal/testkit"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// Acceptance 4: a worker killed mid-check (its context cancelled, its lease
// never released) leaves the row to a second instance, which reclaims it
// after the lease and settles it exactly once; the dead worker's late write
// changes nothing.
func TestKilledWorkerRowIsReclaimedAfterLease(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewPool(t)
	clk := newClock()
	id := seed(t, db, 1, "things.create", "static-api", "outcome_unknown")[0]
	present := readback.Binding{Name: "answer", Kind: readback.Create, Dependency: "static-api",
		Policy: shortPolicy(), Adapter: readback.Static{Verdict: readback.VerdictPresent, ExternalID: "thing-9"}}

	// Instance A claims the row and starts its check; then it is killed.
	clk.Advance(time.Second)
	a, err := reconcile.NewStore(db, "instance-a")
	if err != nil {
		t.Fatal(err)
	}
	claimed, err := a.Claim(ctx, clk.Now(), 10, time.Minute)
	if err != nil || len(claimed) != 1 {
		t.Fatalf("claim = %v, %v", claimed, err)
	}
	checkCtx, kill := context.WithCancel(ctx)
	started, stopped := make(chan struct{}), make(chan error)
	blocking := readback.AdapterFunc(func(ctx context.Context, _ readback.Receipt) (readback.Result, error) {
		close(started)
		<-ctx.Done()
		return readback.Result{}, ctx.Err()
	})
	go func() {
		_, err := blocking.Check(checkCtx, claimed[0].Receipt)
		stopped <- err
	}()
	<-started
	kill()
	if err := <-stopped; !errors.Is(err, context.Canceled) {
		t.Fatalf("killed check returned %v", err)
	}
	if got := receipt(t, db, id); got.State != "reconciling" || got.LeaseOwner == "" {
		t.Fatalf("after the kill = %+v, want reconciling with A's lease", got)
	}

	// Instance B cannot take it while the lease lives...
	b := newPool(t, db, reconcile.Config{Instance: "instance-b", Registry: registry(t, nil, shortPolicy(), present), Now: clk.Now})
	sum, err := b.Drain(ctx)
	if err != nil || sum.Claimed != 0 {
		t.Fatalf("B claimed a leased row: %+v, %v", sum, err)
	}
	// ...and settles it once the lease has expired.
	clk.Advance(time.Minute + time.Second)
	sum, err = b.Drain(ctx)
	if err != nil || sum.Claimed != 1 {
		t.Fatalf("B after the lease: %+v, %v", sum, err)
	}
	if got := receipt(t, db, id); got.State != "succeeded" || got.ExternalID != "thing-9" {
		t.Fatalf("after B = %+v, want succeeded", got)
	}

	// A comes back from the dead with its outcome: refused, nothing moves.
	applied, err := a.Complete(ctx, []reconcile.Outcome{{ID: id, Lease: claimed[0].Lease,
		To: "safe_to_retry", Detail: reconcile.Detail{Reason: "late"}}})
	if err != nil || len(applied) != 0 {
		t.Fatalf("stale completion applied %v, %v", applied, err)
	}
	if ev := settlements(t, db, id); len(ev) != 1 || ev[0]["reason"] != reconcile.ReasonPresent {
		t.Fatalf("settlement events = %v, want exactly one", ev)
	}
}

// buildBinary builds cmd/reconciler once for the test.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "reconciler")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/receiptledger/reconciler/cmd/reconciler")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// daemon is a `reconciler run` process.
type daemon struct {
	cmd    *exec.Cmd
	stderr *testkit.LogBuffer
	done   chan error
}

func startDaemon(t *testing.T, bin, dbURL string, args ...string) *daemon {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"run", "--database-url", dbURL}, args...)...)
	d := &daemon{cmd: cmd, stderr: &testkit.LogBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = d.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-d.done
	})
	return d
}

// stop sends SIGTERM and returns the exit error and how long the exit took.
func (d *daemon) stop(t *testing.T, within time.Duration) (error, time.Duration) {
	t.Helper()
	start := time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-d.done:
		d.done <- err // for the cleanup
		return err, time.Since(start)
	case <-time.After(within):
		t.Fatalf("no exit within %s after SIGTERM; stderr:\n%s", within, d.stderr.String())
	}
	return nil, 0
}

// freeAddr returns a loopback address with a port free at the time of the call.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, within time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s (%s)", what, state)
		}
		<-tick.C
	}
}

func countWhere(t *testing.T, db *pgxpool.Pool, where string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM reconciler.receipts WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Acceptance 5: two `reconciler run` processes on one database with 5,000
// due rows: every row gets exactly one settlement event, none is left
// reconciling.
func TestTwoInstancesSettleEachRowOnce(t *testing.T) {
	bin := buildBinary(t)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	const n = 5000
	seed(t, db, n, "things.create", "load-api", "outcome_unknown")
	adapters := writeFile(t, "adapters.yaml", `
version: 1
adapters:
  - name: load-static
    type: static
    kind: create
    dependency: load-api
    static: {verdict: present}
`)
	common := []string{"--adapters", adapters, "--poll-interval", "200ms", "--batch-size", "200", "--log-level", "warn"}
	metricsAddr := freeAddr(t)
	a := startDaemon(t, bin, url, append(common, "--instance", "a", "--metrics-addr", metricsAddr)...)
	b := startDaemon(t, bin, url, append(common, "--instance", "b")...)
	waitFor(t, 2*time.Minute, "every row settled", func() (bool, string) {
		left := countWhere(t, db, "state <> 'succeeded'")
		return left == 0, fmt.Sprintf("%d left", left)
	})
	for path, want := range map[string]string{
		"/healthz": "ok",
		"/readyz":  "ready",
		"/metrics": `reconciler_settlements_total{reason="present",state="succeeded"}`,
	} {
		resp, err := http.Get("http://" + metricsAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
			t.Errorf("GET %s = %d, want 200 with %q", path, resp.StatusCode, want)
		}
		if path == "/metrics" && strings.Contains(string(body), "receipt_id") {
			t.Error("a receipt id appears in the metrics")
		}
	}
	for name, d := range map[string]*daemon{"a": a, "b": b} {
		if err, _ := d.stop(t, 30*time.Second); err != nil {
			t.Fatalf("instance %s exited with %v; stderr:\n%s", name, err, d.stderr.String())
		}
	}
	var bad, events int
	err := db.QueryRow(context.Background(), `
		SELECT count(*) FILTER (WHERE k <> 1), coalesce(sum(k), 0) FROM (
			SELECT count(e.seq) AS k FROM reconciler.receipts r
			LEFT JOIN reconciler.receipt_events e ON e.receipt_id = r.id
			     AND e.to_state IN ('succeeded', 'safe_to_retry', 'manual_review')
			GROUP BY r.id) x`).Scan(&bad, &events)
	if err != nil {
		t.Fatal(err)
	}
	if bad != 0 || events != n {
		t.Fatalf("%d rows without exactly one settlement event (%d events for %d rows)", bad, events, n)
	}
	if left := countWhere(t, db, "state = 'reconciling' OR lease_owner IS NOT NULL"); left != 0 {
		t.Fatalf("%d rows left reconciling or leased", left)
	}
	rows, err := db.Query(context.Background(), `SELECT actor, count(*) FROM reconciler.receipt_events
		WHERE to_state = 'succeeded' GROUP BY actor ORDER BY actor`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var actor string
		var k int
		if err := rows.Scan(&actor, &k); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s settled %d", actor, k)
	}
}

// Acceptance 7: SIGTERM under load (checks slower than the grace period):
// the process exits 0 within the grace period and leaves no live lease.
func TestSigtermUnderLoad(t *testing.T) {
	bin := buildBinary(t)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	seed(t, db, 2000, "things.create", "slow-api", "outcome_unknown")
	adapters := writeFile(t, "adapters.yaml", `
version: 1
adapters:
  - name: slow-static
    type: static
    kind: create
    dependency: slow-api
    static: {verdict: present, delay: 1h}
`)
	const grace = 2 * time.Second
	d := startDaemon(t, bin, url, "--adapters", adapters, "--grace-period", grace.String(),
		"--workers", "16", "--batch-size", "100", "--check-timeout", "2h", "--lease", "5h", "--log-level", "warn")
	waitFor(t, time.Minute, "rows claimed", func() (bool, string) {
		k := countWhere(t, db, "lease_owner IS NOT NULL")
		return k > 0, fmt.Sprintf("%d leased", k)
	})
	err, took := d.stop(t, 30*time.Second)
	if err != nil {
		t.Fatalf("exit: %v; stderr:\n%s", err, d.stderr.String())
	}
	// The grace period, plus the time to write the releases and exit.
	if took > grace+3*time.Second {
		t.Fatalf("exit took %s, grace period %s", took, grace)
	}
	if k := countWhere(t, db, "lease_owner IS NOT NULL OR lease_expires_at IS NOT NULL"); k != 0 {
		t.Fatalf("%d rows left with a live lease", k)
	}
	if k := countWhere(t, db, "state IN ('succeeded', 'safe_to_retry', 'manual_review')"); k != 0 {
		t.Fatalf("%d rows settled, though no check could finish", k)
	}
	if strings.Contains(d.stderr.String(), `"level":"ERROR"`) {
		t.Fatalf("errors logged:\n%s", d.stderr.String())
	}
}

// `run --once` is the cron mode: it drains what is due, prints a summary
// and exits 0 even when every receipt needed a human; a malformed adapters
// file is refused at start with the file, the adapter and the field.
func TestRunOnceAndConfigErrors(t *testing.T) {
	bin := buildBinary(t)
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	seed(t, db, 3, "mail.send", "mailer", "outcome_unknown")
	seed(t, db, 2, "things.create", "nowhere", "outcome_unknown")
	good := writeFile(t, "adapters.yaml", "version: 1\nadapters:\n  - {name: mailer-blind, type: blind, dependency: mailer}\n")
	out, err := exec.Command(bin, "run", "--once", "--database-url", url, "--adapters", good).Output()
	if err != nil {
		t.Fatalf("run --once: %v\n%s", err, out)
	}
	for _, want := range []string{"claimed=5\n", "settled_manual_review=5\n", "reason_blind=3\n", "reason_no_adapter=2\n", "still_waiting=0\n"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}

	bad := writeFile(t, "bad.yaml", "version: 1\nadapters:\n  - name: slow\n    type: static\n    kind: create\n    dependency: api\n    consistency_window: soon\n    static: {verdict: present}\n")
	cmd := exec.Command(bin, "run", "--once", "--database-url", url, "--adapters", bad)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("bad adapters file: %v, want exit 1", err)
	}
	for _, want := range []string{bad + ":7", `adapter "slow"`, "consistency_window"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("error %q does not name %q", stderr.String(), want)
		}
	}
}
