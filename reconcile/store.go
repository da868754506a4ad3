package reconcile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// ErrInvalidConfig means a Config or Store setting is unusable.
var ErrInvalidConfig = errors.New("invalid reconciler configuration")

// Store is the reconciler's access to the ledger: batch claim, batch
// complete, orphan sweep and backlog counts. Every write after a claim is
// guarded by the lease token of that claim. Safe for concurrent use.
type Store struct {
	pool  *pgxpool.Pool
	actor statemachine.Actor
	// instance names this process in check records; tokens are unique per
	// claim even if two processes were given the same instance name.
	instance string
	nonce    string
	seq      atomic.Uint64
	// claimDetail is the history detail of every claim (the same each time).
	claimDetail []byte
}

// NewStore returns a store writing as "reconciler:<instance>".
func NewStore(pool *pgxpool.Pool, instance string) (*Store, error) {
	actor, err := statemachine.ParseActor("reconciler:" + instance)
	if err != nil {
		return nil, fmt.Errorf("reconcile: instance %q: %w: %w", instance, ErrInvalidConfig, err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	detail, err := json.Marshal(map[string]any{"reason": "claimed", "extra": map[string]any{"instance": instance}})
	if err != nil {
		return nil, fmt.Errorf("reconcile: instance %q: claim detail: %w", instance, err)
	}
	return &Store{pool: pool, actor: actor, instance: instance, nonce: hex.EncodeToString(b), claimDetail: detail}, nil
}

// Actor returns the actor the store writes as.
func (s *Store) Actor() statemachine.Actor { return s.actor }

// Claimed is a leased receipt.
type Claimed struct {
	readback.Receipt
	// Lease is the claim's token: later writes succeed only while the row
	// still carries it.
	Lease        string
	LeaseExpires time.Time
	// Retry is set when the row's previous check failed transiently, so
	// this check is a retry (limited by the dependency's retry budget).
	Retry bool
	// LateOutcomes are the outcomes the receipt's agent recorded after the
	// orphan sweep had moved it (oldest first).
	LateOutcomes []LateOutcome
	// Waits counts the times the row was handed back without a read that
	// counts (Outcome.Waited) since it became outcome_unknown.
	Waits int
}

// Claim leases up to limit rows due as of now, for lease from now, in one
// statement.
func (s *Store) Claim(ctx context.Context, now time.Time, limit int, lease time.Duration) ([]Claimed, error) {
	return s.ClaimAt(ctx, now, now, limit, lease)
}

// ClaimAt leases up to limit rows due by dueBy, each for lease from now
// (the time of the claim, on the database's clock), in one statement. A
// drain keeps dueBy at its start, so it ends, while every row it claims
// late still gets a full lease.
func (s *Store) ClaimAt(ctx context.Context, dueBy, now time.Time, limit int, lease time.Duration) ([]Claimed, error) {
	return s.claim(ctx, claimArgs{dueBy: dueBy, now: now, limit: limit, lease: lease})
}

// claimArgs narrow a claim (sqlDue): skip leaves rows out, only (when not
// nil) claims none but those.
type claimArgs struct {
	dueBy, now time.Time
	limit      int
	lease      time.Duration
	skip, only []int64
}

// claim is ClaimAt with the rows to leave out or to claim alone.
func (s *Store) claim(ctx context.Context, a claimArgs) ([]Claimed, error) {
	if a.limit <= 0 {
		return nil, nil
	}
	token := s.instance + "/" + s.nonce + "/" + strconv.FormatUint(s.seq.Add(1), 10)
	expires := a.now.Add(a.lease)
	rows, err := s.pool.Query(ctx, sqlClaim, pgx.QueryExecModeCacheDescribe, pgx.NamedArgs{
		"due_by": a.dueBy, "limit": a.limit, "skip": a.skip, "only": a.only,
		"actor": string(s.actor), "detail": s.claimDetail, "token": token, "expires": expires})
	if err != nil {
		return nil, fmt.Errorf("reconcile: claim: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Claimed, error) {
		c := Claimed{Lease: token, LeaseExpires: expires}
		r := &c.Receipt
		var late []byte
		err := row.Scan(&r.ID, &r.IdempotencyKey, &r.Operation, &r.Dependency, &r.Method, &r.Target,
			&r.Fingerprint, &r.Intent, &r.PreImage, &r.ExternalID, &r.Attempt, &r.CreatedAt,
			&r.SubmittedAt, &r.SendDeadline, &r.UnknownSince, &r.Checks, &c.Retry, &late, &c.Waits)
		if err == nil && late != nil {
			if jerr := json.Unmarshal(late, &c.LateOutcomes); jerr != nil {
				err = fmt.Errorf("late outcomes of receipt %d: %w", r.ID, jerr)
			}
		}
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: claim: %w", err)
	}
	return out, nil
}

// due returns the ids of up to limit rows due by dueBy, in due order,
// leaving out skip, without claiming them: the candidates of a claim the
// database refused, to be claimed apart.
func (s *Store) due(ctx context.Context, dueBy time.Time, limit int, skip []int64) ([]int64, error) {
	ids, err := s.ids(ctx, sqlDue, pgx.QueryExecModeCacheDescribe, pgx.NamedArgs{
		"due_by": dueBy, "limit": limit, "skip": skip, "only": nil})
	if err != nil {
		return nil, fmt.Errorf("reconcile: due rows: %w", err)
	}
	return ids, nil
}

// ids runs a statement that returns receipt ids, and collects them.
func (s *Store) ids(ctx context.Context, sql string, args ...any) ([]int64, error) {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// Renew extends to expires the leases of the rows ids, each still held by
// its token in tokens, in one statement, and returns the ids renewed.
func (s *Store) Renew(ctx context.Context, ids []int64, tokens []string, expires time.Time) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	renewed, err := s.ids(ctx, sqlRenew, ids, tokens, expires)
	if err != nil {
		return nil, fmt.Errorf("reconcile: renew leases: %w", err)
	}
	return renewed, nil
}

// ReclaimOwn releases (within limit, like SweepOrphans), due at now, the rows still leased by an earlier
// process of this store's instance (a process that crashed or was killed
// and restarted under the same name), and returns how many. Instance names
// must be unique among live processes: a second live process of the same
// name would lose its rows in flight to this (their outcomes are then
// discarded by the lease guard, nothing worse).
func (s *Store) ReclaimOwn(ctx context.Context, now time.Time, limit time.Duration) (int64, error) {
	// Bounded like the orphan sweep (client, statement and lock timeouts):
	// a lock held elsewhere must not stop the start.
	if limit <= 0 {
		limit = DefaultSweepLimit
	}
	ctx, cancel := context.WithTimeout(ctx, limit+time.Second)
	defer cancel()
	var n int64
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlSweepLimits, strconv.FormatInt(max(limit.Milliseconds(), 1), 10),
			strconv.FormatInt(max(limit.Milliseconds()/2, 1), 10)); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, sqlReclaimOwn, s.instance, s.nonce, now)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("reconcile: reclaim own leases: %w", err)
	}
	return n, nil
}

