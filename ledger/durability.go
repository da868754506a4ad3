package ledger

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DurabilityMode says what a commit on the ledger's server means: how much
// of the server can be lost after a commit returns while the commit
// survives. The receipt that matters is submitted: it must survive
// whatever the deployment fails over from, before a byte of the request
// leaves.
type DurabilityMode string

// The durability modes, from weakest to strongest.
const (
	// DurabilityUnknown: the server hides pg_stat_replication's details
	// from this login (grant it pg_read_all_stats or pg_monitor) while
	// synchronous_standby_names asks for synchronous standbys.
	DurabilityUnknown DurabilityMode = "unknown"
	// DurabilityStandby: the server is a standby (in recovery); it
	// accepts no writes. Seen mid-failover through a multi-host URL
	// without target_session_attrs=read-write.
	DurabilityStandby DurabilityMode = "standby"
	// DurabilityUnflushed: synchronous_commit is off; a commit returns
	// before its WAL is flushed even locally, and a crash of the server
	// alone can lose it.
	DurabilityUnflushed DurabilityMode = "unflushed"
	// DurabilityLocal: a commit is flushed on this server only, and no
	// standby streams from it. It survives a crash of the server, not the
	// loss of its disk.
	DurabilityLocal DurabilityMode = "local"
	// DurabilityAsync: standbys stream from the server, but a commit
	// waits for none of them (synchronous_standby_names is empty, or
	// synchronous_commit is local). A failover to a standby can lose
	// receipts recorded just before it, after their requests were sent.
	DurabilityAsync DurabilityMode = "async"
	// DurabilityWaiting: synchronous_standby_names asks for more
	// synchronous standbys than are connected: every commit waits until
	// enough are back (or the setting changes). Nothing is lost, and
	// nothing is written meanwhile.
	DurabilityWaiting DurabilityMode = "sync_waiting"
	// DurabilityRemoteWrite, DurabilityRemoteFlush and
	// DurabilityRemoteApply: a commit returns once the synchronous
	// standbys synchronous_standby_names asks for have written (to their
	// operating system), flushed, or flushed and applied its WAL: a
	// failover to one of them keeps every commit that returned.
	DurabilityRemoteWrite DurabilityMode = "remote_write"
	DurabilityRemoteFlush DurabilityMode = "remote_flush"
	DurabilityRemoteApply DurabilityMode = "remote_apply"
)

// DurabilityModes lists every mode, for a metric that shows one as 1 and
// the others as 0.
func DurabilityModes() []DurabilityMode {
	return []DurabilityMode{DurabilityUnknown, DurabilityStandby, DurabilityUnflushed, DurabilityLocal,
		DurabilityAsync, DurabilityWaiting, DurabilityRemoteWrite, DurabilityRemoteFlush, DurabilityRemoteApply}
}

// Durability is what a commit on the ledger's server means, as read from
// the server's settings and pg_stat_replication (ReadDurability).
type Durability struct {
	Mode DurabilityMode `json:"mode"`
	// SynchronousCommit and SynchronousStandbyNames are the settings as
	// this login's sessions see them.
	SynchronousCommit       string `json:"synchronous_commit"`
	SynchronousStandbyNames string `json:"synchronous_standby_names"`
	// Required is how many synchronous standbys a commit waits for (the
	// number in synchronous_standby_names; 0 when it is empty).
	Required int `json:"required_standbys"`
	// Synchronous counts the standbys that confirm commits now
	// (pg_stat_replication.sync_state sync or quorum); Asynchronous the
	// others that stream; Hidden those whose state this login may not see.
	Synchronous  int `json:"synchronous_standbys"`
	Asynchronous int `json:"asynchronous_standbys"`
	Hidden       int `json:"hidden_standbys,omitempty"`
}

// Replicated reports whether a commit that returns has reached a
// synchronous standby: a failover to it loses no receipt that was
// recorded (the guarantee RequireSynchronousStandby asks for).
func (d Durability) Replicated() bool {
	switch d.Mode {
	case DurabilityRemoteWrite, DurabilityRemoteFlush, DurabilityRemoteApply:
		return true
	}
	return false
}

