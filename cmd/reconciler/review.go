package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/user"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

func reviewCommand() *cli.Command {
	// Flags carry parse state: each subcommand gets its own.
	operator := func() cli.Flag {
		return &cli.StringFlag{Name: "operator", EnvVars: []string{"RECONCILER_OPERATOR"},
			Usage: "who is deciding, recorded as human:<name> (default: the OS user)"}
	}
	reason := func() cli.Flag {
		return &cli.StringFlag{Name: "reason", Usage: "why you decided this (required, recorded in history)"}
	}
	return &cli.Command{
		Name:  "review",
		Usage: "list, inspect and resolve receipts held in manual_review",
		Subcommands: []*cli.Command{
			{
				Name:  "list",
				Usage: "list receipts held in manual_review, the longest held first",
				Flags: []cli.Flag{
					databaseURLFlag(),
					&cli.StringFlag{Name: "operation", Usage: "only this operation"},
					&cli.StringFlag{Name: "dependency", Usage: "only this dependency"},
					&cli.StringFlag{Name: "older-than", Usage: "only receipts held at least this long (e.g. 30m, 48h, 2d)"},
					&cli.IntFlag{Name: "limit", Value: review.DefaultLimit, Usage: "at most this many receipts"},
					&cli.BoolFlag{Name: "json", Usage: "print one JSON array instead of a table"},
				},
				Action: reviewListAction,
			},
			{
				Name:      "show",
				Usage:     "print a receipt and its whole timeline",
				ArgsUsage: "ID",
				Flags:     []cli.Flag{databaseURLFlag(), &cli.BoolFlag{Name: "json", Usage: "print JSON"}},
				Action:    func(c *cli.Context) error { return showAction(c, "review show") },
			},
			{
				Name:      "resolve",
				Usage:     "settle a held receipt as succeeded, safe_to_retry or rejected",
				ArgsUsage: "ID --as STATE --reason REASON",
				Flags: []cli.Flag{
					databaseURLFlag(),
					&cli.StringFlag{Name: "as", Usage: "succeeded, safe_to_retry or rejected (required)"},
					reason(), operator(),
					&cli.StringFlag{Name: "external-id", Usage: "the external id you found, recorded with the move"},
				},
				Action: reviewResolveAction,
			},
			{
				Name:      "requeue",
				Usage:     "send a held receipt back to outcome_unknown for the reconciler to check again",
				ArgsUsage: "ID --reason REASON",
				Flags:     []cli.Flag{databaseURLFlag(), reason(), operator()},
				Action:    reviewRequeueAction,
			},
		},
	}
}

func reviewListAction(c *cli.Context) error {
	const cmd = "review list"
	if c.Int("limit") <= 0 {
		return cli.Exit(fmt.Sprintf("%s: --limit must be positive", cmd), 2)
	}
	olderThan, err := parseAge(c.String("older-than"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("%s: --older-than: %v", cmd, err), 2)
	}
	pool, err := openPool(c, cmd, readLedger)
	if err != nil {
		return err
	}
	defer pool.Close()
	held, err := review.List(c.Context, pool, review.Filter{
		Operation: c.String("operation"), Dependency: c.String("dependency"),
		OlderThan: olderThan, Limit: c.Int("limit"),
	})
	if err != nil {
		return dbFailure(cmd, pool, err, readLedger)
	}
	contradicted, err := review.Contradicted(c.Context, pool, review.Filter{
		Operation: c.String("operation"), Dependency: c.String("dependency"),
		OlderThan: olderThan, Limit: c.Int("limit"),
	})
	if err != nil {
		return dbFailure(cmd, pool, err, readLedger)
	}
	if c.Bool("json") {
		if held == nil {
			held = []review.Held{}
		}
		for _, x := range contradicted {
			held = append(held, x.AsHeld())
		}
		return writeJSON(c.App.Writer, held)
	}
	scr := newScreen(c.App.Writer)
	defer printContradicted(scr, contradicted)
	if len(held) == 0 {
		if c.IsSet("operation") || c.IsSet("dependency") || olderThan > 0 {
			scr.Printf("no receipts match: none held in manual_review has the operation, dependency or age asked for\n")
		} else {
			scr.Printf("no receipts held in manual_review\n")
		}
		return nil
	}
	tw := scr.Table()
	tw.Printf("ID\tAGE\tOPERATION\tDEPENDENCY\tATTEMPT\tREASON\n")
	for _, h := range held {
		why := h.Reason
		if h.ErrorCode != "" {
			why += " (" + h.ErrorCode + ")"
		}
		tw.Printf("%d\t%s\t%s\t%s\t%d\t%s\n", h.ID, review.FormatAge(h.Age), h.Operation, h.Dependency, h.Attempt,
			strings.TrimSpace(why))
	}
	return tw.Flush()
}

