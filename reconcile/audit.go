package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// AuditConfig configures the audits of settled absences (SPEC §5a,
// "Verdicts are checked afterwards"; docs/verdict-audits.md): a receipt
// settled safe_to_retry (or a delete settled succeeded) is read back once
// more, Delay after it settled, through its adapter and its dependency's
// protection, and the audit is recorded in reconciler.verdict_audits.
// Audits run only while no claimed receipt waits for a worker, one read at
// a time, and take no permit a settling check is waiting for: they never
// delay settling. Zero fields take the documented defaults.
type AuditConfig struct {
	// Off disables audits.
	Off bool
	// Delay is how long after settlement a verdict is audited; zero means
	// Multiple × the absence window of the receipt's dependency measured
	// from submission with the default send delay: Multiple ×
	// (readback.DefaultMaxSendDelay + the effective window), the widest of
	// the dependency's adapters'.
	Delay time.Duration
	// Multiple is the audit delay in effective windows when Delay is zero
	// (default DefaultAuditMultiple).
	Multiple float64
	// SampleRate is the share of settled absences audited, in (0, 1]
	// (default 1: all). The sample is drawn from the receipt id, so every
	// replica draws the same.
	SampleRate float64
	// Batch bounds the audits claimed at once (default 16).
	Batch int
	// MaxAttempts bounds the reads of one audit that fail transiently
	// before it is recorded inconclusive (default 3).
	MaxAttempts int
	// Margin is what a window alarm adds to the lag it observed: the
	// effective window becomes (1 + Margin) × observed (default
	// DefaultWindowMargin).
	Margin float64
}

// DefaultAuditMultiple is the default audit delay, in absence windows: an
// effect whose lag is up to about this many windows (plus one: the
// settlement) is still caught.
const DefaultAuditMultiple = 4

// Audit verdicts (reconciler.verdict_audits.verdict).
const (
	AuditConfirmed    = "confirmed"
	AuditContradicted = "contradicted"
	AuditInconclusive = "inconclusive"
)

func (a AuditConfig) withDefaults() AuditConfig {
	if a.Multiple == 0 {
		a.Multiple = DefaultAuditMultiple
	}
	if a.SampleRate == 0 {
		a.SampleRate = 1
	}
	if a.Batch == 0 {
		a.Batch = 16
	}
	if a.MaxAttempts == 0 {
		a.MaxAttempts = 3
	}
	if a.Margin == 0 {
		a.Margin = DefaultWindowMargin
	}
	return a
}

func (a AuditConfig) validate() error {
	switch {
	case a.Delay < 0 || a.Multiple <= 0 || math.IsNaN(a.Multiple) || math.IsInf(a.Multiple, 0):
		return errors.New("audit delay and multiple must be positive")
	case !(a.SampleRate > 0 && a.SampleRate <= 1):
		return fmt.Errorf("audit sample rate must be in (0, 1], got %v", a.SampleRate)
	case a.Batch < 1 || a.MaxAttempts < 1:
		return errors.New("audit batch and attempts must be at least 1")
	case !(a.Margin > 0) || math.IsInf(a.Margin, 0):
		return errors.New("window margin must be positive")
	}
	return nil
}

// sampled reports whether receipt id is in a sample of rate: a hash of the
// id (splitmix64) below rate, the same on every replica.
func sampled(id int64, rate float64) bool {
	if rate >= 1 {
		return true
	}
	z := uint64(id) + 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	z ^= z >> 31
	return float64(z>>11)/float64(1<<53) < rate
}

// auditDelays returns, per dependency with an adapter, how long after
// settlement its verdicts are audited.
func (p *Pool) auditDelays() map[string]time.Duration {
	a := p.cfg.Audits
	out := map[string]time.Duration{}
	for _, b := range p.cfg.Registry.Bindings() {
		if b.Kind == readback.Blind {
			continue
		}
		d := a.Delay
		if d == 0 {
			d = time.Duration(a.Multiple * float64(readback.DefaultMaxSendDelay+p.windows.For(&b).Effective))
		}
		out[b.Dependency] = max(out[b.Dependency], d)
	}
	return out
}

