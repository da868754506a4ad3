package ledger

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/receiptledger/reconciler/internal/contentcoding"
)

// The send guard of one request: who got there first, the send deadline's
// timer or the request.
const (
	guardWaiting int32 = iota // no connection yet: the timer cancels, nothing was written
	guardWriting              // a write began on a connection without a write deadline (HTTP/2): the timer cuts it
	guardHeld                 // an HTTP/1 connection bounded by a write deadline, or the request fully written
	guardExpired              // the timer fired first and canceled the request
)

var (
	// errTransportResend is the cause of a request the transport tried to
	// send again on another connection after a write had begun.
	errTransportResend = errors.New("the transport tried to send the request again on a new connection after writing it on another; refused, nothing was written on the new one")
	// errCutMidWrite is the cause of a request the send deadline cut
	// after its writing began and before it was whole.
	errCutMidWrite = errors.New("the send deadline passed while the request was being written (its headers were sent, the rest was not): canceled, nothing more was written")
)

// sendStats is what the trace saw, kept as evidence.
type sendStats struct {
	conns   atomic.Int32 // GotConn events: more than one means the transport retried
	blocked atomic.Int32 // HTTP/1 connections on which Do let nothing be written (write deadline in the past)
	h1Given atomic.Bool  // the request was handed to an HTTP/1 connection Do did not block
	reused  atomic.Bool
	wrote   atomic.Bool // a write hook fired
	http2   atomic.Bool // a connection was (or may be) HTTP/2
	guard   atomic.Int32
	// deadline is set when the send deadline canceled the request or
	// blocked its writes; midWrite when it cut a request being written.
	deadline atomic.Bool
	midWrite atomic.Bool
	// resent is set when the transport tried to send the request again
	// after a write had begun, and Do refused it.
	resent atomic.Bool
	// h1 is the HTTP/1 connection whose write deadline Do set, to clear.
	h1 atomic.Pointer[net.Conn]
}

// sent reports whether any byte may have been written. From GotConn on it
// may, except on an HTTP/1 connection whose write deadline had already
// passed when the request got it: every write on it fails before the
// system call, and the write hooks then report bytes that only reached the
// transport's buffer.
func (s *sendStats) sent() bool {
	if n := s.conns.Load(); n > 0 {
		return n > s.blocked.Load()
	}
	return s.wrote.Load()
}

// pastDeadline is a write deadline that has passed: every write on a
// connection carrying it fails before the system call.
var pastDeadline = time.Unix(1, 0)

