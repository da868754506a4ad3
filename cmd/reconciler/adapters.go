package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/readback/httpadapter"
	"github.com/receiptledger/reconciler/reconcile"
)

func adaptersCommand() *cli.Command {
	return &cli.Command{
		Name:  "adapters",
		Usage: "inspect readback adapter configurations",
		Subcommands: []*cli.Command{{
			Name:  "check",
			Usage: "validate an adapters file; with --receipt, run one readback and show what it would decide",
			Description: "Without --receipt, loads the file exactly as `run` does and lists the adapters. " +
				"With --receipt ID, reads that receipt (read-only), runs its adapter once against the real API, " +
				"and prints the verdict, the evidence and the decision the reconciler would take now. " +
				"Nothing is written: the receipt, its history and the check records are left as they are.",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "config", Required: true, EnvVars: []string{"RECONCILER_ADAPTERS"},
					Usage: "adapters file (YAML)"},
				&cli.Int64Flag{Name: "receipt", Usage: "run one readback for this receipt id"},
				&cli.StringFlag{Name: "database-url", EnvVars: []string{"RECONCILER_DATABASE_URL"},
					Usage: "Postgres URL of the receipt ledger (with --receipt)"},
				&cli.DurationFlag{Name: "timeout", Value: 30 * time.Second, Usage: "timeout of the readback"},
			},
			Action: adaptersCheckAction,
		}},
	}
}

func adaptersCheckAction(c *cli.Context) error {
	path := c.String("config")
	reg, err := httpadapter.LoadFile(path, nil)
	if err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
	}
	var limits strings.Builder
	if err := printDependencyLimits(&limits, path, reg); err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
	}
	out := c.App.Writer
	bindings := reg.Bindings()
	fmt.Fprintf(out, "%s: valid, %d adapter(s)\n", path, len(bindings))
	printBindings(out, bindings)
	fmt.Fprint(out, limits.String())
	if !c.IsSet("receipt") {
		return nil
	}
	url := c.String("database-url")
	if url == "" {
		return cli.Exit("adapters check: --receipt needs --database-url (or RECONCILER_DATABASE_URL)", 2)
	}
	ctx, cancel := context.WithTimeout(c.Context, c.Duration("timeout")+10*time.Second)
	defer cancel()
	r, state, err := loadReceipt(ctx, url, c.Int64("receipt"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
	}
	return explain(ctx, out, reg, r, state, c.Duration("timeout"), time.Now())
}

