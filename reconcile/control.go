package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/readback"
)

// Positive controls (SPEC §5a; issue 7, "a misconfigured adapter must not
// produce proof"). A wrong path, filter or marker makes an adapter answer
// "absent" for everything, which reads exactly like an authoritative
// absence; a fixed path (or an API that soft-deletes) makes a delete
// adapter answer "present" for everything, which reads exactly like a
// delete that did not happen. So an answer that settles a receipt on such
// a reading settles nothing until the adapter has recently passed the
// control of that reading, for the receipt's operation (ControlNeeded):
//
//   - ControlPresent (an absence: a create's or update's safe_to_retry, a
//     delete's succeeded): an effect known to exist reads present. It is
//     the control the adapters file declares for the binding
//     (readback.Binding.Control), which vouches only for the operation it
//     names, or, for a create or update of another operation or without a
//     declared one, a receipt of the operation being settled that settled
//     succeeded from the API's own 2xx response: the one submitted closest
//     to the receipt being settled (newest submitted no later than it, else
//     the oldest after it; sqlControlReceipt), found with a bounded walk of
//     the newest receipts. A delete's must be declared: a deleted resource
//     is absent, which is precisely what a misconfigured adapter answers.
//   - ControlGone (a delete's safe_to_retry, "still present after the
//     window"): the newest receipt of the same delete operation that
//     settled succeeded from the API's 2xx response must read absent,
//     authoritatively. Until the operation has one, its deletes never
//     settle safe_to_retry (they wait, then go to manual review).
//
// Control state is kept per (adapter, operation, control). A pass of a
// ledger present-control submitted at Tc, drawn for a receipt submitted at
// T >= Tc, vouches for receipts submitted at or after Tc: each of them
// would draw that control or a newer one, which a read that found the
// older one finds too (a list read newest first and cut short misses the
// oldest first). Drawn as the fallback (no control submitted by T: Tc >
// T), it vouches for every receipt: an older one would draw the same. A
// receipt submitted before Tc runs the control again at once, drawn for
// it, while the last run passed (after a failure, runs wait for
// Config.ControlRetry). Declared and gone controls do not depend on the
// receipt and vouch for all receipts of their operation. (The argument is
// for lists read newest first; a list read oldest first and cut short is
// caught by the pagination rules of the adapter, which refuse authority to
// a read that may not have reached the end.)
//
// Controls run lazily: only when an answer would otherwise settle a receipt
// and the control's last run is older than Config.ControlInterval; after a
// failed run, once Config.ControlRetry has passed; a pass counts for
// Config.ControlValidFor. They go through the same Gate as checks. Until a
// control passes the receipt waits (released with its next check, never
// settled on that answer), the check record says why, the adapter is
// reported unhealthy for that operation and control
// (reconciler_adapter_control_ok{adapter,operation,control}, a log line,
// Pool.AdapterHealth for /readyz).

// AdapterHealth is the state of one positive control of one adapter: per
// operation and control once a control has run, else one entry for the
// adapter saying that none has run yet.
type AdapterHealth struct {
	Adapter    string `json:"adapter"`
	Dependency string `json:"dependency"`
	// Operation is the operation the control vouches for ("" before any
	// control of the adapter has run).
	Operation string `json:"operation,omitempty"`
	// Control is the kind of control: "present" (gates absences) or
	// "gone" (gates a delete's "still present after the window").
	Control ControlKind `json:"control,omitempty"`
	// OK is true while the control passed within the validity period: the
	// answers it gates may settle receipts of Operation.
	OK bool `json:"control_ok"`
	// Reason says why the control is not OK, or which control passed.
	Reason string `json:"reason,omitempty"`
	// LastRun and LastPass are on the database's clock (zero: never).
	LastRun  time.Time `json:"last_run,omitempty"`
	LastPass time.Time `json:"last_pass,omitempty"`
}

// controlKey names the state of one control: an adapter's control of one
// kind for one operation.
type controlKey struct {
	adapter   string
	operation string
	kind      ControlKind
}

