// Package retention removes from the ledger the settled receipts no
// guarantee needs any more, and later their history, each only after it was
// exported to an archive (JSON Lines, gzip, a SHA-256 beside each file).
//
// What keeps a receipt is one SQL rule, reconciler.retention_keep_reason
// (migration 00020): it is unsettled or in manual_review, settled inside
// the policy, inside the native idempotency key's retention or the absence
// window its settlement recorded, inside the request horizon of the
// adapters, the open end of a retry chain, or it has a duplicate alarm, a
// webhook delivery pending or a replayable gateway response. The archiver
// chooses by it and the removal function re-checks it under a row lock, so
// a receipt a guarantee needs is never removed, whatever the caller passes.
//
// A removal is one call of a SECURITY DEFINER function that records the
// batch (reconciler.retention_batches, removed_receipts), deletes, and
// refuses the batch unless the rows it deleted are exactly the rows the
// archive holds. Idempotency keys are never removed: the key of a removed
// receipt stays taken, so its reuse is refused rather than sent again.
//
// History is partitioned by ranges of receipt id (migration 00021): a
// range whose receipts all left before the history policy, and that the
// receipts sequence has passed, leaves whole, exported to one file and then
// dropped by one SECURITY DEFINER call (migration 00022) that re-checks the
// rule and the rows under the partitions' locks. A range a few kept
// receipts pin is compacted (migration 00024): the history of its receipts
// that left is exported and removed at once, the kept receipts' history
// copied into new partitions. The history left, that of receipts in ranges
// where the kept share is too large, goes row by row.
// See docs/retention.md.
package retention

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrInvalidPolicy means a Policy is unusable.
var ErrInvalidPolicy = errors.New("retention: invalid policy")

// Policy says what leaves the ledger and when.
type Policy struct {
	// Settled is how long a settled receipt stays after its settlement
	// (its last move), at the least.
	Settled time.Duration
	// History is how long its history (receipt_events, readback_checks)
	// stays after the settlement; at least Settled.
	History time.Duration
	// Horizon is the longest a call's answer can still arrive after its
	// send deadline: the largest request lifetime plus consistency window,
	// or native key retention, of any adapter (see HorizonOf). A receipt
	// stays until it has passed, whatever Settled says.
	Horizon time.Duration
	// Batch is the number of receipts removed per batch (whole retry
	// chains, so a batch may hold a few more).
	Batch int
	// NoCompaction leaves a history range pinned by a few kept receipts
	// to the row-by-row path instead of compacting it: a compaction holds
	// every writer of the history (agents planning included) for its
	// duration, seconds for a range of a million ids (docs/retention.md),
	// which a ledger that cannot pause its writes may not want.
	NoCompaction bool
}

// DefaultBatch is the batch size of a Policy that sets none: large enough
// to amortise a file and a function call, small enough that a batch's
// locks and its export stay short.
const DefaultBatch = 5000

// Validate returns an error matching ErrInvalidPolicy if p is unusable.
func (p Policy) Validate() error {
	switch {
	case p.Settled <= 0:
		return fmt.Errorf("%w: settled must be positive", ErrInvalidPolicy)
	case p.History < p.Settled:
		return fmt.Errorf("%w: history (%s) must be at least settled (%s)", ErrInvalidPolicy, p.History, p.Settled)
	case p.Horizon < 0:
		return fmt.Errorf("%w: the request horizon must not be negative", ErrInvalidPolicy)
	case p.Batch < 0:
		return fmt.Errorf("%w: the batch size must not be negative", ErrInvalidPolicy)
	}
	return nil
}

// Report counts what a pass removed.
type Report struct {
	// ReceiptBatches and HistoryBatches count the batches removed.
	ReceiptBatches, HistoryBatches int
	// HistoryPartitions counts the history partition ranges dropped whole.
	HistoryPartitions int
	// HistoryPartitionsCompacted counts the pinned ranges compacted: the
	// history of their receipts that left removed at once, the kept
	// receipts' history copied into new partitions.
	HistoryPartitionsCompacted int
	// Rows counts the rows removed per table.
	Rows map[string]int64
	// Files are the archives written, in order.
	Files []string
}

