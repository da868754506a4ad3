package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
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

// Issue 25: a history partition range whose receipts all left leaves whole:
// `archive run` prints history_partitions and the range's file, which
// `archive verify` reads back with the range's rows.
func TestArchiveDropsAHistoryPartition(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, url)
	var lo int64
	if err := db.QueryRow(ctx, `SELECT max(to_id) FROM reconciler.history_partitions()`).Scan(&lo); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		// The owner makes ranges of 10 ids above the migration's, and the
		// receipts start at the first of them.
		`SELECT setval(pg_get_serial_sequence('reconciler.receipts', 'id'), ` + strconv.FormatInt(lo-1, 10) + `)`,
		`UPDATE reconciler.history_partitioning SET width = 10`,
		`SELECT reconciler.ensure_history_partitions()`,
		`SET session_replication_role = replica`,
		`INSERT INTO reconciler.receipts (idempotency_key, operation, dependency, method, target, fingerprint,
		     state, state_actor, created_at, submitted_at, updated_at, version)
		 SELECT 'k' || g, 'things.create', 'api', 'POST', '/things', 'sha256:' || repeat('a', 64),
		     CASE WHEN g <= 10 THEN 'succeeded' ELSE 'outcome_unknown' END, 'agent:a',
		     now() - interval '200 days', now() - interval '200 days', now() - interval '100 days', 3
		 FROM generate_series(1, 11) g`,
		`INSERT INTO reconciler.receipt_keys SELECT idempotency_key, id FROM reconciler.receipts`,
		`INSERT INTO reconciler.receipt_events (receipt_id, seq, to_state, at, actor)
		 SELECT id, 1, 'planned', created_at, 'agent:a' FROM reconciler.receipts`,
		`RESET session_replication_role`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	conn.Release()

	archive := t.TempDir()
	code, out, errOut := runCLI(t, "", "archive", "run", "--database-url", url, "--dir", archive,
		"--settled", "90d", "--horizon", "1h")
	file := filepath.Join(archive, fmt.Sprintf("history-p%019d-%019d.jsonl.gz", lo, lo+10))
	if code != 0 || !strings.Contains(out, "\nhistory_partitions=") || strings.Contains(out, "\nhistory_partitions=0\n") ||
		!strings.Contains(out, "\nhistory_partitions_compacted=0\n") || !strings.Contains(out, "file="+file+"\n") {
		t.Fatalf("archive run: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "", "archive", "verify", file)
	if code != 0 || !strings.Contains(out, "receipt_events=10") {
		t.Errorf("archive verify: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM reconciler.receipt_events`).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d events left, want the one of the receipt in flight (%v)", n, err)
	}
}
