package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// Issue 25: `archive run` takes its policy from the adapters file, removes
// the old settled receipt and keeps the one in flight, and `archive verify`
// reads back every file it wrote; a policy is required.
func TestArchiveCommand(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		     state, state_actor, created_at, submitted_at, updated_at, version)
		 SELECT 'k' || g, 'things.create', 'api', 'POST', '/things', 'sha256:' || repeat('a', 64),
		     CASE g WHEN 1 THEN 'succeeded' ELSE 'outcome_unknown' END, 'agent:a',
		     now() - interval '200 days', now() - interval '200 days', now() - interval '100 days', 3
		 FROM generate_series(1, 2) g`,
		`INSERT INTO reconciler.receipt_keys SELECT idempotency_key, id FROM reconciler.receipts`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor)
		 SELECT id, 1, 'planned', created_at, 'agent:a' FROM reconciler.receipts`,
		`RESET session_replication_role`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	conn.Release()

	dir := t.TempDir()
	adapters := filepath.Join(dir, "adapters.yaml")
	if err := os.WriteFile(adapters, []byte(`version: 1
retention: {settled: 90d, history: 90d}
adapters:
  - {name: s, type: static, kind: create, dependency: api, static: {verdict: present}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(dir, "archive")
	if err := os.Mkdir(archive, 0o700); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := runCLI(t, "", "archive", "run", "--database-url", url, "--dir", archive)
	if code != 2 || !strings.Contains(errOut, "--adapters") {
		t.Errorf("no policy: exit %d, stderr %q", code, errOut)
	}
	code, out, errOut = runCLI(t, "", "archive", "run", "--database-url", url, "--dir", archive, "--adapters", adapters)
	if code != 0 || !strings.Contains(out, "removed_receipts=1\n") || !strings.Contains(out, "removed_receipt_events=1\n") {
		t.Fatalf("archive run: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	var files []string
	for _, l := range strings.Split(out, "\n") {
		if f, ok := strings.CutPrefix(l, "file="); ok {
			files = append(files, f)
		}
	}
	code, out, errOut = runCLI(t, "", append([]string{"archive", "verify"}, files...)...)
	if code != 0 || !strings.Contains(out, "receipts=1") || !strings.Contains(out, "receipt_events=1") {
		t.Errorf("archive verify: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	var left int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipts WHERE state = 'outcome_unknown'`).Scan(&left); err != nil || left != 1 {
		t.Errorf("%d receipts in flight left, %v", left, err)
	}
	// A file altered after the fact fails verification.
	if err := os.WriteFile(files[0], []byte("tampered"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut = runCLI(t, "", "archive", "verify", files[0]); code != 1 || !strings.Contains(errOut, "checksum") {
		t.Errorf("tampered file: exit %d, stderr %q", code, errOut)
	}
}