// controlEntry is the state of one control.
type controlEntry struct {
	key        controlKey
	dependency string
	lastRun    time.Time
	lastPass   time.Time
	source     string // of the last pass
	// covers: the last pass vouches for receipts submitted at or after it
	// (zero: for every receipt of the operation).
	covers  time.Time
	reason  string // of the last failure ("" after a pass)
	running chan struct{}
}

// controls holds the control state of a pool.
type controls struct {
	mu      sync.Mutex
	entries map[controlKey]*controlEntry
}

func (cs *controls) entry(b *readback.Binding, op string, kind ControlKind) *controlEntry {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.entries == nil {
		cs.entries = map[controlKey]*controlEntry{}
	}
	k := controlKey{adapter: b.Name, operation: op, kind: kind}
	e, ok := cs.entries[k]
	if !ok {
		e = &controlEntry{key: k, dependency: b.Dependency}
		cs.entries[k] = e
	}
	return e
}

// verdict says whether e's control holds at now, whatever the receipt.
// Callers hold cs.mu.
func (e *controlEntry) verdict(now time.Time, validFor time.Duration) controlVerdict {
	what := fmt.Sprintf("%s control for %s", e.key.kind, e.key.operation)
	switch {
	case !e.lastPass.IsZero() && now.Sub(e.lastPass) < validFor:
		return controlVerdict{ok: true, note: fmt.Sprintf("%s: %s passed at %s", what, e.source, e.lastPass.UTC().Format(time.RFC3339))}
	case e.reason != "":
		return controlVerdict{note: fmt.Sprintf("%s: %s", what, e.reason)}
	case !e.lastPass.IsZero():
		return controlVerdict{note: fmt.Sprintf("%s: last passed at %s, longer ago than %s", what, e.lastPass.UTC().Format(time.RFC3339), validFor)}
	}
	return controlVerdict{note: what + ": not run yet"}
}

// verdictFor is verdict for a receipt submitted at submitted: a pass
// vouches only for receipts submitted since e.covers. Callers hold cs.mu.
func (e *controlEntry) verdictFor(now time.Time, validFor time.Duration, submitted time.Time) controlVerdict {
	v := e.verdict(now, validFor)
	if v.ok && !e.covers.IsZero() && submitted.Before(e.covers) {
		return controlVerdict{note: fmt.Sprintf("%s, which vouches for receipts submitted since %s, not for this one (submitted at %s): "+
			"a control at least as old runs first", v.note, e.covers.UTC().Format(time.RFC3339Nano), submitted.UTC().Format(time.RFC3339Nano))}
	}
	return v
}

// control returns whether b's answers gated by the control kind may settle
// r now, running that control of b for r's operation first when its last
// run is stale, or when its last pass does not reach back to r. One run per
// control at a time: concurrent callers wait for it.
func (s *session) control(b *readback.Binding, r readback.Receipt, kind ControlKind) controlVerdict {
	p := s.p
	cfg := p.cfg
	cs := &p.ctl
	e := cs.entry(b, r.Operation, kind)
	for {
		cs.mu.Lock()
		if e.running == nil {
			break
		}
		ch := e.running
		cs.mu.Unlock()
		select {
		case <-ch:
		case <-s.work.Done():
			return controlVerdict{note: "stopping"}
		}
	}
	now := cfg.Now()
	every := cfg.ControlInterval
	if e.reason != "" {
		every = min(every, cfg.ControlRetry) // the last run failed
	}
	if !e.lastRun.IsZero() && now.Sub(e.lastRun) < every {
		v := e.verdictFor(now, cfg.ControlValidFor, r.SubmittedAt)
		// A pass that does not reach back to r runs again at once, drawn
		// for r: the adapter is healthy, r only needs an older control,
		// and its check would otherwise wait for nothing (and spend its
		// check budget waiting). Each such run moves the pass back to an
		// older control, so their number is bounded by the controls older
		// than the newest pass.
		extend := !v.ok && e.verdict(now, cfg.ControlValidFor).ok
		if !extend {
			cs.mu.Unlock()
			return v
		}
	}
	ch := make(chan struct{})
	e.running = ch
	cs.mu.Unlock()

	source, covers, definitive, err := p.runControl(s.work, b, r, kind, cfg.Gate)

	cs.mu.Lock()
	defer cs.mu.Unlock()
	e.running = nil
	close(ch)
	now = cfg.Now()
	e.lastRun = now
	wasOK := e.verdict(now, cfg.ControlValidFor).ok && e.reason == ""
	if err == nil {
		e.lastPass, e.source, e.covers, e.reason = now, source, covers, ""
		if !wasOK {
			p.log.Info("positive control passed: the adapter's answers it gates may settle receipts of the operation",
				"adapter", b.Name, "dependency", b.Dependency, "operation", r.Operation, "control", string(kind), "source", source)
		}
	} else {
		e.reason = err.Error()
		if definitive {
			// The adapter answered and did not read what is known: whatever
			// passed before, the answers this control gates prove nothing now.
			e.lastPass = time.Time{}
		}
		p.log.Warn("positive control failed: the adapter's answers it gates settle nothing until it passes",
			"adapter", b.Name, "dependency", b.Dependency, "operation", r.Operation, "control", string(kind),
			"source", source, "reason", e.reason)
	}
	if p.m != nil {
		ok := 0.0
		if e.verdict(now, cfg.ControlValidFor).ok {
			ok = 1
		}
		p.m.controlReported(b.Name, r.Operation, kind, ok)
	}
	return e.verdictFor(now, cfg.ControlValidFor, r.SubmittedAt)
}

