package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/migrations"
)

// access is what a command does to the ledger, the privileges that takes
// (a boolean SQL expression over the current login) and the roles of
// docs/roles.sql that have them.
type access struct {
	what  string
	roles string
	sql   string
}

var (
	// readBacklog: `stats`.
	readBacklog = access{"read the backlog",
		"reconciler_worker, reconciler_reviewer or reconciler_readonly",
		`has_table_privilege('reconciler.receipts', 'SELECT') AND has_table_privilege('reconciler.duplicate_alarms', 'SELECT')
		 AND has_table_privilege('reconciler.lifetime_alarms', 'SELECT')`}
	// readLedger: `receipts show`, `review list|show`, `adapters check --receipt|--control`.
	readLedger = access{"read receipts, their history and evidence",
		"reconciler_reviewer or reconciler_readonly",
		`has_table_privilege('reconciler.receipts', 'SELECT') AND has_table_privilege('reconciler.receipt_events', 'SELECT')
		 AND has_table_privilege('reconciler.readback_checks', 'SELECT') AND has_table_privilege('reconciler.late_outcomes', 'SELECT')`}
	// settle: `run`.
	settle = access{"claim and settle receipts",
		"reconciler_worker",
		`has_table_privilege('reconciler.receipts', 'SELECT') AND has_column_privilege('reconciler.receipts', 'lease_owner', 'UPDATE')
		 AND has_any_column_privilege('reconciler.readback_checks', 'INSERT') AND has_table_privilege('reconciler.dependency_breakers', 'UPDATE')`}
	// moveHeld: `review resolve|requeue`.
	moveHeld = access{"move held receipts",
		"reconciler_reviewer",
		`has_table_privilege('reconciler.receipts', 'SELECT') AND has_column_privilege('reconciler.receipts', 'state', 'UPDATE')
		 AND has_table_privilege('reconciler.receipt_events', 'SELECT')`}
)

// checkLedger is what every runtime command does before it touches the
// ledger: it checks, reading only, that the schema is the one this binary
// needs (migrations.Check) and that the login has the privileges of need.
// Either failure is the command's one-line error (exit 1) naming the fix;
// nothing is created or written.
func checkLedger(ctx context.Context, cmd string, pool *pgxpool.Pool, need access) error {
	if err := migrations.Check(ctx, pool); err != nil {
		if msg, ok := connectFailure(cmd, err); ok {
			return cli.Exit(msg, 1)
		}
		var se *migrations.SchemaError
		if errors.As(err, &se) {
			return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
		}
		return cli.Exit(fmt.Sprintf("%s: database: %v", cmd, err), 1)
	}
	var ok bool
	if err := pool.QueryRow(ctx, `SELECT `+need.sql).Scan(&ok); err != nil {
		return dbFailure(cmd, pool, err, need)
	}
	if !ok {
		return cli.Exit(refusal(cmd, pool, need), 1)
	}
	return nil
}

func refusal(cmd string, pool *pgxpool.Pool, need access) string {
	return fmt.Sprintf("%s: permission denied: login %q may not %s (docs/roles.sql grants that to %s)",
		cmd, pool.Config().ConnConfig.User, need.what, need.roles)
}

// dbFailure is the one-line error of a failed database operation: a
// permission refusal names the role that has the right.
func dbFailure(cmd string, pool *pgxpool.Pool, err error, need access) error {
	if msg, ok := connectFailure(cmd, err); ok {
		return cli.Exit(msg, 1)
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42501" {
		return cli.Exit(refusal(cmd, pool, need)+": "+pe.Message, 1)
	}
	return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
}
