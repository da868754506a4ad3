package statemachine

import (
	"errors"
	"testing"
)

// legal is written out independently of the package's table: the test fails
// if the table drifts from SPEC §3.
var legal = map[[2]State]bool{
	{Planned, Submitted}: true, {Planned, Rejected}: true,
	{Submitted, Succeeded}: true, {Submitted, Rejected}: true, {Submitted, OutcomeUnknown}: true,
	{OutcomeUnknown, Reconciling}: true, {OutcomeUnknown, ManualReview}: true,
	{Reconciling, Succeeded}: true, {Reconciling, SafeToRetry}: true, {Reconciling, ManualReview}: true,
	{ManualReview, Succeeded}: true, {ManualReview, SafeToRetry}: true,
	{ManualReview, Rejected}: true, {ManualReview, OutcomeUnknown}: true,
	{SafeToRetry, OutcomeUnknown}: true, // a fresh proof (SPEC §5a)
}

// Legal reports whether the spec allows from -> to for some actor.
func TestMatrix(t *testing.T) {
	for _, from := range States() {
		for _, to := range States() {
			want := legal[[2]State{from, to}]
			for _, actor := range []Actor{"agent:a", "reconciler:r1", "human:ann"} {
				err := Check(actor, from, to)
				ok := want && (from != ManualReview || actor.Kind() == Human)
				if ok && err != nil {
					t.Errorf("%s: %s -> %s refused: %v", actor, from, to, err)
				}
				if !ok {
					var te *TransitionError
					if !errors.Is(err, ErrIllegalTransition) || !errors.As(err, &te) || te.From != from || te.To != to {
						t.Errorf("%s: %s -> %s: got %v, want a TransitionError naming the move", actor, from, to, err)
					}
				}
			}
		}
	}
}

func TestBadInput(t *testing.T) {
	tests := []struct {
		name     string
		actor    Actor
		from, to State
		want     error
	}{
		{"unknown from", "agent:a", "done", Submitted, ErrUnknownState},
		{"unknown to", "agent:a", Planned, "sent", ErrUnknownState},
		{"actor without id", "agent:", Planned, Submitted, ErrInvalidActor},
		{"actor without kind", "bob", Planned, Submitted, ErrInvalidActor},
		{"unknown kind", "robot:x", Planned, Submitted, ErrInvalidActor},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := Check(tt.actor, tt.from, tt.to); !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
}

func TestParseState(t *testing.T) {
	for _, s := range States() {
		if got, err := ParseState(string(s)); err != nil || got != s {
			t.Errorf("ParseState(%q) = %q, %v", s, got, err)
		}
	}
	if _, err := ParseState("failed"); !errors.Is(err, ErrUnknownState) {
		t.Errorf("ParseState(failed) = %v, want ErrUnknownState", err)
	}
}

func TestUnresolvedAndTerminal(t *testing.T) {
	unresolved := map[State]bool{Submitted: true, OutcomeUnknown: true, Reconciling: true, ManualReview: true}
	terminal := map[State]bool{Succeeded: true, Rejected: true}
	for _, s := range States() {
		if s.Unresolved() != unresolved[s] {
			t.Errorf("%s.Unresolved() = %v", s, s.Unresolved())
		}
		if s.Terminal() != terminal[s] {
			t.Errorf("%s.Terminal() = %v", s, s.Terminal())
		}
	}
}
