package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/readback"
)

// process decides one claimed row: settle without a check (no adapter,
// blind), release (stopping, lease too short, deferred by the gate), or
// check and decide.
func (s *session) process(c Claimed) Outcome {
	p := s.p
	cfg := p.cfg
	now := cfg.Now()
	b, ok := cfg.Registry.Lookup(c.Operation, c.Dependency)
	if lo, late := lateSucceeded(c); late {
		// The agent saw the API's 2xx after the orphan sweep moved the
		// receipt: the proof is in, no adapter call needed.
		if !ok {
			b = nil
		}
		return p.dec.voided(now, c, b, p.dec.late(now, c, b, lo))
	}
	if !ok {
		return p.dec.manual(now, c, nil, ReasonNoAdapter)
	}
	if b.Kind == readback.Blind {
		return p.dec.manual(now, c, b, ReasonBlind)
	}
	if s.stop.Err() != nil || now.Add(cfg.Heartbeat).After(s.leaseExpiry(c)) {
		// Stopping, or the lease is about to run out (its renewals failed):
		// hand the row back for whoever claims next instead of racing the
		// lease.
		return p.dec.release(c, now)
	}
	gate := cfg.Gate
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		// Nothing is called: the dependency's protection has nothing to
		// protect, and its rate limit would only slow the answer down.
		gate = openGate{}
	}
	pass, err := gate.Enter(s.work, c.Dependency, c.Retry)
	if err != nil {
		var d *Deferral
		if errors.As(err, &d) {
			s.mu.Lock()
			s.summary.Deferred++
			s.mu.Unlock()
			if p.m != nil {
				p.m.Deferrals.WithLabelValues(c.Dependency).Inc()
			}
			p.log.Debug("check deferred", "receipt_id", c.ID, "dependency", c.Dependency,
				"reason", d.Reason, "until", d.Until)
			// A deferral is a wait, not a check: it does not use up
			// max_checks; only the deadline ends a receipt whose
			// dependency can never be read.
			return p.dec.waitOrDeadline(now, c, b, later(d.Until, now))
		}
		return p.dec.release(c, now)
	}
	ctx, cancel := context.WithTimeout(s.work, cfg.CheckTimeout)
	if r, ok := pass.(protect.Retrier); ok {
		// Retries an adapter makes inside the check (a flaky page) are
		// charged to the dependency's retry budget like repeated checks.
		ctx = protect.WithRetrier(ctx, r)
	}
	// Absence is judged at the moment the read began (SPEC §5a): the
	// database's time just before the adapter's first request, never the
	// time its answer arrives.
	readAt := cfg.Now()
	start := time.Now()
	res, cerr := safeCheck(ctx, b.Adapter, c.Receipt)
	latency := time.Since(start)
	cancel()
	if s.work.Err() != nil {
		// The grace period ran out mid-check: the answer is not the
		// dependency's fault and not evidence; release the row.
		pass.Exit(Cancelled, 0)
		return p.dec.release(c, cfg.Now())
	}
	result, retryAfter := checkResult(cerr)
	pass.Exit(result, retryAfter)
	answeredAt := cfg.Now()
	out := p.dec.decide(readAt, answeredAt, c, b, res, cerr, latency, controlAssumed)
	if kind := ControlNeeded(out); kind != "" {
		// The answer would settle on an answer a misconfigured adapter
		// gives for everything: only if the adapter's positive control of
		// that kind, for this receipt's operation, has passed recently.
		out = p.dec.decide(readAt, answeredAt, c, b, res, cerr, latency, s.control(b, c.Receipt, kind))
	}
	s.found(c, b, readAt, out)
	if p.m != nil {
		outcome := string(res.Verdict)
		if cerr != nil {
			outcome = string(result)
			p.m.Failures.WithLabelValues(c.Dependency, string(result)).Inc()
		}
		p.m.Checks.WithLabelValues(b.Name, outcome).Inc()
		p.m.CheckLatency.WithLabelValues(b.Name).Observe(latency.Seconds())
	}
	if cerr != nil {
		s.mu.Lock()
		s.summary.CheckErrors++
		s.mu.Unlock()
		p.log.Warn("readback check failed", "receipt_id", c.ID, "dependency", c.Dependency,
			"adapter", b.Name, "class", string(result), "error", cerr)
	}
	return out
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// safeCheck calls the adapter, turning a panic into a permanent error: a
// bug in one adapter must not take the daemon down, and repeating the same
// input would panic again.
func safeCheck(ctx context.Context, a readback.Adapter, r readback.Receipt) (res readback.Result, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = readback.PermanentError(fmt.Errorf("adapter panicked: %v", v))
		}
	}()
	return a.Check(ctx, r)
}

