package ledger

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pglisten"
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
// least one Await is waiting (or NotifySettled relays), and closes it when
// none is. A receipt still in flight (planned or submitted, moved on by its
// agent without a notification) is re-read every 10 ms, doubling to 1 s,
// until it is not.
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
	wake := make(chan struct{}, 1)
	listenErr, done := c.settled.register(id, wake, c.log)
	defer done()
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
		case <-wake:
			// A settlement of id, or LISTEN (again) in effect: read the
			// state again, so a settlement between the first read and
			// the LISTEN (or during a reconnection) is not missed.
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

// NotifySettled relays to ch, until ctx ends, a value whenever receipts
// may have settled: on every settlement notified (of any receipt, as Await
// is woken by them), and each time the connection Await shares starts
// listening, at once if it already does, since a settlement made while
// it did not was not notified. On each value, read what you are watching
// again: the value says "look again", not which receipt. Like
// signal.Notify, NotifySettled never blocks sending to ch: give it a
// buffer of one. While ctx lasts, that connection stays open.
func (c *Client) NotifySettled(ctx context.Context, ch chan<- struct{}) {
	if ctx.Err() != nil {
		return
	}
	_, done := c.settled.register(everyReceipt, ch, c.log)
	context.AfterFunc(ctx, done)
}

// inFlight reports whether a receipt in state s is still moved on by the
// agent making its call, without a notification.
func inFlight(s statemachine.State) bool {
	return s == statemachine.Planned || s == statemachine.Submitted
}

// settlements fans the notifications of one dedicated LISTEN connection
// out to the Await calls waiting on each receipt and to NotifySettled's
// channels. The connection is opened when the first waiter registers and
// closed when the last one leaves, so an idle client holds none.
type settlements struct {
	pool *pgxpool.Pool

	mu      sync.Mutex
	waiters map[int64]map[*waiter]struct{} // by receipt id, everyReceipt for all
	count   int
	session *listenSession // nil while nobody waits
}

// everyReceipt registers a waiter woken by every settlement (receipt ids
// start at 1).
const everyReceipt int64 = 0

// waiter is one registration: its channel is signalled, never blocked on.
type waiter struct{ wake chan<- struct{} }

// listenSession is one period during which somebody waits: a listener
// keeps a LISTEN connection open (reconnecting after a failure) until it
// is canceled.
type listenSession struct {
	cancel   context.CancelFunc
	listener *pglisten.Listener
	// listening is set once LISTEN has first taken effect.
	listening bool
}

func newSettlements(pool *pgxpool.Pool) *settlements {
	return &settlements{pool: pool, waiters: map[int64]map[*waiter]struct{}{}}
}

// register adds a waiter on receipt id (everyReceipt: on all). Its wake
// channel is signalled once LISTEN is in effect (at once if it already
// is), on every notification for id, and after every reconnection: each
// time, whatever was read before must be read again. register returns the
// listener's last connection error and the function that removes the
// waiter.
func (s *settlements) register(id int64, wake chan<- struct{}, log *slog.Logger) (listenErr func() error, done func()) {
	w := &waiter{wake: wake}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.waiters[id] == nil {
		s.waiters[id] = map[*waiter]struct{}{}
	}
	s.waiters[id][w] = struct{}{}
	s.count++
	if s.session == nil {
		s.session = s.listen(log)
	} else if s.session.listening {
		signal(wake)
	}
	return s.session.listener.Err, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.waiters[id], w)
		if len(s.waiters[id]) == 0 {
			delete(s.waiters, id)
		}
		if s.count--; s.count == 0 {
			s.session.cancel()
			s.session = nil
		}
	}
}

// listen starts a session's listener, which logs its failures to log (nil:
// nowhere); s.mu is held.
func (s *settlements) listen(log *slog.Logger) *listenSession {
	ctx, cancel := context.WithCancel(context.Background())
	ls := &listenSession{cancel: cancel}
	ls.listener = pglisten.New(s.pool, []string{settledChannel}, pglisten.Options{
		OnListen: func() { s.listened(ls) },
		OnNotify: s.notified,
		Logger:   log,
	})
	go ls.listener.Run(ctx)
	return ls
}

// listened wakes every waiter to read its receipt again: settlements made
// before the LISTEN took effect were not notified to it.
func (s *settlements) listened(ls *listenSession) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ls.listening = true
	if s.session != ls {
		return // a session already canceled
	}
	for _, set := range s.waiters {
		for w := range set {
			signal(w.wake)
		}
	}
}

// notified wakes the waiters on the notified receipt and on every receipt.
func (s *settlements) notified(n pglisten.Notification) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// A payload that is no receipt id was not sent by the trigger.
	if id, err := strconv.ParseInt(n.Payload, 10, 64); err == nil && id != everyReceipt {
		for w := range s.waiters[id] {
			signal(w.wake)
		}
	}
	for w := range s.waiters[everyReceipt] {
		signal(w.wake)
	}
}

// signal wakes a waiter without blocking: one pending wake-up is enough,
// the waiter reads the receipt's state anyway.
func signal(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
