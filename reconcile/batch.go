package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// Batched reads (issue 22). A binding whose adapter is a readback.Batcher
// (an http search declaring search.batch) is not read per receipt: its due
// receipts are gathered by binding and operation, and one read of the list
// over the union of their windows answers them all. One read runs at a
// time per group; the rows that become due meanwhile wait in the group and
// are read together next, so a backlog costs the pages of its window, not
// a read per receipt. Each receipt is decided by the same rules as a check
// of its own (decider.decide), with the time the shared read began as its
// read time: an absence counts only if that read began after the
// receipt's absence window (SPEC §5a). Every request of the read passes
// the dependency's protection (Config.Gate), one pass per request.

// batches holds a session's groups.
type batches struct {
	mu     sync.Mutex
	groups map[groupKey]*group
	// runs counts the group reads started and not yet ended.
	runs sync.WaitGroup
	seq  atomic.Int64
}

// groupKey names a group: the receipts of one binding and operation (a
// positive control vouches for one operation).
type groupKey struct {
	binding, operation string
}

// group is the receipts of one groupKey waiting for a read, and whether a
// read of the group is running.
type group struct {
	b       *readback.Binding
	bt      readback.Batcher
	running bool
	pending []Claimed
}

// batcherOf returns c's binding and its Batcher when c is read in batches:
// a binding whose adapter reads many receipts at once, for a receipt that
// needs a read (no late outcome from the agent, not blind).
func (s *session) batcherOf(c Claimed) (*readback.Binding, readback.Batcher, bool) {
	if _, late := lateSucceeded(c); late {
		return nil, nil, false
	}
	b, ok := s.p.cfg.Registry.Lookup(c.Operation, c.Dependency)
	if !ok || b.Kind == readback.Blind {
		return nil, nil, false
	}
	bt, ok := b.Adapter.(readback.Batcher)
	if !ok || bt.MaxBatch() < 1 {
		return nil, nil, false
	}
	return b, bt, true
}

// dispatch hands claimed rows to the workers, except the rows read in
// batches, which join their group, and starts the reads of the groups
// waiting for none. more says the claim loop claims again at once: idle
// groups then wait for those rows too, unless the room for rows in flight
// is running out (the claim loop would wait for it). It is called after
// every claim, even one that found nothing.
func (s *session) dispatch(rows []Claimed, more bool) {
	cfg := s.p.cfg
	for _, c := range rows {
		b, bt, ok := s.batcherOf(c)
		if !ok {
			s.jobs <- c // never blocks: the channel holds MaxInFlight rows
			continue
		}
		// A grouped row does not wait for a worker: the claims go on
		// filling the group while its read is pending.
		s.unchecked.Add(-1)
		k := groupKey{binding: b.Name, operation: c.Operation}
		s.batch.mu.Lock()
		if s.batch.groups == nil {
			s.batch.groups = map[groupKey]*group{}
		}
		g := s.batch.groups[k]
		if g == nil {
			g = &group{b: b, bt: bt}
			s.batch.groups[k] = g
		}
		g.pending = append(g.pending, c)
		s.batch.mu.Unlock()
	}
	if !more || int64(cfg.MaxInFlight)-s.inflight.Load() < int64(cfg.BatchSize) {
		s.startGroups()
	}
}

// startGroups starts a read for every group that has rows and no read
// running.
func (s *session) startGroups() {
	s.batch.mu.Lock()
	defer s.batch.mu.Unlock()
	for _, g := range s.batch.groups {
		if !g.running && len(g.pending) > 0 {
			s.startLocked(g)
		}
	}
}

// startLocked starts a read of g's pending rows (at most its MaxBatch);
// when it ends, the rows that arrived meanwhile are read next. Callers
// hold s.batch.mu.
func (s *session) startLocked(g *group) {
	n := min(len(g.pending), g.bt.MaxBatch())
	rows := g.pending[:n:n]
	g.pending = append([]Claimed(nil), g.pending[n:]...)
	g.running = true
	s.batch.runs.Add(1)
	go func() {
		defer s.batch.runs.Done()
		s.readBatch(g.b, g.bt, rows)
		s.batch.mu.Lock()
		defer s.batch.mu.Unlock()
		g.running = false
		if len(g.pending) > 0 {
			s.startLocked(g)
		}
	}()
}

