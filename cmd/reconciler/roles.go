package main

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/docs"
	"github.com/receiptledger/reconciler/migrations"
)

// rolesCommand is `reconciler roles apply|show`: docs/roles.sql, embedded,
// applied by the schema's owner after `migrate up` instead of a psql step.
func rolesCommand() *cli.Command {
	return &cli.Command{
		Name:  "roles",
		Usage: "apply or print docs/roles.sql, the database roles of each component",
		Flags: []cli.Flag{databaseURLFlag()},
		Subcommands: []*cli.Command{
			{
				Name:  "apply",
				Usage: "create the four group roles and reset their grants to docs/roles.sql's (as the schema's owner, after migrate up)",
				Flags: []cli.Flag{databaseURLFlag()},
				Action: func(c *cli.Context) error {
					const cmd = "roles apply"
					pool, err := openDatabase(c.Context, cmd, c.String("database-url"))
					if err != nil {
						return err
					}
					defer pool.Close()
					// The grants name the schema's tables: a schema
					// behind this binary would be granted half.
					if err := migrations.Check(c.Context, pool); err != nil {
						if msg, ok := connectFailure(cmd, err); ok {
							return cli.Exit(msg, 1)
						}
						return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
					}
					if _, err := pool.Exec(c.Context, docs.RolesSQL); err != nil {
						var pe *pgconn.PgError
						if errors.As(err, &pe) && pe.Code == "42501" {
							return cli.Exit(fmt.Sprintf("%s: permission denied: login %q may not grant on the reconciler schema "+
								"(apply the roles as the schema's owner, with CREATEROLE the first time on a server): %s",
								cmd, pool.Config().ConnConfig.User, pe.Message), 1)
						}
						return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
					}
					fmt.Fprintln(c.App.Writer, "roles: applied docs/roles.sql: reconciler_agent, reconciler_worker, reconciler_reviewer, reconciler_readonly")
					return nil
				},
			},
			{
				Name:  "show",
				Usage: "print docs/roles.sql as this binary applies it",
				Action: func(c *cli.Context) error {
					_, err := fmt.Fprint(c.App.Writer, docs.RolesSQL)
					return err
				},
			},
		},
	}
}
