package pglisten_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pglisten"
	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// bound is how long any awaited event may take.
const bound = 10 * time.Second

// run is a Listener running over a database of its own; observer is a
// second pool on that database, for the test's own statements (the
// listener's pool keeps no idle session the test could be handed).
type run struct {
	pool     *pgxpool.Pool // the listener's
	observer *pgxpool.Pool
	listened chan struct{}
	notes    chan pglisten.Notification
	l        *pglisten.Listener
	cancel   context.CancelFunc
	done     chan struct{}
}

// start runs a listener on channels until the test ends.
func start(t *testing.T, url string, channels []string, opts pglisten.Options) *run {
	t.Helper()
	r := &run{pool: pgtest.Pool(t, url), observer: pgtest.Pool(t, url),
		listened: make(chan struct{}, 16), notes: make(chan pglisten.Notification, 16), done: make(chan struct{})}
	opts.OnListen = func() { r.listened <- struct{}{} }
	opts.OnNotify = func(n pglisten.Notification) { r.notes <- n }
	r.l = pglisten.New(r.pool, channels, opts)
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { defer close(r.done); r.l.Run(ctx) }()
	t.Cleanup(r.stop(t))
	return r
}

// stop returns the function that cancels the listener and waits
// (bounded) for Run to return.
func (r *run) stop(t *testing.T) func() {
	return func() {
		r.cancel()
		select {
		case <-r.done:
		case <-time.After(bound):
			t.Error("Run did not return after its context ended")
		}
	}
}

func (r *run) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := r.observer.Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// listeners returns the pids of the sessions of the database that LISTEN.
func (r *run) listeners(t *testing.T) []int32 {
	t.Helper()
	rows, _ := r.observer.Query(context.Background(), `SELECT pid FROM pg_stat_activity
		WHERE datname = current_database() AND query LIKE 'LISTEN %'`)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// waitListeners waits (bounded) until n sessions LISTEN, and returns them.
func (r *run) waitListeners(t *testing.T, n int) []int32 {
	t.Helper()
	for deadline := time.Now().Add(bound); ; {
		pids := r.listeners(t)
		if len(pids) == n {
			return pids
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions LISTEN, want %d", len(pids), n)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not racing it
	}
}

// recv waits (bounded) for the next value of ch.
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(bound):
		t.Fatalf("no %s within %v", what, bound)
		panic("unreachable")
	}
}

