package reconcile

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/readback"
)

// Kinds of window alarm (reconciler.window_alarms.kind): proof that a
// dependency's declared window is too short.
const (
	// AlarmPresentAfterAbsence: a settling read found an effect after an
	// authoritative read of the same receipt that began past the window had
	// found it absent.
	AlarmPresentAfterAbsence = "present_after_absence"
	// AlarmFalseAbsence: an audit found the effect of a receipt settled as
	// absent (safe_to_retry, or a delete's succeeded).
	AlarmFalseAbsence = "false_absence"
)

// DefaultWindowMargin is the margin added to an observed lag when a window
// is widened: the effective window becomes (1 + margin) × observed.
const DefaultWindowMargin = 0.5

// DeclaredWindow is the window a binding declares, measured from the send
// deadline: max_request_lifetime + consistency_window (SPEC §5a).
func DeclaredWindow(p readback.Policy) time.Duration {
	return p.MaxRequestLifetime + p.ConsistencyWindow
}

// Window is the effective absence window of one adapter's declaration.
type Window struct {
	Dependency string `json:"dependency"`
	Adapter    string `json:"adapter"`
	// Declared is max_request_lifetime + consistency_window as declared;
	// Effective is what absences wait for: Declared, or wider after an
	// alarm. Both run from the send deadline.
	Declared  time.Duration `json:"-"`
	Effective time.Duration `json:"-"`
	// Why the window was widened, when it was: the alarm that set it.
	Kind     string        `json:"kind,omitempty"`
	Observed time.Duration `json:"-"`
	Receipt  int64         `json:"receipt_id,omitempty"`
	At       time.Time     `json:"at,omitzero"`
}

// MarshalJSON writes w with its durations in seconds.
func (w Window) MarshalJSON() ([]byte, error) {
	type plain Window
	return json.Marshal(struct {
		plain
		DeclaredS  float64  `json:"declared_s"`
		EffectiveS float64  `json:"effective_s"`
		ObservedS  *float64 `json:"observed_s,omitempty"`
	}{plain(w), w.Declared.Seconds(), w.Effective.Seconds(), nullSeconds(w.Observed)})
}

// Widened reports whether w is wider than its declaration.
func (w Window) Widened() bool { return w.Effective > w.Declared }

// windowKey is one declaration: windows widened under another declared
// value no longer apply once the file changes (nor does one set before).
type windowKey struct {
	dependency, adapter string
	declared            time.Duration // to the microsecond, as stored
}

func keyOf(b *readback.Binding) windowKey {
	return windowKey{b.Dependency, b.Name, DeclaredWindow(b.Policy).Truncate(time.Microsecond)}
}

// Windows are the effective windows of the declarations, kept in the
// database (reconciler.window_alarms, append-only) so that every replica
// and every restart applies the same ones: widened once, a window stays
// wide until an operator changes the declaration in the adapters file.
// Safe for concurrent use; the zero value (or nil) knows of no widening.
type Windows struct {
	mu sync.Mutex
	by map[windowKey]Window
}