// Outcome is what happened to one claimed row.
type Outcome struct {
	ID    int64
	Lease string
	// To is succeeded, safe_to_retry or manual_review for a settlement, or
	// reconciling to release the row until NextCheck.
	To        statemachine.State
	NextCheck time.Time
	// Detail is the settlement's detail (reason, evidence, error): the
	// history event's input. Ignored on release.
	Detail     Detail
	ExternalID string
	// Check is the readback check made, if any; it bumps check_count
	// unless Waited is set.
	Check *CheckRecord
	// Waited marks a wait: the row is handed back (or ended by its
	// deadline) without a read that counts against max_checks (a deferral,
	// a positive control not passed, a lease too short, a stop). It bumps
	// wait_count instead of check_count; a Check it carries (the read held
	// back for a control) is recorded all the same.
	Waited bool
	// Duplicates are the matching external ids of a create that matched
	// more than once (an alarm is recorded if the row settles).
	Duplicates []string
	Adapter    string
	Dependency string

	// recorded, when set, is closed once the pool's recorder is done with
	// Check (written, or given up): the outcome is written after it, so a
	// settlement never precedes its check's record.
	recorded <-chan struct{}
}

// Settles reports whether o settles the receipt (as opposed to releasing it).
func (o Outcome) Settles() bool { return o.To != statemachine.Reconciling }

