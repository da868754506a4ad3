// Package reviewui serves the review queue in a browser (`reconciler ui`):
// the receipts held in manual_review, filterable and oldest first, with a
// summary of the backlog, the breakers and the alarms; each receipt's whole
// story; and the decisions of package review (resolve, requeue) with its
// rules: a reason is required, the reviewer's name is recorded, of two
// reviewers deciding at once one wins and the other is told, with nothing
// overwritten.
//
// Who the reviewer is comes from an Identifier: a header set by an
// authenticating proxy (TrustedHeader) or a token of the reviewer's own
// (TokenFile). The pages run under the database login they are given, meant
// to be one in reconciler_reviewer (docs/roles.sql): the database, not this
// package, decides what that login may do. Every form carries a CSRF token
// bound to the reviewer; pages allow no inline script or style (a strict
// Content-Security-Policy) and show every stored string escaped, with its
// control characters made visible.
package reviewui

import (
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/reconcile"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Via is recorded with every decision made on the page, as
// extra.resolved_via.
const Via = "reconciler ui"

// DefaultListen is where `reconciler ui` listens unless told otherwise: this
// host only.
const DefaultListen = "127.0.0.1:8086"

// DefaultLimit is how many receipts the queue shows at once; MaxLimit caps
// the ?limit= a page may ask for.
const (
	DefaultLimit = 100
	MaxLimit     = 1000
)

// contentSecurityPolicy allows scripts, styles and images from this origin
// only, no inline script or style, no framing, and forms that post back
// here only.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; " +
	"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// Config is what a Server needs. Pool and Identifier are required.
type Config struct {
	// Pool is the ledger, opened as the reviewers' database login.
	Pool *pgxpool.Pool
	// Identifier tells who each request is from.
	Identifier Identifier
	// Logger receives one line per refused or failed request; nil discards.
	Logger *slog.Logger
	// Now is the clock of the backlog's age cut-offs; nil means time.Now.
	Now func() time.Time
	// StalePlanned and OrphanTimeout are the summary's cut-offs, as for
	// `reconciler stats`: planned receipts older than StalePlanned are
	// stale, submitted ones older than OrphanTimeout orphans.
	StalePlanned, OrphanTimeout time.Duration
	// CountsEvery is how often the summary bar and the filters' counts are
	// read again (see counts); DefaultCountsEvery when zero.
	CountsEvery time.Duration
	// SecureCookies marks the session cookie Secure: set it when the page is
	// served over HTTPS (directly or by the proxy in front).
	SecureCookies bool
}

// Server is the review page's HTTP handler.
type Server struct {
	pool          *pgxpool.Pool
	id            Identifier
	log           *slog.Logger
	now           func() time.Time
	store         *reconcile.Store
	stalePlanned  time.Duration
	orphanTimeout time.Duration
	secure        bool
	csrf          *csrf
	pages         map[string]*template.Template
	mux           *http.ServeMux
	countsEvery   time.Duration

	mu      sync.Mutex
	last    *counts // the counts read last
	dirty   bool    // a decision was made since
	reading bool    // a read of the counts is under way in the background
	wg      sync.WaitGroup
}

// New returns a Server for cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Pool == nil || cfg.Identifier == nil {
		return nil, fmt.Errorf("%w: a pool and an identifier are required", ErrInvalidConfig)
	}
	store, err := reconcile.NewStore(cfg.Pool, "ui")
	if err != nil {
		return nil, fmt.Errorf("reviewui: %w", err)
	}
	c, err := newCSRF()
	if err != nil {
		return nil, fmt.Errorf("reviewui: csrf key: %w", err)
	}
	s := &Server{pool: cfg.Pool, id: cfg.Identifier, log: cfg.Logger, now: cfg.Now, store: store,
		stalePlanned: cfg.StalePlanned, orphanTimeout: cfg.OrphanTimeout, secure: cfg.SecureCookies,
		csrf: c, pages: map[string]*template.Template{}}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.countsEvery = cfg.CountsEvery; s.countsEvery <= 0 {
		s.countsEvery = DefaultCountsEvery
	}
	for _, page := range []string{"queue", "receipt", "signin", "problem"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+page+".html")
		if err != nil {
			return nil, fmt.Errorf("reviewui: template %s: %w", page, err)
		}
		s.pages[page] = t
	}
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, fmt.Errorf("reviewui: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", s.signedIn(s.queue))
	mux.HandleFunc("GET /receipts/{id}", s.signedIn(s.receipt))
	mux.HandleFunc("POST /receipts/{id}/decide", s.signedIn(s.decide))
	mux.HandleFunc("GET /signin", s.signinPage)
	mux.HandleFunc("POST /signin", s.signin)
	mux.HandleFunc("POST /signout", s.signedIn(s.signout))
	s.mux = mux
	return s, nil
}