// For returns the window b's declaration has now.
func (w *Windows) For(b *readback.Binding) Window {
	k := keyOf(b)
	out := Window{Dependency: b.Dependency, Adapter: b.Name, Declared: DeclaredWindow(b.Policy)}
	out.Effective = out.Declared
	if w == nil {
		return out
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if st, ok := w.by[k]; ok && st.Effective > out.Effective {
		st.Declared = out.Declared
		return st
	}
	return out
}

// Policy returns b's policy with its effective window: the consistency
// window lengthened by what the effective window adds to the declared one,
// so every rule built on the window (the absence window, the native key's
// window, the schedule's aim) waits for it.
func (w *Windows) Policy(b *readback.Binding) readback.Policy {
	p := b.Policy
	if win := w.For(b); win.Widened() {
		p.ConsistencyWindow += win.Effective - win.Declared
	}
	return p
}

// Load reads the effective windows from the database, replacing what w
// knew: another replica's widenings become this one's.
func (w *Windows) Load(ctx context.Context, db *pgxpool.Pool) error {
	rows, err := db.Query(ctx, sqlWindows)
	if err != nil {
		return fmt.Errorf("reconcile: effective windows: %w", err)
	}
	by := map[windowKey]Window{}
	var (
		win                           Window
		declared, effective, observed float64
	)
	_, err = pgx.ForEachRow(rows, []any{&win.Dependency, &win.Adapter, &declared, &effective, &observed,
		&win.Kind, &win.Receipt, &win.At}, func() error {
		win.Declared, win.Effective, win.Observed = seconds(declared), seconds(effective), seconds(observed)
		by[windowKey{win.Dependency, win.Adapter, win.Declared}] = win
		return nil
	})
	if err != nil {
		return fmt.Errorf("reconcile: effective windows: %w", err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	// A widening this process made and the database has not shown yet
	// (none: it is written before it is applied) cannot be lost; keep the
	// wider of the two all the same.
	for k, cur := range w.by {
		if got, ok := by[k]; !ok || cur.Effective > got.Effective {
			by[k] = cur
		}
	}
	w.by = by
	return nil
}

// Know adds widened windows read elsewhere (VerdictStats) to what w knows.
func (w *Windows) Know(ws []Window) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.by == nil {
		w.by = map[windowKey]Window{}
	}
	for _, win := range ws {
		k := windowKey{win.Dependency, win.Adapter, win.Declared}
		if cur, ok := w.by[k]; !ok || win.Effective > cur.Effective {
			w.by[k] = win
		}
	}
}

// all returns the widened windows w knows, by dependency and adapter (the
// widest of each declaration).
func (w *Windows) all() []Window {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]Window, 0, len(w.by))
	for _, win := range w.by {
		out = append(out, win)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Dependency != out[j].Dependency {
			return out[i].Dependency < out[j].Dependency
		}
		if out[i].Adapter != out[j].Adapter {
			return out[i].Adapter < out[j].Adapter
		}
		return out[i].Declared < out[j].Declared
	})
	return out
}

// seconds converts an interval read as seconds to a duration, to the
// microsecond (the interval's precision).
func seconds(s float64) time.Duration {
	return time.Duration(math.Round(s*1e6)) * time.Microsecond
}

// widening is one proof that a declaration's window is too short.
type widening struct {
	at       time.Time
	instance string
	b        *readback.Binding
	r        readback.Receipt
	kind     string
	// observed is the time from the send deadline to the read that found
	// the effect: at least the effect's lag beyond the send deadline.
	observed time.Duration
	margin   float64
	evidence any
}

// widen records the alarm a and widens its declaration's window to
// (1 + margin) × the lag observed, never narrower than it was (nor than
// declared). The database keeps the alarm; w applies it at once. It
// returns the window before and after.
func (w *Windows) widen(ctx context.Context, db *pgxpool.Pool, a widening) (before, after Window, err error) {
	before = w.For(a.b)
	after = before
	want := time.Duration(float64(a.observed) * (1 + a.margin)).Truncate(time.Microsecond)
	if want > after.Effective {
		after.Effective = want
	}
	after.Kind, after.Observed, after.Receipt, after.At = a.kind, a.observed, a.r.ID, a.at
	ev, err := json.Marshal(a.evidence)
	if err != nil {
		ev = []byte("{}")
	}
	ev = boundedEvidence(ev)
	if _, err := db.Exec(ctx, sqlWindowAlarm, pgx.NamedArgs{
		"at": a.at, "instance": a.instance, "dependency": a.b.Dependency, "adapter": a.b.Name,
		"operation": a.r.Operation, "receipt": a.r.ID, "kind": a.kind,
		"declared_s": before.Declared.Seconds(), "observed_s": a.observed.Seconds(),
		"before_s": before.Effective.Seconds(), "after_s": after.Effective.Seconds(), "evidence": string(ev),
	}); err != nil {
		return before, before, fmt.Errorf("reconcile: record window alarm: %w", err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.by == nil {
		w.by = map[windowKey]Window{}
	}
	k := keyOf(a.b)
	if cur, ok := w.by[k]; !ok || after.Effective > cur.Effective {
		w.by[k] = after
	}
	return before, after, nil
}