// Detail is the JSON recorded with a settlement; the shape of ledger.Detail
// (error, evidence, reason, extra) so every history event reads alike.
type Detail struct {
	Error    *DetailError `json:"error,omitempty"`
	Evidence *Evidence    `json:"evidence,omitempty"`
	Reason   string       `json:"reason,omitempty"`
}

// DetailError is a settlement's error, shaped like ledger.CallError.
type DetailError struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

// CheckRecord is one readback check, appended to reconciler.readback_checks.
type CheckRecord struct {
	CheckNo       int
	At            time.Time
	Adapter       string
	Dependency    string
	Verdict       string // a readback.Verdict, or "error"
	Authoritative bool
	Matches       int
	Latency       time.Duration
	ErrorClass    readback.ErrorClass // "" unless Verdict is "error"
	Error         string
	Evidence      json.RawMessage
	// Recorded is set once RecordChecks has written the check: Complete
	// then does not write it again.
	Recorded bool
}

// minimal returns c without the API's text (evidence, error message), for
// a check the database refused for its data (why): only the reconciler's
// own fields, and for an error the refusal.
func (c *CheckRecord) minimal(why string) CheckRecord {
	r := *c
	r.Error, r.Evidence = "", json.RawMessage(`{"sanitized":true}`)
	if r.Verdict == "error" {
		r.Error = "the check's error could not be stored: " + why
	}
	return r
}

// ReceiptCheck is a check of one receipt, for RecordChecks.
type ReceiptCheck struct {
	ReceiptID int64
	Check     *CheckRecord
}

// RecordChecks appends checks to reconciler.readback_checks in one
// statement, apart from any settlement, and marks each written one
// Recorded. The pool records every check as soon as its adapter answers, so
// a read made by a process that dies before it settles is still in the
// audit trail; the settlement that follows does not record it again. A
// check the database refuses permanently (its data, a privilege) is
// recorded without its evidence and error text; one refused even so is
// left unrecorded, with no error (Complete then handles it with its
// outcome). An error means the database did not answer (transient).
func (s *Store) RecordChecks(ctx context.Context, checks []ReceiptCheck) error {
	_, err := s.recordChecks(ctx, checks, false)
	return err
}

// RecordChecksAgain repeats a RecordChecks whose commit is unknown (the
// connection broke after COMMIT was sent): a check already recorded is not
// recorded again.
func (s *Store) RecordChecksAgain(ctx context.Context, checks []ReceiptCheck) error {
	_, err := s.recordChecks(ctx, checks, true)
	return err
}

// recordChecks is RecordChecks (or, with retry, RecordChecksAgain), which
// also returns the first refusal of a check left unrecorded.
func (s *Store) recordChecks(ctx context.Context, checks []ReceiptCheck, retry bool) (refused, err error) {
	if len(checks) == 0 {
		return nil, nil
	}
	clean := make([]ReceiptCheck, len(checks))
	for i, c := range checks {
		r := c.Check.sanitized()
		clean[i] = ReceiptCheck{ReceiptID: c.ReceiptID, Check: &r}
	}
	ok, refused, err := s.recordSplit(ctx, clean, retry)
	for i, c := range checks {
		if ok[i] {
			c.Check.Recorded = true
		}
	}
	return refused, err
}

// recordSplit writes checks in one statement and reports which were
// written. On a permanent refusal (permanentDB) it splits the batch in
// halves, down to single checks, each then written minimally (no evidence,
// no error text), as complete does with outcomes; a check refused even so
// is left unrecorded (its outcome's write records it, or gives it up), and
// the first such refusal is returned as refused. Only a transient failure
// is returned as err.
func (s *Store) recordSplit(ctx context.Context, checks []ReceiptCheck, retry bool) (ok []bool, refused, err error) {
	ok = make([]bool, len(checks))
	err = s.insertChecks(ctx, checks, retry)
	if err == nil {
		for i := range ok {
			ok[i] = true
		}
		return ok, nil, nil
	}
	if !permanentDB(err) || ctx.Err() != nil {
		return ok, nil, err
	}
	if len(checks) == 1 {
		r := checks[0].Check.minimal(refusal(err))
		merr := s.insertChecks(ctx, []ReceiptCheck{{ReceiptID: checks[0].ReceiptID, Check: &r}}, retry)
		if merr != nil && permanentDB(merr) {
			return ok, err, nil
		}
		ok[0] = merr == nil
		return ok, nil, merr
	}
	half := len(checks) / 2
	a, refused, err := s.recordSplit(ctx, checks[:half], retry)
	if err != nil {
		return append(a, make([]bool, len(checks)-half)...), refused, err
	}
	b, refusedB, err := s.recordSplit(ctx, checks[half:], retry)
	if refused == nil {
		refused = refusedB
	}
	return append(a, b...), refused, err
}