// String says, in one sentence, what a commit means in d.
func (d Durability) String() string {
	switch d.Mode {
	case DurabilityRemoteWrite, DurabilityRemoteFlush, DurabilityRemoteApply:
		what := map[DurabilityMode]string{DurabilityRemoteWrite: "written", DurabilityRemoteFlush: "flushed",
			DurabilityRemoteApply: "applied"}[d.Mode]
		return fmt.Sprintf("a commit returns once %s on %d synchronous standby(s) (%d connected, %d asynchronous): a failover to one keeps every recorded receipt",
			what, d.Required, d.Synchronous, d.Asynchronous)
	case DurabilityWaiting:
		return fmt.Sprintf("synchronous_standby_names (%q) asks for %d synchronous standby(s) and %d is connected: every commit waits until one is back",
			d.SynchronousStandbyNames, d.Required, d.Synchronous)
	case DurabilityAsync:
		return fmt.Sprintf("local only: %d standby(s) stream asynchronously and a commit waits for none (synchronous_standby_names %q, synchronous_commit %s): a failover can lose recorded receipts",
			d.Synchronous+d.Asynchronous+d.Hidden, d.SynchronousStandbyNames, d.SynchronousCommit)
	case DurabilityLocal:
		return "local only: no standby streams from the server; a commit survives a crash of the server, not the loss of its disk"
	case DurabilityUnflushed:
		return "synchronous_commit is off: a commit returns before its WAL is flushed, and a crash of the server can lose it"
	case DurabilityStandby:
		return "the server is a standby (in recovery): it accepts no writes"
	}
	return fmt.Sprintf("unknown: synchronous_standby_names (%q) asks for %d synchronous standby(s), and pg_stat_replication hides their state from this login (grant it pg_read_all_stats)",
		d.SynchronousStandbyNames, d.Required)
}

// sqlDurability reads what a commit means, in one round trip: the
// settings and a count of pg_stat_replication's rows (one per walsender:
// at most max_wal_senders, read from shared memory).
const sqlDurability = `SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
	pg_is_in_recovery(),
	count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')),
	count(*) FILTER (WHERE r.sync_state IN ('async', 'potential')),
	count(*) FILTER (WHERE r.pid IS NOT NULL AND r.sync_state IS NULL)
	FROM (SELECT 1) AS one LEFT JOIN pg_stat_replication AS r ON true`

// Querier is what ReadDurability reads through: a pool, a connection or a
// transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ReadDurability reads what a commit on db's server means now.
func ReadDurability(ctx context.Context, db Querier) (Durability, error) {
	var d Durability
	var recovery bool
	if err := db.QueryRow(ctx, sqlDurability).Scan(&d.SynchronousCommit, &d.SynchronousStandbyNames, &recovery,
		&d.Synchronous, &d.Asynchronous, &d.Hidden); err != nil {
		return Durability{}, fmt.Errorf("ledger: read the durability of commits: %w", err)
	}
	d.Required = requiredStandbys(d.SynchronousStandbyNames)
	d.Mode = durabilityMode(d, recovery)
	return d, nil
}

// numSync matches the number of synchronous_standby_names in its
// "[FIRST | ANY] num (names)" forms.
var numSync = regexp.MustCompile(`(?i)^\s*(?:(?:first|any)\s+)?(\d+)\s*\(`)

// requiredStandbys is the number of synchronous standbys a commit waits
// for under synchronous_standby_names: the number its "[FIRST|ANY] num
// (...)" form gives, 1 for a plain list or "*", 0 when empty.
func requiredStandbys(names string) int {
	if strings.TrimSpace(names) == "" {
		return 0
	}
	if m := numSync.FindStringSubmatch(names); m != nil {
		n, _ := strconv.Atoi(m[1])
		return n
	}
	return 1
}

// durabilityMode classifies d (its settings and counts filled in).
func durabilityMode(d Durability, recovery bool) DurabilityMode {
	standbys := d.Synchronous + d.Asynchronous + d.Hidden
	switch {
	case recovery:
		return DurabilityStandby
	case d.SynchronousCommit == "off":
		return DurabilityUnflushed
	case d.Required == 0 || d.SynchronousCommit == "local":
		if standbys > 0 {
			return DurabilityAsync
		}
		return DurabilityLocal
	case d.Synchronous >= d.Required:
		switch d.SynchronousCommit {
		case "remote_write":
			return DurabilityRemoteWrite
		case "remote_apply":
			return DurabilityRemoteApply
		}
		return DurabilityRemoteFlush
	case d.Hidden > 0:
		return DurabilityUnknown
	}
	return DurabilityWaiting
}