func TestListener(t *testing.T) {
	for _, tc := range []struct {
		name     string
		channels []string
		check    func(t *testing.T, r *run)
	}{{
		// OnListen is called once LISTEN is in effect: a notification
		// sent right after it is delivered, with its channel and payload,
		// on each channel, in order, and nothing from other channels.
		name:     "notifications on every channel are delivered once LISTEN is signalled",
		channels: []string{"first", "Second Channel"},
		check: func(t *testing.T, r *run) {
			recv(t, r.listened, "OnListen")
			r.exec(t, `SELECT pg_notify('Second Channel', 'b'), pg_notify('elsewhere', 'x')`)
			r.exec(t, `NOTIFY first, 'a'`)
			for _, want := range []pglisten.Notification{{Channel: "Second Channel", Payload: "b"}, {Channel: "first", Payload: "a"}} {
				if got := recv(t, r.notes, "notification"); got != want {
					t.Fatalf("notification %+v, want %+v", got, want)
				}
			}
			if err := r.l.Err(); err != nil {
				t.Fatalf("Err() = %v with no failure", err)
			}
		},
	}, {
		// The listening session was taken out of the pool for good: the
		// pool neither counts it as acquired nor hands it to its users.
		name:     "the listening session is never handed to the pool's users",
		channels: []string{"hijacked"},
		check: func(t *testing.T, r *run) {
			recv(t, r.listened, "OnListen")
			pid := r.waitListeners(t, 1)[0]
			if n := r.pool.Stat().AcquiredConns(); n != 0 {
				t.Fatalf("the pool counts %d sessions acquired, want the listening one out of it", n)
			}
			var got int32
			if err := r.pool.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if got == pid {
				t.Fatalf("the pool handed out the listening session %d", pid)
			}
		},
	}, {
		// The server ends the session: the listener records the failure,
		// connects again, signals OnListen again (what was sent meanwhile
		// is lost: the owner must read again), and delivers from then on.
		name:     "after its backend is terminated it listens again, signals, and delivers",
		channels: []string{"reconnecting"},
		check: func(t *testing.T, r *run) {
			recv(t, r.listened, "OnListen")
			pid := r.waitListeners(t, 1)[0]
			r.exec(t, `SELECT pg_terminate_backend($1)`, pid)
			recv(t, r.listened, "OnListen after the reconnection")
			if r.l.Err() == nil {
				t.Fatal("Err() = nil after the session was terminated")
			}
			if now := r.waitListeners(t, 1)[0]; now == pid {
				t.Fatalf("still listening on the terminated session %d", pid)
			}
			r.exec(t, `NOTIFY reconnecting, 'again'`)
			if got := recv(t, r.notes, "notification"); got.Payload != "again" {
				t.Fatalf("notification %+v after the reconnection", got)
			}
		},
	}, {
		// Cancelling the context returns Run with its session closed: no
		// backend is left listening, neither alone nor back in the pool.
		name:     "cancel stops Run and closes the session",
		channels: []string{"stopping"},
		check: func(t *testing.T, r *run) {
			recv(t, r.listened, "OnListen")
			r.waitListeners(t, 1)
			r.stop(t)()
			r.waitListeners(t, 0)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			r := start(t, pgtest.NewEmptyDatabase(t), tc.channels, pglisten.Options{FirstPause: time.Millisecond})
			tc.check(t, r)
		})
	}
}

// While the server refuses connections, the pauses between attempts
// double up to the cap; once LISTEN has taken effect, the next failure
// pauses the first pause again.
func TestListenerBacksOffAndStartsOver(t *testing.T) {
	url := pgtest.NewEmptyDatabase(t)
	admin, err := pgx.Connect(context.Background(), pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	allow := func(on bool) {
		t.Helper()
		cfg, _ := pgxpool.ParseConfig(url)
		sql := `ALTER DATABASE ` + pgx.Identifier{cfg.ConnConfig.Database}.Sanitize() + ` WITH ALLOW_CONNECTIONS ` + map[bool]string{true: "true", false: "false"}[on]
		if _, err := admin.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
	observer := pgtest.Pool(t, url) // connected before the refusal
	if err := observer.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	allow(false)
	t.Cleanup(func() { allow(true) }) // so the database can be dropped

	// After hands each pause to the test, which ends it.
	pauses := make(chan time.Duration)
	end := make(chan time.Time)
	r := start(t, url, []string{"backing_off"}, pglisten.Options{FirstPause: time.Millisecond, MaxPause: 4 * time.Millisecond,
		After: func(d time.Duration) <-chan time.Time { pauses <- d; return end }})
	ms := time.Millisecond
	for i, want := range []time.Duration{ms, 2 * ms, 4 * ms, 4 * ms} {
		if i > 0 {
			end <- time.Now()
		}
		if got := recv(t, pauses, "pause"); got != want {
			t.Fatalf("pause %d = %v, want %v", i+1, got, want)
		}
	}
	var pgErr interface{ SQLState() string }
	if err := r.l.Err(); !errors.As(err, &pgErr) || pgErr.SQLState() != "55000" {
		t.Fatalf("Err() = %v, want the server's refusal (55000)", err)
	}
	allow(true)
	end <- time.Now()
	recv(t, r.listened, "OnListen")
	r.exec(t, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'`)
	if got := recv(t, pauses, "pause after the reconnection"); got != ms {
		t.Fatalf("pause after a session that listened = %v, want the first pause %v", got, ms)
	}
	end <- time.Now()
	recv(t, r.listened, "OnListen after the reconnection")
}