// insertChecks appends checks (already sanitized) in one statement.
func (s *Store) insertChecks(ctx context.Context, checks []ReceiptCheck, retry bool) error {
	var c checkRows
	for _, rc := range checks {
		c.add(rc.ReceiptID, rc.Check)
	}
	if _, err := s.pool.Exec(ctx, sqlRecordChecks, c.id, c.no, c.at, c.adapter, c.dep, c.verdict,
		c.auth, c.matches, c.latency, c.class, c.err, c.ev, s.instance, retry); err != nil {
		return fmt.Errorf("reconcile: record %d checks: %w", len(checks), err)
	}
	return nil
}

// checkRows are check records as the columns of readback_checks, one array
// per column, for unnest.
type checkRows struct {
	id                    []int64
	no, matches           []int32
	at                    []time.Time
	adapter, dep, verdict []string
	auth                  []bool
	latency               []int64
	class, err            []*string
	ev                    [][]byte
}

func (r *checkRows) add(receipt int64, c *CheckRecord) {
	r.id = append(r.id, receipt)
	r.no = append(r.no, int32(c.CheckNo))
	r.at = append(r.at, c.At)
	r.adapter = append(r.adapter, c.Adapter)
	r.dep = append(r.dep, c.Dependency)
	r.verdict = append(r.verdict, c.Verdict)
	r.auth = append(r.auth, c.Authoritative)
	r.matches = append(r.matches, int32(c.Matches))
	r.latency = append(r.latency, c.Latency.Microseconds())
	r.class = append(r.class, nullable(string(c.ErrorClass)))
	r.err = append(r.err, nullable(c.Error))
	if len(c.Evidence) > 0 {
		r.ev = append(r.ev, c.Evidence)
	} else {
		r.ev = append(r.ev, nil)
	}
}

// Complete applies outcomes in one statement and returns the ids whose
// lease still held (the others were reclaimed after their lease expired and
// are left to their new holder).
func (s *Store) Complete(ctx context.Context, outcomes []Outcome) (applied []int64, err error) {
	w, err := s.complete(ctx, outcomes, false)
	return w.applied, err
}

// CompleteAgain repeats a Complete of the same outcomes that failed in a
// way that leaves its commit unknown (the connection broke after COMMIT was
// sent). It is idempotent: a check already recorded is not recorded again,
// and a row that already holds the outcome (the first attempt committed) is
// returned as applied.
func (s *Store) CompleteAgain(ctx context.Context, outcomes []Outcome) (applied []int64, err error) {
	w, err := s.complete(ctx, outcomes, true)
	return w.applied, err
}

// written is what a write of outcomes did: the ids whose outcome (or,
// for a refused one, what could be written in its place) was applied under
// the claim's lease, and the rows the database refused permanently, with
// what became of each.
type written struct {
	applied []int64
	refused map[int64]rowRefusal
}

func (w *written) add(o written) {
	w.applied = append(w.applied, o.applied...)
	for id, r := range o.refused {
		w.refuse(id, r)
	}
}

func (w *written) refuse(id int64, r rowRefusal) {
	if w.refused == nil {
		w.refused = map[int64]rowRefusal{}
	}
	w.refused[id] = r
}

// rowRefusal is a row whose outcome the database refused permanently: the
// refusal of its full outcome (cause) and what was written instead (fate).
type rowRefusal struct {
	cause error
	fate  refusedFate
	// last is the refusal that ended the fallbacks (fateHeld).
	last error
}

// refusedFate is what became of a row whose outcome was refused, from the
// best to the worst.
type refusedFate int