// endBatches reads (or, once stopped, releases) the rows still waiting in
// groups and waits for every group read to end. The claim loop has ended:
// nothing joins a group any more.
func (s *session) endBatches() {
	s.startGroups()
	s.batch.runs.Wait()
}

// emit hands o to the completer, after its check (if any) to the recorder.
func (s *session) emit(o Outcome) {
	if o.Check != nil {
		// Never blocks: the channel holds MaxInFlight checks, one per row
		// in flight at most.
		done := make(chan struct{})
		s.checks <- pendingCheck{check: ReceiptCheck{ReceiptID: o.ID, Check: o.Check}, done: done}
		o.recorded = done
	}
	s.outcomes <- o
	s.signalSpace()
}

// SharedReadEvidence is what each receipt's check record says of the shared read
// that answered it (under "shared_read" in its evidence): every receipt
// the read answered records the same id.
type SharedReadEvidence struct {
	ID string `json:"id"`
	// Receipts is how many receipts the read was made for.
	Receipts int `json:"receipts"`
	// BeganAt is when the read began, on the database's clock: the time
	// every receipt's absence window is compared with.
	BeganAt time.Time `json:"began_at"`
}

// readBatch reads rows of binding b in one shared read and decides each.
func (s *session) readBatch(b *readback.Binding, bt readback.Batcher, rows []Claimed) {
	p := s.p
	cfg := p.cfg
	now := cfg.Now()
	live := make([]Claimed, 0, len(rows))
	for _, c := range rows {
		if s.stop.Err() != nil || now.Add(cfg.Heartbeat).After(s.leaseExpiry(c)) {
			// As process does: stopping, or the lease is about to run out.
			s.emit(p.dec.release(c, now))
			continue
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	dec := p.dec
	dec.sched = aimed{base: p.dec.schedule()}
	receipts := make([]readback.Receipt, len(live))
	for i, c := range live {
		receipts[i] = c.Receipt
	}
	ctx, cancel := context.WithTimeout(s.work, cfg.CheckTimeout)
	readAt := cfg.Now()
	note := SharedReadEvidence{ID: fmt.Sprintf("%s:%d:%d", cfg.Instance, readAt.UnixNano(), s.batch.seq.Add(1)),
		Receipts: len(live), BeganAt: readAt}
	read := readback.SharedRead{ID: note.ID, Call: s.gateCall(ctx, b)}
	start := time.Now()
	answers, err := safeBatch(ctx, bt, read, receipts)
	latency := time.Since(start)
	cancel()
	if s.work.Err() != nil {
		// The grace period ran out mid-read: not evidence; release.
		for _, c := range live {
			s.emit(p.dec.release(c, cfg.Now()))
		}
		return
	}
	answeredAt := cfg.Now()
	if err == nil && len(answers) != len(live) {
		err = readback.PermanentError(fmt.Errorf("adapter %s answered %d receipts of %d", b.Name, len(answers), len(live)))
	}
	if p.m != nil {
		p.m.CheckLatency.WithLabelValues(b.Name).Observe(latency.Seconds())
	}
	for i, c := range live {
		ans := readback.Answer{Err: err}
		if err == nil {
			ans = answers[i]
		}
		if ans.Alone {
			// No shared read can narrow its window enough: its own check.
			s.unchecked.Add(1)
			s.jobs <- c
			continue
		}
		var d *Deferral
		if errors.As(ans.Err, &d) {
			s.mu.Lock()
			s.summary.Deferred++
			s.mu.Unlock()
			if p.m != nil {
				p.m.Deferrals.WithLabelValues(c.Dependency).Inc()
			}
			s.emit(dec.waitOrDeadline(answeredAt, c, b, later(d.Until, answeredAt)))
			continue
		}
		res := ans.Result
		if ans.Err == nil {
			res.Evidence = withSharedRead(res.Evidence, note)
		}
		out := dec.decide(readAt, answeredAt, c, b, res, ans.Err, latency, controlAssumed)
		if kind := ControlNeeded(out); kind != "" {
			out = dec.decide(readAt, answeredAt, c, b, res, ans.Err, latency, s.control(b, c.Receipt, kind))
		}
		// A shared read that found the effect is evidence of the lag like a
		// receipt's own read: observed, and an alarm that widens the
		// window when an earlier absence past it was wrong.
		s.found(c, b, readAt, out)
		s.countCheck(c, b, res, ans.Err)
		s.emit(out)
	}
}

// countCheck updates the metrics and the summary for one receipt's answer.
func (s *session) countCheck(c Claimed, b *readback.Binding, res readback.Result, err error) {
	p := s.p
	outcome := string(res.Verdict)
	if err != nil {
		result, _ := checkResult(err)
		outcome = string(result)
		s.mu.Lock()
		s.summary.CheckErrors++
		s.mu.Unlock()
		p.log.Warn("shared readback failed for a receipt", "receipt_id", c.ID, "dependency", c.Dependency,
			"adapter", b.Name, "class", outcome, "error", err)
	}
	if p.m != nil {
		if err != nil {
			p.m.Failures.WithLabelValues(c.Dependency, outcome).Inc()
		}
		p.m.Checks.WithLabelValues(b.Name, outcome).Inc()
	}
}

// gateCall returns the SharedRead.Call of a read of b: each request takes
// its own pass from the pool's Gate, so a read of many pages is paced by
// the dependency's rate limit like as many checks. A request deferred by
// the protection waits for the time it was given when that falls within
// ctx's deadline; otherwise the refusal (a *Deferral, classified permanent
// so that no in-check retry repeats it) ends the read, and its receipts
// wait without a check.
func (s *session) gateCall(ctx context.Context, b *readback.Binding) func(context.Context, func() error) error {
	gate := s.p.cfg.Gate
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		gate = openGate{}
	}
	return func(rctx context.Context, do func() error) error {
		for {
			pass, err := gate.Enter(rctx, b.Dependency, false)
			var d *Deferral
			if errors.As(err, &d) {
				wait := d.Until.Sub(s.p.cfg.Now())
				if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= wait {
					return readback.PermanentError(d)
				}
				if err := sleepCtx(rctx, wait); err != nil {
					return readback.TransientError(err, 0)
				}
				continue
			}
			if err != nil {
				return readback.TransientError(err, 0)
			}
			derr := do()
			result, retryAfter := checkResult(derr)
			pass.Exit(result, retryAfter)
			return derr
		}
	}
}

// sleepCtx waits d, or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// safeBatch calls the adapter's CheckBatch, turning a panic into a
// permanent error, as safeCheck does.
func safeBatch(ctx context.Context, bt readback.Batcher, read readback.SharedRead, rs []readback.Receipt) (answers []readback.Answer, err error) {
	defer func() {
		if v := recover(); v != nil {
			answers, err = nil, readback.PermanentError(fmt.Errorf("adapter panicked: %v", v))
		}
	}()
	return bt.CheckBatch(ctx, read, rs)
}

// withSharedRead returns the adapter's evidence with the shared read it
// came from under "shared_read": the fields of an evidence object are
// kept as they are; anything else is kept under "adapter_evidence".
func withSharedRead(ev any, n SharedReadEvidence) any {
	fields := map[string]json.RawMessage{}
	if ev != nil {
		if b, err := json.Marshal(ev); err == nil {
			if json.Unmarshal(b, &fields) != nil || fields == nil {
				fields = map[string]json.RawMessage{"adapter_evidence": b}
			}
		}
	}
	if b, err := json.Marshal(n); err == nil {
		fields["shared_read"] = b
	}
	return fields
}
