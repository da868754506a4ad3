package main

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
)

// openDatabase parses --database-url and makes the command's pool. A URL
// that does not parse is a usage error (exit 2, as the table of exit codes
// in docs/operations.md says): nothing was tried, the operator typed it
// wrong. The pool connects lazily, so a refused connection or a wrong
// password shows up at the first query: connectFailure words that one.
func openDatabase(ctx context.Context, cmd, url string) (*pgxpool.Pool, error) {
	cfg, err := parseDatabaseURL(cmd, url)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
	}
	return pool, nil
}

// openLedgerPool is openDatabase for the commands that write the ledger
// (run, gateway): the pool is configured by ledger.ConfigurePool, which
// watches the server's warnings (a submit whose wait for a synchronous
// standby was canceled is never followed by a send).
func openLedgerPool(ctx context.Context, cmd, url string) (*pgxpool.Pool, error) {
	cfg, err := parseDatabaseURL(cmd, url)
	if err != nil {
		return nil, err
	}
	ledger.ConfigurePool(cfg)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
	}
	return pool, nil
}

// parseDatabaseURL is pgxpool.ParseConfig with its failure as the usage
// error of cmd (exit 2).
func parseDatabaseURL(cmd, url string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, cli.Exit(fmt.Sprintf("%s: invalid --database-url: %v", cmd, err), 2)
	}
	return cfg, nil
}

// connectFailure words a failure to reach the database, if err is one, as
// the one line an operator acts on: a wrong password or an unknown login
// as an authentication failure (pgx's message would otherwise come wrapped
// in whatever the command was reading first), a refused or unreachable
// server by its dial error, once (pgx tries each address with and without
// TLS and lists every attempt, so the same dial error came twice).
func connectFailure(cmd string, err error) (string, bool) {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return "", false
	}
	where := "the database"
	if ce.Config != nil {
		where = fmt.Sprintf("the database %q on %s as %q", ce.Config.Database,
			net.JoinHostPort(ce.Config.Host, fmt.Sprint(ce.Config.Port)), ce.Config.User)
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code {
		case "28P01", "28000": // invalid_password, invalid_authorization_specification
			return fmt.Sprintf("%s: authentication failed: cannot log in to %s: %s (check the user and password in --database-url)",
				cmd, where, pe.Message), true
		}
		return fmt.Sprintf("%s: cannot connect to %s: %s", cmd, where, pe.Message), true
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		return fmt.Sprintf("%s: cannot connect to %s: %v", cmd, where, oe), true
	}
	return fmt.Sprintf("%s: cannot connect to %s: %v", cmd, where, errors.Unwrap(ce)), true
}