// ServeHTTP serves the pages, with the headers every answer carries, and
// refuses any unsafe request another site's page started (the browser's
// Sec-Fetch-Site and Origin headers; the CSRF tokens are the check that does
// not depend on them).
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", contentSecurityPolicy)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	if !strings.HasPrefix(r.URL.Path, "/static/") {
		h.Set("Cache-Control", "no-store")
	}
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.problem(w, r, nil, http.StatusForbidden, "Refused: this form was sent from another site.")
	}))
	cop.Handler(s.mux).ServeHTTP(w, r)
}

// page is what every page's layout reads.
type page struct {
	Title    string
	Reviewer string
	SignOut  bool
	CSRF     string
	Login    string
	CanMove  bool
	Counts   *counts
	Message  string
	Problem  string
	Body     any
}

type handler func(w http.ResponseWriter, r *http.Request, id Identity)

// signedIn runs h for a request whose reviewer is known; anyone else is
// sent to sign in, or refused.
func (s *Server) signedIn(h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := s.id.Identify(r)
		switch {
		case err == nil:
			h(w, r, id)
		case errors.Is(err, ErrNotSignedIn) && s.id.SignIn():
			if r.Method == http.MethodGet {
				http.Redirect(w, r, "/signin", http.StatusSeeOther)
				return
			}
			s.problem(w, r, nil, http.StatusUnauthorized, "Your session has ended: sign in again.")
		case errors.Is(err, ErrUntrustedProxy):
			s.log.Warn("ui: request not from a trusted proxy", "remote", r.RemoteAddr, "err", err)
			s.problem(w, r, nil, http.StatusForbidden, "Refused: open this page through the sign-in proxy.")
		default:
			s.log.Warn("ui: no identity", "remote", r.RemoteAddr, "err", err)
			s.problem(w, r, nil, http.StatusUnauthorized, "Refused: the proxy did not say who you are.")
		}
	}
}

// render writes a page; the summary bar is read for every page but the
// sign-in and problem pages.
func (s *Server) render(w http.ResponseWriter, r *http.Request, status int, name string, id *Identity, p page) {
	if id != nil {
		p.Reviewer = id.Reviewer
		p.CSRF = s.csrf.token(*id)
		p.SignOut = s.id.SignIn()
		if err := s.pool.QueryRow(r.Context(), sqlWho).Scan(&p.Login, &p.CanMove); err != nil {
			s.fail(w, r, err)
			return
		}
		if p.Counts == nil && name != "problem" {
			c, err := s.counts(r.Context())
			if err != nil {
				s.fail(w, r, err)
				return
			}
			p.Counts = c
		}
	}
	var b strings.Builder
	if err := s.pages[name].Execute(&b, p); err != nil {
		s.log.Error("ui: render", "page", name, "err", err)
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}

// problem renders a page that says only what went wrong.
func (s *Server) problem(w http.ResponseWriter, r *http.Request, id *Identity, status int, msg string) {
	s.render(w, r, status, "problem", nil, page{Title: http.StatusText(status), Problem: msg,
		Reviewer: reviewerOf(id)})
}

func reviewerOf(id *Identity) string {
	if id == nil {
		return ""
	}
	return id.Reviewer
}

// fail reports a failed read or write: the details go to the log, the page
// says the database failed (a refusal is named: the login lacks a right).
func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "42501" {
		s.log.Warn("ui: refused by the database", "path", r.URL.Path, "err", err)
		s.problem(w, r, nil, http.StatusForbidden, "The database refused: "+pg.Message+
			". The page's database login must be a member of reconciler_reviewer (docs/roles.sql).")
		return
	}
	s.log.Error("ui: database", "path", r.URL.Path, "err", err)
	s.problem(w, r, nil, http.StatusInternalServerError, "The database failed to answer; the error is in the ui's log.")
}

// MaxCount is the most receipts the queue counts as matching a filter;
// past it, the page says "more than".
const MaxCount = 1000

