package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/internal/dbclock"
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
			Usage: "validate an adapters file; with --control, run the declared positive controls; with --receipt, run one readback and show what it would decide",
			Description: "Without --receipt, loads the file exactly as `run` does and lists the adapters. " +
				"With --control, runs each adapter's declared positive control (a resource known to exist, " +
				"which a correct configuration must find) and prints passed or failed and why; the exit status " +
				"is 1 when a declared control fails. " +
				"With --receipt ID, reads that receipt (read-only), runs its adapter once against the real API, " +
				"and prints the verdict, the evidence and the decision the reconciler would take now; a receipt " +
				"already settled (succeeded, safe_to_retry, rejected) is not read back: the command says how " +
				"and when it was settled. " +
				"Nothing is written: the receipt, its history and the check records are left as they are.",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "config", Required: true, EnvVars: []string{"RECONCILER_ADAPTERS"},
					Usage: "adapters file (YAML)"},
				&cli.BoolFlag{Name: "control", Usage: "run every adapter's declared positive control against the real API"},
				&cli.Int64Flag{Name: "receipt", Usage: "run one readback for this receipt id"},
				&cli.StringFlag{Name: "database-url", EnvVars: []string{"RECONCILER_DATABASE_URL"},
					Usage: "Postgres URL of the receipt ledger (with --receipt; with --control, the control an adapter that declares none draws from the ledger is run too)"},
				&cli.DurationFlag{Name: "timeout", Value: 30 * time.Second, Usage: "timeout of the readback"},
			},
			Action: adaptersCheckAction,
		}},
	}
}

func adaptersCheckAction(c *cli.Context) error {
	url := c.String("database-url")
	if c.IsSet("receipt") && url == "" {
		return cli.Exit("adapters check: --receipt needs --database-url (or RECONCILER_DATABASE_URL)", 2)
	}
	path := c.String("config")
	reg, err := httpadapter.LoadFile(path, nil)
	if err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
	}
	var limits strings.Builder
	if err := printDependencyLimits(&limits, path, reg); err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
	}
	out := newScreen(c.App.Writer)
	bindings := reg.Bindings()
	out.Printf("%s: valid, %d adapter(s)\n", path, len(bindings))
	printBindings(out, bindings)
	_, _ = out.Write([]byte(limits.String())) // laid out by printDependencyLimits; the guard applies
	var db *pgxpool.Pool
	if url != "" && (c.Bool("control") || c.IsSet("receipt")) {
		if db, err = openDatabase(c.Context, "adapters check", url); err != nil {
			return err
		}
		defer db.Close()
		if err := checkLedger(c.Context, "adapters check", db, readLedger); err != nil {
			return err
		}
		// Reads end their window at the database's now, as under `run`.
		clock := dbclock.New(db)
		if _, err := clock.Sync(c.Context); err != nil {
			return cli.Exit(fmt.Sprintf("adapters check: database: %v", err), 1)
		}
		if reg, err = httpadapter.LoadFile(path, nil, httpadapter.WithClock(clock.Now)); err != nil {
			return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
		}
		bindings = reg.Bindings()
	}
	if err := printWindows(c.Context, out, db, url, bindings); err != nil {
		return err
	}
	failed := 0
	if c.Bool("control") {
		failed = runControls(c.Context, out, db, bindings, c.Duration("timeout"))
	}
	if c.IsSet("receipt") {
		ctx, cancel := context.WithTimeout(c.Context, 2*c.Duration("timeout")+10*time.Second)
		defer cancel()
		r, state, settled, err := loadReceipt(ctx, db, c.Int64("receipt"))
		if err != nil {
			return cli.Exit(fmt.Sprintf("adapters check: %v", err), 1)
		}
		if settled != nil {
			printSettled(out, r, state, settled)
		} else if err := explain(ctx, out, db, reg, r, state, c.Duration("timeout")); err != nil {
			return err
		}
	}
	if failed > 0 {
		return cli.Exit(fmt.Sprintf("adapters check: %d control(s) failed: "+
			"until they pass, these adapters cannot prove an absence", failed), 1)
	}
	return nil
}

// noControl is what `adapters check --control` says of an adapter that
// declares no control.
const noControl = "no declared control: the reconciler uses receipts of the same operation that settled " +
	"succeeded from a 2xx response; declare one to bootstrap a new deployment"

