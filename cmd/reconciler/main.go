// Command reconciler makes side-effecting API calls safe when their outcome
// is unknown: it migrates the receipt ledger, computes intent fingerprints,
// runs the reconciler that settles outcome_unknown receipts, and lets humans
// resolve what cannot be proven.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args, os.Stdin, os.Stdout, os.Stderr))
}

// run executes the CLI and returns the process exit status: 0 on success,
// 1 for bad input or a failed operation, 2 for usage errors.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	app := newApp(stdin, stdout, stderr)
	err := app.RunContext(ctx, args)
	if err == nil {
		return 0
	}
	var ec cli.ExitCoder
	if errors.As(err, &ec) {
		if msg := termText(oneLine(err.Error())); msg != "" {
			fmt.Fprintln(stderr, "reconciler: "+msg)
		}
		return ec.ExitCode()
	}
	// Anything urfave/cli returns unwrapped is a usage error (unknown
	// flag, missing required flag, unknown command).
	fmt.Fprintln(stderr, "reconciler: "+termText(oneLine(err.Error())))
	return 2
}

// oneLine folds a multi-line error (pgx lists every address it tried on a
// line of its own) into the one line a script can log or grep. The caller
// escapes what is left with termText: an error can quote an API's answer, an
// agent's target or an operator's flag, and it is printed on a terminal.
func oneLine(msg string) string {
	return strings.Join(strings.Fields(msg), " ")
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *cli.App {
	return &cli.App{
		Name:            "reconciler",
		Usage:           "make side-effecting API calls safe when their outcome is unknown",
		Reader:          stdin,
		Writer:          stdout,
		ErrWriter:       stderr,
		HideHelpCommand: true,
		ExitErrHandler:  func(*cli.Context, error) {}, // run prints and exits
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return cli.Exit(err.Error(), 2)
		},
		Action: func(c *cli.Context) error {
			if c.Args().Present() {
				return cli.Exit(fmt.Sprintf("unknown command %q (see reconciler --help)", c.Args().First()), 2)
			}
			return cli.ShowAppHelp(c)
		},
		Commands: []*cli.Command{
			migrateCommand(),
			fingerprintCommand(),
			demoCommand(),
			runCommand(),
			statsCommand(),
			benchCommand(),
			adaptersCommand(),
			reviewCommand(),
			receiptsCommand(),
		},
	}
}

// databaseURLFlag is the --database-url flag shared by every command that
// talks to Postgres.
func databaseURLFlag() *cli.StringFlag {
	return &cli.StringFlag{
		Name:     "database-url",
		Usage:    "Postgres URL of the receipt ledger",
		EnvVars:  []string{"RECONCILER_DATABASE_URL"},
		Required: true,
	}
}
