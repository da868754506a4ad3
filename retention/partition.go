package retention

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// partitionRange is a range [Lo, Hi) of receipt ids the history tables are
// partitioned by; Lo nil for the first partition (from MINVALUE).
type partitionRange struct {
	Lo *int64
	Hi int64
}

// String names the range as its archive does, with the 19 digits of the
// partitions' names (migration 00021); the first partition's lower bound
// is "min".
func (r partitionRange) String() string {
	lo := "min"
	if r.Lo != nil {
		lo = fmt.Sprintf("%019d", *r.Lo)
	}
	return lo + "-" + fmt.Sprintf("%019d", r.Hi)
}

// removePartitions drops, oldest first, every history partition range
// whose receipts all left the ledger before historyBefore and that no new
// receipt can land in (reconciler.retention_partition_keep_reason), each
// exported first to history-p<lo>-<hi>.jsonl.gz. The database re-checks
// the rule and the rows under the partitions' locks; a refusal (RL020: a
// row written after the export) stops the pass, nothing of that range
// removed, and the next pass exports it again.
func (a *Archiver) removePartitions(ctx context.Context, historyBefore time.Time, rep *Report) error {
	rows, err := a.db.Query(ctx, sqlPartitionsDue, historyBefore)
	if err != nil {
		return fmt.Errorf("retention: history partitions: %w", err)
	}
	due, err := pgx.CollectRows(rows, pgx.RowToStructByPos[partitionRange])
	if err != nil {
		return fmt.Errorf("retention: history partitions: %w", err)
	}
	for _, r := range due {
		name := "history-p" + r.String() + ".jsonl.gz"
		counts, loc, sum, err := a.export(ctx, name, partitionTables(), sqlExportPartition, r.Lo, r.Hi)
		if err != nil {
			return err
		}
		var batch int64
		if err := a.db.QueryRow(ctx, sqlDropPartition, pgx.NamedArgs{"lo": r.Lo, "hi": r.Hi,
			"history_before": historyBefore, "archive": loc, "sha256": sum, "expected": counts}).Scan(&batch); err != nil {
			return fmt.Errorf("retention: drop the history partition %s (archived in %s): %w", r, loc, err)
		}
		rep.HistoryPartitions++
		rep.Files = append(rep.Files, loc)
		for t, n := range counts {
			rep.Rows[t] += n
		}
		a.log.Info("retention: history partition dropped", "batch", batch, "range", r.String(),
			"events", counts["receipt_events"], "checks", counts["readback_checks"],
			"audits", counts["verdict_audits"], "archive", loc, "sha256", sum)
	}
	return nil
}

// partitionTables are the tables partitioned by receipt id, whose
// partitions of a range leave together.
func partitionTables() []string {
	return []string{"receipt_events", "readback_checks", "verdict_audits"}
}

// maxKeptShare bounds the share of a pinned range's receipts (those kept,
// over those kept and those whose history would leave) below which the
// range is compacted rather than its history removed row by row: a
// compaction copies the kept receipts' history and scans the partitions,
// which is worth it while the kept share is small (at `bench scale`'s mix,
// ~0.7% of receipts are kept, so every range qualifies); above it the
// copy would approach the rows it removes.
const maxKeptShare = 0.10

// compactRange is a pinned range and the compactions it had.
type compactRange struct {
	partitionRange
	Compactions int64
}

// compactPartitions compacts, oldest first, every history partition range
// that receipts still in the ledger pin but whose other receipts all left
// before historyBefore (reconciler.retention_partition_compact_reason), if
// the kept share is below maxKeptShare: it exports the rows of the
// receipts that left to history-p<lo>-<hi>-c<n>.jsonl.gz (n: the range's
// nth compaction) and removes them at once, the kept receipts' history
// staying whole. A refusal (RL020: a row written after the export, a kept
// receipt that left) stops the pass, nothing of that range removed.
func (a *Archiver) compactPartitions(ctx context.Context, historyBefore time.Time, rep *Report) error {
	rows, err := a.db.Query(ctx, sqlPartitionsToCompact, pgx.NamedArgs{"history_before": historyBefore,
		"max_kept_share": maxKeptShare})
	if err != nil {
		return fmt.Errorf("retention: history partitions to compact: %w", err)
	}
	due, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (compactRange, error) {
		var c compactRange
		err := row.Scan(&c.Lo, &c.Hi, &c.Compactions)
		return c, err
	})
	if err != nil {
		return fmt.Errorf("retention: history partitions to compact: %w", err)
	}
	for _, r := range due {
		name := fmt.Sprintf("history-p%s-c%d.jsonl.gz", r.partitionRange, r.Compactions+1)
		counts, loc, sum, err := a.export(ctx, name, partitionTables(), sqlExportCompaction, r.Lo, r.Hi)
		if err != nil {
			return err
		}
		var batch int64
		if err := a.db.QueryRow(ctx, sqlCompactPartition, pgx.NamedArgs{"lo": r.Lo, "hi": r.Hi,
			"history_before": historyBefore, "archive": loc, "sha256": sum, "expected": counts}).Scan(&batch); err != nil {
			return fmt.Errorf("retention: compact the history partition %s (archived in %s): %w", r.partitionRange, loc, err)
		}
		rep.HistoryPartitionsCompacted++
		rep.Files = append(rep.Files, loc)
		for t, n := range counts {
			rep.Rows[t] += n
		}
		a.log.Info("retention: history partition compacted", "batch", batch, "range", r.partitionRange.String(),
			"events", counts["receipt_events"], "checks", counts["readback_checks"],
			"audits", counts["verdict_audits"], "archive", loc, "sha256", sum)
	}
	return nil
}
