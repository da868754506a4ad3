package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/reconcile"
)

// printWindows says, per adapter, the window its absences wait for now
// (docs/verdict-audits.md): the declared one, or the wider one a window
// alarm set, and why. It reads the ledger db (already checked), else the
// one at url; without either it says where to look.
func printWindows(ctx context.Context, out *screen, db *pgxpool.Pool, url string, bs []readback.Binding) error {
	if url == "" {
		out.Printf("effective windows: as declared unless a window alarm widened them; " +
			"give --database-url to see them\n")
		return nil
	}
	if db == nil {
		var err error
		if db, err = pgxpool.New(ctx, url); err != nil {
			return cli.Exit(fmt.Sprintf("adapters check: database: %v", err), 1) // pgx redacts passwords
		}
		defer db.Close()
		if err := checkLedger(ctx, "adapters check", db, readBacklog); err != nil {
			return err
		}
	}
	var ws reconcile.Windows
	if err := ws.Load(ctx, db); err != nil {
		return dbFailure("adapters check", db, err, readBacklog)
	}
	out.Printf("effective windows (absence conclusive at send deadline +):\n")
	for _, b := range bs {
		if b.Kind == readback.Blind {
			continue
		}
		w := ws.For(&b)
		if !w.Widened() {
			out.Printf("  %s: %s, as declared (no window alarm under this declaration)\n", b.Name, w.Effective)
			continue
		}
		out.Printf("  %s: %s, widened from the declared %s: %s on receipt %d at %s observed %s "+
			"(the window stays widened until the declaration in the file changes)\n",
			b.Name, w.Effective, w.Declared, w.Kind, w.Receipt, w.At.UTC().Format(time.RFC3339), w.Observed)
	}
	return nil
}

// effectiveBinding returns b with the effective window the reconciler
// applies to it (a widened one after a window alarm), so that an explained
// decision waits for what the daemon waits for.
func effectiveBinding(ctx context.Context, w *screen, db *pgxpool.Pool, b *readback.Binding) (*readback.Binding, error) {
	var ws reconcile.Windows
	if err := ws.Load(ctx, db); err != nil {
		return nil, dbFailure("adapters check", db, err, readLedger)
	}
	win := ws.For(b)
	if !win.Widened() {
		return b, nil
	}
	w.Printf("window: %s, widened from the declared %s by a %s alarm (absences wait for it)\n",
		win.Effective, win.Declared, win.Kind)
	eff := *b
	eff.Policy = ws.Policy(b)
	return &eff, nil
}