// runControls runs each binding's positive control once and prints the
// outcome per adapter: the declared control, else, given the ledger (db not
// nil), the latest receipt it reads that settled succeeded from a 2xx
// response, as the reconciler would. It returns how many controls failed.
func runControls(ctx context.Context, w *screen, db *pgxpool.Pool, bs []readback.Binding, timeout time.Duration) int {
	w.Printf("\npositive controls:\n")
	failed := 0
	for i := range bs {
		b := &bs[i]
		switch {
		case b.Kind == readback.Blind:
			w.Printf("  %s: blind: nothing is read back, no control applies\n", b.Name)
			continue
		case b.Control == nil && db == nil:
			w.Printf("  %s: %s (give --database-url to run that one)\n", b.Name, noControl)
			continue
		case b.Control == nil:
			cctx, cancel := context.WithTimeout(ctx, timeout)
			err := reconcile.RunControl(cctx, db, b)
			cancel()
			if err != nil {
				failed++
				w.Printf("  %s: failed: %v\n    until a control passes, no absence this adapter reads settles anything\n", b.Name, err)
				continue
			}
			w.Printf("  %s: passed: found a receipt of the ledger that settled succeeded from a 2xx response\n", b.Name)
			continue
		}
		r := b.Control.Receipt
		cctx, cancel := context.WithTimeout(ctx, timeout)
		res, err := b.Adapter.Check(cctx, r)
		cancel()
		if cerr := readback.EvaluateControl(b, res, err); cerr != nil {
			failed++
			w.Printf("  %s: failed: %v\n    the declared resource: key %q, target %s, made at %s\n",
				b.Name, cerr, r.IdempotencyKey, r.Target, r.SubmittedAt.UTC().Format(time.RFC3339))
			if err == nil && res.Evidence != nil {
				if j, jerr := json.Marshal(res.Evidence); jerr == nil {
					w.Printf("    evidence: %s\n", j)
				}
			}
			w.Printf("    a correct configuration finds it: check base_url, the path, the filters and the marker; " +
				"until a control passes, no absence this adapter reads settles anything safe_to_retry\n")
			continue
		}
		w.Printf("  %s: passed: found %s (query %s)\n", b.Name, strings.Join(res.ExternalIDs, ", "), res.Query)
	}
	return failed
}

// settlement is how and when a settled receipt was settled: its last move.
type settlement struct {
	at     time.Time
	actor  string
	reason string
}

// printSettled says that r is settled instead of deciding anything.
func printSettled(w *screen, r readback.Receipt, state string, s *settlement) {
	w.Printf("\nreceipt %d: %s on %s is already settled: %s at %s by %s",
		r.ID, r.Operation, r.Dependency, state, s.at.UTC().Format(time.RFC3339), s.actor)
	if s.reason != "" {
		w.Printf(" (%s)", s.reason)
	}
	if r.ExternalID != "" {
		w.Printf(", external id %s", r.ExternalID)
	}
	w.Printf("\nnothing to decide: only a receipt whose outcome is unknown is read back; no readback was run and nothing was changed\n")
}

func printBindings(w *screen, bs []readback.Binding) {
	tw := w.Table()
	tw.Printf("NAME\tTYPE\tKIND\tDEPENDENCY\tOPERATIONS\tABSENCE CONCLUSIVE AT SEND DEADLINE +\tCONTROL\n")
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
		control := "-"
		switch {
		case b.Kind == readback.Blind:
		case b.Control != nil && (len(b.Operations) != 1 || b.Kind == readback.Delete):
			// A declared control vouches only for its operation; the
			// others are vouched for by their succeeded receipts. A
			// delete's "gone" control always comes from the ledger.
			control = "declared for " + b.Control.Receipt.Operation + ", others: succeeded receipts"
			if b.Kind == readback.Delete {
				control = "declared (present) for " + b.Control.Receipt.Operation + ", gone: succeeded receipts"
			}
		case b.Control != nil:
			control = "declared"
		default:
			control = "succeeded receipts only"
		}
		tw.Printf("%s\t%s\t%s\t%s\t%s\t%s\t%s\n", b.Name, b.Type, b.Kind, b.Dependency, ops, after, control)
	}
	_ = tw.Flush()
	for _, b := range bs {
		if a, ok := b.Adapter.(*httpadapter.Adapter); ok {
			if note := a.AbsenceNote(); note != "" {
				w.Printf("%s: %s\n", b.Name, note)
			}
		}
	}
}

