package review

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/statemachine"
)

// Audit is one audit read of a settled absence (reconciler.verdict_audits,
// docs/verdict-audits.md): the reconciler read the receipt back after it
// had settled safe_to_retry (or, for a delete, succeeded).
type Audit struct {
	// At is when the audit read began; Settled and SettledAt the verdict
	// it audited.
	At        time.Time          `json:"at"`
	Adapter   string             `json:"adapter"`
	Settled   statemachine.State `json:"settled_state"`
	SettledAt time.Time          `json:"settled_at"`
	// Verdict is confirmed, contradicted (the effect is there: the
	// verdict was wrong, a false_absence) or inconclusive.
	Verdict string `json:"verdict"`
	// Matches is what the audit found, Retries how many of them later
	// attempts of the same logical key account for.
	Matches int `json:"matches"`
	Retries int `json:"retries"`
	// ObservedLagSeconds is, when contradicted, the time from submission
	// to the audit read.
	ObservedLagSeconds *float64 `json:"observed_lag_s,omitempty"`
	// Evidence is what the audit read returned and why it was judged so.
	Evidence json.RawMessage `json:"evidence"`
}

// Contradiction is a receipt whose settled absence an audit contradicted:
// it stays in its terminal state (a retry may have been made on the
// strength of it), and is listed for a person to look at the duplicate.
type Contradiction struct {
	ID             int64              `json:"id"`
	IdempotencyKey string             `json:"idempotency_key"`
	Operation      string             `json:"operation"`
	Dependency     string             `json:"dependency"`
	Attempt        int                `json:"attempt"`
	State          statemachine.State `json:"state"`
	SettledAt      time.Time          `json:"settled_at"`
	AuditedAt      time.Time          `json:"audited_at"`
	Matches        int                `json:"matches"`
	Retries        int                `json:"retries"`
	// Retried is the id of the receipt that retried this one, if any.
	Retried int64 `json:"retried_by,omitempty"`
	// AgeSeconds is the time since the audit, by the database's clock.
	AgeSeconds float64 `json:"age_s"`
}

// Contradicted returns the receipts whose settled absence an audit
// contradicted (false_absence) that match f (operation, dependency, audited
// at least f.OlderThan ago; a reason other than false_absence matches
// none), the newest first.
func Contradicted(ctx context.Context, pool *pgxpool.Pool, f Filter) ([]Contradiction, error) {
	if f.Reason != "" && f.Reason != FalseAbsence {
		return nil, nil
	}
	if f.Limit <= 0 {
		f.Limit = DefaultLimit
	}
	var minAge *float64
	if f.OlderThan > 0 {
		s := f.OlderThan.Seconds()
		minAge = &s
	}
	rows, err := pool.Query(ctx, sqlContradicted, nullText(f.Operation), nullText(f.Dependency), minAge, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("review: contradicted verdicts: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Contradiction, error) {
		var c Contradiction
		var state string
		err := row.Scan(&c.ID, &c.IdempotencyKey, &c.Operation, &c.Dependency, &c.Attempt, &state,
			&c.SettledAt, &c.AuditedAt, &c.Matches, &c.Retries, &c.Retried, &c.AgeSeconds)
		c.State = statemachine.State(state)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("review: contradicted verdicts: %w", err)
	}
	return out, nil
}

// nullText returns s as a nullable text parameter: NULL when empty.
func nullText(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// audits reads the audits of receipt id, in order.
func audits(ctx context.Context, tx pgx.Tx, id int64) ([]Audit, error) {
	rows, err := tx.Query(ctx, sqlAudits, id)
	if err != nil {
		return nil, fmt.Errorf("review: audits of receipt %d: %w", id, err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Audit, error) {
		var a Audit
		var settled string
		err := row.Scan(&a.At, &a.Adapter, &settled, &a.SettledAt, &a.Verdict, &a.Matches, &a.Retries,
			&a.ObservedLagSeconds, &a.Evidence)
		a.Settled = statemachine.State(settled)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("review: audits of receipt %d: %w", id, err)
	}
	return out, nil
}

// AsHeld is c as an entry of a review list: reason false_absence, held
// since the audit that contradicted it, by the reconciler's audit. It is
// not in manual_review: a person looks for the duplicate the retry made,
// and resolve does not apply to it.
func (c Contradiction) AsHeld() Held {
	age := time.Duration(c.AgeSeconds * float64(time.Second))
	return Held{ID: c.ID, IdempotencyKey: c.IdempotencyKey, Operation: c.Operation, Dependency: c.Dependency,
		Attempt: c.Attempt, HeldSince: c.AuditedAt, Age: age, AgeSeconds: age.Seconds(),
		HeldBy: "reconciler:audit", Reason: FalseAbsence}
}

// FalseAbsence is the reason of a contradicted verdict in a review list.
const FalseAbsence = "false_absence"
