package reconcile

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// DefaultPartitionInterval is how often the keeper makes sure the history
// partitions are ahead when PartitionConfig.Interval is unset.
const DefaultPartitionInterval = time.Minute

// HistoryPartition is one partition of a history table (receipt_events,
// readback_checks, verdict_audits): receipt ids From (inclusive, nil: no
// lower bound) to To (exclusive), or, Default, the partition that holds a
// row past every range.
type HistoryPartition struct {
	Parent, Name string
	From, To     *int64
	Default      bool
	// DefaultRows is the rows a default partition holds (0 otherwise).
	DefaultRows int64
	// Described by PartitionKeeper.Describe only: the planner's estimate
	// of its rows (-1: never analyzed), its size with its indexes, and the
	// creation times of the first and last receipt of its range (nil: no
	// receipt; a default partition has no range).
	EstimatedRows             int64
	Bytes                     int64
	FirstCreated, LastCreated *time.Time
}

// PartitionStatus is what the keeper found after a round.
type PartitionStatus struct {
	// Created is how many partitions this round created.
	Created int
	// LastID is the receipts' highest id.
	LastID int64
	// Ahead is the fewest ranges, over the three tables, that lie wholly
	// above LastID: how many more ranges of receipts can be planned before
	// their history lands in a default partition.
	Ahead int
	// DefaultRows is the rows the default partitions hold, together: none
	// unless the ranges ahead ran out (or a row was written with an id of
	// its own past them).
	DefaultRows int64
	// Partitions are the partitions of each table, in id order.
	Partitions []HistoryPartition
}

// PartitionMetrics are the keeper's gauges.
type PartitionMetrics struct {
	// Ahead is PartitionStatus.Ahead.
	Ahead prometheus.Gauge
	// DefaultRows is PartitionStatus.DefaultRows.
	DefaultRows prometheus.Gauge
}

// NewPartitionMetrics creates the keeper's gauges and registers them with
// reg. Until the first round they read -1 ahead (unknown), which the alert
// on "no range ahead" does not mistake for 0.
func NewPartitionMetrics(reg prometheus.Registerer) *PartitionMetrics {
	m := &PartitionMetrics{
		Ahead: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_history_partitions_ahead",
			Help: "History partitions wholly above the receipts' highest id, the fewest over receipt_events, readback_checks and verdict_audits (-1 until known): 0 means the next receipts' history lands in a default partition.",
		}),
		DefaultRows: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "reconciler_history_default_rows",
			Help: "Rows held by the history tables' default partitions: history past every range (the partitions ahead ran out); kept, but no partition can be dropped around them.",
		}),
	}
	m.Ahead.Set(-1)
	reg.MustRegister(m.Ahead, m.DefaultRows)
	return m
}

// PartitionConfig configures a PartitionKeeper.
type PartitionConfig struct {
	// Interval is the time between rounds (default
	// DefaultPartitionInterval).
	Interval time.Duration
	// Tick, if set, replaces the Interval ticker: a round runs on each
	// receive (tests inject their clock this way).
	Tick <-chan time.Time
	// Logger receives the partitions created (INFO), a default partition
	// holding rows (ERROR) and failed rounds (WARN).
	Logger *slog.Logger
	// Metrics, if set, get the status of each round.
	Metrics *PartitionMetrics
}

// PartitionKeeper keeps the history partitions ahead of the receipts
// (reconciler.ensure_history_partitions, migration 00021). Every instance
// runs one; the function's advisory lock makes one of them the leader of
// each round, and the others' calls return at once.
type PartitionKeeper struct {
	db  *pgxpool.Pool
	cfg PartitionConfig
	log *slog.Logger
}

// NewPartitionKeeper returns a keeper over db.
func NewPartitionKeeper(db *pgxpool.Pool, cfg PartitionConfig) *PartitionKeeper {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultPartitionInterval
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &PartitionKeeper{db: db, cfg: cfg, log: log}
}