const (
	// fateMinimal: the same outcome was written without the API's text
	// (evidence and error message): applied, settled or released as decided.
	fateMinimal refusedFate = iota + 1
	// fateCheckError: released with a check error recorded, next check
	// pushed (WriteRefusedRetry); check_count grows, so the bounds end it.
	fateCheckError
	// fateReleased: only the lease was released and the next check pushed
	// (WriteRefusedRetry at least); the check's record was refused too.
	fateReleased
	// fateHeld: nothing could be written; the row stays leased until its
	// lease expires (the pool stops renewing it), then is claimable again.
	fateHeld
)

// String describes the fate for logs.
func (f refusedFate) String() string {
	switch f {
	case fateMinimal:
		return "written without the API's text"
	case fateCheckError:
		return "not settled: released with a check error, next check pushed"
	case fateReleased:
		return "not settled: released, next check pushed; its check is not recorded"
	case fateHeld:
		return "not settled: nothing could be written; the row returns when its lease expires"
	}
	return "unknown"
}

// complete writes outcomes, each sanitized first (text from an API made
// valid, bounded and marked: outcome.sanitized), in one statement. If the
// database refuses the batch permanently (permanentDB: one row's data, a
// trigger's refusal, a missing privilege), the batch is split in halves,
// down to single rows, so every row that can be written is; a row refused
// on its own is given up (writeRefused), so it never stays leased and
// failing forever. The split costs nothing unless a batch fails. Only a
// transient failure is returned as an error (the caller keeps the batch).
func (s *Store) complete(ctx context.Context, outcomes []Outcome, retry bool) (written, error) {
	if len(outcomes) == 0 {
		return written{}, nil
	}
	clean := make([]Outcome, len(outcomes))
	for i, o := range outcomes {
		clean[i] = o.sanitized()
	}
	return s.completeSplit(ctx, clean, retry)
}

// completeSplit writes outcomes in one statement, splitting the batch on a
// permanent refusal (see complete).
func (s *Store) completeSplit(ctx context.Context, outcomes []Outcome, retry bool) (written, error) {
	applied, err := s.write(ctx, outcomes, retry)
	if err == nil || !permanentDB(err) || ctx.Err() != nil {
		return written{applied: applied}, err
	}
	if len(outcomes) == 1 {
		return s.writeRefused(ctx, outcomes[0], err, retry)
	}
	half := len(outcomes) / 2
	a, err := s.completeSplit(ctx, outcomes[:half], retry)
	if err != nil {
		return a, err
	}
	b, err := s.completeSplit(ctx, outcomes[half:], retry)
	a.add(b)
	return a, err
}

// WriteRefusedRetry is how long a row whose outcome the database refused
// waits, at least, before its next check: a refusal is not cured by
// checking again at once, and the row must not come back in a hot loop.
const WriteRefusedRetry = time.Minute

