package readback

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"time"

	"go.yaml.in/yaml/v3"
)

// Retention is the retention policy of the adapters file's top-level
// `retention` mapping (`retention: {settled: 90d, history: 1y}`): how long
// a settled receipt, and then its history, stays in the ledger at the
// least (package retention, `reconciler archive`).
type Retention struct {
	Settled time.Duration
	History time.Duration
}

// Retention returns the file's retention policy, and false when the file
// declares none.
func (r *Registry) Retention() (Retention, bool) {
	if r.retention == nil {
		return Retention{}, false
	}
	return *r.retention, true
}

// RequestHorizon is the longest time after a call's send deadline that
// its effect or its answer can still arrive, for any adapter: the request
// lifetime plus the consistency window, or the native idempotency key's
// retention where it is longer. Retention keeps a receipt at least this
// long after its send deadline.
func (r *Registry) RequestHorizon() time.Duration {
	h := DefaultPolicy().MaxRequestLifetime + DefaultPolicy().ConsistencyWindow
	for _, b := range r.all {
		h = max(h, b.Policy.MaxRequestLifetime+b.Policy.ConsistencyWindow)
		if b.Policy.IdempotencyKeys {
			h = max(h, b.Policy.IdempotencyRetention)
		}
	}
	return h
}

// ParseAge parses an age of the retention policy: a Go duration ("36h"),
// or a whole number of days, weeks or years ("90d", "2w", "1y"; a year is
// 365 days).
func ParseAge(s string) (time.Duration, error) {
	if m := ageRE().FindStringSubmatch(s); m != nil {
		n, err := strconv.ParseInt(m[1], 10, 64)
		if err == nil && n <= 1000*365 {
			unit := map[string]time.Duration{"d": 24 * time.Hour, "w": 7 * 24 * time.Hour, "y": 365 * 24 * time.Hour}[m[2]]
			return time.Duration(n) * unit, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("want an age such as 90d, 1y or 36h, got %q", s)
	}
	return d, nil
}

func ageRE() *regexp.Regexp { return regexp.MustCompile(`^([0-9]+)([dwy])$`) }

// loadRetention decodes the retention mapping: both ages positive, the
// history at least as long as the receipts.
func loadRetention(n *yaml.Node) (*Retention, *keyError) {
	if n.Kind != yaml.MappingNode {
		return nil, &keyError{field: "retention", line: n.Line, err: errors.New("must be a mapping of settled and history")}
	}
	if err := checkKeys(n, []string{"settled", "history"}); err != nil {
		err.field = "retention." + err.field
		return nil, err
	}
	var r Retention
	for _, f := range []struct {
		key string
		dst *time.Duration
	}{{"settled", &r.Settled}, {"history", &r.History}} {
		v := mapValue(n, f.key)
		if v == nil {
			return nil, &keyError{field: "retention." + f.key, line: n.Line, err: errors.New("is required")}
		}
		d, err := ParseAge(v.Value)
		if err == nil && d <= 0 {
			err = errors.New("must be positive")
		}
		if err != nil {
			return nil, &keyError{field: "retention." + f.key, line: v.Line, err: err}
		}
		*f.dst = d
	}
	if r.History < r.Settled {
		return nil, &keyError{field: "retention.history", line: lineOf(n, "history"),
			err: fmt.Errorf("must be at least retention.settled (%s): history outlives its receipt", r.Settled)}
	}
	return &r, nil
}
