package readback

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"go.yaml.in/yaml/v3"
)

// Static is an adapter that gives the same answer for every receipt without
// calling anything: the benchmark's no-op "present" adapter, and a way to
// exercise a deployment end to end before a real adapter exists.
type Static struct {
	Verdict       Verdict
	Authoritative bool
	// ExternalID is the id reported with a present answer; empty means
	// "static-<receipt id>".
	ExternalID string
	// Delay makes each answer take this long (honouring cancellation): a
	// stand-in for a slow API in load and shutdown drills.
	Delay time.Duration
}

// Check returns the fixed answer.
func (s Static) Check(ctx context.Context, r Receipt) (Result, error) {
	if s.Delay > 0 {
		t := time.NewTimer(s.Delay)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return Result{}, TransientError(ctx.Err(), 0)
		case <-t.C:
		}
	}
	res := Result{Verdict: s.Verdict, Authoritative: s.Authoritative, Query: "static"}
	if s.Verdict == VerdictPresent {
		id := s.ExternalID
		if id == "" {
			id = "static-" + strconv.FormatInt(r.ID, 10)
		}
		res.ExternalIDs = []string{id}
	}
	return res, nil
}

// Local reports true: a static answer calls nothing.
func (Static) Local() bool { return true }

type staticYAML struct {
	Verdict       Verdict   `yaml:"verdict"`
	Authoritative bool      `yaml:"authoritative"`
	ExternalID    string    `yaml:"external_id"`
	Delay         *duration `yaml:"delay"`
}

func newStatic(_ string, n *yaml.Node) (Adapter, error) {
	if n == nil {
		return nil, &FieldError{Field: "verdict", Err: errors.New("is required")}
	}
	if err := checkKeys(n, []string{"verdict", "authoritative", "external_id", "delay"}); err != nil {
		return nil, &FieldError{Field: err.field, Err: err.err}
	}
	if v := mapValue(n, "delay"); v != nil {
		var d duration
		if err := d.UnmarshalYAML(v); err != nil {
			return nil, &FieldError{Field: "delay", Err: err}
		}
	}
	var s staticYAML
	if err := n.Decode(&s); err != nil {
		return nil, err
	}
	if !s.Verdict.Valid() {
		return nil, &FieldError{Field: "verdict", Err: fmt.Errorf("%q is not one of present, absent, inconclusive, diverged", s.Verdict)}
	}
	st := Static{Verdict: s.Verdict, Authoritative: s.Authoritative, ExternalID: s.ExternalID}
	if s.Delay != nil {
		st.Delay = time.Duration(*s.Delay)
	}
	return st, nil
}
