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
	"slices"
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
	args, unknown := normalizeArgs(app, args)
	if unknown != "" {
		fmt.Fprintln(stderr, "reconciler: "+termText(oneLine(unknown)))
		return 2
	}
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
	app := &cli.App{
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
		Flags: []cli.Flag{&cli.BoolFlag{Name: "version", Usage: "print the version, as the version command does"}},
		Action: func(c *cli.Context) error {
			if c.Bool("version") {
				return printVersion(c)
			}
			if c.Args().First() == "help" {
				return helpAction(c)
			}
			if c.Args().Present() {
				return cli.Exit(unknownCommand("reconciler", c.App.Commands, c.Args().First()), 2)
			}
			return cli.ShowAppHelp(c)
		},
		Commands: []*cli.Command{
			migrateCommand(),
			fingerprintCommand(),
			demoCommand(),
			simCommand(),
			runCommand(),
			gatewayCommand(),
			statsCommand(),
			benchCommand(),
			adaptersCommand(),
			reviewCommand(),
			uiCommand(),
			receiptsCommand(),
			archiveCommand(),
			partitionsCommand(),
			versionCommand(),
			rolesCommand(),
		},
	}
	refuseUnknownSubcommands("reconciler", app.Commands)
	return app
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

// normalizeArgs lets every flag go wherever people put it: before or after
// the subcommand, before or after positional arguments. urfave/cli v2 parses
// a command's flags only between its name and its first positional
// argument, so `migrate up --database-url URL`, `--database-url URL migrate
// status` and `review show 12 --json` would each be refused. This walks the
// command path, then moves each flag right after the deepest command on that
// path that declares it (a flag no command on the path declares goes to the
// last one, whose parser refuses it by name), and the positional arguments
// after every flag. Everything after "--" stays positional; with --help the
// positional arguments are dropped (urfave/cli would read the first as a
// help topic).
//
// A command with subcommands takes no positional argument, so a word that
// names none of them is an unknown command, and a flag that takes a value
// cannot end the line: unknown is then the one-line usage error to print
// (exit 2), before any flag is checked.
func normalizeArgs(app *cli.App, args []string) (_ []string, unknown string) {
	if len(args) < 2 {
		return args, ""
	}
	values := flagsTakingValues(app.Commands)
	type level struct {
		name  string
		cmd   *cli.Command // nil for the program itself
		flags []string
	}
	type flagTok struct {
		name  string
		words []string
	}
	levels := []*level{{name: args[0]}}
	var pending []flagTok
	var positional, tail []string
	missing := "" // a flag that wants a value and ends the line
	subs := app.Commands
	for rest := args[1:]; len(rest) > 0; {
		tok := rest[0]
		rest = rest[1:]
		if tok == "--" {
			tail = rest
			break
		}
		if len(tok) > 1 && tok[0] == '-' {
			name, _, inline := strings.Cut(strings.TrimLeft(tok, "-"), "=")
			words := []string{tok}
			if !inline && values[name] {
				if len(rest) == 0 {
					missing = tok
					break
				}
				words = append(words, rest[0])
				rest = rest[1:]
			}
			pending = append(pending, flagTok{name, words})
			continue
		}
		if len(positional) == 0 {
			if c := findCommand(subs, tok); c != nil {
				levels = append(levels, &level{name: tok, cmd: c})
				subs = c.Subcommands
				continue
			}
		}
		positional = append(positional, tok)
	}
	path := "reconciler"
	for _, l := range levels[1:] {
		path += " " + l.name
	}
	if len(positional) > 0 && len(subs) > 0 && positional[0] != "help" {
		return nil, unknownCommand(path, subs, positional[0])
	}
	if len(positional) == 0 && len(subs) > 0 && len(levels) > 1 {
		// A command group named without its subcommand prints its help
		// (exit 0) whatever flags came with it, as long as one of its
		// subcommands declares them: `review --database-url URL` as
		// `migrate --database-url URL`.
		pending = slices.DeleteFunc(pending, func(f flagTok) bool { return declaredBelow(subs, f.name) })
	}
	if missing != "" {
		return nil, fmt.Sprintf("%s: flag needs an argument: %s", strings.TrimPrefix(path, "reconciler "), missing)
	}
	for _, f := range pending {
		at := len(levels) - 1
		if f.name == "help" || f.name == "h" {
			positional, tail = nil, nil
		} else {
			for i := len(levels) - 1; i >= 1; i-- {
				if declares(levels[i].cmd.Flags, f.name) {
					at = i
					break
				}
			}
		}
		levels[at].flags = append(levels[at].flags, f.words...)
	}
	out := make([]string, 0, len(args)+1)
	for _, l := range levels {
		out = append(out, l.name)
		out = append(out, l.flags...)
	}
	if len(tail) > 0 {
		out = append(out, "--")
	}
	out = append(out, positional...)
	return append(out, tail...), ""
}

// flagsTakingValues maps every flag name in the command tree to whether it
// takes a value (every flag but a boolean one does).
func flagsTakingValues(cmds []*cli.Command) map[string]bool {
	m := map[string]bool{}
	var walk func([]*cli.Command)
	walk = func(cmds []*cli.Command) {
		for _, c := range cmds {
			for _, f := range c.Flags {
				tv, ok := f.(cli.DocGenerationFlag)
				for _, n := range f.Names() {
					m[n] = !ok || tv.TakesValue()
				}
			}
			walk(c.Subcommands)
		}
	}
	walk(cmds)
	return m
}

