package ledger

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/statemachine"
)

// settledChannel is the channel the history trigger notifies (migration
// 00011), with the receipt's id as payload, on every settlement of an
// unknown outcome: a move out of outcome_unknown, reconciling or
// manual_review into a state Await returns on.
const settledChannel = "reconciler_settled"

// In flight (planned, submitted), a receipt is moved on by the agent making
// the call, and those moves send no notification: they are on every call's
// hot path, and the agent that makes them has its answer already. Await
// re-reads such a receipt on a timer, from inFlightFirstPoll doubling to
// inFlightMaxPoll; it stays in flight for at most its send deadline plus
// the call, or until the orphan sweep moves it to outcome_unknown.
const (
	inFlightFirstPoll = 10 * time.Millisecond
	inFlightMaxPoll   = time.Second
)

// Awaiting reports whether Await keeps waiting on a receipt in state s:
// planned, submitted, outcome_unknown and reconciling, the states whose
// outcome nobody knows yet. Await returns on every other state: succeeded,
// safe_to_retry, rejected, and manual_review (held for a human, which can
// take days: the caller decides whether to wait for that).
func Awaiting(s statemachine.State) bool {
	switch s {
	case statemachine.Planned, statemachine.Submitted, statemachine.OutcomeUnknown, statemachine.Reconciling:
		return true
	}
	return false
}

// Await returns the receipt with id once it is no longer Awaiting: settled
// (succeeded, safe_to_retry, rejected) or held for a human (manual_review).
// A settlement by the reconciler or a reviewer wakes it through the
// database's NOTIFY, not by polling: every client made from one New (As,
// WithSecretKey) shares one dedicated connection that LISTENs while at
// least one Await is waiting, and closes it when none is. A receipt still
// in flight (planned or submitted, moved on by its agent without a
// notification) is re-read every 10 ms, doubling to 1 s, until it is not.
// A receipt already settled is returned at once, without that connection.
//
// When ctx ends first, Await returns the receipt as last read and an error
// that matches ctx.Err() (and carries the listener's last error, if its
// connection failed); ErrNotFound when there is no such receipt.
func (c *Client) Await(ctx context.Context, id int64) (*Receipt, error) {
	r, err := c.Get(ctx, id)
	if err != nil || !Awaiting(r.State) {
		return r, err
	}
	wake, ready, listenErr, done := c.settled.register(id)
	defer done()
	waitFor := ready
	poll := time.NewTimer(inFlightFirstPoll)
	defer poll.Stop()
	pause := inFlightFirstPoll
	for {
		if inFlight(r.State) {
			poll.Reset(pause)
			pause = min(2*pause, inFlightMaxPoll)
		} else {
			poll.Stop()
		}
		select {
		case <-poll.C:
		case <-ctx.Done():
			if lerr := listenErr(); lerr != nil {
				return r, fmt.Errorf("ledger: await receipt %d: still %s: %w (listener: %w)", id, r.State, ctx.Err(), lerr)
			}
			return r, fmt.Errorf("ledger: await receipt %d: still %s: %w", id, r.State, ctx.Err())
		case <-waitFor:
			// LISTEN is in effect from here on: read the state again, so
			// a settlement between the first read and the LISTEN (or
			// during a reconnection) is not missed.
			waitFor = wake
		case <-wake:
		}
		cur, err := c.Get(ctx, id)
		if err != nil {
			if ctx.Err() != nil {
				continue // reported above with the state last read
			}
			return r, err
		}
		if r = cur; !Awaiting(r.State) {
			return r, nil
		}
	}
}

// inFlight reports whether a receipt in state s is still moved on by the
// agent making its call, without a notification.
func inFlight(s statemachine.State) bool {
	return s == statemachine.Planned || s == statemachine.Submitted
}

// settlements fans the notifications of one dedicated LISTEN connection out
// to the Await calls waiting on each receipt. The connection is opened when
// the first waiter registers and closed when the last one leaves, so an idle
// client holds none.
type settlements struct {
	pool *pgxpool.Pool

	mu      sync.Mutex
	waiters map[int64]map[chan struct{}]struct{}
	count   int
	session *listenSession // nil while nobody waits
}

// listenSession is one period during which somebody waits: one goroutine
// keeps a LISTEN connection open (reconnecting after a failure) until it
// is canceled.
type listenSession struct {
	cancel context.CancelFunc
	// ready is closed the first time LISTEN is in effect.
	ready chan struct{}
	once  sync.Once

	mu      sync.Mutex
	lastErr error
}

func newSettlements(pool *pgxpool.Pool) *settlements {
	return &settlements{pool: pool, waiters: map[int64]map[chan struct{}]struct{}{}}
}

// register adds a waiter on receipt id. It returns the channel a
// notification for id (or a reconnection, after which the state must be
// read again) signals, a channel closed once LISTEN is in effect, the
// listener's last connection error, and the function that removes the
// waiter.
func (s *settlements) register(id int64) (wake chan struct{}, ready <-chan struct{}, listenErr func() error, done func()) {
	wake = make(chan struct{}, 1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.waiters[id] == nil {
		s.waiters[id] = map[chan struct{}]struct{}{}
	}
	s.waiters[id][wake] = struct{}{}
	s.count++
	if s.session == nil {
		ctx, cancel := context.WithCancel(context.Background())
		s.session = &listenSession{cancel: cancel, ready: make(chan struct{})}
		go s.listen(ctx, s.session)
	}
	sess := s.session
	return wake, sess.ready, sess.err, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.waiters[id], wake)
		if len(s.waiters[id]) == 0 {
			delete(s.waiters, id)
		}
		if s.count--; s.count == 0 && s.session != nil {
			s.session.cancel()
			s.session = nil
		}
	}
}

func (ls *listenSession) err() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.lastErr
}

// listen keeps a LISTEN connection open until ctx ends, pausing between
// failed attempts (100 ms, doubling up to 5 s).
func (s *settlements) listen(ctx context.Context, ls *listenSession) {
	pause := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := s.listenOnce(ctx, ls)
		if ctx.Err() != nil {
			return
		}
		ls.mu.Lock()
		ls.lastErr = err
		ls.mu.Unlock()
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		pause = min(2*pause, 5*time.Second)
	}
}

// listenOnce opens a connection of its own (not one of the pool's: a
// LISTENing session must not be handed to another user), LISTENs, wakes
// every waiter to read its receipt again (settlements made before the
// LISTEN are not notified to it), and dispatches notifications until the
// connection fails or ctx ends.
func (s *settlements) listenOnce(ctx context.Context, ls *listenSession) error {
	conn, err := pgx.ConnectConfig(ctx, s.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+settledChannel); err != nil {
		return err
	}
	ls.once.Do(func() { close(ls.ready) })
	s.wakeAll()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Channel != settledChannel {
			continue
		}
		// A payload that is no receipt id was not sent by the trigger.
		if id, err := strconv.ParseInt(n.Payload, 10, 64); err == nil {
			s.wake(id)
		}
	}
}

func (s *settlements) wake(id int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.waiters[id] {
		signal(ch)
	}
}

func (s *settlements) wakeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, set := range s.waiters {
		for ch := range set {
			signal(ch)
		}
	}
}

// signal wakes a waiter without blocking: one pending wake-up is enough,
// the waiter reads the receipt's state anyway.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