// loadReceipt reads one receipt in a read-only transaction: this command
// must never change the ledger. For a settled receipt (succeeded,
// safe_to_retry, rejected) it also returns its settling move.
func loadReceipt(ctx context.Context, db *pgxpool.Pool, id int64) (readback.Receipt, string, *settlement, error) {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return readback.Receipt{}, "", nil, fmt.Errorf("database: %w", err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var r readback.Receipt
	var state string
	err = tx.QueryRow(ctx, `SELECT id, idempotency_key, operation, dependency, method, target, fingerprint,
		intent, pre_image, coalesce(external_id, ''), attempt, created_at,
		coalesce(submitted_at, created_at), coalesce(submitted_at, created_at) + max_send_delay,
		coalesce(unknown_since, 'epoch'::timestamptz), check_count, state
		FROM reconciler.receipts WHERE id = $1`, id).Scan(&r.ID, &r.IdempotencyKey, &r.Operation,
		&r.Dependency, &r.Method, &r.Target, &r.Fingerprint, &r.Intent, &r.PreImage, &r.ExternalID,
		&r.Attempt, &r.CreatedAt, &r.SubmittedAt, &r.SendDeadline, &r.UnknownSince, &r.Checks, &state)
	if errors.Is(err, pgx.ErrNoRows) {
		return readback.Receipt{}, "", nil, fmt.Errorf("receipt %d not found", id)
	}
	if err != nil {
		return readback.Receipt{}, "", nil, fmt.Errorf("reading receipt %d: %w", id, err)
	}
	if r.UnknownSince.Equal(time.Unix(0, 0)) {
		r.UnknownSince = time.Time{}
	}
	switch state {
	case "succeeded", "safe_to_retry", "rejected":
	default:
		return r, state, nil, nil
	}
	var s settlement
	err = tx.QueryRow(ctx, `SELECT at, actor, coalesce(detail->>'reason', '')
		FROM reconciler.receipt_events WHERE receipt_id = $1 AND to_state = $2
		ORDER BY seq DESC LIMIT 1`, id, state).Scan(&s.at, &s.actor, &s.reason)
	if err != nil {
		return readback.Receipt{}, "", nil, fmt.Errorf("reading the history of receipt %d: %w", id, err)
	}
	return r, state, &s, nil
}

// explain runs one check of r and prints the answer and what the
// reconciler would decide now, following the rules of package reconcile.
func explain(ctx context.Context, w *screen, db *pgxpool.Pool, reg *readback.Registry, r readback.Receipt, state string,
	timeout time.Duration) error {
	// The read's time is the database's (SPEC §5a), taken before the read
	// begins: never this host's clock, never the time the answer arrives.
	var now time.Time
	if err := db.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		return cli.Exit(fmt.Sprintf("adapters check: database clock: %v", err), 1)
	}
	w.Printf("\nreceipt %d: %s on %s, state %s, submitted %s ago, %d check(s) so far\n",
		r.ID, r.Operation, r.Dependency, state, now.Sub(r.SubmittedAt).Round(time.Second), r.Checks)
	b, ok := reg.Lookup(r.Operation, r.Dependency)
	if !ok {
		w.Printf("adapter: none\ndecision: manual_review (no_adapter): no adapter reads this operation or dependency\n")
		return nil
	}
	w.Printf("adapter: %s (type %s, kind %s)\n", b.Name, b.Type, b.Kind)
	if b.Kind == readback.Blind {
		w.Printf("decision: manual_review (blind): the endpoint cannot be read back\n")
		return nil
	}
	b, err := effectiveBinding(ctx, w, db, b)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	res, err := b.Adapter.Check(cctx, r)
	cancel()
	if err != nil {
		class, _ := readback.Classify(err)
		w.Printf("error: %s: %v\n", class, err)
		w.Printf("decision: %s\n", decision(b, r, res, err, now))
		w.Printf("nothing was changed\n")
		return nil
	}
	auth := "not authoritative"
	if res.Authoritative {
		auth = "authoritative"
	}
	w.Printf("query: %s\nverdict: %s (%s)\n", res.Query, res.Verdict, auth)
	if len(res.ExternalIDs) > 0 {
		w.Printf("matched: %s\n", strings.Join(res.ExternalIDs, ", "))
	}
	if res.Evidence != nil {
		if j, err := json.Marshal(res.Evidence); err == nil {
			w.Printf("evidence: %s\n", j)
		}
	}
	d := decision(b, r, res, nil, now)
	// The control the pool would need for this outcome, drawn for this
	// receipt as the pool would draw it.
	if kind := reconcile.ControlNeeded(reconcile.Decide(now, r, b, res, nil)); kind != "" {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		cerr := reconcile.RunControlFor(cctx, db, b, r, kind)
		cancel()
		if cerr != nil {
			d = fmt.Sprintf("check again later, not %s: this rests on the adapter's answer, and its %s control "+
				"has not passed (%v)", d, kind, cerr)
		} else {
			d += fmt.Sprintf("; the adapter's %s control passed", kind)
		}
	}
	w.Printf("decision: %s\n", d)
	w.Printf("nothing was changed\n")
	return nil
}

// decision says what the reconciler would do with this check now, by the
// rules of package reconcile.
func decision(b *readback.Binding, r readback.Receipt, res readback.Result, checkErr error, now time.Time) string {
	o := reconcile.Decide(now, r, b, res, checkErr)
	if !o.Settles() {
		safeAt, _, _ := b.Policy.AbsenceWindowFor(r, now)
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