// queueBody is the queue page's content.
type queueBody struct {
	Filter review.Filter
	Age    string
	Ages   []struct{ Value, Label string }
	Held   []review.Held
	// Filtered is whether any filter is set; Matches counts the receipts
	// that match it, at most MaxCount (More: more match).
	Filtered bool
	Matches  int64
	More     bool
	Limit    int
	// Contradicted are the settled absences an audit contradicted
	// (reason false_absence) that match the filter: terminal, so not
	// held, but a person looks for the duplicate a retry made.
	Contradicted []review.Contradiction
}

func (s *Server) queue(w http.ResponseWriter, r *http.Request, id Identity) {
	q := r.URL.Query()
	f := review.Filter{Dependency: q.Get("dependency"), Operation: q.Get("operation"), Reason: q.Get("reason"),
		Limit: DefaultLimit}
	body := queueBody{Age: q.Get("age"), Ages: ages}
	if a := body.Age; a != "" {
		d, err := time.ParseDuration(a)
		if err != nil || d < 0 {
			s.problem(w, r, &id, http.StatusBadRequest, "The age filter must be a duration such as 1h or 24h.")
			return
		}
		f.OlderThan = d
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n <= 0 || n > MaxLimit {
			s.problem(w, r, &id, http.StatusBadRequest, fmt.Sprintf("The limit must be a whole number from 1 to %d.", MaxLimit))
			return
		}
		f.Limit = n
	}
	body.Filter, body.Limit = f, f.Limit
	body.Filtered = f.Dependency != "" || f.Operation != "" || f.Reason != "" || f.OlderThan > 0
	ctx := r.Context()
	var err error
	if body.Held, err = review.List(ctx, s.pool, f); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.Contradicted, err = review.Contradicted(ctx, s.pool, f); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.Filtered {
		if body.Matches, body.More, err = review.Count(ctx, s.pool, f, MaxCount); err != nil {
			s.fail(w, r, err)
			return
		}
	}
	c, err := s.counts(ctx)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	s.render(w, r, http.StatusOK, "queue", &id, page{Title: "Review queue", Counts: c, Body: body})
}

// receiptBody is the receipt page's content.
type receiptBody struct {
	*detail
	Decisions []decision
	// Form echoes a refused decision's fields, so nothing typed is lost.
	Form    struct{ Decision, Reason, ExternalID string }
	Decided bool
}

func (s *Server) receipt(w http.ResponseWriter, r *http.Request, id Identity) {
	s.showReceipt(w, r, id, http.StatusOK, "", nil)
}

