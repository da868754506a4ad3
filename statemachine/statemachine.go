// Package statemachine defines the receipt lifecycle: the eight states a
// side-effecting call can be in, which moves between them are legal, and which
// kinds of actor may make them.
//
// The same table is enforced by the database (see package migrations); this
// package lets Go callers refuse an illegal move before a round trip and gives
// both sides one vocabulary.
package statemachine

import (
	"errors"
	"fmt"
	"strings"
)

// State is one of the eight receipt states.
type State string

// The receipt states, in lifecycle order.
const (
	Planned        State = "planned"
	Submitted      State = "submitted"
	OutcomeUnknown State = "outcome_unknown"
	Reconciling    State = "reconciling"
	Succeeded      State = "succeeded"
	SafeToRetry    State = "safe_to_retry"
	Rejected       State = "rejected"
	ManualReview   State = "manual_review"
)

// States lists every state, in lifecycle order.
func States() []State {
	return []State{Planned, Submitted, OutcomeUnknown, Reconciling, Succeeded, SafeToRetry, Rejected, ManualReview}
}

// transitions is the table of SPEC §3. Kept unexported so no caller can
// widen it at run time.
var transitions = map[State][]State{
	Planned:        {Submitted, Rejected},
	Submitted:      {Succeeded, Rejected, OutcomeUnknown},
	OutcomeUnknown: {Reconciling, ManualReview},
	Reconciling:    {Succeeded, SafeToRetry, ManualReview},
	ManualReview:   {Succeeded, SafeToRetry, Rejected, OutcomeUnknown},
	// A fresh proof (SPEC §5a): a safe_to_retry whose proof no longer
	// holds (its native key's retention passed) goes back to the
	// reconciler. The database refuses it once a retry of the receipt is
	// past planned.
	SafeToRetry: {OutcomeUnknown},
}

// Valid reports whether s is one of the eight states.
func (s State) Valid() bool {
	switch s {
	case Planned, Submitted, OutcomeUnknown, Reconciling, Succeeded, SafeToRetry, Rejected, ManualReview:
		return true
	}
	return false
}

// Terminal reports whether no move leaves s.
func (s State) Terminal() bool {
	return s.Valid() && len(transitions[s]) == 0
}

// Unresolved reports whether a receipt in s may still have an effect nobody
// has proven or ruled out: a re-planned duplicate must wait for it.
func (s State) Unresolved() bool {
	switch s {
	case Submitted, OutcomeUnknown, Reconciling, ManualReview:
		return true
	}
	return false
}

// Next returns the states reachable from s in one move.
func (s State) Next() []State {
	return append([]State(nil), transitions[s]...)
}

// ParseState returns the State named by s, or ErrUnknownState.
func ParseState(s string) (State, error) {
	st := State(s)
	if !st.Valid() {
		return "", fmt.Errorf("%w: %q", ErrUnknownState, s)
	}
	return st, nil
}

// ActorKind is the kind of party that makes a move.
type ActorKind string

// The actor kinds. An actor is written "<kind>:<id>", e.g. "agent:billing-7".
const (
	Agent      ActorKind = "agent"
	Reconciler ActorKind = "reconciler"
	Human      ActorKind = "human"
)

// Actor identifies who made a move, as "<kind>:<id>".
type Actor string

// ParseActor checks that s is "<kind>:<id>" with a known kind and a non-empty id.
func ParseActor(s string) (Actor, error) {
	kind, id, ok := strings.Cut(s, ":")
	if !ok || id == "" || strings.TrimSpace(id) != id {
		return "", fmt.Errorf("%w: %q is not <kind>:<id>", ErrInvalidActor, s)
	}
	switch ActorKind(kind) {
	case Agent, Reconciler, Human:
		return Actor(s), nil
	}
	return "", fmt.Errorf("%w: %q has unknown kind %q (want agent, reconciler or human)", ErrInvalidActor, s, kind)
}

// Kind returns the actor's kind, or "" when a is malformed.
func (a Actor) Kind() ActorKind {
	kind, _, _ := strings.Cut(string(a), ":")
	return ActorKind(kind)
}

// Errors returned by this package. Refusals wrap one of them, so callers test
// with errors.Is.
var (
	// ErrUnknownState means a name is not one of the eight states.
	ErrUnknownState = errors.New("unknown receipt state")
	// ErrInvalidActor means an actor string is not "<kind>:<id>".
	ErrInvalidActor = errors.New("invalid actor")
	// ErrIllegalTransition means the move is not in the transition table, or
	// the actor's kind may not make it.
	ErrIllegalTransition = errors.New("illegal transition")
)

// TransitionError names a refused move. It matches ErrIllegalTransition
// under errors.Is.
type TransitionError struct {
	From, To State
	Actor    Actor
	// Reason says why the move was refused.
	Reason string
}

// Error describes the TransitionError in one line.
func (e *TransitionError) Error() string {
	return fmt.Sprintf("illegal transition %s -> %s by %s: %s", e.From, e.To, e.Actor, e.Reason)
}

// Is makes errors.Is(err, ErrIllegalTransition) true.
func (e *TransitionError) Is(target error) bool { return target == ErrIllegalTransition }

// Check answers "may actor move a receipt from one state to another". It
// returns nil when the move is legal, a *TransitionError when it is not, and
// ErrUnknownState or ErrInvalidActor for malformed input.
func Check(actor Actor, from, to State) error {
	if !from.Valid() {
		return fmt.Errorf("from: %w: %q", ErrUnknownState, from)
	}
	if !to.Valid() {
		return fmt.Errorf("to: %w: %q", ErrUnknownState, to)
	}
	if _, err := ParseActor(string(actor)); err != nil {
		return err
	}
	legal := false
	for _, n := range transitions[from] {
		if n == to {
			legal = true
			break
		}
	}
	switch {
	case !legal && from.Terminal():
		return &TransitionError{From: from, To: to, Actor: actor, Reason: string(from) + " is terminal"}
	case !legal:
		return &TransitionError{From: from, To: to, Actor: actor, Reason: "not in the transition table"}
	case from == ManualReview && actor.Kind() != Human:
		return &TransitionError{From: from, To: to, Actor: actor, Reason: "only a human may leave manual_review"}
	}
	return nil
}