// Run makes a round at once and then one per interval (or per tick) until
// ctx is cancelled. A failed round is logged and retried the next time.
func (k *PartitionKeeper) Run(ctx context.Context) {
	tick := k.cfg.Tick
	if tick == nil {
		t := time.NewTicker(k.cfg.Interval)
		defer t.Stop()
		tick = t.C
	}
	for {
		if _, err := k.Ensure(ctx); err != nil && ctx.Err() == nil {
			k.log.Warn("history partitions: round failed; retried next round", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick:
		}
	}
}

// Ensure makes one round: creates the partitions due, reads their status,
// logs it and sets the metrics.
func (k *PartitionKeeper) Ensure(ctx context.Context) (PartitionStatus, error) {
	var st PartitionStatus
	err := pgx.BeginFunc(ctx, k.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlPartitionLockTimeout); err != nil {
			return err
		}
		return tx.QueryRow(ctx, sqlEnsurePartitions).Scan(&st.Created)
	})
	if err != nil {
		return st, fmt.Errorf("reconcile: ensure history partitions: %w", err)
	}
	if st, err = k.status(ctx, st.Created); err != nil {
		return st, err
	}
	if st.Created > 0 {
		k.log.Info("history partitions created", "created", st.Created, "ahead", st.Ahead, "last_receipt_id", st.LastID)
	}
	if st.DefaultRows > 0 {
		k.log.Error("history default partitions hold rows: history written past every range is kept there, "+
			"and the next ranges start above it (docs/retention.md, \"Partitioned history\")",
			"rows", st.DefaultRows, "ahead", st.Ahead)
	}
	if m := k.cfg.Metrics; m != nil {
		m.Ahead.Set(float64(st.Ahead))
		m.DefaultRows.Set(float64(st.DefaultRows))
	}
	return st, nil
}

// Describe reads the partitions without creating any, with each one's
// size and period of creation time.
func (k *PartitionKeeper) Describe(ctx context.Context) (PartitionStatus, error) {
	st, err := k.status(ctx, 0)
	if err != nil {
		return st, err
	}
	for i := range st.Partitions {
		p := &st.Partitions[i]
		from, to := ptrOr(p.From, math.MinInt64), ptrOr(p.To, math.MaxInt64)
		if p.Default {
			from, to = 0, 0 // no range: no receipt matches
		}
		if err := k.db.QueryRow(ctx, sqlPartitionDetails, p.Name, from, to).Scan(
			&p.EstimatedRows, &p.Bytes, &p.FirstCreated, &p.LastCreated); err != nil {
			return st, fmt.Errorf("reconcile: history partition %s: %w", p.Name, err)
		}
	}
	return st, nil
}

// Status reads the partitions without creating any.
func (k *PartitionKeeper) Status(ctx context.Context) (PartitionStatus, error) {
	return k.status(ctx, 0)
}

func (k *PartitionKeeper) status(ctx context.Context, created int) (PartitionStatus, error) {
	st := PartitionStatus{Created: created}
	rows, err := k.db.Query(ctx, sqlHistoryPartitions)
	if err != nil {
		return st, fmt.Errorf("reconcile: history partitions: %w", err)
	}
	for rows.Next() {
		var p HistoryPartition
		var dflt *int64
		if err := rows.Scan(&p.Parent, &p.Name, &p.From, &p.To, &dflt, &st.LastID); err != nil {
			rows.Close()
			return st, fmt.Errorf("reconcile: history partitions: %w", err)
		}
		if dflt != nil {
			p.Default, p.DefaultRows = true, *dflt
		}
		st.Partitions = append(st.Partitions, p)
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("reconcile: history partitions: %w", err)
	}
	slices.SortStableFunc(st.Partitions, func(a, b HistoryPartition) int {
		return cmp.Or(strings.Compare(a.Parent, b.Parent), cmp.Compare(partitionRank(a), partitionRank(b)),
			cmp.Compare(ptrOr(a.From, 0), ptrOr(b.From, 0)))
	})
	ahead := map[string]int{}
	for _, p := range st.Partitions {
		if _, ok := ahead[p.Parent]; !ok {
			ahead[p.Parent] = 0
		}
		if p.Default {
			st.DefaultRows += p.DefaultRows
		} else if p.From != nil && *p.From > st.LastID {
			ahead[p.Parent]++
		}
	}
	st.Ahead = -1
	for _, n := range ahead {
		if st.Ahead < 0 || n < st.Ahead {
			st.Ahead = n
		}
	}
	return st, nil
}

// partitionRank orders a table's partitions: the one from MINVALUE, the
// ranges, the default.
func partitionRank(p HistoryPartition) int {
	switch {
	case p.Default:
		return 2
	case p.From == nil:
		return 0
	}
	return 1
}

func ptrOr(v *int64, or int64) int64 {
	if v == nil {
		return or
	}
	return *v
}