// complete collects outcomes and writes them in batches: when a batch is
// full, when every claimed row has its outcome, or after FlushInterval.
func (s *session) complete() {
	cfg := s.p.cfg
	// Several batches are written at once, so the database works on a
	// claim and on completions in parallel instead of taking turns.
	batches := make(chan []Outcome)
	var writers sync.WaitGroup
	for range cfg.Flushers {
		writers.Go(func() {
			for b := range batches {
				s.flush(b)
				s.flushing.Add(-int64(len(b)))
			}
		})
	}
	pending := make([]Outcome, 0, cfg.BatchSize)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	armed := false
	flush := func() {
		if armed {
			timer.Stop()
			armed = false
		}
		if len(pending) > 0 {
			s.flushing.Add(int64(len(pending)))
			batches <- pending
			pending = make([]Outcome, 0, cfg.BatchSize)
		}
	}
	for {
		select {
		case o, ok := <-s.outcomes:
			if !ok {
				flush()
				close(batches)
				writers.Wait()
				return
			}
			pending = append(pending, o)
			// Flush a full batch, or when every row not already being
			// written has its outcome: nothing more is coming soon.
			if len(pending) >= cfg.BatchSize || int64(len(pending)) >= s.inflight.Load()-s.flushing.Load() {
				flush()
			} else if !armed {
				timer.Reset(cfg.FlushInterval)
				armed = true
			}
		case <-timer.C:
			armed = false
			flush()
		}
	}
}

// persist runs write until it succeeds: retried twice with a short
// jittered backoff, then kept and retried, with a backoff capped at
// min(5s, PollInterval), until the database answers or the grace period of
// a stop ends. Every attempt after the first is told so (again): it may
// follow an attempt that committed without our hearing of it. Each attempt
// outlives the stop signal, bounded by its own timeout. A permanent refusal
// (permanentDB: a privilege, the schema, a row's data) is returned at once:
// retrying the same statement cannot change it, and keeping it would hold
// its rows, and the claims behind them, forever. The writes handle their
// rows' refusals themselves; this is the net under them.
func (s *session) persist(what string, rows int, write func(ctx context.Context, again bool) error) error {
	p := s.p
	retry := backoff.NewExponentialBackOff()
	retry.InitialInterval = 200 * time.Millisecond
	attempt := 0
	try := func() error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(s.stop), 30*time.Second)
		defer cancel()
		attempt++
		err := write(ctx, attempt > 1)
		if err != nil && permanentDB(err) {
			return backoff.Permanent(err)
		}
		return err
	}
	err := backoff.RetryNotify(try, backoff.WithMaxRetries(retry, 2),
		func(err error, _ time.Duration) { s.dbError(what, err) })
	if err == nil {
		return nil
	}
	s.dbError(what, err)
	if permanentDB(err) {
		return err
	}
	p.log.Warn("kept until the database answers", "statement", what, "rows", rows, "error", err)
	keep := backoff.NewExponentialBackOff()
	keep.InitialInterval = 500 * time.Millisecond
	keep.MaxInterval = min(5*time.Second, p.cfg.PollInterval)
	keep.MaxElapsedTime = 0
	err = backoff.RetryNotify(try, backoff.WithContext(keep, s.work),
		func(err error, _ time.Duration) { s.dbError(what, err) })
	if err == nil {
		p.log.Info("kept rows written", "statement", what, "rows", rows)
	} else if permanentDB(err) {
		s.dbError(what, err)
	}
	return err
}

// pendingCheck is a check on its way to the recorder; done is closed once
// the recorder is done with it.
type pendingCheck struct {
	check ReceiptCheck
	done  chan struct{}
}

