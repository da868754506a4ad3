package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
)

// requireSyncFlag is --require-synchronous-standby, shared by run and
// gateway.
func requireSyncFlag() *cli.BoolFlag {
	return &cli.BoolFlag{Name: "require-synchronous-standby", EnvVars: []string{"RECONCILER_REQUIRE_SYNCHRONOUS_STANDBY"},
		Usage: "require that every commit reach a synchronous standby (synchronous_standby_names, one connected): " +
			"the gateway records and sends nothing while none does; both answer /readyz 503 meanwhile"}
}

// The cadence of ledgerHealth's checks, and the bound of each.
const (
	healthEvery   = 2 * time.Second
	healthTimeout = 5 * time.Second
)

// ledgerHealth checks, every healthEvery in the background, what /readyz
// answers from: whether the database answers, whether this process can
// write the ledger now (its sessions not read-only: a standby or a read-only primary
// refuses it with SQLSTATE 25006), whether the schema is current, and what
// a commit means (ledger.Durability). /readyz never waits on the database:
// it answers at once from the last check, so a slow database (300 ms a
// round trip) cannot make it miss its own deadline.
type ledgerHealth struct {
	db      *pgxpool.Pool
	require bool
	log     *slog.Logger
	now     func() time.Time
	mode    *prometheus.GaugeVec
	write   prometheus.Gauge

	mu        sync.Mutex
	checked   time.Time // when the last check ended
	d         ledger.Durability
	known     bool  // d was read at least once
	dbErr     error // the database did not answer the last check
	writeErr  error // the write probe failed
	schemaErr error
}

// newLedgerHealth returns a checker of db registering its metrics on reg
// (nil: none): reconciler_durability_mode{mode} (1 for the mode now, 0
// for the others) and reconciler_ledger_writable (1 or 0).
func newLedgerHealth(db *pgxpool.Pool, reg prometheus.Registerer, logger *slog.Logger, require bool) *ledgerHealth {
	h := &ledgerHealth{db: db, require: require, log: logger, now: time.Now,
		mode: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "reconciler_durability_mode",
			Help: "What a commit on the ledger's server means: 1 for the mode now (local, async, remote_write, remote_flush, remote_apply, sync_waiting, unflushed, standby, unknown)."},
			[]string{"mode"}),
		write: prometheus.NewGauge(prometheus.GaugeOpts{Name: "reconciler_ledger_writable",
			Help: "1 while this process's last write probe of the ledger's database succeeded."}),
	}
	if reg != nil {
		reg.MustRegister(h.mode, h.write)
	}
	return h
}

// sqlWriteProbe reads whether this process's sessions are read-only: on
// a standby, or with default_transaction_read_only on (a primary made
// read-only, as a switchover does), every ledger write is refused with
// SQLSTATE 25006.
const sqlWriteProbe = `SELECT current_setting('transaction_read_only')::bool`

// errReadOnly is the write probe's finding: the session is read-only.
var errReadOnly = errors.New("the database is read-only (transaction_read_only is on: a standby, or a primary made read-only, as mid-failover); " +
	"every ledger write is refused with SQLSTATE 25006: this process cannot write the ledger now")

// check reads everything once, within healthTimeout, and logs the
// durability the first time and whenever it changes.
func (h *ledgerHealth) check(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	d, dbErr := ledger.ReadDurability(ctx, h.db)
	var writeErr, schemaErr error
	if dbErr == nil {
		var readOnly bool
		if writeErr = h.db.QueryRow(ctx, sqlWriteProbe).Scan(&readOnly); writeErr == nil && readOnly {
			writeErr = errReadOnly
		}
		schemaErr = migrations.Check(ctx, h.db)
	}
	h.mu.Lock()
	prev, known := h.d, h.known
	h.checked, h.dbErr, h.writeErr, h.schemaErr = h.now(), dbErr, writeErr, schemaErr
	if dbErr == nil {
		h.d, h.known = d, true
	}
	h.mu.Unlock()
	if dbErr != nil {
		h.write.Set(0)
		return
	}
	if writeErr != nil {
		h.write.Set(0)
	} else {
		h.write.Set(1)
	}
	for _, m := range ledger.DurabilityModes() {
		v := 0.0
		if m == d.Mode {
			v = 1
		}
		h.mode.WithLabelValues(string(m)).Set(v)
	}
	switch {
	case !known:
		level := slog.LevelInfo
		if h.require && !d.Replicated() {
			level = slog.LevelWarn
		}
		h.log.Log(ctx, level, "ledger durability: "+d.String(), "mode", d.Mode, "synchronous_commit", d.SynchronousCommit,
			"synchronous_standby_names", d.SynchronousStandbyNames, "synchronous_standbys", d.Synchronous,
			"asynchronous_standbys", d.Asynchronous, "require_synchronous_standby", h.require)
	case prev.Mode != d.Mode:
		h.log.Warn("ledger durability changed: "+d.String(), "mode", d.Mode, "was", prev.Mode,
			"synchronous_standbys", d.Synchronous, "asynchronous_standbys", d.Asynchronous)
	}
}

// run checks every healthEvery until ctx ends.
func (h *ledgerHealth) run(ctx context.Context) {
	t := time.NewTicker(healthEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			h.check(ctx)
		}
	}
}

// durabilityJSON is the durability in /readyz's body.
type durabilityJSON struct {
	ledger.Durability
	Meaning string `json:"meaning"`
	// Replicated says a commit that returns is on a synchronous standby.
	Replicated bool `json:"replicated"`
}

// notReady returns why the process cannot write the ledger now (or, with
// --require-synchronous-standby, cannot keep the promise), "" when it
// can; and the durability last read, nil before the first.
func (h *ledgerHealth) notReady() (string, *durabilityJSON) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var dj *durabilityJSON
	if h.known {
		dj = &durabilityJSON{Durability: h.d, Meaning: h.d.String(), Replicated: h.d.Replicated()}
	}
	age := h.now().Sub(h.checked)
	switch {
	case h.checked.IsZero():
		return "the database has not been checked yet", dj
	case h.dbErr != nil:
		return "database unreachable: " + h.dbErr.Error(), dj
	case age > 3*healthEvery+healthTimeout:
		return fmt.Sprintf("the database has not answered a check for %s", age.Round(time.Second)), dj
	case errors.Is(h.writeErr, errReadOnly):
		return h.writeErr.Error(), dj
	case h.writeErr != nil:
		return "database unreachable: " + h.writeErr.Error(), dj
	case h.schemaErr != nil:
		return "database schema not current: " + h.schemaErr.Error(), dj
	case h.require && !h.d.Replicated():
		return "no synchronous standby confirms commits (--require-synchronous-standby): " + h.d.String(), dj
	}
	return "", dj
}
