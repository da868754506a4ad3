package reconcile

import (
	"context"
	"time"

	"github.com/receiptledger/reconciler/readback"
	"github.com/receiptledger/reconciler/statemachine"
)

// Windows returns the pool's effective windows (docs/verdict-audits.md).
func (p *Pool) Windows() *Windows { return p.windows }

// Audit runs the audits due now (AuditConfig), as a Drain does at its end,
// and returns how many it recorded.
func (p *Pool) Audit(ctx context.Context) (int, error) {
	if err := p.loadWindows(ctx); err != nil {
		return 0, err
	}
	return p.auditDue(ctx, func() bool { return true })
}

// loadWindows reads the effective windows the database holds (another
// replica's widenings become this one's) and publishes them.
func (p *Pool) loadWindows(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := p.windows.Load(ctx, p.db); err != nil {
		return err
	}
	if p.m != nil {
		for _, b := range p.cfg.Registry.Bindings() {
			if b.Kind == readback.Blind {
				continue
			}
			w := p.windows.For(&b)
			v := p.m.Verdicts
			v.DeclaredWindow.WithLabelValues(b.Dependency, b.Name).Set(w.Declared.Seconds())
			v.EffectiveWindow.WithLabelValues(b.Dependency, b.Name).Set(w.Effective.Seconds())
			// The counters exist from the start, at zero, so that an
			// increase over the first alarm is seen.
			for _, verdict := range []string{AuditConfirmed, AuditContradicted, AuditInconclusive} {
				v.Audits.WithLabelValues(b.Dependency, verdict)
			}
			v.FalseAbsences.WithLabelValues(b.Dependency)
			for _, kind := range []string{AlarmPresentAfterAbsence, AlarmFalseAbsence} {
				v.WindowAlarms.WithLabelValues(b.Dependency, kind)
			}
		}
	}
	return nil
}

// auditLoop runs the audits of a Run: every poll interval, while no
// claimed receipt waits for a worker (settling comes first), it re-reads
// the effective windows and runs the audits due, one read at a time.
func (s *session) auditLoop() {
	p := s.p
	t := time.NewTicker(p.cfg.PollInterval)
	defer t.Stop()
	idle := func() bool { return s.stop.Err() == nil && s.unchecked.Load() == 0 }
	for {
		select {
		case <-s.stop.Done():
			return
		case <-t.C:
		}
		if err := p.loadWindows(s.stop); err != nil && s.stop.Err() == nil {
			s.dbError("effective windows", err)
		}
		if _, err := p.auditDue(s.stop, idle); err != nil && s.stop.Err() == nil {
			s.dbError("audit", err)
		}
	}
}

// found looks at a settling read of c that found its effect (readAt: when
// it began): it records the lag observed, and if an authoritative read of
// the same receipt had found the effect absent after its window, that is
// proof the window is too short: a window alarm, which widens it. Only a
// read past the window costs a statement (the receipt's earlier checks).
func (s *session) found(c Claimed, b *readback.Binding, readAt time.Time, o Outcome) {
	p := s.p
	if o.Check == nil || o.To != statemachine.Succeeded ||
		(o.Detail.Reason != ReasonPresent && o.Detail.Reason != ReasonPresentDuplicates) {
		return
	}
	if p.m != nil {
		p.m.Verdicts.ObservedLag.WithLabelValues(c.Dependency, c.Operation).Observe(readAt.Sub(c.SubmittedAt).Seconds())
	}
	send := readback.SendDeadlineOf(c.Receipt)
	safeAt := send.Add(p.windows.For(b).Effective)
	if readAt.Before(safeAt) {
		return
	}
	ctx, cancel := context.WithTimeout(s.work, 10*time.Second)
	defer cancel()
	var absent *time.Time
	if err := p.db.QueryRow(ctx, sqlLastAbsenceSince, c.ID, safeAt).Scan(&absent); err != nil {
		s.dbError("absences past the window", err)
		return
	}
	if absent == nil {
		return
	}
	p.windowAlarm(ctx, widening{at: readAt, instance: p.store.instance, b: b, r: c.Receipt,
		kind: AlarmPresentAfterAbsence, observed: readAt.Sub(send), margin: p.cfg.Audits.Margin,
		evidence: map[string]any{"absent_at": *absent, "present_at": readAt, "window_ended": safeAt}})
}