// showReceipt renders receipt {id}'s page with status, a problem to
// report, and the fields of a refused form to echo.
func (s *Server) showReceipt(w http.ResponseWriter, r *http.Request, id Identity, status int, problem string, form *struct{ Decision, Reason, ExternalID string }) {
	rid, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || rid <= 0 {
		s.problem(w, r, &id, http.StatusNotFound, "No such receipt: the address must end in a receipt id.")
		return
	}
	d, err := s.detail(r.Context(), rid)
	if errors.Is(err, review.ErrNotFound) {
		s.problem(w, r, &id, http.StatusNotFound, fmt.Sprintf("Receipt %d does not exist.", rid))
		return
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	body := receiptBody{detail: d, Decisions: decisions, Decided: r.URL.Query().Get("decided") == "1"}
	if form != nil {
		body.Form = *form
	}
	p := page{Title: fmt.Sprintf("Receipt %d", rid), Problem: problem, Body: body}
	s.render(w, r, status, "receipt", &id, p)
}

// decide records a reviewer's decision on a held receipt through package
// review, then shows the receipt again (after a redirect, so a reload does
// not send the form twice).
func (s *Server) decide(w http.ResponseWriter, r *http.Request, id Identity) {
	if err := s.csrf.check(r, id); err != nil {
		s.log.Warn("ui: form refused", "reviewer", id.Reviewer, "path", r.URL.Path, "err", err)
		s.problem(w, r, &id, http.StatusForbidden,
			"Refused: this form did not carry its page's security token. Reload the receipt's page and decide again.")
		return
	}
	rid, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || rid <= 0 {
		s.problem(w, r, &id, http.StatusNotFound, "No such receipt.")
		return
	}
	form := struct{ Decision, Reason, ExternalID string }{
		r.PostFormValue("decision"), r.PostFormValue("reason"), r.PostFormValue("external_id")}
	ctx := r.Context()
	d := review.Resolution{ID: rid, To: statemachine.State(form.Decision), Operator: id.Reviewer,
		Reason: form.Reason, ExternalID: form.ExternalID, Via: Via}
	switch form.Decision {
	case "requeue":
		d.To, d.ExternalID = statemachine.OutcomeUnknown, ""
	case string(statemachine.Succeeded), string(statemachine.SafeToRetry), string(statemachine.Rejected):
	default:
		s.showReceipt(w, r, id, http.StatusBadRequest, "Choose what happened before you decide.", &form)
		return
	}
	_, err = review.Decide(ctx, s.pool, d)
	var pg *pgconn.PgError
	switch {
	case err == nil:
		s.countsChanged()
		s.log.Info("ui: decided", "reviewer", id.Reviewer, "receipt", rid, "decision", form.Decision)
		http.Redirect(w, r, fmt.Sprintf("/receipts/%d?decided=1", rid), http.StatusSeeOther)
	case errors.Is(err, review.ErrReasonRequired):
		s.showReceipt(w, r, id, http.StatusBadRequest,
			"A reason is required: say why you decided this; it is recorded in the receipt's history.", &form)
	case errors.Is(err, review.ErrNotHeld):
		s.showReceipt(w, r, id, http.StatusConflict, "Your decision was not recorded: "+err.Error()+
			". The page below shows the receipt as it is now.", nil)
	case errors.Is(err, review.ErrInvalidOperator):
		s.problem(w, r, &id, http.StatusForbidden, "Refused: your reviewer name cannot be recorded as a human actor.")
	case errors.Is(err, review.ErrNotFound):
		s.problem(w, r, &id, http.StatusNotFound, fmt.Sprintf("Receipt %d does not exist.", rid))
	case errors.As(err, &pg) && (pg.Code == "42501" || pg.Code == "RL001"):
		s.log.Warn("ui: decision refused by the database", "reviewer", id.Reviewer, "receipt", rid, "err", err)
		s.showReceipt(w, r, id, http.StatusForbidden, "The database refused your decision: "+pg.Message+
			". The page's database login must be a member of reconciler_reviewer (docs/roles.sql); nothing was changed.", &form)
	default:
		s.fail(w, r, err)
	}
}

// signinPage shows the token form (TokenFile only).
func (s *Server) signinPage(w http.ResponseWriter, r *http.Request) {
	if !s.id.SignIn() {
		s.problem(w, r, nil, http.StatusNotFound, "Reviewers sign in through the proxy in front of this page.")
		return
	}
	s.showSignin(w, r, http.StatusOK, "")
}

func (s *Server) showSignin(w http.ResponseWriter, r *http.Request, status int, problem string) {
	v, err := randomToken(32)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	http.SetCookie(w, &http.Cookie{Name: preSessionCookie, Value: v, Path: "/signin", HttpOnly: true,
		Secure: s.secure, SameSite: http.SameSiteStrictMode, MaxAge: 600})
	s.render(w, r, status, "signin", nil, page{Title: "Sign in", CSRF: v, Problem: problem})
}

// signin checks a typed token and keeps it in the session cookie.
func (s *Server) signin(w http.ResponseWriter, r *http.Request) {
	tf, ok := s.id.(*TokenFile)
	if !ok {
		s.problem(w, r, nil, http.StatusNotFound, "Reviewers sign in through the proxy in front of this page.")
		return
	}
	c, err := r.Cookie(preSessionCookie)
	if err != nil || !sameToken(c.Value, r.PostFormValue(csrfField)) {
		s.showSignin(w, r, http.StatusForbidden, "Refused: this form did not carry its page's security token. Try again.")
		return
	}
	token := strings.TrimSpace(r.PostFormValue("token"))
	id, ok := tf.lookup(token)
	if !ok {
		s.log.Warn("ui: sign-in with an unknown token", "remote", r.RemoteAddr)
		s.showSignin(w, r, http.StatusUnauthorized, "That token belongs to no reviewer.")
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: token, Path: "/", HttpOnly: true,
		Secure: s.secure, SameSite: http.SameSiteStrictMode})
	s.log.Info("ui: signed in", "reviewer", id.Reviewer)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (s *Server) signout(w http.ResponseWriter, r *http.Request, id Identity) {
	if err := s.csrf.check(r, id); err != nil {
		s.problem(w, r, &id, http.StatusForbidden, "Refused: this form did not carry its page's security token.")
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
		Secure: s.secure, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
}