// runControl runs b's control of kind for receipt r (its operation, and for
// a ledger present-control its submission time) through gate. covers is
// the earliest submission time a pass vouches for (zero: all). definitive
// is set when the failure says the adapter is wrong (it answered, or
// failed permanently, or has no control to run), as opposed to a transient
// failure or a deferral.
func (p *Pool) runControl(ctx context.Context, b *readback.Binding, r readback.Receipt, kind ControlKind, gate Gate) (source string, covers time.Time, definitive bool, err error) {
	ctl, source, covers, err := findControl(ctx, p.db, b, r.Operation, kind, r.SubmittedAt, p.cfg.ControlScan)
	if err != nil {
		var none *noControlError
		return source, covers, errors.As(err, &none), err
	}
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		gate = openGate{}
	}
	pass, err := gate.Enter(ctx, b.Dependency, false)
	if err != nil {
		return source, covers, false, fmt.Errorf("control %s not run: %w", source, err)
	}
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CheckTimeout)
	res, cerr := safeCheck(cctx, b.Adapter, ctl)
	cancel()
	result, retryAfter := checkResult(cerr)
	if ctx.Err() != nil {
		pass.Exit(Cancelled, 0)
		return source, covers, false, fmt.Errorf("control %s: %w", source, ctx.Err())
	}
	pass.Exit(result, retryAfter)
	if p.m != nil {
		outcome := "control_" + string(res.Verdict)
		if cerr != nil {
			outcome = "control_" + string(result)
		}
		p.m.Checks.WithLabelValues(b.Name, outcome).Inc()
	}
	if err := evaluateControl(b, kind, res, cerr); err != nil {
		return source, covers, cerr == nil || result == FailedPermanent, fmt.Errorf("control %s: %w", source, err)
	}
	return source, covers, false, nil
}

// evaluateControl says whether the answer res (or the failure err) passes
// b's control of kind: a present control must read present
// (readback.EvaluateControl); a gone control, a resource the API confirmed
// deleted, must read absent, authoritatively.
func evaluateControl(b *readback.Binding, kind ControlKind, res readback.Result, err error) error {
	if kind != ControlGone {
		return readback.EvaluateControl(b, res, err)
	}
	if err != nil {
		return fmt.Errorf("%w: adapter %s: the check failed: %w", readback.ErrControlFailed, b.Name, err)
	}
	if res.Verdict != readback.VerdictAbsent || !res.Authoritative {
		auth := "authoritative"
		if !res.Authoritative {
			auth = "not authoritative"
		}
		return fmt.Errorf("%w: adapter %s answered %s (%s; query %s) for a resource the API confirmed deleted "+
			"(a delete that settled succeeded from its 2xx response): its \"present\" proves nothing",
			readback.ErrControlFailed, b.Name, res.Verdict, auth, res.Query)
	}
	return nil
}