func printBindings(w io.Writer, bs []readback.Binding) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tTYPE\tKIND\tDEPENDENCY\tOPERATIONS\tABSENCE CONCLUSIVE AFTER")
	for _, b := range bs {
		ops := strings.Join(b.Operations, ",")
		if ops == "" {
			ops = "*"
		}
		after := "-"
		if b.Kind != readback.Blind {
			p := b.Policy
			after = (p.MaxRequestLifetime + p.ConsistencyWindow).String()
			if p.IdempotencyKeys {
				after += fmt.Sprintf(" (%s with native keys, retained %s)", p.ConsistencyWindow, p.IdempotencyRetention)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", b.Name, b.Type, b.Kind, b.Dependency, ops, after)
	}
	_ = tw.Flush()
}

// loadReceipt reads one receipt in a read-only transaction: this command
// must never change the ledger.
func loadReceipt(ctx context.Context, url string, id int64) (readback.Receipt, string, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return readback.Receipt{}, "", fmt.Errorf("database: %w", err) // pgx redacts passwords
	}
	defer conn.Close(context.Background())
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return readback.Receipt{}, "", fmt.Errorf("database: %w", err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var r readback.Receipt
	var state string
	err = tx.QueryRow(ctx, `SELECT id, idempotency_key, operation, dependency, method, target, fingerprint,
		intent, pre_image, coalesce(external_id, ''), attempt, created_at,
		coalesce(submitted_at, created_at), check_count, state
		FROM reconciler.receipts WHERE id = $1`, id).Scan(&r.ID, &r.IdempotencyKey, &r.Operation,
		&r.Dependency, &r.Method, &r.Target, &r.Fingerprint, &r.Intent, &r.PreImage, &r.ExternalID,
		&r.Attempt, &r.CreatedAt, &r.SubmittedAt, &r.Checks, &state)
	if errors.Is(err, pgx.ErrNoRows) {
		return readback.Receipt{}, "", fmt.Errorf("receipt %d does not exist", id)
	}
	if err != nil {
		return readback.Receipt{}, "", fmt.Errorf("reading receipt %d: %w", id, err)
	}
	return r, state, nil
}

// explain runs one check of r and prints the answer and what the
// reconciler would decide now, following the rules of package reconcile.
func explain(ctx context.Context, w io.Writer, reg *readback.Registry, r readback.Receipt, state string,
	timeout time.Duration, now time.Time) error {
	fmt.Fprintf(w, "\nreceipt %d: %s on %s, state %s, submitted %s ago, %d check(s) so far\n",
		r.ID, r.Operation, r.Dependency, state, now.Sub(r.SubmittedAt).Round(time.Second), r.Checks)
	b, ok := reg.Lookup(r.Operation, r.Dependency)
	if !ok {
		fmt.Fprintln(w, "adapter: none\ndecision: manual_review (no_adapter): no adapter reads this operation or dependency")
		return nil
	}
	fmt.Fprintf(w, "adapter: %s (type %s, kind %s)\n", b.Name, b.Type, b.Kind)
	if b.Kind == readback.Blind {
		fmt.Fprintln(w, "decision: manual_review (blind): the endpoint cannot be read back")
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	res, err := b.Adapter.Check(cctx, r)
	cancel()
	if err != nil {
		class, _ := readback.Classify(err)
		fmt.Fprintf(w, "error: %s: %v\n", class, err)
		fmt.Fprintf(w, "decision: %s\n", decision(b, r, res, err, now))
		fmt.Fprintln(w, "nothing was changed")
		return nil
	}
	auth := "not authoritative"
	if res.Authoritative {
		auth = "authoritative"
	}
	fmt.Fprintf(w, "query: %s\nverdict: %s (%s)\n", res.Query, res.Verdict, auth)
	if len(res.ExternalIDs) > 0 {
		fmt.Fprintf(w, "matched: %s\n", strings.Join(res.ExternalIDs, ", "))
	}
	if res.Evidence != nil {
		if j, err := json.Marshal(res.Evidence); err == nil {
			fmt.Fprintf(w, "evidence: %s\n", j)
		}
	}
	fmt.Fprintf(w, "decision: %s\n", decision(b, r, res, nil, now))
	fmt.Fprintln(w, "nothing was changed")
	return nil
}

// decision says what the reconciler would do with this check now, by the
// rules of package reconcile.
func decision(b *readback.Binding, r readback.Receipt, res readback.Result, checkErr error, now time.Time) string {
	o := reconcile.Decide(now, r, b, res, checkErr)
	if !o.Settles() {
		safeAt, _, _ := b.Policy.AbsenceWindow(r.SubmittedAt, now)
		return fmt.Sprintf("check again at %s (in %s); an absence is conclusive only when authoritative and after %s",
			o.NextCheck.UTC().Format(time.RFC3339), max(o.NextCheck.Sub(now), 0).Round(time.Second),
			safeAt.UTC().Format(time.RFC3339))
	}
	d := fmt.Sprintf("%s (%s)", o.To, o.Detail.Reason)
	if ev := o.Detail.Evidence; ev != nil {
		if ev.Guarantee != "" {
			d += fmt.Sprintf(", guarantee %s", ev.Guarantee)
		}
		if ev.ReuseKeyBefore != nil {
			d += fmt.Sprintf("; the retry must reuse the original idempotency key before %s",
				ev.ReuseKeyBefore.UTC().Format(time.RFC3339))
		}
	}
	if len(o.Duplicates) > 1 {
		d += fmt.Sprintf("; %d resources match: a duplicate alarm is raised", len(o.Duplicates))
	}
	if e := o.Detail.Error; e != nil {
		d += ": " + e.Message
	}
	return d
}
