package gateway

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/receiptledger/reconciler/ledger"
)

// unrecordedOutcomes are the outcomes of calls the gateway made whose
// recording failed (the database unreachable, or read-only mid-failover):
// kept in memory and written, with the response kept for replays, as soon
// as the database takes writes again (Run retries them). Each receipt
// stays submitted meanwhile; should the gateway stop first, the
// reconciler's orphan sweep and a readback settle it.
type unrecordedOutcomes struct {
	mu    sync.Mutex
	items map[int64]*unrecordedOutcome
	wake  chan struct{}
}

type unrecordedOutcome struct {
	caller *ledger.Caller
	u      *ledger.Unrecorded
	route  string
	agent  string
	kept   *storedResponse
	since  time.Time
}

func newUnrecordedOutcomes() *unrecordedOutcomes {
	return &unrecordedOutcomes{items: map[int64]*unrecordedOutcome{}, wake: make(chan struct{}, 1)}
}

// keepUnrecorded keeps the outcome of a call whose recording failed.
func (g *Gateway) keepUnrecorded(c *call, caller *ledger.Caller, res *ledger.Result) {
	u := res.Unrecorded
	item := &unrecordedOutcome{caller: caller, u: u, route: c.route.Name, agent: c.agent, since: time.Now()}
	// What the answer left for replays (keep: nothing for an unknown
	// outcome), written once the outcome is.
	item.kept = c.kept
	g.unrecorded.mu.Lock()
	g.unrecorded.items[u.Receipt.ID] = item
	n := len(g.unrecorded.items)
	g.unrecorded.mu.Unlock()
	g.log.Warn("recording a call's outcome failed; the gateway keeps it and records it when the database takes writes again",
		"route", c.route.Name, "agent", c.agent, "receipt_id", u.Receipt.ID, "outcome", u.Verdict.Outcome,
		"http_status", u.HTTPStatus, "kept", n)
	signal(g.unrecorded.wake)
}

// Unrecorded returns how many outcomes the gateway keeps because their
// recording failed, not yet written.
func (g *Gateway) Unrecorded() int {
	g.unrecorded.mu.Lock()
	defer g.unrecorded.mu.Unlock()
	return len(g.unrecorded.items)
}

// RecordUnrecorded writes the kept outcomes the database takes now, and
// returns how many are left.
func (g *Gateway) RecordUnrecorded(ctx context.Context) int {
	g.unrecorded.mu.Lock()
	items := make([]*unrecordedOutcome, 0, len(g.unrecorded.items))
	for _, it := range g.unrecorded.items {
		items = append(items, it)
	}
	g.unrecorded.mu.Unlock()
	for _, it := range items {
		wctx, cancel := context.WithTimeout(ctx, ledger.DefaultSettleTimeout)
		r, err := it.caller.RecordUnrecorded(wctx, it.u)
		cancel()
		if err != nil {
			continue
		}
		id := it.u.Receipt.ID
		if r != nil && it.kept != nil {
			if err := g.store.record(ctx, id, *it.kept, g.cfg.Retention); err != nil {
				g.log.Warn("keeping the response for replays failed", "route", it.route, "receipt_id", id, "error", err)
			}
		}
		state := "kept as a late outcome (the receipt had moved on)"
		if r != nil {
			state = string(r.State)
			signal(g.hooks.wake)
		}
		g.log.Info("a kept outcome was recorded", "route", it.route, "agent", it.agent, "receipt_id", id,
			"outcome", it.u.Verdict.Outcome, "now", state, "kept_for", time.Since(it.since).Round(time.Millisecond))
		g.unrecorded.mu.Lock()
		delete(g.unrecorded.items, id)
		g.unrecorded.mu.Unlock()
	}
	return g.Unrecorded()
}

// unrecordedLoop writes kept outcomes until ctx ends: at once when one is
// kept, then every pause (doubling from 200 ms to 5 s while the database
// refuses).
func (g *Gateway) unrecordedLoop(ctx context.Context) {
	const first, most = 200 * time.Millisecond, 5 * time.Second
	pause := first
	t := time.NewTimer(pause)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			// One last try, bounded: a stop must not wait on a database
			// that does not answer.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledger.DefaultSettleTimeout)
			n := g.RecordUnrecorded(fctx)
			cancel()
			if n > 0 {
				g.log.Error("stopping with outcomes not recorded: their receipts stay submitted until the reconciler's orphan sweep and readback settle them",
					"unrecorded", n)
			}
			return
		case <-g.unrecorded.wake:
		case <-t.C:
		}
		if g.RecordUnrecorded(ctx) > 0 {
			pause = min(2*pause, most)
		} else {
			pause = first
		}
		t.Reset(pause)
	}
}

// unrecordedAnswer answers a call made whose outcome could not be recorded
// yet: what the upstream said, that the gateway keeps it, and that the
// receipt is submitted until it is written.
func (g *Gateway) unrecordedAnswer(w http.ResponseWriter, c *call, res *ledger.Result) {
	u := res.Unrecorded
	g.metrics.request(c.route.Name, outcomeUnknown)
	said := "no answer"
	if u.HTTPStatus != 0 {
		said = "HTTP " + strconv.Itoa(u.HTTPStatus)
	}
	pr := newProblem(ProblemOutcomeUnknown, fmt.Sprintf("the request was sent and the upstream's answer (%s: %s) could not be recorded "+
		"in the ledger (the database did not take the write): the gateway keeps it and records it as soon as the database does; "+
		"until then receipt %d is submitted. Do not send it under another key: wait at wait_url, then send it again with the "+
		"same Idempotency-Key for the recorded answer", said, u.Verdict.Outcome, u.Receipt.ID))
	pr.ReceiptID, pr.ReceiptState, pr.WaitURL = u.Receipt.ID, string(res.Receipt.State), waitURL(u.Receipt.ID)
	pr.Code = string(u.Verdict.Outcome)
	if u.Verdict.Code != "" {
		pr.Code = u.Verdict.Code
	}
	pr.UpstreamStatus = u.HTTPStatus
	writeProblem(w, pr)
}
