package reconcile

import (
	"testing"
	"time"
)

// The claim size follows the measured cost of a row: one row beyond the
// workers until a check is measured, the checks the workers finish in
// PrefetchFor after, and a full batch for checks that cost microseconds.
func TestPrefetchFollowsTheCostOfARow(t *testing.T) {
	cfg := Config{Workers: 32, BatchSize: 512, PrefetchFor: 100 * time.Millisecond}.withDefaults()
	s := &session{p: &Pool{cfg: cfg}}
	if got := s.prefetch(); got != 1 {
		t.Fatalf("before any check: prefetch %d, want 1", got)
	}
	s.measure(100 * time.Millisecond)
	if got := s.prefetch(); got != 32 {
		t.Fatalf("checks of 100 ms: prefetch %d, want 32 (32 workers × 100 ms / 100 ms)", got)
	}
	// A slower row moves the average by an eighth of the difference.
	s.measure(900 * time.Millisecond)
	if got := s.rowCost.Load(); got != int64(200*time.Millisecond) {
		t.Fatalf("average %v, want 200ms", time.Duration(got))
	}
	if got := s.prefetch(); got != 16 {
		t.Fatalf("checks of 200 ms: prefetch %d, want 16", got)
	}
	for range 100 {
		s.measure(5 * time.Microsecond)
	}
	if got := s.prefetch(); got != 512 {
		t.Fatalf("checks of microseconds: prefetch %d, want the batch size", got)
	}
	for range 100 {
		s.measure(time.Minute)
	}
	if got := s.prefetch(); got != 1 {
		t.Fatalf("checks of a minute: prefetch %d, want 1", got)
	}
}