func reviewResolveAction(c *cli.Context) error {
	const cmd = "review resolve"
	id, err := receiptID(c, cmd)
	if err != nil {
		return err
	}
	as := c.String("as")
	switch to := statemachine.State(as); to {
	case statemachine.Succeeded, statemachine.SafeToRetry, statemachine.Rejected:
	case "":
		return cli.Exit(cmd+": --as is required: succeeded, safe_to_retry or rejected", 2)
	default:
		return cli.Exit(fmt.Sprintf("%s: --as %q: must be succeeded, safe_to_retry or rejected "+
			"(use `review requeue` to send it back to the reconciler)", cmd, as), 2)
	}
	return decide(c, cmd, func(pool *pgxpool.Pool, operator, reason string) (*ledger.Receipt, error) {
		return review.Resolve(c.Context, pool, review.Resolution{ID: id, To: statemachine.State(as),
			Operator: operator, Reason: reason, ExternalID: c.String("external-id")})
	})
}

func reviewRequeueAction(c *cli.Context) error {
	const cmd = "review requeue"
	id, err := receiptID(c, cmd)
	if err != nil {
		return err
	}
	return decide(c, cmd, func(pool *pgxpool.Pool, operator, reason string) (*ledger.Receipt, error) {
		return review.Requeue(c.Context, pool, id, operator, reason)
	})
}

// decide checks the reason and the operator, makes the move and reports it.
func decide(c *cli.Context, cmd string, move func(pool *pgxpool.Pool, operator, reason string) (*ledger.Receipt, error)) error {
	reason := strings.TrimSpace(c.String("reason"))
	if reason == "" {
		return cli.Exit(cmd+": --reason is required: say why, it is recorded in the receipt's history", 2)
	}
	operator, err := operatorName(c.String("operator"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 2)
	}
	pool, err := openPool(c, cmd, moveHeld)
	if err != nil {
		return err
	}
	defer pool.Close()
	r, err := move(pool, operator, reason)
	switch {
	case err == nil:
		newScreen(c.App.Writer).Printf("receipt %d: manual_review -> %s by human:%s\n", r.ID, r.State, operator)
		return nil
	case errors.Is(err, review.ErrInvalidOperator), errors.Is(err, review.ErrReasonRequired),
		errors.Is(err, review.ErrInvalidResolution):
		return cli.Exit(fmt.Sprintf("%s: %v", cmd, err), 2)
	}
	return dbFailure(cmd, pool, err, moveHeld)
}

// operatorName is the --operator flag (or RECONCILER_OPERATOR), else the OS
// user.
func operatorName(flag string) (string, error) {
	if name := strings.TrimSpace(flag); name != "" {
		return name, nil
	}
	u, err := user.Current()
	if err != nil || strings.TrimSpace(u.Username) == "" {
		return "", fmt.Errorf("cannot tell who you are (%v): pass --operator NAME or set RECONCILER_OPERATOR", err)
	}
	return strings.TrimSpace(u.Username), nil
}

// receiptID parses the single ID argument (normalizeArgs has moved every
// flag typed after it before it; what follows "--" is an argument).
func receiptID(c *cli.Context, cmd string) (int64, error) {
	args := c.Args().Slice()
	if len(args) != 1 {
		return 0, cli.Exit(fmt.Sprintf("%s: want exactly one receipt ID, got %d argument(s)", cmd, len(args)), 2)
	}
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id <= 0 {
		return 0, cli.Exit(fmt.Sprintf("%s: %q is not a receipt ID", cmd, args[0]), 2)
	}
	return id, nil
}

