package main

import (
	"fmt"
	"strconv"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/migrations"
)

// migrateShow is `migrate show N`: a migration's SQL as the binary embeds
// it, so an operator reads what `migrate up` or `migrate down` would run.
func migrateShow(c *cli.Context) error {
	const cmd = "migrate show"
	if c.NArg() != 1 {
		return cli.Exit(fmt.Sprintf("%s: want exactly one migration version, got %d argument(s)", cmd, c.NArg()), 2)
	}
	v, err := strconv.ParseInt(c.Args().First(), 10, 64)
	if err != nil || v <= 0 {
		return cli.Exit(fmt.Sprintf("%s: %q is not a migration version (a number such as 13)", cmd, c.Args().First()), 2)
	}
	file, text, err := migrations.SQL(v)
	if err != nil {
		return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
	}
	fmt.Fprintf(c.App.Writer, "-- %s\n%s", file, text)
	return nil
}

// migrateDryRun is `migrate up --dry-run`: the Up part of every migration
// the database lacks, in the order `migrate up` would apply them, read with
// plain SELECTs (any role of docs/roles.sql may run it); nothing is
// created, locked or applied.
func migrateDryRun(c *cli.Context) error {
	const cmd = "migrate up"
	pool, err := openDatabase(c.Context, cmd, c.String("database-url"))
	if err != nil {
		return err
	}
	defer pool.Close()
	ms, _, _, err := migrations.Status(c.Context, pool)
	if msg, ok := connectFailure(cmd, err); ok {
		return cli.Exit(msg, 1)
	}
	if err != nil {
		return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
	}
	n := 0
	for _, m := range ms {
		if m.Applied {
			continue
		}
		_, text, err := migrations.SQL(m.Version)
		if err != nil {
			return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 1)
		}
		fmt.Fprintf(c.App.Writer, "-- %s (pending)\n%s\n", m.File, migrations.UpSQL(text))
		n++
	}
	fmt.Fprintf(c.App.Writer, "-- dry run: %d migration(s) would be applied; nothing was changed\n", n)
	return nil
}