// noControlError means a binding has no control to run.
type noControlError struct{ msg string }

func (e *noControlError) Error() string { return e.msg }

// declaredOperation is the operation a declared control vouches for: its
// Receipt.Operation (never empty after readback.LoadFile), else the
// binding's only operation, else none.
func declaredOperation(b *readback.Binding) string {
	if b.Control == nil {
		return ""
	}
	if op := b.Control.Receipt.Operation; op != "" {
		return op
	}
	if len(b.Operations) == 1 {
		return b.Operations[0]
	}
	return ""
}

// findControl returns the receipt b's control of kind for operation op
// looks for, with its source and the earliest submission time a pass
// vouches for (zero: all). A present control is the declared one when it
// vouches for op, else (create and update only) the ledger receipt of op
// closest to a receipt submitted at before (before zero: the newest). A
// gone control (delete only) is the newest ledger receipt of op.
func findControl(ctx context.Context, db *pgxpool.Pool, b *readback.Binding, op string, kind ControlKind, before time.Time, scan int) (readback.Receipt, string, time.Time, error) {
	if scan <= 0 {
		scan = ControlScan
	}
	if kind == ControlGone {
		if b.Kind != readback.Delete {
			return readback.Receipt{}, "", time.Time{}, &noControlError{msg: "no gone control: only a delete adapter has one"}
		}
		r, ok, err := controlReceipt(ctx, db, b, op, time.Time{}, scan)
		if err != nil {
			return readback.Receipt{}, "", time.Time{}, err
		}
		if !ok {
			return readback.Receipt{}, "", time.Time{}, &noControlError{msg: fmt.Sprintf("no gone control: none of the %d newest "+
				"receipts of %s on %s settled succeeded from the API's response, so nothing known to be deleted shows that "+
				"the adapter's \"present\" is real; its deletes do not settle safe_to_retry", scan, op, b.Dependency)}
		}
		return r, fmt.Sprintf("receipt:%d", r.ID), time.Time{}, nil
	}
	if c := b.Control; c != nil {
		declared := declaredOperation(b)
		if declared == op {
			source := c.Source
			if source == "" {
				source = "declared"
			}
			return c.Receipt, source, time.Time{}, nil
		}
		if b.Kind == readback.Delete {
			if declared == "" {
				return readback.Receipt{}, "", time.Time{}, &noControlError{msg: fmt.Sprintf("no present control for %s: "+
					"the declared control names no operation and the adapter has several or none: it vouches for none", op)}
			}
			return readback.Receipt{}, "", time.Time{}, &noControlError{msg: fmt.Sprintf("no present control for %s: "+
				"the declared control vouches only for %s", op, declared)}
		}
	}
	if b.Kind == readback.Delete {
		return readback.Receipt{}, "", time.Time{}, &noControlError{msg: "no present control: a delete adapter needs a declared control " +
			"(a resource known to exist), since a deleted one reads absent like a misconfiguration"}
	}
	r, ok, err := controlReceipt(ctx, db, b, op, before, scan)
	if err != nil {
		return readback.Receipt{}, "", time.Time{}, err
	}
	if !ok {
		return readback.Receipt{}, "", time.Time{}, &noControlError{msg: fmt.Sprintf("no present control: none declared for %s, "+
			"and none of the %d newest receipts of %s on %s settled succeeded from the API's response", op, scan, op, b.Dependency)}
	}
	// A control submitted no later than before vouches for receipts
	// submitted since itself (they draw it or a newer one); one submitted
	// after before (none is as old: the fallback) vouches for all (an older
	// receipt draws the same one, a newer one it or a newer one).
	covers := time.Time{}
	if !before.IsZero() && !r.SubmittedAt.After(before) {
		covers = r.SubmittedAt
	}
	return r, fmt.Sprintf("receipt:%d", r.ID), covers, nil
}