// auditClaim is a claimed audit: the receipt and the verdict it got.
type auditClaim struct {
	r         readback.Receipt
	settled   statemachine.State
	settledAt time.Time
	attempts  int
	// verdictEvidence is the evidence of the settling read.
	verdictEvidence json.RawMessage
	token           string
}

// claimAudits leases up to limit audits due at now, for long enough to
// make the read (a lease and a check timeout): no other replica reads them
// meanwhile.
func (p *Pool) claimAudits(ctx context.Context, now time.Time, limit int) ([]auditClaim, error) {
	delays := p.auditDelays()
	if len(delays) == 0 {
		return nil, nil
	}
	deps := make([]string, 0, len(delays))
	cutoffs := make([]time.Time, 0, len(delays))
	for dep, d := range delays {
		deps = append(deps, dep)
		cutoffs = append(cutoffs, now.Add(-d))
	}
	token := p.store.instance + "/" + p.store.nonce + "/audit/" + strconv.FormatUint(p.store.seq.Add(1), 10)
	rows, err := p.db.Query(ctx, sqlAuditClaim, pgx.NamedArgs{"deps": deps, "cutoffs": cutoffs, "now": now,
		"limit": limit, "token": token, "expires": now.Add(p.cfg.Lease + p.cfg.CheckTimeout)})
	if err != nil {
		return nil, fmt.Errorf("reconcile: claim audits: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (auditClaim, error) {
		a := auditClaim{token: token}
		r := &a.r
		var settled string
		err := row.Scan(&r.ID, &r.IdempotencyKey, &r.Operation, &r.Dependency, &r.Method, &r.Target,
			&r.Fingerprint, &r.Intent, &r.PreImage, &r.ExternalID, &r.Attempt, &r.CreatedAt,
			&r.SubmittedAt, &r.SendDeadline, &settled, &a.settledAt, &a.attempts, &a.verdictEvidence)
		a.settled = statemachine.State(settled)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: claim audits: %w", err)
	}
	return out, nil
}

// IdleGate is optionally implemented by a Gate that can admit a call only
// if it need not wait: an audit takes a permit of its dependency only when
// one is free now, and is put off otherwise.
type IdleGate interface {
	EnterIdle(ctx context.Context, dependency string) (Pass, error)
}

// EnterIdle implements IdleGate: Acquire, which never waits for a free
// slot (AcquireWait does, for settling checks).
func (gg guardGate) EnterIdle(ctx context.Context, dependency string) (Pass, error) {
	p, err := gg.g.Acquire(ctx, dependency, protect.First)
	if err != nil {
		var d *protect.Deferral
		if errors.As(err, &d) {
			return nil, &Deferral{Reason: string(d.Reason), Until: d.Slot}
		}
		return nil, err
	}
	return guardPass{p: p}, nil
}

// Audited is the record of one audit read.
type Audited struct {
	ReceiptID  int64  `json:"receipt_id"`
	Dependency string `json:"dependency"`
	Operation  string `json:"operation"`
	Adapter    string `json:"adapter"`
	// Settled is the verdict audited (safe_to_retry, or succeeded of a
	// delete) and SettledAt when it was settled.
	Settled   statemachine.State `json:"settled_state"`
	SettledAt time.Time          `json:"settled_at"`
	// At is when the audit read began (the database's clock).
	At time.Time `json:"at"`
	// Verdict is confirmed, contradicted or inconclusive.
	Verdict string `json:"verdict"`
	// Matches is what the read found; Retries how many of them later
	// attempts of the same logical key account for.
	Matches int `json:"matches"`
	Retries int `json:"retries"`
	// ObservedLag is, for a contradicted verdict, the time from submission
	// to the audit read: an upper bound of the effect's lag.
	ObservedLag time.Duration `json:"-"`
	// Evidence is what the audit read returned (query, matches, the
	// adapter's evidence, an error) and why it was judged so.
	Evidence map[string]any `json:"evidence"`
}

// judgeAudit decides what an audit's answer res says of the verdict
// settled for a receipt of kind, given retries later attempts of its
// logical key that may have taken effect. A create or update settled
// safe_to_retry is contradicted by its effect on more resources than the
// retries account for (at all when none was sent); a delete settled
// succeeded by its resource present again; a delete settled safe_to_retry
// (still present after the window) by its resource gone with no retry to
// account for it. Only an authoritative absence confirms an absence.
func judgeAudit(kind readback.Kind, settled statemachine.State, res readback.Result, retries int) (verdict string, matches int, why string) {
	matches = len(res.ExternalIDs)
	if res.Verdict == readback.VerdictPresent && matches == 0 {
		matches = 1
	}
	switch {
	case res.Verdict == readback.VerdictInconclusive || res.Verdict == readback.VerdictDiverged:
		return AuditInconclusive, matches, "the adapter could not tell (" + string(res.Verdict) + ")"
	case kind == readback.Delete && settled == statemachine.Succeeded:
		if res.Verdict == readback.VerdictPresent {
			return AuditContradicted, matches, "the deleted resource is present"
		}
	case kind == readback.Delete:
		if res.Verdict == readback.VerdictAbsent {
			if !res.Authoritative {
				return AuditInconclusive, matches, "absent, but not authoritatively"
			}
			if retries == 0 {
				return AuditContradicted, matches, "the resource found present after the window is gone, and no retry was sent"
			}
			return AuditConfirmed, matches, "gone, as the retry made it"
		}
		return AuditConfirmed, matches, "still present"
	case res.Verdict == readback.VerdictPresent:
		if matches > retries {
			return AuditContradicted, matches, fmt.Sprintf("the effect is present: %d match(es), %d accounted for by retries", matches, retries)
		}
		return AuditConfirmed, matches, fmt.Sprintf("%d match(es), all accounted for by retries", matches)
	}
	if !res.Authoritative {
		return AuditInconclusive, matches, "absent, but not authoritatively"
	}
	if kind == readback.Delete {
		return AuditConfirmed, matches, "still gone"
	}
	return AuditConfirmed, matches, "still absent"
}

// auditDue runs the audits due now, a batch at a time and one read at a
// time, while idle says no settling work waits, and returns how many it
// recorded. Stopped early, it gives back what it claimed.
func (p *Pool) auditDue(ctx context.Context, idle func() bool) (int, error) {
	done := 0
	for !p.cfg.Audits.Off && idle() {
		claimed, err := p.claimAudits(ctx, p.cfg.Now(), p.cfg.Audits.Batch)
		if err != nil {
			return done, err
		}
		for i, a := range claimed {
			if ctx.Err() != nil || !idle() {
				for _, rest := range claimed[i:] {
					p.putOffAudit(ctx, rest, p.cfg.Now(), false)
				}
				return done, nil
			}
			ok, err := p.audit(ctx, a)
			if err != nil {
				return done, err
			}
			if ok {
				done++
			}
		}
		if len(claimed) < p.cfg.Audits.Batch {
			break
		}
	}
	return done, nil
}

// putOffAudit gives a claimed audit back until notBefore.
func (p *Pool) putOffAudit(ctx context.Context, a auditClaim, notBefore time.Time, failed bool) {
	if _, err := p.db.Exec(context.WithoutCancel(ctx), sqlAuditPutOff, pgx.NamedArgs{"receipt": a.r.ID,
		"token": a.token, "not_before": notBefore, "failed": failed}); err != nil {
		p.log.Warn("audit not given back; it is claimable again when its lease expires", "receipt_id", a.r.ID, "error", err)
	}
}

// audit reads one settled absence back and records what it found. It
// reports whether an audit was recorded (false: skipped, put off).
func (p *Pool) audit(ctx context.Context, a auditClaim) (bool, error) {
	cfg := p.cfg
	if !sampled(a.r.ID, cfg.Audits.SampleRate) {
		_, err := p.db.Exec(ctx, sqlAuditSkip, pgx.NamedArgs{"receipt": a.r.ID, "token": a.token})
		return false, err
	}
	rec := Audited{ReceiptID: a.r.ID, Dependency: a.r.Dependency, Operation: a.r.Operation,
		Settled: a.settled, SettledAt: a.settledAt, Evidence: map[string]any{}}
	b, ok := cfg.Registry.Lookup(a.r.Operation, a.r.Dependency)
	if !ok || b.Kind == readback.Blind {
		rec.At, rec.Verdict = cfg.Now(), AuditInconclusive
		rec.Evidence["why"] = "no adapter reads this operation now"
		return p.recordAudit(ctx, a, rec)
	}
	rec.Adapter = b.Name
	gate := cfg.Gate
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		gate = openGate{}
	}
	var pass Pass
	var err error
	if ig, ok := gate.(IdleGate); ok {
		pass, err = ig.EnterIdle(ctx, a.r.Dependency)
	} else {
		pass, err = gate.Enter(ctx, a.r.Dependency, false)
	}
	if err != nil {
		// Put off at least a second: a protection that keeps deferring to
		// the present must not make a drain claim the same audit again.
		until := cfg.Now().Add(cfg.PollInterval)
		var d *Deferral
		if errors.As(err, &d) {
			until = later(d.Until, cfg.Now().Add(time.Second))
		}
		p.putOffAudit(ctx, a, until, false)
		return false, nil
	}
	cctx, cancel := context.WithTimeout(ctx, cfg.CheckTimeout)
	readAt := cfg.Now()
	res, cerr := safeCheck(cctx, b.Adapter, a.r)
	cancel()
	result, _ := checkResult(cerr)
	if ctx.Err() != nil {
		// Stopping: the read is no evidence, and no failed attempt.
		pass.Exit(Cancelled, 0)
		p.putOffAudit(ctx, a, cfg.Now(), false)
		return false, nil
	}
	pass.Exit(result, 0)
	rec.At = readAt
	if cerr != nil {
		if result == FailedTransient && a.attempts+1 < cfg.Audits.MaxAttempts {
			p.putOffAudit(ctx, a, cfg.Now().Add(cfg.PollInterval), true)
			return false, nil
		}
		rec.Verdict = AuditInconclusive
		rec.Evidence["error"] = cerr.Error()
		rec.Evidence["why"] = "the audit read failed"
		return p.recordAudit(ctx, a, rec)
	}
	retries := 0
	if err := p.db.QueryRow(ctx, sqlAuditRetries, a.r.ID).Scan(&retries); err != nil {
		return false, fmt.Errorf("reconcile: audit: retries of receipt %d: %w", a.r.ID, err)
	}
	var why string
	rec.Verdict, rec.Matches, why = judgeAudit(b.Kind, a.settled, res, retries)
	rec.Retries = retries
	rec.Evidence["why"] = why
	rec.Evidence["verdict"] = string(res.Verdict)
	rec.Evidence["authoritative"] = res.Authoritative
	if res.Query != "" {
		rec.Evidence["query"] = res.Query
	}
	if len(res.ExternalIDs) > 0 {
		rec.Evidence["matched"] = res.ExternalIDs
	}
	if res.Evidence != nil {
		rec.Evidence["adapter_evidence"] = res.Evidence
	}
	if len(a.verdictEvidence) > 0 {
		rec.Evidence["settled_on"] = a.verdictEvidence
	}
	if rec.Verdict == AuditContradicted {
		rec.ObservedLag = readAt.Sub(a.r.SubmittedAt)
	}
	recorded, err := p.recordAudit(ctx, a, rec)
	if err != nil || !recorded {
		return false, err
	}
	if rec.Verdict == AuditContradicted {
		p.falseAbsence(ctx, a, b, rec)
	}
	return true, nil
}

