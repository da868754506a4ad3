package main

import (
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/time/rate"

	"github.com/receiptledger/reconciler/internal/protect"
	"github.com/receiptledger/reconciler/readback"
)

const limitsFile = `version: 1
adapters:
  - {name: gh, type: static, kind: create, dependency: github, static: {verdict: present}}
  - {name: pay, type: static, kind: create, dependency: stripe, static: {verdict: present}}
  - {name: shop, type: static, kind: create, dependency: shop, static: {verdict: present}}
  - {name: mail, type: blind, dependency: mailer}
dependencies:
  github:
    rate: 1
    burst: 5
    concurrency: 2
    breaker: {failures: 3, cooldown: 10m}
    retry_budget: {ratio: 0.5, min: 0}
    degraded: {enter: 0.4, concurrency: 1}
  stripe:
    rate: 20
  shop:
    rate: .inf
    degraded: {exit: 0.1}
`

// flagPolicyOf parses args as run's flags and returns flagPolicy.
func flagPolicyOf(t *testing.T, args ...string) protect.Policy {
	t.Helper()
	var p protect.Policy
	app := &cli.App{Flags: runFlags(), Writer: io.Discard, ErrWriter: io.Discard, Action: func(c *cli.Context) error {
		p = flagPolicy(c)
		return nil
	}}
	if err := app.Run(append([]string{"run", "--database-url", "postgres://unused"}, args...)); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProtectConfig(t *testing.T) {
	reg, err := readback.Load("adapters.yaml", strings.NewReader(limitsFile), nil)
	if err != nil {
		t.Fatal(err)
	}
	def := flagPolicyOf(t, "--dependency-rate", "3", "--dependency-burst", "6", "--breaker-failures", "7")
	cfg, err := protectConfig("i-1", def, "adapters.yaml", reg.Dependencies())
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Instance != "i-1" {
		t.Errorf("Instance = %q", cfg.Instance)
	}

	// The flags are the default policy, for every dependency not listed.
	want := protect.DefaultPolicy()
	want.Rate.Limit, want.Rate.Burst, want.Breaker.FailureThreshold = 3, 6, 7
	if cfg.Default != want {
		t.Errorf("Default = %+v\nwant      %+v", cfg.Default, want)
	}
	if len(cfg.Dependencies) != 3 {
		t.Fatalf("Dependencies = %v, want github, stripe and shop", cfg.Dependencies)
	}

	gh := want
	gh.Rate.Limit, gh.Rate.Burst = 1, 5
	gh.Concurrency.MaxInFlight = 2
	gh.Breaker.FailureThreshold, gh.Breaker.Cooldown = 3, 10*time.Minute
	gh.Breaker.MaxCooldown = 10 * time.Minute // raised to the cool-down
	gh.RetryBudget.Ratio, gh.RetryBudget.MinRetries = 0.5, 0
	gh.Degraded.EnterRate, gh.Degraded.ExitRate = 0.4, 0.2 // exit: half of enter
	gh.Degraded.MaxInFlight = 1
	if got := cfg.Dependencies["github"]; got != gh {
		t.Errorf("github = %+v\nwant     %+v", got, gh)
	}

	st := want
	st.Rate.Limit = 20 // everything else from the flags
	if got := cfg.Dependencies["stripe"]; got != st {
		t.Errorf("stripe = %+v\nwant     %+v", got, st)
	}

	sh := want
	sh.Rate.Limit = rate.Inf
	sh.Degraded.ExitRate = 0.1
	if got := cfg.Dependencies["shop"]; got != sh {
		t.Errorf("shop = %+v\nwant   %+v", got, sh)
	}
	if l := cfg.Dependencies["shop"].Rate.Limit; l != rate.Inf || math.IsInf(float64(l), 0) {
		t.Errorf("rate .inf maps to %v, want rate.Inf", l)
	}

	// The guard accepts it.
	if _, err := protect.New(protect.NewMemStore(), cfg, nil, nil); err != nil {
		t.Fatal(err)
	}
}

func TestProtectConfigNoFile(t *testing.T) {
	cfg, err := protectConfig("i", flagPolicyOf(t, "--breaker-cooldown", "10m"), "", readback.NewRegistry().Dependencies())
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Dependencies != nil {
		t.Errorf("Dependencies = %v, want none", cfg.Dependencies)
	}
	// A cool-down beyond the default cap raises the cap instead of failing.
	if b := cfg.Default.Breaker; b.Cooldown != 10*time.Minute || b.MaxCooldown != 10*time.Minute {
		t.Errorf("breaker = %+v", b)
	}
}

func TestProtectConfigErrors(t *testing.T) {
	ptr := func(v int) *int { return &v }
	fptr := func(v float64) *float64 { return &v }
	dptr := func(v time.Duration) *time.Duration { return &v }
	tests := []struct {
		name   string
		limits readback.DependencyLimits
		want   string
	}{
		{"degraded above the flag concurrency", readback.DependencyLimits{Line: 12, DegradedConcurrency: ptr(9)},
			`adapters.yaml:12: dependency "github": degraded.concurrency: must not exceed concurrency (8, from --dependency-concurrency)`},
		{"exit above the default enter", readback.DependencyLimits{Line: 12, DegradedExit: fptr(0.3)},
			`adapters.yaml:12: dependency "github": degraded.exit: must not exceed degraded.enter (0.2 by default)`},
		{"max cooldown below the flag cooldown", readback.DependencyLimits{Line: 12, BreakerMaxCooldown: dptr(10 * time.Second)},
			`adapters.yaml:12: dependency "github": breaker.max_cooldown: must be at least the cooldown (30s, from --breaker-cooldown)`},
		{"backstop", readback.DependencyLimits{Line: 12, Rate: fptr(-1)},
			`adapters.yaml:12: dependency "github": with the flag defaults: protect: config: Policy.Rate.Limit`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := protectConfig("i", flagPolicyOf(t), "adapters.yaml", map[string]readback.DependencyLimits{"github": tt.limits})
			var ce *readback.ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, readback.ErrInvalidConfig) {
				t.Fatalf("error %v is not a ConfigError", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
		})
	}

	// Bad flags are not the file's fault.
	_, err := protectConfig("i", flagPolicyOf(t, "--dependency-concurrency", "0"), "adapters.yaml", nil)
	var ce *readback.ConfigError
	if err == nil || errors.As(err, &ce) || !strings.Contains(err.Error(), "protection flags") {
		t.Errorf("bad flag: %v", err)
	}
}

func TestAdaptersCheckPrintsLimits(t *testing.T) {
	path := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(path, []byte(limitsFile), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "", "adapters", "check", "--config", path)
	if code != 0 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	if !strings.Contains(out, "protection of each dependency") {
		t.Errorf("no protection table:\n%s", out)
	}
	rows := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			rows[f[0]] = strings.Join(f, " ")
		}
	}
	for dep, want := range map[string]string{
		"github": "github 2 1/s 5 50% of 20+ calls per 30s or 3 in a row, 10m0s cooldown (max 10m0s) 50%, min 0 per 1m0s at 40% (exit 20%), 1 in flight file+flags",
		"shop":   "shop 8 unlimited - 50% of 20+ calls per 30s, 30s cooldown (max 5m0s) 50%, min 10 per 1m0s at 20% (exit 10%), 1 in flight file+flags",
		"stripe": "stripe 8 20/s 20 50% of 20+ calls per 30s, 30s cooldown (max 5m0s) 50%, min 10 per 1m0s at 20% (exit 10%), 1 in flight file+flags",
	} {
		if rows[dep] != want {
			t.Errorf("row of %s = %q\nwant        %q", dep, rows[dep], want)
		}
	}
	if strings.Count(out, "mailer") != 1 { // its adapter row only
		t.Errorf("a blind adapter's dependency has no protection row:\n%s", out)
	}

	// Limits run would refuse with its default flags fail the check.
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	src := "version: 1\nadapters:\n  - {name: gh, type: static, kind: create, dependency: github, static: {verdict: present}}\n" +
		"dependencies:\n  github: {degraded: {concurrency: 20}}\n"
	if err := os.WriteFile(bad, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = runCLI(t, "", "adapters", "check", "--config", bad)
	if code != 1 || !strings.Contains(errOut, `bad.yaml:5: dependency "github": degraded.concurrency: must not exceed concurrency (8`) ||
		strings.Contains(out, "valid") {
		t.Errorf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
