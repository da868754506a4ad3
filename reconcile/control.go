package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/readback"
)

// Positive controls (SPEC §5a; issue 7, "a misconfigured adapter must not
// produce proof"). A wrong path, filter or marker makes an adapter answer
// "absent" for everything, which reads exactly like an authoritative
// absence. So an adapter's absence settles nothing until the adapter has
// recently found an effect known to exist: its control. The control is the
// one the adapters file declares for the binding (readback.Binding.Control)
// or, failing that, the latest receipt the binding reads that settled
// succeeded from the API's own 2xx response (found by Store.ControlReceipt
// with a bounded walk of the newest receipts). A delete adapter's control
// must be declared: a deleted resource is absent, which is precisely what
// a misconfigured adapter answers.
//
// Controls run lazily: only when an absence would otherwise settle a
// receipt and the binding's last run is older than Config.ControlInterval;
// after a failed run, once Config.ControlRetry has passed; a pass counts for
// Config.ControlValidFor. They go through the same Gate
// as checks. Until a control passes the receipt waits (released with its
// next check, never safe_to_retry), the check record says why, the adapter
// is reported unhealthy (reconciler_adapter_control_ok, a log line,
// Pool.AdapterHealth for /readyz).

// AdapterHealth is the positive-control state of one adapter.
type AdapterHealth struct {
	Adapter    string `json:"adapter"`
	Dependency string `json:"dependency"`
	// OK is true while the adapter's control passed within the validity
	// period: its absences may settle receipts.
	OK bool `json:"control_ok"`
	// Reason says why the adapter is not OK, or which control passed.
	Reason string `json:"reason,omitempty"`
	// LastRun and LastPass are on the database's clock (zero: never).
	LastRun  time.Time `json:"last_run,omitempty"`
	LastPass time.Time `json:"last_pass,omitempty"`
}

// controlEntry is the control state of one binding.
type controlEntry struct {
	binding  *readback.Binding
	lastRun  time.Time
	lastPass time.Time
	source   string // of the last pass
	reason   string // of the last failure ("" after a pass)
	running  chan struct{}
}

// controls holds the control state of every binding of a pool.
type controls struct {
	mu      sync.Mutex
	entries map[string]*controlEntry
}

func (cs *controls) entry(b *readback.Binding) *controlEntry {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.entries == nil {
		cs.entries = map[string]*controlEntry{}
	}
	e, ok := cs.entries[b.Name]
	if !ok {
		e = &controlEntry{binding: b}
		cs.entries[b.Name] = e
	}
	return e
}

// verdict says whether e's control holds at now. Callers hold cs.mu.
func (e *controlEntry) verdict(now time.Time, validFor time.Duration) controlVerdict {
	switch {
	case !e.lastPass.IsZero() && now.Sub(e.lastPass) < validFor:
		return controlVerdict{ok: true, note: fmt.Sprintf("%s found at %s", e.source, e.lastPass.UTC().Format(time.RFC3339))}
	case e.reason != "":
		return controlVerdict{note: e.reason}
	case !e.lastPass.IsZero():
		return controlVerdict{note: fmt.Sprintf("last passed at %s, longer ago than %s", e.lastPass.UTC().Format(time.RFC3339), validFor)}
	}
	return controlVerdict{note: "not run yet"}
}

// control returns whether b's absences may settle receipts now, running
// b's control first when its last run is stale. One run per binding at a
// time: concurrent callers wait for it.
func (s *session) control(b *readback.Binding) controlVerdict {
	p := s.p
	cfg := p.cfg
	cs := &p.ctl
	e := cs.entry(b)
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
		v := e.verdict(now, cfg.ControlValidFor)
		cs.mu.Unlock()
		return v
	}
	ch := make(chan struct{})
	e.running = ch
	cs.mu.Unlock()

	source, definitive, err := p.runControl(s.work, b, cfg.Gate)

	cs.mu.Lock()
	defer cs.mu.Unlock()
	e.running = nil
	close(ch)
	now = cfg.Now()
	e.lastRun = now
	wasOK := e.reason == "" && !e.lastPass.IsZero()
	if err == nil {
		e.lastPass, e.source, e.reason = now, source, ""
		if !wasOK {
			p.log.Info("positive control passed: the adapter's absences may settle receipts",
				"adapter", b.Name, "dependency", b.Dependency, "control", source)
		}
	} else {
		e.reason = err.Error()
		if definitive {
			// The adapter answered and did not find what exists: whatever
			// passed before, its absences prove nothing now.
			e.lastPass = time.Time{}
		}
		p.log.Warn("positive control failed: the adapter's absences settle nothing until it passes",
			"adapter", b.Name, "dependency", b.Dependency, "control", source, "reason", e.reason)
	}
	v := e.verdict(now, cfg.ControlValidFor)
	if p.m != nil {
		ok := 0.0
		if v.ok {
			ok = 1
		}
		p.m.ControlOK.WithLabelValues(b.Name).Set(ok)
	}
	return v
}

