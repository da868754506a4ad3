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