// writeRefused gives up, for a row whose outcome the database refused on
// its own (cause), as little as it can, in order:
//
//  1. the same outcome built only from the reconciler's own data (its
//     evidence replaced by a minimal one recording the refusal, its check
//     without evidence): the verdict stands;
//  2. a release with a check error recorded, so check_count grows and the
//     bounds (max_checks, deadline) eventually settle it to manual_review;
//  3. a bare release (lease and next check, nothing else: what a claim
//     writes), for when even a check record is refused (a missing
//     privilege on readback_checks);
//  4. nothing: the row is left to its lease's expiry.
//
// Steps 2 and 3 push the next check WriteRefusedRetry ahead at least. A
// transient failure at any step is returned (the batch is kept and retried).
func (s *Store) writeRefused(ctx context.Context, o Outcome, cause error, retry bool) (written, error) {
	why := refusal(cause)
	minimal := Outcome{ID: o.ID, Lease: o.Lease, To: o.To, NextCheck: o.NextCheck,
		Adapter: o.Adapter, Dependency: o.Dependency, Waited: o.Waited}
	if o.Settles() {
		ev := &Evidence{Sanitized: true, WriteError: why}
		if e := o.Detail.Evidence; e != nil {
			ev.Adapter, ev.Operation, ev.Dependency, ev.Checks = e.Adapter, e.Operation, e.Dependency, e.Checks
			ev.Verdict, ev.Authoritative, ev.Bound, ev.Control = e.Verdict, e.Authoritative, e.Bound, e.Control
			ev.Guarantee, ev.AbsenceSafeAt, ev.ReuseKeyBefore = e.Guarantee, e.AbsenceSafeAt, e.ReuseKeyBefore
			ev.SinceSubmissionSec, ev.ReadAt, ev.SendDeadline = e.SinceSubmissionSec, e.ReadAt, e.SendDeadline
		}
		minimal.Detail = Detail{Reason: o.Detail.Reason, Evidence: ev}
		if o.Detail.Error != nil {
			minimal.Detail.Error = &DetailError{Code: o.Detail.Error.Code}
		}
	}
	if c := o.Check; c != nil && !c.Recorded {
		r := c.minimal(why)
		minimal.Check = &r
	}
	given := func(applied []int64, fate refusedFate, last error) written {
		w := written{applied: applied}
		if len(applied) > 0 || fate == fateHeld {
			w.refuse(o.ID, rowRefusal{cause: cause, fate: fate, last: last})
		}
		return w
	}
	applied, err := s.write(ctx, []Outcome{minimal}, retry)
	if err == nil || !permanentDB(err) {
		return given(applied, fateMinimal, nil), err
	}
	var next, at *time.Time
	if !o.NextCheck.IsZero() {
		next = &o.NextCheck
	}
	if o.Check != nil {
		at = &o.Check.At
	}
	wait := WriteRefusedRetry.Seconds()
	applied, err = s.release(ctx, sqlReleaseRefused, o.ID, o.Lease, next, at, wait, o.Adapter,
		"outcome refused by the database: "+why, s.instance)
	if err == nil || !permanentDB(err) {
		return given(applied, fateCheckError, nil), err
	}
	applied, err = s.release(ctx, sqlReleaseBare, o.ID, o.Lease, next, at, wait)
	if err == nil || !permanentDB(err) {
		return given(applied, fateReleased, nil), err
	}
	return given(nil, fateHeld, err), nil
}