// Archiver runs retention passes over one ledger.
type Archiver struct {
	db   *pgxpool.Pool
	sink Sink
	log  *slog.Logger
}

// New returns an Archiver removing from db what it first writes to sink.
// A nil log discards.
func New(db *pgxpool.Pool, sink Sink, log *slog.Logger) *Archiver {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return &Archiver{db: db, sink: sink, log: log}
}

// Run makes one pass: it removes, in batches, every receipt chain p lets
// go (each batch exported first), then, oldest first, every history
// partition range nothing in which is needed any more (see
// removePartitions), then every range a few kept receipts pin (see
// compactPartitions), then row by row the history left of every removed
// batch past p.History. maxBatches bounds the receipts batches of the pass (0:
// no bound). An export that fails stops the pass with its error, nothing of
// that batch removed; a batch the database refuses (a receipt changed
// since it was chosen: RL020) stops it too.
func (a *Archiver) Run(ctx context.Context, p Policy, maxBatches int) (Report, error) {
	rep := Report{Rows: map[string]int64{}}
	if err := p.Validate(); err != nil {
		return rep, err
	}
	if p.Batch == 0 {
		p.Batch = DefaultBatch
	}
	var now time.Time
	if err := a.db.QueryRow(ctx, sqlNow).Scan(&now); err != nil {
		return rep, fmt.Errorf("retention: clock: %w", err)
	}
	settledBefore := now.Add(-p.Settled)
	bound, err := a.bound(ctx, settledBefore)
	if err != nil {
		return rep, err
	}
	var after int64
	for maxBatches == 0 || rep.ReceiptBatches < maxBatches {
		ids, next, err := a.choose(ctx, after, bound, settledBefore, p)
		if err != nil {
			return rep, err
		}
		if len(ids) == 0 {
			break
		}
		if err := a.removeReceipts(ctx, ids, settledBefore, p.Horizon, &rep); err != nil {
			return rep, err
		}
		after = next
	}
	if err := a.removePartitions(ctx, now.Add(-p.History), &rep); err != nil {
		return rep, err
	}
	if !p.NoCompaction {
		if err := a.compactPartitions(ctx, now.Add(-p.History), &rep); err != nil {
			return rep, err
		}
	}
	for {
		done, err := a.removeHistory(ctx, now.Add(-p.History), &rep)
		if err != nil || !done {
			return rep, err
		}
	}
}