// recordAudit appends rec and ends a's queue entry, and reports whether it
// did: not if a's lease was lost (another replica took the audit over).
func (p *Pool) recordAudit(ctx context.Context, a auditClaim, rec Audited) (bool, error) {
	ev, err := json.Marshal(rec.Evidence)
	if err != nil {
		return false, fmt.Errorf("reconcile: audit of receipt %d: %w", a.r.ID, err)
	}
	tag, err := p.db.Exec(context.WithoutCancel(ctx), sqlAuditRecord, pgx.NamedArgs{"receipt": a.r.ID, "token": a.token,
		"dependency": a.r.Dependency, "operation": a.r.Operation, "adapter": rec.Adapter,
		"settled_state": string(a.settled), "settled_at": a.settledAt, "at": rec.At,
		"instance": p.store.instance, "verdict": rec.Verdict, "matches": rec.Matches, "retries": rec.Retries,
		"lag_s": nullSeconds(rec.ObservedLag), "evidence": string(boundedEvidence(ev))})
	if err != nil {
		return false, fmt.Errorf("reconcile: record audit of receipt %d: %w", a.r.ID, err)
	}
	if tag.RowsAffected() == 0 {
		p.log.Warn("audit not recorded: its claim expired and another reconciler took it over", "receipt_id", a.r.ID)
		return false, nil
	}
	if m := p.m; m != nil {
		m.Verdicts.Audits.WithLabelValues(a.r.Dependency, rec.Verdict).Inc()
	}
	p.log.Debug("verdict audited", "receipt_id", a.r.ID, "dependency", a.r.Dependency, "verdict", rec.Verdict)
	return true, nil
}