// ErrNoSynchronousStandby means a client that requires a synchronous
// standby (RequireSynchronousStandby) refused to record a receipt: the
// server cannot now confirm a commit on one, so a failover could lose the
// receipt after its request was sent. Nothing was recorded and nothing
// sent; see DurabilityError for what the server said.
var ErrNoSynchronousStandby = errors.New("no synchronous standby confirms commits")

// DurabilityError is the refusal of a client that requires a synchronous
// standby. It matches ErrNoSynchronousStandby.
type DurabilityError struct {
	// Durability is the server's, as last read.
	Durability Durability
	// Reason, when set, is why the durability could not be trusted
	// although the server reports it (a pool that does not watch notices:
	// see ConfigurePool).
	Reason string
}

// Error describes the refusal in one line.
func (e *DurabilityError) Error() string {
	why := e.Reason
	if why == "" {
		why = "mode " + string(e.Durability.Mode) + ": " + e.Durability.String()
	}
	return fmt.Sprintf("%v (%s); a synchronous standby is required, so no receipt is recorded until one is back", ErrNoSynchronousStandby, why)
}

// Unwrap returns ErrNoSynchronousStandby.
func (e *DurabilityError) Unwrap() error { return ErrNoSynchronousStandby }

// ErrNotReplicated means a statement that records a receipt submitted
// returned with a warning from the server, such as PostgreSQL's "canceling
// wait for synchronous replication ... The transaction has already
// committed locally, but might not have been replicated to the standby"
// (the wait was canceled: pg_cancel_backend, a cancel request, a shutdown).
// The receipt is recorded on this server, possibly on no standby: a
// failover could lose it, so nothing may be sent. Caller.Do sends nothing
// and rejects the receipt as not_sent (retryable); see NotReplicatedError.
var ErrNotReplicated = errors.New("the commit was not confirmed by a standby")

// NotReplicatedError is returned, with the receipt as recorded, by the
// moves that submit (PlanAndSubmit, Submit, Transition to submitted) when
// the server warned during the statement. It matches ErrNotReplicated.
type NotReplicatedError struct {
	// Receipt is the receipt as the statement returned it (submitted).
	Receipt *Receipt
	// Warning is the server's warning, message and detail.
	Warning string
}

// Error describes the NotReplicatedError in one line.
func (e *NotReplicatedError) Error() string {
	return fmt.Sprintf("receipt %d: %v: the server warned %q; nothing may be sent", e.Receipt.ID, ErrNotReplicated, e.Warning)
}

// Unwrap returns ErrNotReplicated.
func (e *NotReplicatedError) Unwrap() error { return ErrNotReplicated }

// Keys of the pgconn.PgConn custom data ConfigurePool's hooks write.
const (
	customWarning = "reconciler.ledger.warning"
	customWatched = "reconciler.ledger.watched"
)

// ConfigurePool prepares cfg for a pool the ledger records receipts
// through: each connection keeps the server's warnings (OnNotice, chained
// before any handler cfg has), so a statement that records a receipt
// submitted and comes back with a warning (a canceled wait for
// synchronous replication: committed locally, perhaps on no standby) is
// taken for what it is and nothing is sent (ErrNotReplicated). Without it
// such a commit looks like any other. RequireSynchronousStandby refuses a
// pool not configured so. NewPool calls it.
func ConfigurePool(cfg *pgxpool.Config) {
	prevNotice := cfg.ConnConfig.OnNotice
	cfg.ConnConfig.OnNotice = func(pc *pgconn.PgConn, n *pgconn.Notice) {
		// Every warning, not only the English text of the canceled wait:
		// messages follow lc_messages, and the statements that submit
		// raise none of their own.
		if n.SeverityUnlocalized == "WARNING" || n.Severity == "WARNING" {
			msg := n.Message
			if n.Detail != "" {
				msg += " (" + n.Detail + ")"
			}
			pc.CustomData()[customWarning] = msg
		}
		if prevNotice != nil {
			prevNotice(pc, n)
		}
	}
	prevConnect := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		conn.PgConn().CustomData()[customWatched] = true
		if prevConnect != nil {
			return prevConnect(ctx, conn)
		}
		return nil
	}
}

