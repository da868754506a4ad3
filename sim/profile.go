package sim

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Profile is a fault profile: the chance that any one call to the fake API
// fails, by kind, and how long a committed record stays invisible to reads.
type Profile struct {
	// Name is the profile's name on the command line.
	Name string
	// Transient is the chance of a 503 answer.
	Transient float64
	// Hang is the chance that the API holds the call for HangFor and then
	// answers 504: a client without a deadline waits all of it.
	Hang float64
	// Malformed is the chance of a 200 whose body is cut short (the
	// article's "balance": 1000 arriving as "balance": 1).
	Malformed float64
	// Lag is the visibility lag: a record appears in lists this long after
	// it was stored.
	Lag time.Duration
	// Why says what the profile stands for, for the report.
	Why string
}

// AmbiguousWindow is the chance that a failing write stores its effect
// before it fails (the article's ambiguous write window): the caller sees a
// failure either way.
const AmbiguousWindow = 0.5

// Profiles are the fault profiles, mildest first. Medium is the article's;
// high doubles each of its rates, so half of all calls fail with the same
// mix of kinds, and triples the visibility lag.
var Profiles = []Profile{
	{Name: "none", Lag: 20 * time.Millisecond,
		Why: "no faults: the cost of each pattern when nothing fails"},
	{Name: "low", Transient: 0.03, Hang: 0.02, Malformed: 0.02, Lag: 50 * time.Millisecond,
		Why: "7% of calls fail: a healthy API on a bad day"},
	{Name: "medium", Transient: 0.10, Hang: 0.07, Malformed: 0.08, Lag: 100 * time.Millisecond,
		Why: "the article's medium profile: 25% of calls fail"},
	{Name: "high", Transient: 0.20, Hang: 0.14, Malformed: 0.16, Lag: 300 * time.Millisecond,
		Why: "each medium rate doubled, so half of all calls fail in the same mix, and the lag tripled: " +
			"the regime where the article's all-patterns row answered 97.9% of questions but ended clean on 12.5%, " +
			"and where three attempts lose one step in eight"},
}

// ProfileNamed returns the profile called name.
func ProfileNamed(name string) (Profile, error) {
	for _, p := range Profiles {
		if p.Name == name {
			return p, nil
		}
	}
	names := make([]string, len(Profiles))
	for i, p := range Profiles {
		names[i] = p.Name
	}
	return Profile{}, fmt.Errorf("%w: unknown profile %q (one of %v)", ErrInvalidOptions, name, names)
}

// Fault is what the fake API does to one call.
type Fault string

// The faults a call can meet.
const (
	OK        Fault = "ok"
	Transient Fault = "transient"
	Hang      Fault = "hang"
	Malformed Fault = "malformed"
)

// Draw is one call's fate: its fault, and for a write whether the effect
// is stored before the fault (always for OK).
type Draw struct {
	Fault   Fault `json:"fault"`
	Applied bool  `json:"applied"`
}

// schedule hands out the faults of every call from per-stream random
// sequences. A stream is one tool called for one task (or one record, for
// the reconciler's reads), so the n-th call of a task to a tool meets the
// same fault whatever other tasks do at the same time: the same seed
// injects the same faults at any concurrency, and in every strategy.
type schedule struct {
	seed    uint64
	profile Profile

	mu      sync.Mutex
	streams map[string]*rand.Rand
	log     map[string][]Draw
}

func newSchedule(seed uint64, p Profile) *schedule {
	return &schedule{seed: seed, profile: p, streams: map[string]*rand.Rand{}, log: map[string][]Draw{}}
}

// next draws the fate of the next call on stream.
func (s *schedule) next(stream string) Draw {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.streams[stream]
	if !ok {
		h := fnv.New64a()
		h.Write([]byte(stream))
		r = rand.New(rand.NewPCG(s.seed, h.Sum64()))
		s.streams[stream] = r
	}
	// Both numbers are drawn on every call so that the stream stays
	// aligned whatever the fault.
	u, v := r.Float64(), r.Float64()
	p := s.profile
	d := Draw{Fault: OK, Applied: true}
	switch {
	case u < p.Transient:
		d.Fault = Transient
	case u < p.Transient+p.Hang:
		d.Fault = Hang
	case u < p.Transient+p.Hang+p.Malformed:
		d.Fault = Malformed
	}
	if d.Fault != OK {
		d.Applied = v < AmbiguousWindow
	}
	s.log[stream] = append(s.log[stream], d)
	return d
}

// Faults returns every stream's draws so far, in call order.
func (s *schedule) faults() map[string][]Draw {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string][]Draw, len(s.log))
	for k, v := range s.log {
		out[k] = slices.Clone(v)
	}
	return out
}