// boundedEvidence is raw as the database takes it: escapes Postgres
// refuses, and strings and totals beyond the bounds of a check's evidence,
// are altered (the evidence holds the API's text).
func boundedEvidence(raw []byte) []byte {
	out, _ := sanitize.JSON(raw, MaxEvidenceStringBytes, MaxEvidenceBytes)
	return out
}

// nullSeconds is d in seconds, or NULL for zero.
func nullSeconds(d time.Duration) *float64 {
	if d == 0 {
		return nil
	}
	s := d.Seconds()
	return &s
}

// falseAbsence raises the alarm of a contradicted verdict: an ERROR, the
// metric, and the widening of its declaration's window to the lag observed
// plus the margin (a window alarm row, which every replica reads).
func (p *Pool) falseAbsence(ctx context.Context, a auditClaim, b *readback.Binding, rec Audited) {
	if m := p.m; m != nil {
		m.Verdicts.FalseAbsences.WithLabelValues(a.r.Dependency).Inc()
	}
	p.log.Error("false_absence: an audit found the effect of a receipt settled as absent; "+
		"the receipt is listed by `reconciler review list` and its dependency's window is widened",
		"receipt_id", a.r.ID, "dependency", a.r.Dependency, "adapter", b.Name, "settled_state", string(a.settled),
		"settled_at", a.settledAt, "audit_at", rec.At, "matches", rec.Matches, "retries", rec.Retries,
		"observed_lag_s", rec.ObservedLag.Seconds())
	p.windowAlarm(ctx, widening{at: rec.At, instance: p.store.instance, b: b, r: a.r, kind: AlarmFalseAbsence,
		observed: rec.At.Sub(readback.SendDeadlineOf(a.r)), margin: p.cfg.Audits.Margin,
		evidence: map[string]any{"audit": rec.Evidence, "settled_at": a.settledAt}})
}

// windowAlarm widens w's window, counts and logs the alarm.
func (p *Pool) windowAlarm(ctx context.Context, w widening) {
	before, after, err := p.windows.widen(context.WithoutCancel(ctx), p.db, w)
	if err != nil {
		p.log.Error("window alarm not recorded: this process applies nothing new", "receipt_id", w.r.ID,
			"dependency", w.b.Dependency, "error", err)
		return
	}
	if m := p.m; m != nil {
		m.Verdicts.WindowAlarms.WithLabelValues(w.b.Dependency, w.kind).Inc()
		m.Verdicts.EffectiveWindow.WithLabelValues(w.b.Dependency, w.b.Name).Set(after.Effective.Seconds())
	}
	p.log.Error("window alarm: the dependency's declared window is too short; absences now wait for the effective window "+
		"until the declaration in the adapters file changes",
		"kind", w.kind, "receipt_id", w.r.ID, "dependency", w.b.Dependency, "adapter", w.b.Name,
		"declared_s", before.Declared.Seconds(), "observed_s", w.observed.Seconds(),
		"effective_before_s", before.Effective.Seconds(), "effective_s", after.Effective.Seconds())
}