// RunControl runs b's positive controls once, without protection, for
// every operation b has one for (its operations; for an adapter of a whole
// dependency, the declared control's operation and those with a receipt
// among the ControlScan newest that settled succeeded from the API's 2xx
// response): the present control (the declared one, else the newest such
// receipt of the operation) and, for a delete adapter, the gone control.
// It returns nil when all passed, and an error (matching
// readback.ErrControlFailed when the adapter answered wrongly) saying what
// happened otherwise. For `reconciler adapters check --control`.
func RunControl(ctx context.Context, db *pgxpool.Pool, b *readback.Binding) error {
	if b.Kind == readback.Blind {
		return fmt.Errorf("adapter %s is blind: it reads nothing, so it has no control", b.Name)
	}
	ops := b.Operations
	if len(ops) == 0 {
		if op := declaredOperation(b); op != "" {
			ops = append(ops, op)
		}
		more, err := controlOperations(ctx, db, b, ControlScan)
		if err != nil {
			return err
		}
		for _, op := range more {
			if !slices.Contains(ops, op) {
				ops = append(ops, op)
			}
		}
	}
	if len(ops) == 0 {
		return fmt.Errorf("adapter %s: no control: none declared for an operation, and none of the %d newest receipts of %s "+
			"settled succeeded from the API's response", b.Name, ControlScan, b.Dependency)
	}
	kinds := []ControlKind{ControlPresent}
	if b.Kind == readback.Delete {
		kinds = append(kinds, ControlGone)
	}
	var errs []error
	for _, op := range ops {
		for _, kind := range kinds {
			if err := RunControlFor(ctx, db, b, readback.Receipt{Operation: op}, kind); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// RunControlFor runs b's control of kind (ControlNeeded of a decision) for
// receipt r once, without protection, as the pool would before settling r:
// for r's operation, and for a ledger present-control the receipt closest
// to r's submission (zero SubmittedAt: the newest). For `reconciler
// adapters check --receipt`.
func RunControlFor(ctx context.Context, db *pgxpool.Pool, b *readback.Binding, r readback.Receipt, kind ControlKind) error {
	if b.Kind == readback.Blind {
		return fmt.Errorf("adapter %s is blind: it reads nothing, so it has no control", b.Name)
	}
	ctl, source, _, err := findControl(ctx, db, b, r.Operation, kind, r.SubmittedAt, ControlScan)
	if err != nil {
		return fmt.Errorf("adapter %s, %s control for %s: %w", b.Name, kind, r.Operation, err)
	}
	res, cerr := safeCheck(ctx, b.Adapter, ctl)
	if err := evaluateControl(b, kind, res, cerr); err != nil {
		return fmt.Errorf("%s control %s for %s: %w", kind, source, r.Operation, err)
	}
	return nil
}

// AdapterHealth reports the positive-control state of the pool's non-blind
// adapters, sorted by adapter, operation and control: one entry per
// control that has run, and one entry (not OK, "control not run yet") for
// an adapter none of whose controls has run yet (no answer has needed one).
func (p *Pool) AdapterHealth() []AdapterHealth {
	now := p.cfg.Now()
	var out []AdapterHealth
	p.ctl.mu.Lock()
	byAdapter := map[string][]*controlEntry{}
	for _, e := range p.ctl.entries {
		byAdapter[e.key.adapter] = append(byAdapter[e.key.adapter], e)
	}
	for _, b := range p.cfg.Registry.Bindings() {
		if b.Kind == readback.Blind {
			continue
		}
		es := byAdapter[b.Name]
		if len(es) == 0 {
			out = append(out, AdapterHealth{Adapter: b.Name, Dependency: b.Dependency, Reason: "control not run yet"})
			continue
		}
		for _, e := range es {
			v := e.verdict(now, p.cfg.ControlValidFor)
			out = append(out, AdapterHealth{Adapter: b.Name, Dependency: b.Dependency, Operation: e.key.operation,
				Control: e.key.kind, OK: v.ok, Reason: v.note, LastRun: e.lastRun, LastPass: e.lastPass})
		}
	}
	p.ctl.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Adapter != b.Adapter {
			return a.Adapter < b.Adapter
		}
		if a.Operation != b.Operation {
			return a.Operation < b.Operation
		}
		return a.Control < b.Control
	})
	return out
}
