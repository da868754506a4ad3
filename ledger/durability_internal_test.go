package ledger

import "testing"

// What a commit means, from the settings and pg_stat_replication's counts.
func TestDurabilityMode(t *testing.T) {
	for _, tc := range []struct {
		name                string
		commit, names       string
		sync, async, hidden int
		recovery            bool
		want                DurabilityMode
		replicated          bool
	}{
		{name: "no standby", commit: "on", want: DurabilityLocal},
		{name: "asynchronous standby", commit: "on", async: 1, want: DurabilityAsync},
		{name: "asynchronous standby hidden", commit: "on", hidden: 1, want: DurabilityAsync},
		{name: "synchronous_commit local", commit: "local", names: "s1", sync: 1, want: DurabilityAsync},
		{name: "synchronous_commit off", commit: "off", names: "s1", sync: 1, want: DurabilityUnflushed},
		{name: "one synchronous", commit: "on", names: "s1", sync: 1, want: DurabilityRemoteFlush, replicated: true},
		{name: "remote_write", commit: "remote_write", names: "s1", sync: 1, want: DurabilityRemoteWrite, replicated: true},
		{name: "remote_apply", commit: "remote_apply", names: "*", sync: 1, want: DurabilityRemoteApply, replicated: true},
		{name: "pg_auto_failover's quorum", commit: "on", names: "ANY 1 (pgautofailover_standby_2)", sync: 1, want: DurabilityRemoteFlush, replicated: true},
		{name: "first 2 with one", commit: "on", names: "FIRST 2 (a, b, c)", sync: 1, async: 1, want: DurabilityWaiting},
		{name: "named standby gone", commit: "on", names: "s1", want: DurabilityWaiting},
		{name: "named standby potential only", commit: "on", names: "2 (a, b)", async: 2, want: DurabilityWaiting},
		{name: "hidden from this login", commit: "on", names: "s1", hidden: 1, want: DurabilityUnknown},
		{name: "a standby", commit: "on", recovery: true, want: DurabilityStandby},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Durability{SynchronousCommit: tc.commit, SynchronousStandbyNames: tc.names,
				Required: requiredStandbys(tc.names), Synchronous: tc.sync, Asynchronous: tc.async, Hidden: tc.hidden}
			d.Mode = durabilityMode(d, tc.recovery)
			if d.Mode != tc.want || d.Replicated() != tc.replicated {
				t.Fatalf("mode %s (replicated %v), want %s (%v): %s", d.Mode, d.Replicated(), tc.want, tc.replicated, d)
			}
		})
	}
}

func TestRequiredStandbys(t *testing.T) {
	for names, want := range map[string]int{"": 0, "  ": 0, "s1": 1, "*": 1, "s1, s2": 1, "2 (s1, s2)": 2,
		"FIRST 3 (a,b,c)": 3, "any 2 (a, b, c)": 2, `"s1"`: 1} {
		if got := requiredStandbys(names); got != want {
			t.Errorf("requiredStandbys(%q) = %d, want %d", names, got, want)
		}
	}
}