// send writes req under ctx with a trace and reads the whole response body.
//
// "Sent" is decided conservatively: from GotConn on, the request may have
// been handed to the connection's writer, and once a write has started,
// bytes may be on the wire even if the write then fails (WroteRequest
// reports an error for a partial write just as for none; a successful
// write says nothing about delivery either). Only a failure before the
// transport had a connection (DNS, dial, TLS handshake, proxy, a wrapping
// RoundTripper's own error such as missing credentials) proves that no
// byte left. Mistaking "not sent" for "sent" costs a readback; the reverse
// would allow a duplicate.
//
// The send deadline (see Do) is enforced here: a timer cancels the request
// at deadline unless the transport got an HTTP/1 connection first (whose
// write deadline then bounds every write) or the request was written
// whole. On a connection without a write deadline (HTTP/2) a request
// whose writing began but did not end by the deadline is canceled then
// (outcome_unknown: its headers left), and its body reads fail from then
// on, so nothing more of it is written.
//
// The transport never sends the request twice (see noReplay); should it
// try, a second connection obtained after a write began is refused: on
// HTTP/1 its write deadline is set in the past, so nothing is written on
// it, and the request is canceled.
func (c *Caller) send(ctx context.Context, req *http.Request, deadline time.Time, delay time.Duration) (Exchange, *sendStats) {
	st := &sendStats{}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	wrote := func() {
		st.wrote.Store(true)
		st.guard.CompareAndSwap(guardWaiting, guardWriting)
	}
	trace := &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			earlier := st.conns.Add(1) > 1
			if info.Reused {
				st.reused.Store(true)
			}
			h2 := info.Conn == nil || c.mayBeHTTP2(info.Conn)
			if h2 {
				st.http2.Store(true)
			}
			if earlier && (st.wrote.Load() || st.h1Given.Load()) {
				// The transport is retrying on another connection a
				// request it may have written on the first: refuse.
				st.resent.Store(true)
				if !h2 && info.Conn.SetWriteDeadline(pastDeadline) == nil {
					conn := info.Conn
					st.h1.Store(&conn)
					st.blocked.Add(1)
				}
				cancel(errTransportResend)
				return
			}
			if h2 {
				// A shared connection: leave it alone; the timer stays
				// armed until the request is written whole.
				return
			}
			// HTTP/1: the connection is this request's alone until it
			// is written, and GotConn runs before the request is handed
			// to the connection's writer.
			expired := !time.Now().Before(deadline)
			if info.Conn.SetWriteDeadline(deadline) != nil {
				// Unbounded writes: the timer stays armed as on HTTP/2.
				st.h1Given.Store(true)
				return
			}
			conn := info.Conn
			st.h1.Store(&conn)
			if expired {
				// Every write on it fails without a system call: nothing
				// of this request can leave on it.
				st.blocked.Add(1)
				st.deadline.Store(true)
				cancel(ErrSendDeadline)
				return
			}
			st.h1Given.Store(true)
			st.guard.CompareAndSwap(guardWaiting, guardHeld)
		},
		WroteHeaderField: func(string, []string) { wrote() },
		WroteHeaders:     wrote,
		Wait100Continue:  wrote,
		WroteRequest: func(httptrace.WroteRequestInfo) {
			wrote()
			// Written whole (or failed): the timer must not cut it now.
			st.guard.CompareAndSwap(guardWriting, guardHeld)
			if conn := st.h1.Load(); conn != nil {
				// The pooled connection must not keep this request's
				// deadline.
				_ = (*conn).SetWriteDeadline(time.Time{})
			}
		},
	}
	out := req.Clone(httptrace.WithClientTrace(sctx, trace))
	c.noReplay(out, st)
	if !time.Now().Before(deadline) {
		// The submit itself took the whole delay: send nothing.
		st.deadline.Store(true)
		closeBody(out)
		return Exchange{Request: out, Err: fmt.Errorf("%w (%v after submit): the submit took it all", ErrSendDeadline, delay)}, st
	}
	timer := time.AfterFunc(time.Until(deadline), func() {
		switch {
		case st.guard.CompareAndSwap(guardWaiting, guardExpired):
			st.deadline.Store(true)
			cancel(ErrSendDeadline)
		case st.guard.CompareAndSwap(guardWriting, guardExpired):
			st.deadline.Store(true)
			st.midWrite.Store(true)
			cancel(errCutMidWrite)
		}
	})
	// Answered or failed: from then on the deadline no longer concerns a
	// request written whole (it must not cut short the reading of a
	// response, whatever the transport reported). One still being
	// written (an HTTP/2 server may answer before the body ends) stays
	// under the timer until its body read is done.
	disarm := func() {
		timer.Stop()
		st.guard.CompareAndSwap(guardWaiting, guardHeld)
		st.guard.CompareAndSwap(guardWriting, guardHeld)
	}
	resp, err := c.client().Do(out)
	if err != nil || st.guard.Load() != guardWriting {
		disarm()
	}
	switch {
	case err != nil && st.resent.Load():
		err = fmt.Errorf("%w: %w", errTransportResend, err)
	case err != nil && st.midWrite.Load():
		err = fmt.Errorf("%w (%v after submit): %w", errCutMidWrite, delay, err)
	case err != nil && st.deadline.Load():
		if st.sent() {
			err = fmt.Errorf("canceled at the send deadline (%v after submit) after the transport had a connection: %w", delay, err)
		} else {
			err = fmt.Errorf("%w (%v after submit): no connection by then, nothing written: %w", ErrSendDeadline, delay, err)
		}
	}
	ex := Exchange{Request: out, Response: resp, Err: err}
	if resp != nil && err == nil {
		if c.DecodeContent {
			ex.Err = contentcoding.Decode(resp)
		}
		if ex.Err == nil {
			ex.Body, ex.Err = readBody(resp.Body, c.maxBody())
		}
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(ex.Body))
		disarm()
		if ex.Err != nil && st.midWrite.Load() {
			ex.Err = fmt.Errorf("%w (%v after submit): %w", errCutMidWrite, delay, ex.Err)
		}
	}
	ex.Sent = resp != nil || st.sent()
	return ex, st
}

