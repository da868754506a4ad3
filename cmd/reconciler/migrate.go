package main

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/migrations"
)

func migrateCommand() *cli.Command {
	// withProvider runs f with a goose provider over --database-url and turns
	// its error into the command's one-line failure.
	withProvider := func(c *cli.Context, f func(p *goose.Provider) error) error {
		if c.String("database-url") == "" {
			return cli.Exit("migrate: --database-url (or RECONCILER_DATABASE_URL) is empty", 2)
		}
		pool, err := pgxpool.New(c.Context, c.String("database-url"))
		if err != nil {
			return cli.Exit(fmt.Sprintf("migrate: %v", err), 1)
		}
		defer pool.Close()
		db := migrations.OpenDB(pool)
		defer db.Close()
		p, err := migrations.NewProvider(c.Context, db)
		if err == nil {
			err = f(p)
		}
		if err != nil {
			return cli.Exit(fmt.Sprintf("migrate %s: %v", c.Command.Name, err), 1)
		}
		return nil
	}
	return &cli.Command{
		Name:  "migrate",
		Usage: "apply, roll back or list the embedded schema migrations",
		Flags: []cli.Flag{databaseURLFlag()},
		Subcommands: []*cli.Command{
			{
				Name:  "up",
				Usage: "apply every pending migration",
				Action: func(c *cli.Context) error {
					return withProvider(c, func(p *goose.Provider) error {
						if _, err := p.Up(c.Context); err != nil {
							return err
						}
						fmt.Fprintln(c.App.Writer, "migrations: up to date")
						return nil
					})
				},
			},
			{
				Name:  "down",
				Usage: "roll back the most recent migration",
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
				Name:  "status",
				Usage: "list migrations and whether each is applied",
				Action: func(c *cli.Context) error {
					return withProvider(c, func(p *goose.Provider) error {
						sts, err := p.Status(c.Context)
						if err != nil {
							return err
						}
						for _, s := range sts {
							applied := "pending"
							if s.State == goose.StateApplied {
								applied = "applied " + s.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
							}
							fmt.Fprintf(c.App.Writer, "%-40s %s\n", s.Source.Path, applied)
						}
						return nil
					})
				},
			},
		},
	}
}