// record writes the checks as their adapters answer, apart from the
// settlements, so a read is in the audit trail even if this process dies
// before it settles. It writes whatever has arrived while the previous
// write ran, up to BatchSize in one statement: a lone check is written at
// once, and under load the batches grow by themselves. A check whose write
// is refused or abandoned (end of the grace period) stays unrecorded and is
// written with its outcome.
func (s *session) record() {
	cfg := s.p.cfg
	batch := make([]pendingCheck, 0, cfg.BatchSize)
	for first := range s.checks {
		batch = append(batch[:0], first)
	more:
		for len(batch) < cfg.BatchSize {
			select {
			case c, ok := <-s.checks:
				if !ok {
					break more
				}
				batch = append(batch, c)
			default:
				break more
			}
		}
		checks := make([]ReceiptCheck, len(batch))
		for i, c := range batch {
			checks[i] = c.check
		}
		var refused error
		err := s.persist("record checks", len(checks), func(ctx context.Context, again bool) error {
			var err error
			refused, err = s.p.store.recordChecks(ctx, checks, again)
			return err
		})
		if err != nil && !permanentDB(err) {
			s.p.log.Warn("checks not recorded at the end of the grace period; each is written with its outcome if that can be",
				"rows", len(checks))
		} else if err != nil {
			refused = err
		}
		if refused != nil {
			s.checksRefused(checks, refused)
		}
		for _, c := range batch {
			close(c.done)
		}
	}
}

// flush writes one batch of outcomes, once the recorder is done with their
// checks. A failed write (a failover, a dropped connection, a database
// outage) is kept and retried (persist) until the database answers: the
// outcomes are not lost, and their rows stay in flight, leases renewed by
// the heartbeat (so at most MaxInFlight outcomes are ever kept, and claims
// stop meanwhile). Only at the end of the grace period of a stop is a batch
// that still cannot be written abandoned to its leases' expiry, which
// re-offers its rows: checks are repeatable, settlements are guarded.
//
// A permanent refusal is not kept: the store writes every row it can and
// gives up the refused ones (Store.complete), each logged at ERROR with its
// verdict, so no evidence disappears unsaid. A batch refused whole for a
// reason of the statement (a privilege, the schema) makes the claims back
// off (Pool.WritesRefused) until a write goes through again.
func (s *session) flush(batch []Outcome) {
	p := s.p
	for _, o := range batch {
		if o.recorded != nil {
			<-o.recorded
		}
	}
	var w written
	err := s.persist("complete", len(batch), func(ctx context.Context, again bool) error {
		// A retry may follow a first attempt that committed without our
		// hearing of it, so it is the idempotent CompleteAgain's. What an
		// attempt that then failed wrote is kept too: a split commits row
		// by row, and a row it released after a refusal is no longer
		// leased, so the retry would not see it (nor its refusal) again.
		got, err := p.store.complete(ctx, batch, again)
		w.add(got)
		return err
	})
	if err != nil && !permanentDB(err) {
		p.log.Warn("kept outcomes abandoned at the end of the grace period; their rows return when their leases expire",
			"rows", len(batch))
	}
	s.release(batch)
	ok := make(map[int64]bool, len(w.applied))
	for _, id := range w.applied {
		ok[id] = true
	}
	var dueAt []time.Time
	wrote := 0
	var stmtRefusal error
	s.mu.Lock()
	for _, o := range batch {
		r, refused := w.refused[o.ID]
		if err != nil && permanentDB(err) {
			r, refused = rowRefusal{cause: err, fate: fateHeld, last: err}, true
		}
		if refused {
			s.refused(o, r)
			if classifyDB(r.cause) == dbStatementRefused && r.fate != fateMinimal {
				stmtRefusal = r.cause
			}
		}
		switch {
		case refused && r.fate != fateMinimal:
			// Not settled: released to wait (or left to its lease).
			s.summary.Refused++
			if p.m != nil {
				p.m.Refused.Inc()
			}
			if r.fate != fateHeld {
				s.summary.Waiting++
				if p.m != nil {
					p.m.Rescheduled.Inc()
				}
			}
		case err != nil:
		case !ok[o.ID]:
			s.summary.LeaseLost++
			if p.m != nil {
				p.m.LeaseLost.Inc()
			}
			p.log.Warn("outcome discarded: lease lost", "receipt_id", o.ID, "dependency", o.Dependency)
		case o.Settles():
			wrote++
			s.summary.Settled[o.To]++
			s.summary.Reasons[o.Detail.Reason]++
			if len(o.Duplicates) > 1 {
				s.summary.Duplicates++
			}
			if p.m != nil {
				p.m.Settlements.WithLabelValues(string(o.To), o.Detail.Reason).Inc()
				if len(o.Duplicates) > 1 {
					p.m.Duplicates.Inc()
				}
			}
			if len(o.Duplicates) > 1 {
				p.log.Warn("duplicate detected", "receipt_id", o.ID, "dependency", o.Dependency,
					"adapter", o.Adapter, "matches", len(o.Duplicates))
			}
			s.lifetimeAlarm(o)
			p.log.Info("receipt settled", "receipt_id", o.ID, "dependency", o.Dependency,
				"state", string(o.To), "reason", o.Detail.Reason, "adapter", o.Adapter)
		default:
			wrote++
			s.summary.Waiting++
			if p.m != nil {
				p.m.Rescheduled.Inc()
			}
			if !o.NextCheck.IsZero() {
				dueAt = append(dueAt, o.NextCheck)
			}
		}
	}
	s.mu.Unlock()
	switch {
	case wrote > 0:
		p.refusals.clear("complete")
	case stmtRefusal != nil:
		p.refusals.note("complete", stmtRefusal)
	}
	// Run wakes when the first of these rows is due again.
	s.noteDue(dueAt)
	s.inflight.Add(-int64(len(batch)))
	s.signalSpace()
}