// noReplay makes out a request net/http never sends twice on its own.
// net/http's Transport resends a request on a new connection, within one
// RoundTrip, when a reused HTTP/1 connection fails after the request was
// written and the request is "replayable" (its body is nil, NoBody or has
// GetBody, and its method is GET, HEAD, OPTIONS or TRACE or it carries an
// Idempotency-Key or X-Idempotency-Key header); its HTTP/2 transport
// resends a request whose body is nil, NoBody or has GetBody after some
// stream errors (a PROTOCOL_ERROR reset by the server among them, which
// does not prove the server ignored the request). So:
//
//   - GetBody is cleared: a body cannot be rewound, so it is never sent
//     again (and a 307/308 redirect could not be replayed: Do follows
//     none);
//   - a body-less request gets an empty, non-nil body without GetBody
//     (neither transport resends it). On the wire: for GET, HEAD, DELETE,
//     OPTIONS (methods net/http probes) nothing changes, no body and no
//     Content-Length; over HTTP/2 the headers are followed by an empty
//     DATA frame ending the stream; over HTTP/1 a POST, PUT, PATCH (or
//     another method) is sent with "Transfer-Encoding: chunked" and an
//     empty chunked body instead of "Content-Length: 0";
//   - except that when the request can only go over HTTP/1 (an http URL,
//     sent by net/http's own Transport without unencrypted HTTP/2) and its
//     method is not one net/http replays by itself, the body stays nil so
//     that "Content-Length: 0" is kept, and the Idempotency-Key and
//     X-Idempotency-Key headers are stored under their lower-case names,
//     which net/http does not look for (header names are case-insensitive
//     on the wire, and HTTP/2 lower-cases them anyway).
//
// A body that may go over HTTP/2 is read through sendBody, which fails
// once the send deadline cut the request.
func (c *Caller) noReplay(out *http.Request, st *sendStats) {
	out.GetBody = nil
	h1 := c.onlyHTTP1(out.URL)
	if out.Body != nil && out.Body != http.NoBody {
		if !h1 {
			out.Body = &sendBody{ReadCloser: out.Body, st: st}
		}
		return
	}
	if h1 && !replayableMethod(out.Method) {
		out.Body, out.ContentLength = nil, 0
		for _, k := range [...]string{"Idempotency-Key", "X-Idempotency-Key"} {
			if v, ok := out.Header[k]; ok {
				delete(out.Header, k)
				lk := strings.ToLower(k)
				out.Header[lk] = append(out.Header[lk], v...)
			}
		}
		return
	}
	out.Body, out.ContentLength = emptyBody{}, 0
}

// replayableMethod reports whether net/http takes a body-less request of
// method as idempotent whatever its headers.
func replayableMethod(method string) bool {
	switch method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// emptyBody is the body of a body-less request: empty, but neither nil
// nor http.NoBody, so net/http never takes the request for replayable.
type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

// sendBody is a request body whose reads fail once the send deadline cut
// the request being written (on HTTP/2; on HTTP/1 the connection's write
// deadline does): no byte of it is produced after the deadline.
type sendBody struct {
	io.ReadCloser
	st *sendStats
}

func (b *sendBody) Read(p []byte) (int, error) {
	if b.st.guard.Load() == guardExpired {
		return 0, errCutMidWrite
	}
	return b.ReadCloser.Read(p)
}

// client returns the HTTP client Do sends with: c.HTTP (or the default)
// with redirects turned off.
func (c *Caller) client() *http.Client {
	hc := http.DefaultClient
	if c.HTTP != nil {
		hc = c.HTTP
	}
	cp := *hc
	cp.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &cp
}

// mayBeHTTP2 reports whether conn may carry HTTP/2, whose connection is
// shared by concurrent requests: a TLS connection that negotiated "h2", or
// a plain one when the transport is configured for unencrypted HTTP/2.
func (c *Caller) mayBeHTTP2(conn net.Conn) bool {
	if tc, ok := conn.(*tls.Conn); ok {
		return tc.ConnectionState().NegotiatedProtocol == "h2"
	}
	tr, ok := c.transport()
	return ok && tr.Protocols != nil && tr.Protocols.UnencryptedHTTP2()
}

// onlyHTTP1 reports whether a request to u can only be sent over HTTP/1:
// an http URL sent by net/http's own Transport without unencrypted HTTP/2.
// Any other RoundTripper may speak HTTP/2.
func (c *Caller) onlyHTTP1(u *url.URL) bool {
	tr, ok := c.transport()
	return ok && u != nil && strings.EqualFold(u.Scheme, "http") &&
		(tr.Protocols == nil || !tr.Protocols.UnencryptedHTTP2())
}

// transport returns the RoundTripper Do sends with as an *http.Transport,
// when it is one.
func (c *Caller) transport() (*http.Transport, bool) {
	var rt http.RoundTripper
	if c.HTTP != nil {
		rt = c.HTTP.Transport
	}
	if rt == nil {
		rt = http.DefaultTransport
	}
	tr, ok := rt.(*http.Transport)
	return tr, ok
}

func (c *Caller) maxBody() int64 {
	if c.MaxResponseBytes > 0 {
		return c.MaxResponseBytes
	}
	return DefaultMaxResponseBytes
}

func readBody(r io.Reader, limit int64) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return body, err
	}
	if int64(len(body)) > limit {
		return body[:limit], fmt.Errorf("%w: more than %d bytes", ErrResponseTooLarge, limit)
	}
	return body, nil
}

func closeBody(req *http.Request) {
	if req != nil && req.Body != nil {
		req.Body.Close()
	}
}
