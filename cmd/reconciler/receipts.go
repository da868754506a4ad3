package main

import (
	"github.com/urfave/cli/v2"
)

func receiptsCommand() *cli.Command {
	return &cli.Command{
		Name:  "receipts",
		Usage: "inspect receipts in any state",
		Subcommands: []*cli.Command{{
			Name:      "show",
			Usage:     "print a receipt and its whole timeline, with the evidence of every move",
			ArgsUsage: "ID",
			Flags:     []cli.Flag{databaseURLFlag(), &cli.BoolFlag{Name: "json", Usage: "print JSON"}},
			Action:    func(c *cli.Context) error { return showAction(c, "receipts show") },
		}},
	}
}