// bound returns the highest receipt id created before t (0: none), by
// binary search over the primary key.
func (a *Archiver) bound(ctx context.Context, t time.Time) (int64, error) {
	var lo, hi int64
	if err := a.db.QueryRow(ctx, sqlIDRange).Scan(&lo, &hi); err != nil {
		return 0, fmt.Errorf("retention: id range: %w", err)
	}
	created := func(id int64) (time.Time, error) {
		var at time.Time
		err := a.db.QueryRow(ctx, sqlCreatedAt, id).Scan(&at)
		return at, err
	}
	if hi == 0 {
		return 0, nil
	}
	if at, err := created(lo); err != nil {
		return 0, fmt.Errorf("retention: bound: %w", err)
	} else if !at.Before(t) {
		return 0, nil
	}
	// Invariant: the receipt at or after lo was created before t; ids above
	// hi+1 were not (or do not exist).
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		at, err := created(mid)
		if err != nil {
			return 0, fmt.Errorf("retention: bound: %w", err)
		}
		if at.Before(t) {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo, nil
}

// choose returns the ids of the next chains that may go, p.Batch receipts
// (a few more when the last chain has retries) unless the range ran out,
// and the id to continue after.
func (a *Archiver) choose(ctx context.Context, after, bound int64, settledBefore time.Time, p Policy) ([]int64, int64, error) {
	var ids []int64
	for len(ids) < p.Batch && after < bound {
		before := len(ids)
		rows, err := a.db.Query(ctx, sqlChains, pgx.NamedArgs{"after": after, "bound": bound,
			"settled_before": settledBefore, "horizon_us": p.Horizon.Microseconds(), "limit": p.Batch - len(ids)})
		if err != nil {
			return nil, 0, fmt.Errorf("retention: choose: %w", err)
		}
		scanned := 0
		var head int64
		var chain []int64
		var removable bool
		_, err = pgx.ForEachRow(rows, []any{&head, &chain, &removable}, func() error {
			scanned++
			after = head
			if removable {
				ids = append(ids, chain...)
			}
			return nil
		})
		if err != nil {
			return nil, 0, fmt.Errorf("retention: choose: %w", err)
		}
		if scanned < p.Batch-before {
			after = bound
		}
	}
	return ids, after, nil
}

// removeReceipts exports the rows of ids and then removes them.
func (a *Archiver) removeReceipts(ctx context.Context, ids []int64, settledBefore time.Time, horizon time.Duration, rep *Report) error {
	name := fmt.Sprintf("receipts-%012d-%012d.jsonl.gz", ids[0], ids[len(ids)-1])
	counts, loc, sum, err := a.export(ctx, name, receiptTables(), sqlExportReceipts, ids)
	if err != nil {
		return err
	}
	var batch int64
	if err := a.db.QueryRow(ctx, sqlRemoveReceipts, ids, loc, sum, settledBefore, horizon.Microseconds(), counts).Scan(&batch); err != nil {
		return fmt.Errorf("retention: remove receipts %d..%d (archived in %s): %w", ids[0], ids[len(ids)-1], loc, err)
	}
	rep.ReceiptBatches++
	rep.Files = append(rep.Files, loc)
	for t, n := range counts {
		rep.Rows[t] += n
	}
	a.log.Info("retention: receipts removed", "batch", batch, "receipts", counts["receipts"], "archive", loc, "sha256", sum)
	return nil
}

// removeHistory exports and removes the history of the oldest receipts
// batch past cutoff; false when there was none.
func (a *Archiver) removeHistory(ctx context.Context, cutoff time.Time, rep *Report) (bool, error) {
	var of int64
	if err := a.db.QueryRow(ctx, sqlHistoryDue, cutoff).Scan(&of); errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("retention: history: %w", err)
	}
	name := fmt.Sprintf("history-%012d.jsonl.gz", of)
	counts, loc, sum, err := a.export(ctx, name, historyTables(), sqlExportHistory, of)
	if err != nil {
		return false, err
	}
	var batch int64
	if err := a.db.QueryRow(ctx, sqlRemoveHistory, of, loc, sum, counts).Scan(&batch); err != nil {
		return false, fmt.Errorf("retention: remove the history of batch %d (archived in %s): %w", of, loc, err)
	}
	rep.HistoryBatches++
	rep.Files = append(rep.Files, loc)
	for t, n := range counts {
		rep.Rows[t] += n
	}
	a.log.Info("retention: history removed", "batch", batch, "of_batch", of,
		"events", counts["receipt_events"], "checks", counts["readback_checks"], "archive", loc, "sha256", sum)
	return true, nil
}

// export writes the rows query returns for args as the archive name and
// counts them per table (every table of tables counted, zero included: the
// removal compares the two maps).
func (a *Archiver) export(ctx context.Context, name string, tables []string, query string, args ...any) (map[string]int64, string, string, error) {
	counts := make(map[string]int64, len(tables))
	for _, t := range tables {
		counts[t] = 0
	}
	loc, sum, err := a.sink.Write(ctx, name, func(w io.Writer) error {
		rows, err := a.db.Query(ctx, query, args...)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(w)
		var l Line
		_, err = pgx.ForEachRow(rows, []any{&l.Table, &l.Row}, func() error {
			counts[l.Table]++
			return enc.Encode(l)
		})
		return err
	})
	if err != nil {
		return nil, "", "", fmt.Errorf("retention: export %s (nothing removed): %w", name, err)
	}
	return counts, loc, sum, nil
}
