package main

import (
	"fmt"

	"github.com/urfave/cli/v2"
	"github.com/xrash/smetrics"
)

// helpAction is `reconciler help [COMMAND...]`: the help page of the program
// or of the command named, as --help prints it. The groups' pages list
// `help` among their subcommands' ways in, so the program answers it too.
func helpAction(c *cli.Context) error {
	topic := c.Args().Tail()
	if len(topic) == 0 {
		return cli.ShowAppHelp(c)
	}
	// Re-run the line as `reconciler TOPIC... --help`: urfave/cli prints a
	// subcommand's page only from inside its parent's context.
	cmds, path := c.App.Commands, "reconciler"
	for _, name := range topic {
		cmd := findCommand(cmds, name)
		if cmd == nil {
			return cli.Exit(unknownCommand(path, cmds, name), 2)
		}
		cmds, path = cmd.Subcommands, path+" "+name
	}
	return c.App.RunContext(c.Context, append(append([]string{"reconciler"}, topic...), "--help"))
}

// unknownCommand is the usage error for a word that names none of cmds, the
// commands of path, with the nearest visible name when one is near: a
// Jaro-Winkler similarity of at least 0.85 with the boost urfave/cli's own
// suggestions use ("stast" is near "stats"; an unrelated word gets no
// guess).
func unknownCommand(path string, cmds []*cli.Command, word string) string {
	msg := fmt.Sprintf("unknown command %q (see %s --help)", path+" "+word, path)
	best, score := "", 0.85
	for _, c := range cmds {
		if c.Hidden {
			continue
		}
		for _, name := range c.Names() {
			if s := smetrics.JaroWinkler(name, word, 0.7, 4); s >= score {
				best, score = name, s
			}
		}
	}
	if best != "" {
		msg += fmt.Sprintf("; did you mean %q?", best)
	}
	return msg
}

// declaredBelow reports whether a command of cmds, or a subcommand of one,
// declares the flag.
func declaredBelow(cmds []*cli.Command, name string) bool {
	for _, c := range cmds {
		if declares(c.Flags, name) || declaredBelow(c.Subcommands, name) {
			return true
		}
	}
	return false
}
