package integration

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TestFaults runs the fault tests of issue 9 (item 5) against one build of
// `reconciler run`: each starts real daemon processes over a backlog whose
// truth truthAPI knows, injects one fault, waits for every receipt to
// settle (bounded), and checks each history and each verdict against the
// truth. Each logs its figures (t.Logf); docs/reliability.md quotes them.
func TestFaults(t *testing.T) {
	bin := buildBinary(t)
	t.Run("SigkillLoop", func(t *testing.T) { testSigkillLoop(t, bin) })
	t.Run("DatabaseRestart", func(t *testing.T) { testDatabaseRestart(t, bin) })
	t.Run("SeveralInstances", func(t *testing.T) { testSeveralInstances(t, bin) })
	t.Run("FlakyLink", func(t *testing.T) { testFlakyLink(t, bin) })
	t.Run("PartialOutage", func(t *testing.T) { testPartialOutage(t, bin) })
}

// faultSeed is the seed of a fault run's random choices: def, or
// RECONCILER_FAULT_SEED to replay or vary a run. Every run logs its seed.
func faultSeed(t *testing.T, def uint64) uint64 {
	t.Helper()
	seed := def
	if s := os.Getenv("RECONCILER_FAULT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("RECONCILER_FAULT_SEED: %v", err)
		}
		seed = v
	}
	t.Logf("seed %d (RECONCILER_FAULT_SEED replays it)", seed)
	return seed
}

// waitSettled waits, at most within, until no receipt of truth is open.
func waitSettled(t *testing.T, db *pgxpool.Pool, truth map[int64]bool, within time.Duration) {
	t.Helper()
	waitFor(t, within, "every receipt settled", func() (bool, string) {
		n := unsettled(t, db, truth)
		return n == 0, strconv.Itoa(n) + " unsettled"
	})
}
