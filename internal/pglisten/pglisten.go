// Package pglisten keeps one PostgreSQL session LISTENing on a set of
// channels for as long as a context lasts, and tells its owner of every
// notification and of every moment LISTEN (again) takes effect.
//
// NOTIFY is fire and forget: a notification sent while no session listens
// is lost. An owner therefore treats a notification as a hint to read the
// database again, never as the data itself, and reads again each time
// OnListen says LISTEN has taken effect: the first time, and after every
// reconnection.
package pglisten

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Notification is one NOTIFY received on a listened channel.
type Notification struct {
	Channel string
	Payload string
}

// Options are a Listener's collaborators; every field may be left zero.
type Options struct {
	// OnListen is called each time LISTEN has taken effect on a new
	// connection. Every notification sent from then on reaches OnNotify;
	// those sent before, while no connection listened, are lost, so the
	// owner reads again whatever they would have announced.
	OnListen func()
	// OnNotify is called with each notification, in the order received.
	// OnListen and OnNotify run on Run's goroutine: they must not block.
	OnNotify func(Notification)
	// Logger receives a warning on each failure (default: discard).
	Logger *slog.Logger
	// FirstPause is the pause before reconnecting after a failure
	// (default 100 ms). It doubles with each further failure up to
	// MaxPause (default 5 s), and starts over once LISTEN takes effect.
	FirstPause, MaxPause time.Duration
	// After returns a channel that receives once d has passed (default
	// time.After). Tests inject it to see the pauses without waiting.
	After func(d time.Duration) <-chan time.Time
}

// Listener keeps a dedicated connection LISTENing; see Run.
type Listener struct {
	pool     *pgxpool.Pool
	channels []string
	opts     Options

	mu      sync.Mutex
	lastErr error
}

// New returns a listener on channels (at least one) over connections
// taken from pool. Channels are written as given when they are lower-case
// identifiers, as the notifying triggers name them, and quoted otherwise.
func New(pool *pgxpool.Pool, channels []string, opts Options) *Listener {
	if opts.OnListen == nil {
		opts.OnListen = func() {}
	}
	if opts.OnNotify == nil {
		opts.OnNotify = func(Notification) {}
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.FirstPause <= 0 {
		opts.FirstPause = 100 * time.Millisecond
	}
	if opts.MaxPause <= 0 {
		opts.MaxPause = 5 * time.Second
	}
	opts.MaxPause = max(opts.MaxPause, opts.FirstPause)
	if opts.After == nil {
		opts.After = time.After
	}
	return &Listener{pool: pool, channels: channels, opts: opts}
}

// Run listens until ctx ends, and returns once its connection is closed.
// The connection is taken from the pool for good (hijacked): a LISTENing
// session must never be handed to another user of the pool. After a
// failure, Run records it (Err), logs it, pauses, and connects again.
func (l *Listener) Run(ctx context.Context) {
	pause := l.opts.FirstPause
	for {
		listened, err := l.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			pause = l.opts.FirstPause
		}
		l.mu.Lock()
		l.lastErr = err
		l.mu.Unlock()
		l.opts.Logger.Warn("LISTEN connection failed; reconnecting after a pause",
			"channels", l.channels, "error", err, "pause", pause)
		select {
		case <-ctx.Done():
			return
		case <-l.opts.After(pause):
		}
		pause = min(2*pause, l.opts.MaxPause)
	}
}

// Err returns the last failure of the listener's connection, nil if it
// has not failed.
func (l *Listener) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lastErr
}

// listenOnce connects, LISTENs and dispatches notifications until the
// connection fails or ctx ends; listened reports whether LISTEN took
// effect.
func (l *Listener) listenOnce(ctx context.Context) (listened bool, err error) {
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return false, fmt.Errorf("pglisten: connect: %w", err)
	}
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	listening := make(map[string]bool, len(l.channels))
	for _, ch := range l.channels {
		if _, err := conn.Exec(ctx, "LISTEN "+identifier(ch)); err != nil {
			return false, fmt.Errorf("pglisten: LISTEN %s: %w", ch, err)
		}
		listening[ch] = true
	}
	l.opts.OnListen()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, fmt.Errorf("pglisten: waiting for a notification: %w", err)
		}
		// A pooled session may have LISTENed for something else before
		// it was hijacked: only the channels asked for are passed on.
		if listening[n.Channel] {
			l.opts.OnNotify(Notification{Channel: n.Channel, Payload: n.Payload})
		}
	}
}

// plainIdentifier matches the channel names that need no quoting.
var plainIdentifier = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// identifier returns ch as SQL: bare when it needs no quoting, so
// pg_stat_activity reads "LISTEN reconciler_due", quoted otherwise.
func identifier(ch string) string {
	if plainIdentifier.MatchString(ch) {
		return ch
	}
	return pgx.Identifier{ch}.Sanitize()
}