// openPool connects to --database-url and checks, reading only, that the
// schema is current and that the login may do what need says.
func openPool(c *cli.Context, cmd string, need access) (*pgxpool.Pool, error) {
	pool, err := openDatabase(c.Context, cmd, c.String("database-url"))
	if err != nil {
		return nil, err
	}
	if err := checkLedger(c.Context, cmd, pool, need); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// showAction prints one receipt's timeline; `review show` and `receipts
// show` share it.
func showAction(c *cli.Context, cmd string) error {
	id, err := receiptID(c, cmd)
	if err != nil {
		return err
	}
	pool, err := openPool(c, cmd, readLedger)
	if err != nil {
		return err
	}
	defer pool.Close()
	t, err := review.Show(c.Context, pool, id)
	if err != nil {
		return dbFailure(cmd, pool, err, readLedger)
	}
	if c.Bool("json") {
		return writeJSON(c.App.Writer, t)
	}
	printTimeline(newScreen(c.App.Writer), t)
	return nil
}

// printTimeline prints a receipt and its history for a person; every field
// goes through w, which escapes it.
func printTimeline(w *screen, t *review.Timeline) {
	r := t.Receipt
	ts := func(at time.Time) string { return at.UTC().Format("2006-01-02T15:04:05.000Z07:00") }
	w.Printf("receipt %d  %s\n", r.ID, r.State)
	w.Printf("  operation    %s on %s: %s %s\n", r.Operation, r.Dependency, r.Method, r.Target)
	w.Printf("  key          %s (attempt %d", r.IdempotencyKey, r.Attempt)
	if r.RetryOf != 0 {
		w.Printf(", retry of receipt %d", r.RetryOf)
	}
	w.Printf(")\n")
	w.Printf("  fingerprint  %s\n", r.Fingerprint)
	w.Printf("  intent       %s\n", compact(r.Intent))
	if len(r.PreImage) > 0 {
		w.Printf("  pre-image    %s\n", compact(r.PreImage))
	}
	if r.ExternalID != "" {
		w.Printf("  external id  %s\n", r.ExternalID)
	}
	w.Printf("  created      %s\n", ts(r.CreatedAt))
	if r.SubmittedAt != nil {
		w.Printf("  submitted    %s\n", ts(*r.SubmittedAt))
	}
	w.Printf("  updated      %s (version %d, %d readback check(s))\n", ts(r.UpdatedAt), r.Version, r.Checks)
	if r.NextCheckAt != nil {
		w.Printf("  next check   %s\n", ts(*r.NextCheckAt))
	}
	w.Printf("timeline\n")
	for _, e := range t.Events {
		from := string(e.From)
		if from == "" {
			from = "(new)"
		}
		w.Printf("  #%d  %s  %s -> %s  by %s\n", e.Seq, ts(e.At), from, e.To, e.Actor)
		line := func(label string, v string) {
			if v != "" {
				w.Printf("        %-11s %s\n", label+":", v)
			}
		}
		line("reason", e.Reason)
		line("error", compact(e.Error))
		line("evidence", compact(e.Evidence))
		line("extra", compact(e.Extra))
		line("external id", e.ExternalID)
	}
	printAudits(w, t.Audits)
}

// compact prints a JSON value on one line, "" for none.
func compact(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return string(raw)
	}
	return b.String()
}

// writeJSON prints v as indented JSON for scripts, with the characters
// encoding/json leaves raw (DEL, C1, bidi controls) escaped too (jsonText).
func writeJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return cli.Exit(fmt.Sprintf("json: %v", err), 1)
	}
	if _, err := w.Write(jsonText(b.Bytes())); err != nil {
		return cli.Exit(fmt.Sprintf("json: %v", err), 1)
	}
	return nil
}

// parseAge reads an age for --older-than: a Go duration (30m, 48h) or a
// whole number of days (2d), which is how people say how long a receipt
// has been held. Empty means no bound.
func parseAge(s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100000 {
			return 0, fmt.Errorf("want a duration such as 30m, 48h or 2d, got %q", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("want a duration such as 30m, 48h or 2d, got %q", s)
		}
	}
	if d < 0 {
		return 0, fmt.Errorf("must not be negative, got %q", s)
	}
	return d, nil
}
