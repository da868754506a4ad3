package protect

import (
	"strings"
	"testing"
	"time"
)

func TestDefaultConfigIsValid(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	if err := DefaultPolicy().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Config)
		want []string // substrings of the error
	}{
		{"zero config", func(c *Config) { *c = Config{} }, []string{
			"SharedRefresh must be > 0", "StoreTimeout must be > 0",
			"Default.Breaker.MinCalls must be >= 1, got 0",
			"Default.Breaker.FailureRate must be in (0, 1], got 0",
			"Default.Breaker.Cooldown must be > 0",
			"Default.Concurrency.MaxInFlight must be >= 1",
			"Default.Rate.Limit must be > 0",
			"Default.Degraded.MinCalls must be >= 1",
		}},
		{"growth below 1", func(c *Config) { c.Default.Breaker.CooldownGrowth = 0.5 }, []string{"Default.Breaker.CooldownGrowth must be >= 1"}},
		{"max cooldown below cooldown", func(c *Config) { c.Default.Breaker.MaxCooldown = time.Second }, []string{"Default.Breaker.MaxCooldown must be >= Cooldown (30s), got 1s"}},
		{"negative rate", func(c *Config) { c.Default.Rate.Limit = -1 }, []string{"Default.Rate.Limit must be > 0"}},
		{"zero burst", func(c *Config) { c.Default.Rate.Burst = 0 }, []string{"Default.Rate.Burst must be >= 1"}},
		{"negative budget", func(c *Config) { c.Default.RetryBudget.Ratio = -0.1 }, []string{"Default.RetryBudget.Ratio must be >= 0"}},
		{"tiny window", func(c *Config) { c.Default.RetryBudget.Window = time.Millisecond }, []string{"Default.RetryBudget.Window must be >= 12ms"}},
		{"enter rate above 1", func(c *Config) { c.Default.Degraded.EnterRate = 1.5 }, []string{"Default.Degraded.EnterRate must be in (0, 1]"}},
		{"exit above enter", func(c *Config) { c.Default.Degraded.ExitRate = 0.9 }, []string{"Default.Degraded.ExitRate must be in [0, EnterRate=0.2], got 0.9"}},
		{"degraded limit above normal", func(c *Config) { c.Default.Degraded.MaxInFlight = 9 }, []string{"Default.Degraded.MaxInFlight must be <= Concurrency.MaxInFlight (8), got 9"}},
		{"per-dependency policy", func(c *Config) {
			p := c.Default
			p.Concurrency.BusyDelay = 0
			c.Dependencies = map[string]Policy{"blog-api": p}
		}, []string{`Dependencies["blog-api"].Concurrency.BusyDelay must be > 0`}},
		{"empty dependency name", func(c *Config) { c.Dependencies = map[string]Policy{"": c.Default} }, []string{"Dependencies has an empty dependency name"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			tc.edit(&cfg)
			err := cfg.Validate()
			if err == nil {
				t.Fatal("valid, want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			if _, nerr := New(NewMemStore(), cfg, nil, nil); nerr == nil {
				t.Error("New accepted an invalid config")
			}
		})
	}
}

func TestNewRefusesNilStoreAndNamesTheInstance(t *testing.T) {
	if _, err := New(nil, DefaultConfig(), nil, nil); err == nil || !strings.Contains(err.Error(), "nil Store") {
		t.Fatalf("nil store: %v", err)
	}
	g, err := New(NewMemStore(), DefaultConfig(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if g.Instance() == "" || !strings.Contains(g.Instance(), ":") {
		t.Fatalf("default instance %q", g.Instance())
	}
	cfg := DefaultConfig()
	cfg.Instance = "reconciler-7"
	if g, _ := New(NewMemStore(), cfg, nil, nil); g.Instance() != "reconciler-7" {
		t.Fatalf("instance %q", g.Instance())
	}
}

func TestCooldownGrowth(t *testing.T) {
	b := DefaultPolicy().Breaker
	for n, want := range []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute} {
		if got := cooldown(b, n); got != want {
			t.Errorf("cooldown after %d failed probes = %v, want %v", n, got, want)
		}
	}
	if got := cooldown(b, 10000); got != b.MaxCooldown {
		t.Errorf("cooldown after many failed probes = %v", got)
	}
}