// refused reports an outcome the database refused permanently: an ERROR
// naming the receipt, the statement, the SQLSTATE, what to do, what became
// of the row, and the verdict itself (the evidence the database did not
// take is not dropped unsaid), and the count by statement and SQLSTATE
// class. An outcome written without the API's text is a WARN: its verdict
// stands.
func (s *session) refused(o Outcome, r rowRefusal) {
	p := s.p
	if p.m != nil {
		p.m.WritesRefused.WithLabelValues("complete", sqlStateClass(r.cause)).Inc()
	}
	args := []any{"receipt_id", o.ID, "dependency", o.Dependency, "statement", "complete",
		"sqlstate", sqlState(r.cause), "error", refusal(r.cause), "hint", refusalHint(r.cause),
		"fate", r.fate.String()}
	if r.last != nil && r.last != r.cause {
		args = append(args, "last_error", refusal(r.last))
	}
	args = append(args, verdictAttrs(o)...)
	if r.fate == fateMinimal {
		p.log.Warn("outcome refused by the database; written without the API's text", args...)
		return
	}
	p.log.Error("outcome refused by the database", args...)
}

// checksRefused reports checks the recorder could not write even without
// their evidence (the first refusal: cause): they are written with their
// outcomes, or given up with them (refused).
func (s *session) checksRefused(checks []ReceiptCheck, cause error) {
	n := 0
	for _, c := range checks {
		if !c.Check.Recorded {
			n++
		}
	}
	if n == 0 {
		return
	}
	if s.p.m != nil {
		s.p.m.WritesRefused.WithLabelValues("record checks", sqlStateClass(cause)).Add(float64(n))
	}
	s.p.log.Warn("checks refused by the database; each is written with its outcome if that can be",
		"statement", "record checks", "rows", n, "sqlstate", sqlState(cause), "error", refusal(cause),
		"hint", refusalHint(cause))
}

// verdictAttrs are the log attributes of o's verdict: what it decided and
// on what evidence (bounded, as the database would have stored it).
func verdictAttrs(o Outcome) []any {
	c := o.sanitized()
	args := []any{"outcome", string(c.To), "reason", c.Detail.Reason, "adapter", c.Adapter}
	if c.ExternalID != "" {
		args = append(args, "external_id", c.ExternalID)
	}
	if e := c.Detail.Evidence; e != nil {
		args = append(args, "verdict", e.Verdict, "authoritative", e.Authoritative, "matched", e.Matched)
	}
	if k := c.Check; k != nil {
		args = append(args, "check_no", k.CheckNo, "check_at", k.At, "check_verdict", k.Verdict)
		if k.Error != "" {
			args = append(args, "check_error", k.Error)
		}
	}
	if !c.NextCheck.IsZero() {
		args = append(args, "next_check", c.NextCheck)
	}
	return args
}