// release runs one of the statements that release a refused row, and
// returns the id if the row was still leased by the token.
func (s *Store) release(ctx context.Context, sql string, id int64, args ...any) ([]int64, error) {
	ids, err := s.ids(ctx, sql, append([]any{id}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("reconcile: release receipt %d after its outcome was refused: %w", id, err)
	}
	return ids, nil
}

// write applies outcomes (already sanitized) in one statement.
func (s *Store) write(ctx context.Context, outcomes []Outcome, retry bool) (applied []int64, err error) {
	n := len(outcomes)
	var (
		ids      = make([]int64, n)
		leases   = make([]string, n)
		tos      = make([]string, n)
		details  = make([][]byte, n)
		extIDs   = make([]*string, n)
		nexts    = make([]*time.Time, n)
		addCheck = make([]int32, n)
		addWait  = make([]int32, n)
		trans    = make([]bool, n)

		checks checkRows

		aID, aAt, aAdapter, aDep, aIDs = []int64{}, []time.Time{}, []string{}, []string{}, [][]byte{}
	)
	for i, o := range outcomes {
		ids[i], leases[i], tos[i] = o.ID, o.Lease, string(o.To)
		if o.Settles() {
			d, err := json.Marshal(o.Detail)
			if err != nil {
				return nil, fmt.Errorf("reconcile: receipt %d: detail: %w", o.ID, err)
			}
			details[i] = d
		} else {
			details[i] = []byte(`{}`)
			t := o.NextCheck
			nexts[i] = &t
		}
		if o.ExternalID != "" {
			e := o.ExternalID
			extIDs[i] = &e
		}
		if o.Waited {
			addWait[i] = 1
		}
		if c := o.Check; c != nil {
			// A check RecordChecks already wrote still counts; it is not
			// written again.
			if !o.Waited {
				addCheck[i] = 1
				trans[i] = c.ErrorClass == readback.Transient
			}
			if !c.Recorded {
				checks.add(o.ID, c)
			}
		}
		if len(o.Duplicates) > 1 && o.Settles() && o.Check != nil {
			j, _ := json.Marshal(o.Duplicates)
			aID = append(aID, o.ID)
			aAt = append(aAt, o.Check.At)
			aAdapter = append(aAdapter, o.Adapter)
			aDep = append(aDep, o.Dependency)
			aIDs = append(aIDs, j)
		}
	}
	// The batch is joined to its rows by primary key. The planner sizes
	// that join from statistics, which say "almost nothing is reconciling"
	// (true of the table, false of this batch): it then picks a nested loop
	// that re-runs the unnest per row, and 1,000 rows cost 0.5-2 s instead of
	// 40 ms (measured, docs/explain.md). Nested loops are therefore off for
	// this one transaction, and the statement is planned for its own arrays
	// (unnamed statement) rather than from a cached generic plan.
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_nestloop = off`); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sqlComplete, pgx.QueryExecModeCacheDescribe,
			ids, leases, tos, details, extIDs, nexts, addCheck, string(s.actor),
			checks.id, checks.no, checks.at, checks.adapter, checks.dep, checks.verdict, checks.auth, checks.matches,
			checks.latency, checks.class, checks.err, checks.ev, s.instance,
			aID, aAt, aAdapter, aDep, aIDs, trans, retry, addWait)
		if err != nil {
			return err
		}
		applied, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: complete %d rows: %w", n, err)
	}
	return applied, nil
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// Orphan is a submitted receipt the sweep moved to outcome_unknown.
type Orphan struct {
	ID         int64
	Dependency string
}

// DefaultSweepLimit bounds one orphan-sweep statement when the caller sets
// no limit of its own.
const DefaultSweepLimit = 10 * time.Second

// SweepOrphans moves submitted receipts with no transition for longer than
// timeout (as of now) to outcome_unknown, in statements of at most batch
// rows, and returns them. Each statement is bounded by limit (zero:
// DefaultSweepLimit): a context deadline, and statement_timeout and
// lock_timeout on the server, so a lock held elsewhere or a hung connection
// fails the sweep instead of stalling the caller's claim loop.
func (s *Store) SweepOrphans(ctx context.Context, now time.Time, timeout time.Duration, batch int, limit time.Duration) ([]Orphan, error) {
	if timeout <= 0 {
		return nil, nil
	}
	bound := DefaultSweepLimit
	if limit > 0 {
		bound = limit
	}
	detail, _ := json.Marshal(map[string]any{
		"reason": "orphaned",
		"extra":  map[string]any{"timeout": timeout.String(), "instance": s.instance},
	})
	stmtMS := strconv.FormatInt(max(bound.Milliseconds(), 1), 10)
	lockMS := strconv.FormatInt(max(bound.Milliseconds()/2, 1), 10)
	var all []Orphan
	for {
		var got []Orphan
		sctx, cancel := context.WithTimeout(ctx, bound+time.Second)
		err := pgx.BeginFunc(sctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(sctx, sqlSweepLimits, stmtMS, lockMS); err != nil {
				return err
			}
			rows, err := tx.Query(sctx, sqlSweepOrphans, string(s.actor), detail, now.Add(-timeout), batch)
			if err != nil {
				return err
			}
			got, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Orphan, error) {
				var o Orphan
				err := row.Scan(&o.ID, &o.Dependency)
				return o, err
			})
			return err
		})
		cancel()
		if err != nil {
			return all, fmt.Errorf("reconcile: orphan sweep: %w", err)
		}
		all = append(all, got...)
		if len(got) < batch {
			return all, nil
		}
	}
}

// Backlog is a snapshot of the work in the ledger.
type Backlog struct {
	Planned, StalePlanned   int64
	Submitted, StaleOrphans int64
	OutcomeUnknown          int64
	Reconciling             int64
	ManualReview            int64
	// DueNow counts outcome_unknown and reconciling rows due at the time of
	// the snapshot.
	DueNow int64
	// OldestUnknownAge is the time since submission of the oldest
	// outcome_unknown receipt; OldestUnsettledAge also counts reconciling.
	OldestUnknownAge   time.Duration
	OldestUnsettledAge time.Duration
	// Duplicates counts recorded duplicate alarms.
	Duplicates int64
}

// Backlog counts the rows by state (non-terminal states only: terminal
// counts would need a full scan and say nothing about work to do).
func (s *Store) Backlog(ctx context.Context, now time.Time, stalePlanned, orphanTimeout time.Duration) (Backlog, error) {
	var b Backlog
	var unknownAge, unsettledAge float64
	err := s.pool.QueryRow(ctx, sqlBacklogDue, now).Scan(&b.OutcomeUnknown, &b.Reconciling, &b.DueNow, &unknownAge, &unsettledAge)
	if err != nil {
		return b, fmt.Errorf("reconcile: backlog: %w", err)
	}
	b.OldestUnknownAge = time.Duration(unknownAge * float64(time.Second))
	b.OldestUnsettledAge = time.Duration(unsettledAge * float64(time.Second))
	orphanCut := now.Add(-orphanTimeout)
	if orphanTimeout <= 0 {
		orphanCut = time.Time{} // no sweep configured: nothing counts as an orphan
	}
	if err := s.pool.QueryRow(ctx, sqlBacklogStale, now.Add(-stalePlanned), orphanCut).
		Scan(&b.Planned, &b.StalePlanned, &b.Submitted, &b.StaleOrphans); err != nil {
		return b, fmt.Errorf("reconcile: backlog: %w", err)
	}
	if err := s.pool.QueryRow(ctx, sqlBacklogHeld).Scan(&b.ManualReview); err != nil {
		return b, fmt.Errorf("reconcile: backlog: %w", err)
	}
	if err := s.pool.QueryRow(ctx, sqlDuplicates).Scan(&b.Duplicates); err != nil {
		return b, fmt.Errorf("reconcile: backlog: %w", err)
	}
	return b, nil
}

// ControlScan is how many of the newest receipts ControlReceipt examines
// by default.
const ControlScan = 10000

// ControlReceipt returns a receipt of b's dependency and of operation op,
// among the scan newest (default ControlScan), that settled succeeded from
// the API's own 2xx response: an effect known to exist, for b's positive
// control of op. With before zero it is the newest such receipt; otherwise
// the newest submitted no later than before, else the oldest submitted
// after (the one closest to a receipt submitted at before). ok is false
// when there is none.
func (s *Store) ControlReceipt(ctx context.Context, b *readback.Binding, op string, before time.Time, scan int) (r readback.Receipt, ok bool, err error) {
	return controlReceipt(ctx, s.pool, b, op, before, scan)
}

func controlReceipt(ctx context.Context, db *pgxpool.Pool, b *readback.Binding, op string, before time.Time, scan int) (r readback.Receipt, ok bool, err error) {
	if db == nil {
		return readback.Receipt{}, false, fmt.Errorf("reconcile: find a control receipt for adapter %s: no database", b.Name)
	}
	if scan <= 0 {
		scan = ControlScan
	}
	var at any
	if !before.IsZero() {
		at = before
	}
	err = db.QueryRow(ctx, sqlControlReceipt, b.Dependency, op, scan, at).Scan(
		&r.ID, &r.IdempotencyKey, &r.Operation, &r.Dependency, &r.Method, &r.Target,
		&r.Fingerprint, &r.Intent, &r.PreImage, &r.ExternalID, &r.Attempt, &r.CreatedAt,
		&r.SubmittedAt, &r.SendDeadline, &r.UnknownSince)
	if errors.Is(err, pgx.ErrNoRows) {
		return readback.Receipt{}, false, nil
	}
	if err != nil {
		return readback.Receipt{}, false, fmt.Errorf("reconcile: find a control receipt for adapter %s, operation %s: %w", b.Name, op, err)
	}
	return r, true, nil
}

// controlOperations returns the operations of b's dependency that have a
// ledger control among the scan newest receipts.
func controlOperations(ctx context.Context, db *pgxpool.Pool, b *readback.Binding, scan int) ([]string, error) {
	if db == nil {
		return nil, nil
	}
	rows, err := db.Query(ctx, sqlControlOperations, b.Dependency, scan)
	if err != nil {
		return nil, fmt.Errorf("reconcile: list the operations of adapter %s: %w", b.Name, err)
	}
	ops, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("reconcile: list the operations of adapter %s: %w", b.Name, err)
	}
	return ops, nil
}