func findCommand(cmds []*cli.Command, name string) *cli.Command {
	for _, c := range cmds {
		if slices.Contains(c.Names(), name) {
			return c
		}
	}
	return nil
}

func declares(flags []cli.Flag, name string) bool {
	for _, f := range flags {
		if slices.Contains(f.Names(), name) {
			return true
		}
	}
	return false
}

// optionalParentFlags makes a parent command's flags optional to
// the parser: urfave/cli checks them before it reaches the subcommand, so
// `migrate up --help` would fail on a missing --database-url. The
// subcommands check the value themselves (checkUsage).
func optionalParentFlags(c *cli.Command) {
	for _, f := range c.Flags {
		if sf, ok := f.(*cli.StringFlag); ok && sf.Required {
			sf.Required = false
		}
	}
}

// checkUsage makes a command check its usage in its action instead of in
// urfave/cli's parser, which prints the whole help page on stdout before a
// missing required flag's error, and which passes a command that takes no
// argument whatever arguments it is given: a missing required flag is the
// usage error "<command>: --name (or ENV) is required" and an argument to a
// command that takes none (no ArgsUsage) "<command>: unexpected argument",
// exit 2, before anything runs.
func checkUsage(path string, c *cli.Command) {
	var required []*cli.StringFlag
	for _, f := range c.Flags {
		if sf, ok := f.(*cli.StringFlag); ok && sf.Required {
			sf.Required = false
			required = append(required, sf)
		}
	}
	if c.Action == nil {
		return
	}
	action, takesArgs := c.Action, c.ArgsUsage != ""
	c.Action = func(ctx *cli.Context) error {
		if !takesArgs && ctx.Args().Present() {
			return cli.Exit(fmt.Sprintf("%s: unexpected argument %q", path, ctx.Args().First()), 2)
		}
		for _, f := range required {
			if strings.TrimSpace(ctx.String(f.Name)) == "" {
				what := "--" + f.Name
				if len(f.EnvVars) > 0 {
					what += " (or " + strings.Join(f.EnvVars, ", ") + ")"
				}
				return cli.Exit(fmt.Sprintf("%s: %s is required", path, what), 2)
			}
		}
		return action(ctx)
	}
}

// usageMessage is the one line of a usage error of command c: the flag in
// the standard library's "flag provided but not defined: -name" or
// "invalid value "x" for flag -name: parse error" written as it was most
// likely typed, --name, and a bad value followed by what the flag accepts.
func usageMessage(c *cli.Command, msg string) string {
	const undefined = "flag provided but not defined: -"
	if rest, ok := strings.CutPrefix(msg, undefined); ok && len(rest) > 1 {
		return undefined + "-" + rest
	}
	if rest, ok := strings.CutPrefix(msg, "invalid boolean value "); ok {
		if value, name, ok := strings.Cut(rest, " for -"); ok {
			name, _, _ = strings.Cut(name, ":")
			return fmt.Sprintf("invalid value %s for flag --%s: want true or false", value, name)
		}
	}
	const invalid = "invalid value "
	value, rest, ok := strings.Cut(strings.TrimPrefix(msg, invalid), " for flag -")
	if !strings.HasPrefix(msg, invalid) || !ok {
		return msg
	}
	name, _, _ := strings.Cut(rest, ":")
	want := "a valid value"
	for _, f := range c.Flags {
		if !slices.Contains(f.Names(), name) {
			continue
		}
		switch f.(type) {
		case *cli.DurationFlag:
			want = "a duration such as 90s, 5m or 1h"
		case *cli.IntFlag, *cli.Int64Flag, *cli.UintFlag, *cli.Uint64Flag:
			want = "a whole number"
		case *cli.Float64Flag:
			want = "a number"
		}
	}
	dash := "--"
	if len(name) == 1 {
		dash = "-" // -n, as bench settle declares it
	}
	return fmt.Sprintf("invalid value %s for flag %s%s: want %s", value, dash, name, want)
}

// refuseUnknownSubcommands gives every command that has subcommands but no
// action of its own one that refuses an unknown subcommand as a usage error
// (exit 2, one line) instead of urfave/cli's "No help topic" (exit 3), and
// makes every usage error (unknown flag, bad value, missing required flag)
// one line, exit 2, escaped by run, instead of a help page printed
// unescaped on stdout.
func refuseUnknownSubcommands(prefix string, cmds []*cli.Command) {
	for _, c := range cmds {
		path := prefix + " " + c.Name
		if len(c.Subcommands) > 0 {
			optionalParentFlags(c)
		} else {
			checkUsage(path[len("reconciler "):], c)
		}
		if c.OnUsageError == nil {
			c.OnUsageError = func(_ *cli.Context, err error, _ bool) error {
				return cli.Exit(path[len("reconciler "):]+": "+usageMessage(c, err.Error()), 2)
			}
		}
		if len(c.Subcommands) > 0 && c.Action == nil {
			c.Action = func(ctx *cli.Context) error {
				if first := ctx.Args().First(); first != "" && first != "help" {
					return cli.Exit(unknownCommand(path, c.Subcommands, first), 2)
				}
				return cli.ShowSubcommandHelp(ctx)
			}
		}
		refuseUnknownSubcommands(path, c.Subcommands)
	}
}