// runControl runs b's control through gate. definitive is set when the
// failure says the adapter is wrong (it answered, or failed permanently, or
// has no control to run), as opposed to a transient failure or a deferral.
func (p *Pool) runControl(ctx context.Context, b *readback.Binding, gate Gate) (source string, definitive bool, err error) {
	r, source, err := findControl(ctx, p.db, b, p.cfg.ControlScan)
	if err != nil {
		var none *noControlError
		return source, errors.As(err, &none), err
	}
	if l, ok := b.Adapter.(readback.Local); ok && l.Local() {
		gate = openGate{}
	}
	pass, err := gate.Enter(ctx, b.Dependency, false)
	if err != nil {
		return source, false, fmt.Errorf("control %s not run: %w", source, err)
	}
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CheckTimeout)
	res, cerr := safeCheck(cctx, b.Adapter, r)
	cancel()
	result, retryAfter := Answered, time.Duration(0)
	if cerr != nil {
		class, ra := readback.Classify(cerr)
		result, retryAfter = FailedTransient, ra
		if class == readback.Permanent {
			result = FailedPermanent
		}
	}
	if ctx.Err() != nil {
		pass.Exit(Cancelled, 0)
		return source, false, fmt.Errorf("control %s: %w", source, ctx.Err())
	}
	pass.Exit(result, retryAfter)
	if p.m != nil {
		outcome := "control_" + string(res.Verdict)
		if cerr != nil {
			outcome = "control_" + string(result)
		}
		p.m.Checks.WithLabelValues(b.Name, outcome).Inc()
	}
	if err := readback.EvaluateControl(b, res, cerr); err != nil {
		return source, cerr == nil || result == FailedPermanent, fmt.Errorf("control %s: %w", source, err)
	}
	return source, false, nil
}

// noControlError means a binding has no control to run.
type noControlError struct{ msg string }

func (e *noControlError) Error() string { return e.msg }

// findControl returns the receipt b's control looks for: the declared one,
// else a ledger receipt (create and update only).
func findControl(ctx context.Context, db *pgxpool.Pool, b *readback.Binding, scan int) (readback.Receipt, string, error) {
	if c := b.Control; c != nil {
		source := c.Source
		if source == "" {
			source = "declared"
		}
		return c.Receipt, source, nil
	}
	if b.Kind == readback.Delete {
		return readback.Receipt{}, "", &noControlError{msg: "no control: a delete adapter needs a declared control " +
			"(a resource known to exist), since a deleted one reads absent like a misconfiguration"}
	}
	if scan <= 0 {
		scan = ControlScan
	}
	r, ok, err := controlReceipt(ctx, db, b, scan)
	if err != nil {
		return readback.Receipt{}, "", err
	}
	if !ok {
		return readback.Receipt{}, "", &noControlError{msg: fmt.Sprintf("no control: none declared, and none of the "+
			"%d newest receipts of its operations on %s settled succeeded from the API's response", scan, b.Dependency)}
	}
	return r, fmt.Sprintf("receipt:%d", r.ID), nil
}

// RunControl runs b's positive control once, without protection: the
// control the adapters file declares, else the latest receipt b reads that
// settled succeeded from the API's 2xx response (among the ControlScan
// newest). It returns nil when the adapter found the known effect, and an
// error (matching readback.ErrControlFailed when the adapter answered
// wrongly) saying what happened otherwise. For `reconciler adapters check
// --control`.
func RunControl(ctx context.Context, db *pgxpool.Pool, b *readback.Binding) error {
	if b.Kind == readback.Blind {
		return fmt.Errorf("adapter %s is blind: it reads nothing, so it has no control", b.Name)
	}
	r, source, err := findControl(ctx, db, b, ControlScan)
	if err != nil {
		return fmt.Errorf("adapter %s: %w", b.Name, err)
	}
	res, cerr := safeCheck(ctx, b.Adapter, r)
	if err := readback.EvaluateControl(b, res, cerr); err != nil {
		return fmt.Errorf("control %s: %w", source, err)
	}
	return nil
}

// AdapterHealth reports the positive-control state of every non-blind
// adapter of the pool's registry, sorted by name. An adapter whose control
// has not run yet (no absence has needed it) is not OK, with that reason.
func (p *Pool) AdapterHealth() []AdapterHealth {
	now := p.cfg.Now()
	var out []AdapterHealth
	for _, b := range p.cfg.Registry.Bindings() {
		if b.Kind == readback.Blind {
			continue
		}
		h := AdapterHealth{Adapter: b.Name, Dependency: b.Dependency, Reason: "control not run yet"}
		p.ctl.mu.Lock()
		if e, ok := p.ctl.entries[b.Name]; ok {
			v := e.verdict(now, p.cfg.ControlValidFor)
			h.OK, h.Reason, h.LastRun, h.LastPass = v.ok, v.note, e.lastRun, e.lastPass
		}
		p.ctl.mu.Unlock()
		out = append(out, h)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Adapter < out[j].Adapter })
	return out
}
