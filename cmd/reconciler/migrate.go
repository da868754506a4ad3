package main

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/migrations"
)

func migrateCommand() *cli.Command {
	// withProvider runs f with a goose provider over --database-url and turns
	// its error into the command's one-line failure.
	withProvider := func(c *cli.Context, f func(p *goose.Provider) error) error {
		cmd := "migrate " + c.Command.Name
		cfg, err := parseDatabaseURL(cmd, c.String("database-url"))
		if err != nil {
			return err
		}
		// A migration's DDL queues for its lock on receipts behind any
		// open transaction that touched them, and every agent's next move
		// queues behind the migration: so it gives up after lock-timeout
		// (rolled back, nothing half-applied) rather than stall the
		// ledger for as long as that transaction lasts. A lock_timeout in
		// the URL stands unless the flag is given.
		if _, inURL := cfg.ConnConfig.RuntimeParams["lock_timeout"]; c.IsSet("lock-timeout") || !inURL {
			cfg.ConnConfig.RuntimeParams["lock_timeout"] = strconv.FormatInt(c.Duration("lock-timeout").Milliseconds(), 10)
		}
		if c.Command.Name == "down" && c.Bool("accept-data-loss") {
			// Read by the Down of 00004, which refuses to drop the late
			// outcomes and send deadlines of a ledger in use otherwise.
			cfg.ConnConfig.RuntimeParams["reconciler.accept_down_data_loss"] = "on"
		}
		pool, err := pgxpool.NewWithConfig(c.Context, cfg)
		if err != nil {
			return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
		}
		defer pool.Close()
		checkErr := migrations.Check(c.Context, pool)
		if msg, ok := connectFailure(cmd, checkErr); ok {
			return cli.Exit(msg, 1)
		}
		// An up-to-date schema needs nothing, not even the right to
		// create it (goose's first statement), so `migrate up` says so to
		// any login that can read the version table.
		if c.Command.Name == "up" && checkErr == nil {
			fmt.Fprintf(c.App.Writer, "migrations: nothing to apply, the schema is at version %d\n", migrations.Latest())
			return nil
		}
		db := migrations.OpenDB(pool)
		defer db.Close()
		p, err := migrations.NewProvider(c.Context, db)
		if err == nil {
			err = f(p)
		}
		var pe *pgconn.PgError
		var partial *goose.PartialError
		if msg, ok := connectFailure(cmd, err); ok {
			return cli.Exit(msg, 1)
		}
		switch {
		case err == nil:
			return nil
		case errors.As(err, &pe) && pe.Code == "55P03": // lock_not_available
			which := "the migration"
			if errors.As(err, &partial) && partial.Failed != nil && partial.Failed.Source != nil {
				which = partial.Failed.Source.Path
			}
			return cli.Exit(fmt.Sprintf("%s: %s waited longer than --lock-timeout %s for a lock (%s) and was rolled back, "+
				"so agents did not wait behind it; a long transaction holds the ledger's tables (see pg_stat_activity): "+
				"run it again once that transaction ends, or pass a longer --lock-timeout (0 waits as long as it takes, "+
				"and every agent waits too)", cmd, which, c.Duration("lock-timeout"), pe.Message), 1)
		case errors.As(err, &pe) && pe.Code == "RL010": // a Down that would drop soundness data
			return cli.Exit(fmt.Sprintf("%s: %s, and nothing was rolled back. %s %s", cmd, pe.Message, pe.Detail,
				"Settle the receipts first (reconciler run, reconciler review), stay at this version, or pass "+
					"--accept-data-loss to roll back all the same."), 1)
		case errors.As(err, &pe) && pe.Code == "42501": // insufficient_privilege
			return cli.Exit(fmt.Sprintf("%s: permission denied: login %q may not change the schema; "+
				"migrate as the owner of the reconciler schema (the role that first ran `reconciler migrate up`), "+
				"never as a login of docs/roles.sql: %s", cmd, pool.Config().ConnConfig.User, pe.Message), 1)
		}
		return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
	}
	return &cli.Command{
		Name:  "migrate",
		Usage: "apply, roll back or list the embedded schema migrations",
		// Every subcommand declares --database-url too, so that its --help
		// lists it; normalizeArgs hands the flag to the subcommand wherever
		// it was typed. The parent keeps it only so that `migrate
		// --database-url URL` without a subcommand prints the help.
		Flags: []cli.Flag{databaseURLFlag()},
		Subcommands: []*cli.Command{
			{
				Name:  "up",
				Usage: "apply every pending migration",
				Flags: []cli.Flag{databaseURLFlag(), lockTimeoutFlag(),
					&cli.BoolFlag{Name: "dry-run", Usage: "print the SQL of every pending migration, apply nothing (reads only)"}},
				Action: func(c *cli.Context) error {
					if c.Bool("dry-run") {
						return migrateDryRun(c)
					}
					return withProvider(c, func(p *goose.Provider) error {
						res, err := p.Up(c.Context)
						for _, r := range res {
							if r.Error == nil {
								fmt.Fprintf(c.App.Writer, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(time.Millisecond))
							}
						}
						if err != nil {
							return err
						}
						v, err := p.GetDBVersion(c.Context)
						if err != nil {
							return err
						}
						if len(res) == 0 {
							fmt.Fprintf(c.App.Writer, "migrations: nothing to apply, the schema is at version %d\n", v)
						} else {
							fmt.Fprintf(c.App.Writer, "migrations: applied %d, the schema is at version %d\n", len(res), v)
						}
						return nil
					})
				},
			},
			{
				Name:  "down",
				Usage: "roll back the most recent migration (docs/rules-of-time.md lists what each one drops)",
				Flags: []cli.Flag{databaseURLFlag(), lockTimeoutFlag(),
					&cli.BoolFlag{Name: "accept-data-loss",
						Usage: "roll back below 00004 even while receipts are unsettled or late outcomes are kept (they and every send deadline are lost)"}},
				Action: func(c *cli.Context) error {
					return withProvider(c, func(p *goose.Provider) error {
						res, err := p.Down(c.Context)
						if errors.Is(err, goose.ErrNoNextVersion) {
							return errors.New("nothing to roll back: no migration is applied")
						}
						if err != nil {
							return err
						}
						fmt.Fprintf(c.App.Writer, "rolled back %s\n", res.Source.Path)
						return nil
					})
				},
			},
			{
				Name:      "show",
				Usage:     "print the SQL of embedded migration N (its Up and Down parts), touching no database",
				ArgsUsage: "N",
				Action:    migrateShow,
			},
			{
				Name:  "status",
				Usage: "list migrations and whether each is applied (reads only: creates nothing)",
				Flags: []cli.Flag{databaseURLFlag()},
				Action: func(c *cli.Context) error {
					pool, err := openDatabase(c.Context, "migrate status", c.String("database-url"))
					if err != nil {
						return err
					}
					defer pool.Close()
					ms, exists, unknown, err := migrations.Status(c.Context, pool)
					if msg, ok := connectFailure("migrate status", err); ok {
						return cli.Exit(msg, 1)
					}
					if err != nil {
						return cli.Exit(fmt.Sprintf("migrate status: %v", err), 1)
					}
					if !exists {
						fmt.Fprintln(c.App.Writer, "no schema: nothing applied")
					}
					for _, m := range ms {
						applied := "pending"
						if m.Applied {
							applied = "applied " + m.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
						}
						fmt.Fprintf(c.App.Writer, "%-40s %s\n", m.File, applied)
					}
					for _, v := range unknown {
						fmt.Fprintf(c.App.Writer, "%-40s applied, unknown to this binary (a newer reconciler migrated it)\n", fmt.Sprintf("%05d", v))
					}
					return nil
				},
			},
		},
	}
}

// defaultLockTimeout is how long `migrate up` and `migrate down` wait for
// each lock before they give up: long enough for the moves agents and the
// reconciler make (milliseconds), short enough that agents queued behind
// a migration waiting on a long transaction are not stalled for long.
const defaultLockTimeout = 5 * time.Second

func lockTimeoutFlag() *cli.DurationFlag {
	return &cli.DurationFlag{
		Name:  "lock-timeout",
		Value: defaultLockTimeout,
		Usage: "give up (and roll back) a migration that waits longer than this for a lock; agents queue behind it meanwhile (0: wait as long as it takes)",
	}
}