// NewPool opens a pool on url (any form pgx takes, multi-host
// "postgres://a,b/db?target_session_attrs=read-write" included: a new
// connection goes to whichever host is the primary then) configured by
// ConfigurePool.
func NewPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	ConfigurePool(cfg)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	return pool, nil
}

// DefaultDurabilityRecheck is how long a client that requires a
// synchronous standby trusts the durability it last read.
const DefaultDurabilityRecheck = time.Second

// durabilityCache is the durability a client last read, shared by every
// client made from one New; at most one read per recheck period, made by
// whichever call finds the last one too old.
type durabilityCache struct {
	pool *pgxpool.Pool
	now  func() time.Time

	mu   sync.Mutex
	last Durability
	at   time.Time // zero: never read
}

// read reads the durability now and keeps it.
func (d *durabilityCache) read(ctx context.Context) (Durability, error) {
	got, err := ReadDurability(ctx, d.pool)
	if err != nil {
		return Durability{}, err
	}
	d.mu.Lock()
	d.last, d.at = got, d.now()
	d.mu.Unlock()
	return got, nil
}

// get returns the durability read within every, reading it again when the
// last read is older.
func (d *durabilityCache) get(ctx context.Context, every time.Duration) (Durability, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.at.IsZero() && d.now().Sub(d.at) < every {
		return d.last, nil
	}
	got, err := ReadDurability(ctx, d.pool)
	if err != nil {
		return Durability{}, err
	}
	d.last, d.at = got, d.now()
	return got, nil
}

// Durability reads what a commit on the client's server means now (and
// refreshes what RequireSynchronousStandby checks).
func (c *Client) Durability(ctx context.Context) (Durability, error) {
	return c.durability.read(ctx)
}

// RequireSynchronousStandby returns a client like c that refuses to record
// a receipt (Plan, PlanAndSubmit, Retry, Submit; so Caller.Do) with a
// *DurabilityError, nothing recorded and nothing sent, while the server
// cannot confirm a commit on a synchronous standby (Durability.Replicated
// is false: asynchronous standbys only, none, or synchronous ones gone).
// The durability is read again when the last read is older than every
// (DefaultDurabilityRecheck when 0), by the call that finds it so: one
// query per period, not per call. Once a standby is back, calls succeed
// again within a period. The client's pool must be configured by
// ConfigurePool (NewPool), or every call is refused: a commit a standby
// did not confirm could not be told from one it did.
//
// Between two reads a standby can go, and a failover manager that then
// empties synchronous_standby_names lets commits return unreplicated for
// up to every: that is the window this check leaves. A manager that
// promotes only a standby that was synchronous (pg_auto_failover, Patroni
// in synchronous mode) does not promote one that missed those commits.
func (c *Client) RequireSynchronousStandby(every time.Duration) *Client {
	d := *c
	d.requireSync = cmpDuration(every, DefaultDurabilityRecheck)
	return &d
}

func cmpDuration(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// checkDurability refuses, when the client requires a synchronous standby
// and the server cannot now give one, with a *DurabilityError.
func (c *Client) checkDurability(ctx context.Context) error {
	if c.requireSync <= 0 {
		return nil
	}
	d, err := c.durability.get(ctx, c.requireSync)
	if err != nil {
		return err
	}
	if !d.Replicated() {
		return &DurabilityError{Durability: d}
	}
	return nil
}

// submitRow runs a statement that records a receipt submitted on one
// connection, and returns a *NotReplicatedError with the receipt when the
// server warned during it (ConfigurePool).
func (c *Client) submitRow(ctx context.Context, sql string, args ...any) (*Receipt, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	custom := conn.Conn().PgConn().CustomData()
	if c.requireSync > 0 && custom[customWatched] == nil {
		return nil, &DurabilityError{Reason: "the client's pool does not watch the server's warnings: make it with ledger.NewPool or ledger.ConfigurePool"}
	}
	delete(custom, customWarning)
	r, err := scanReceipt(conn.QueryRow(ctx, sql, args...))
	if w, ok := custom[customWarning].(string); ok {
		delete(custom, customWarning)
		if err == nil {
			return r, &NotReplicatedError{Receipt: r, Warning: w}
		}
	}
	return r, err
}
