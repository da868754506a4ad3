package gateway

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/internal/credential"
	"github.com/receiptledger/reconciler/internal/redact"
	"github.com/receiptledger/reconciler/ledger"
)

// Defaults of the routes file's optional fields.
const (
	// DefaultListen is where the gateway listens: this host only.
	DefaultListen = "127.0.0.1:7070"
	// DefaultMaxRequestBytes bounds an agent's request body: 1 MiB, the
	// largest payload the fingerprint takes.
	DefaultMaxRequestBytes = 1 << 20
	// DefaultMaxResponseBytes bounds an upstream's response body: 10 MiB.
	DefaultMaxResponseBytes = ledger.DefaultMaxResponseBytes
	// DefaultReplayBodyBytes is the largest response body kept for replays.
	DefaultReplayBodyBytes = 64 << 10
	// DefaultRetention is how long a response is kept for replays: 24 h,
	// the retention of Stripe's idempotency keys.
	DefaultRetention = 24 * time.Hour
	// DefaultTimeout bounds one upstream exchange.
	DefaultTimeout = 30 * time.Second
	// minTokenBytes is the shortest agent token accepted.
	minTokenBytes = 16
	// minWebhookSecretBytes is the shortest webhook secret accepted: an
	// HMAC-SHA256 key of 256 bits.
	minWebhookSecretBytes = 32
	// DefaultWebhookTimeout bounds one webhook delivery.
	DefaultWebhookTimeout = 10 * time.Second
	// DefaultWebhookMaxAttempts and DefaultWebhookMaxAge bound the retries
	// of one event: after either, it is given up (and recorded so).
	DefaultWebhookMaxAttempts = 12
	DefaultWebhookMaxAge      = 24 * time.Hour
)

// defaultReplayHeaders are the upstream response headers kept with a
// response for replays when the file names none.
func defaultReplayHeaders() []string {
	return []string{"Content-Type", "Location", "Retry-After", "ETag", "Last-Modified"}
}

// reservedPaths are the gateway's own endpoints: no route may shadow them.
func reservedPaths() []string {
	return []string{"/receipts", "/openapi.json", "/healthz", "/metrics", "/problems"}
}

// Config is a loaded routes file, with every credential resolved.
type Config struct {
	// Listen is the address to listen on (DefaultListen).
	Listen string
	// MaxRequestBytes and MaxResponseBytes bound bodies in both directions.
	MaxRequestBytes  int64
	MaxResponseBytes int64
	// ReplayBodyBytes, Retention and ReplayHeaders say what is kept of a
	// settled call's response for replays, and how long.
	ReplayBodyBytes int64
	Retention       time.Duration
	ReplayHeaders   []string
	// Agents maps the SHA-256 of each agent's token to its id.
	Agents map[[32]byte]string
	// Routes, longest prefix first.
	Routes []*Route
}

// Route forwards the requests under one path prefix to one upstream.
type Route struct {
	// Name labels the route in metrics and logs (default: the prefix).
	Name string
	// Prefix is the path prefix the agents call, without a trailing slash.
	Prefix string
	// Upstream is the base URL the rest of the path is appended to.
	Upstream *url.URL
	// Dependency is the receipts' dependency.
	Dependency string
	// Operations name each call from its method and path; with none, a
	// call's operation is "<method> <path>" (lower-case method).
	Operations []Operation
	// Drop and Secret are the payload's volatile and secret fields (JSON
	// pointers) for every operation of the route.
	Drop   []string
	Secret []string
	// PassAuthorization forwards the agent's own Authorization header
	// upstream (the agent then authenticates to the gateway with
	// Proxy-Authorization). Off by default: it is stripped.
	PassAuthorization bool
	// ReceiptsForReads records GET and HEAD calls through the ledger too.
	ReceiptsForReads bool
	// MaxSendDelay is each receipt's send deadline (0: the ledger's default).
	MaxSendDelay time.Duration
	// Timeout bounds one upstream exchange.
	Timeout time.Duration
	// ExternalID extracts the external id from a 2xx body (nil: "id").
	ExternalID func([]byte) (string, error)
	// Webhook, if set, receives a signed event when a receipt created
	// through the route settles.
	Webhook *Webhook

	// auth is the credential header injected upstream, if any.
	authHeader, authValue string
	// redactor removes every form of the route's credential from a
	// response body before it is stored.
	redactor *redact.Redactor
}

// Webhook is where a route's settlement events are delivered.
type Webhook struct {
	// URL receives a POST per event; it holds no credentials.
	URL *url.URL
	// Timeout bounds one delivery (DefaultWebhookTimeout).
	Timeout time.Duration
	// MaxAttempts and MaxAge bound the retries of one event.
	MaxAttempts int
	MaxAge      time.Duration

	// secret keys the events' HMAC-SHA256 signatures.
	secret []byte
}

// Operation names the calls that match a method and a path pattern.
type Operation struct {
	Method string
	// Path is split in segments; "{name}" matches any one segment and a
	// final "*" any rest.
	Path []string
	Name string
	// Drop and Secret add to the route's.
	Drop   []string
	Secret []string
}

// ConfigError names what is wrong in the routes file.
type ConfigError struct {
	File  string
	Line  int
	Field string
	Err   error
}

func (e *ConfigError) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	if e.Field != "" {
		b.WriteString(": " + e.Field)
	}
	b.WriteString(": " + e.Err.Error())
	return b.String()
}

// Unwrap returns the underlying error.
func (e *ConfigError) Unwrap() error { return e.Err }

type fileYAML struct {
	Version int         `yaml:"version"`
	Listen  string      `yaml:"listen"`
	Limits  limitsYAML  `yaml:"limits"`
	Replay  replayYAML  `yaml:"replay"`
	Agents  []agentYAML `yaml:"agents"`
	Routes  []routeYAML `yaml:"routes"`
}

type limitsYAML struct {
	MaxRequestBytes  int64 `yaml:"max_request_bytes"`
	MaxResponseBytes int64 `yaml:"max_response_bytes"`
}

type replayYAML struct {
	MaxBodyBytes *int64   `yaml:"max_body_bytes"`
	Retention    string   `yaml:"retention"`
	Headers      []string `yaml:"headers"`
}

type secretYAML struct {
	Env  string `yaml:"env"`
	File string `yaml:"file"`
}

type agentYAML struct {
	ID    string     `yaml:"id"`
	Token secretYAML `yaml:"token"`
	line  int
}

type authYAML struct {
	Scheme     string `yaml:"scheme"`
	Header     string `yaml:"header"`
	secretYAML `yaml:",inline"`
}

type operationYAML struct {
	Method string   `yaml:"method"`
	Path   string   `yaml:"path"`
	Name   string   `yaml:"name"`
	Drop   []string `yaml:"drop"`
	Secret []string `yaml:"secret"`
}

type routeYAML struct {
	Name              string          `yaml:"name"`
	Prefix            string          `yaml:"prefix"`
	Upstream          string          `yaml:"upstream"`
	Dependency        string          `yaml:"dependency"`
	Operations        []operationYAML `yaml:"operations"`
	Drop              []string        `yaml:"drop"`
	Secret            []string        `yaml:"secret"`
	Auth              *authYAML       `yaml:"auth"`
	PassAuthorization bool            `yaml:"pass_authorization"`
	ReceiptsForReads  bool            `yaml:"receipts_for_reads"`
	MaxSendDelay      string          `yaml:"max_send_delay"`
	Timeout           string          `yaml:"timeout"`
	ExternalID        string          `yaml:"external_id"`
	Webhook           *webhookYAML    `yaml:"webhook"`
}

type webhookYAML struct {
	URL         string     `yaml:"url"`
	Secret      secretYAML `yaml:"secret"`
	Timeout     string     `yaml:"timeout"`
	MaxAttempts int        `yaml:"max_attempts"`
	MaxAge      string     `yaml:"max_age"`
}

// LoadConfig reads the routes file at path, resolving every credential
// (agent tokens, upstream credentials) from the environment through
// lookupEnv or from the files named. Every error is a *ConfigError; none
// prints a credential.
func LoadConfig(path string, lookupEnv func(string) (string, bool)) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, &ConfigError{File: path, Err: err}
	}
	return ParseConfig(path, data, lookupEnv)
}

// ParseConfig is LoadConfig for the file's contents; name is used in errors.
func ParseConfig(name string, data []byte, lookupEnv func(string) (string, bool)) (*Config, error) {
	fail := func(field string, err error) error { return &ConfigError{File: name, Field: field, Err: err} }
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var f fileYAML
	if err := dec.Decode(&f); err != nil {
		return nil, fail("", err)
	}
	if f.Version != 1 {
		return nil, fail("version", fmt.Errorf("must be 1, got %d", f.Version))
	}
	cfg := &Config{
		Listen:           f.Listen,
		MaxRequestBytes:  f.Limits.MaxRequestBytes,
		MaxResponseBytes: f.Limits.MaxResponseBytes,
		ReplayBodyBytes:  DefaultReplayBodyBytes,
		Retention:        DefaultRetention,
		ReplayHeaders:    f.Replay.Headers,
		Agents:           map[[32]byte]string{},
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.MaxRequestBytes == 0 {
		cfg.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if cfg.MaxResponseBytes == 0 {
		cfg.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if cfg.MaxRequestBytes < 0 || cfg.MaxResponseBytes < 0 {
		return nil, fail("limits", errors.New("sizes must be positive"))
	}
	if f.Replay.MaxBodyBytes != nil {
		if cfg.ReplayBodyBytes = *f.Replay.MaxBodyBytes; cfg.ReplayBodyBytes < 0 {
			return nil, fail("replay.max_body_bytes", errors.New("must not be negative"))
		}
	}
	if f.Replay.Retention != "" {
		d, err := time.ParseDuration(f.Replay.Retention)
		if err != nil || d <= 0 {
			return nil, fail("replay.retention", fmt.Errorf("want a positive duration such as 24h, got %q", f.Replay.Retention))
		}
		cfg.Retention = d
	}
	if cfg.ReplayHeaders == nil {
		cfg.ReplayHeaders = defaultReplayHeaders()
	}
	for i, h := range cfg.ReplayHeaders {
		cfg.ReplayHeaders[i] = http.CanonicalHeaderKey(h)
		if redact.SensitiveHeader(cfg.ReplayHeaders[i]) {
			return nil, fail(fmt.Sprintf("replay.headers[%d]", i), fmt.Errorf("%s may carry a credential: it is never stored", h))
		}
	}

	if len(f.Agents) == 0 {
		return nil, fail("agents", errors.New("declare at least one agent: every call needs an agent's token"))
	}
	seen := map[string]bool{}
	for i, a := range f.Agents {
		field := fmt.Sprintf("agents[%d]", i)
		if a.ID == "" || strings.ContainsAny(a.ID, " \t\r\n") || seen[a.ID] {
			return nil, fail(field+".id", fmt.Errorf("want a unique id without spaces, got %q", a.ID))
		}
		seen[a.ID] = true
		tok, err := resolveSecret(a.Token, lookupEnv)
		if err != nil {
			return nil, fail(field+".token", err)
		}
		if len(tok) < minTokenBytes {
			return nil, fail(field+".token", fmt.Errorf("a token must be at least %d bytes", minTokenBytes))
		}
		h := sha256.Sum256([]byte(tok))
		if _, dup := cfg.Agents[h]; dup {
			return nil, fail(field+".token", errors.New("two agents share this token"))
		}
		cfg.Agents[h] = a.ID
	}

	if len(f.Routes) == 0 {
		return nil, fail("routes", errors.New("declare at least one route"))
	}
	prefixes := map[string]bool{}
	for i, ry := range f.Routes {
		field := fmt.Sprintf("routes[%d]", i)
		r, fld, err := compileRoute(ry, lookupEnv)
		if err != nil {
			return nil, fail(field+"."+fld, err)
		}
		if prefixes[r.Prefix] {
			return nil, fail(field+".prefix", fmt.Errorf("%s is the prefix of another route", r.Prefix))
		}
		prefixes[r.Prefix] = true
		cfg.Routes = append(cfg.Routes, r)
	}
	sort.SliceStable(cfg.Routes, func(i, j int) bool { return len(cfg.Routes[i].Prefix) > len(cfg.Routes[j].Prefix) })
	return cfg, nil
}

func compileRoute(ry routeYAML, lookupEnv func(string) (string, bool)) (*Route, string, error) {
	r := &Route{Name: ry.Name, Prefix: ry.Prefix, Dependency: ry.Dependency, Drop: ry.Drop, Secret: ry.Secret,
		PassAuthorization: ry.PassAuthorization, ReceiptsForReads: ry.ReceiptsForReads, Timeout: DefaultTimeout,
		redactor: redact.New()}
	if !strings.HasPrefix(r.Prefix, "/") || len(r.Prefix) < 2 || strings.HasSuffix(r.Prefix, "/") ||
		strings.ContainsAny(r.Prefix, "?#%") || hasDotSegment(r.Prefix) {
		return nil, "prefix", fmt.Errorf("want a path such as /stripe (no trailing slash, no dot segments), got %q", r.Prefix)
	}
	for _, p := range reservedPaths() {
		if r.Prefix == p || strings.HasPrefix(r.Prefix, p+"/") {
			return nil, "prefix", fmt.Errorf("%s is the gateway's own endpoint", p)
		}
	}
	if r.Name == "" {
		r.Name = r.Prefix
	}
	if r.Dependency == "" || len(r.Dependency) > ledger.MaxNameBytes {
		return nil, "dependency", errors.New("required, at most 200 bytes")
	}
	u, err := url.Parse(ry.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, "upstream", fmt.Errorf("want an http or https base URL, got %q", ry.Upstream)
	}
	if u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, "upstream", errors.New("must hold no credentials, query or fragment (credentials go in auth, with env or file)")
	}
	u.Path, u.RawPath = strings.TrimSuffix(u.Path, "/"), strings.TrimSuffix(u.RawPath, "/")
	r.Upstream = u
	for _, d := range []struct {
		field, v string
		dst      *time.Duration
	}{{"max_send_delay", ry.MaxSendDelay, &r.MaxSendDelay}, {"timeout", ry.Timeout, &r.Timeout}} {
		if d.v == "" {
			continue
		}
		v, err := time.ParseDuration(d.v)
		if err != nil || v <= 0 {
			return nil, d.field, fmt.Errorf("want a positive duration such as 5s, got %q", d.v)
		}
		*d.dst = v
	}
	if r.MaxSendDelay > ledger.MaxSendDelayLimit {
		return nil, "max_send_delay", fmt.Errorf("at most %v", ledger.MaxSendDelayLimit)
	}
	if ry.ExternalID != "" {
		if r.ExternalID, err = ledger.ExternalIDAt(ry.ExternalID); err != nil {
			return nil, "external_id", err
		}
	}
	for i, oy := range ry.Operations {
		field := fmt.Sprintf("operations[%d]", i)
		method := strings.ToUpper(oy.Method)
		if method == "" || oy.Name == "" || len(oy.Name) > ledger.MaxNameBytes {
			return nil, field, errors.New("method and name (at most 200 bytes) are required")
		}
		if !strings.HasPrefix(oy.Path, "/") {
			return nil, field + ".path", fmt.Errorf("want a path such as /v1/charges/{id}, got %q", oy.Path)
		}
		segs := strings.Split(strings.TrimPrefix(oy.Path, "/"), "/")
		if i := slices.Index(segs, "*"); i >= 0 && i != len(segs)-1 {
			return nil, field + ".path", errors.New("* may only end a path")
		}
		r.Operations = append(r.Operations, Operation{Method: method, Path: segs, Name: oy.Name, Drop: oy.Drop, Secret: oy.Secret})
	}
	if a := ry.Auth; a != nil {
		secret, err := resolveSecret(a.secretYAML, lookupEnv)
		if err != nil {
			return nil, "auth", err
		}
		if r.authHeader, r.authValue, err = credential.Header(a.Scheme, a.Header, secret); err != nil {
			if ce := (*credential.Error)(nil); errors.As(err, &ce) {
				return nil, "auth." + ce.Field, ce.Err
			}
			return nil, "auth", err
		}
		r.redactor.Add(secret)
		r.redactor.AddHeader(r.authValue)
		// Built now, by its first use: String is then safe for the
		// route's concurrent requests.
		r.redactor.String(r.authValue)
	}
	if ry.Webhook != nil {
		w, fld, err := compileWebhook(*ry.Webhook, lookupEnv)
		if err != nil {
			return nil, "webhook." + fld, err
		}
		r.Webhook = w
	}
	return r, "", nil
}

// compileWebhook checks a route's webhook and resolves its secret; the
// field it returns names what is wrong.
func compileWebhook(wy webhookYAML, lookupEnv func(string) (string, bool)) (*Webhook, string, error) {
	u, err := url.Parse(wy.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, "url", fmt.Errorf("want an http or https URL, got %q", redactURL(wy.URL))
	}
	if u.User != nil || u.Fragment != "" {
		return nil, "url", errors.New("must hold no credentials or fragment (events are signed with the secret instead)")
	}
	secret, err := resolveSecret(wy.Secret, lookupEnv)
	if err != nil {
		return nil, "secret", err
	}
	if len(secret) < minWebhookSecretBytes {
		return nil, "secret", fmt.Errorf("a webhook secret must be at least %d bytes", minWebhookSecretBytes)
	}
	w := &Webhook{URL: u, Timeout: DefaultWebhookTimeout, MaxAttempts: wy.MaxAttempts, MaxAge: DefaultWebhookMaxAge,
		secret: []byte(secret)}
	if w.MaxAttempts == 0 {
		w.MaxAttempts = DefaultWebhookMaxAttempts
	}
	if w.MaxAttempts < 1 || w.MaxAttempts > 100 {
		return nil, "max_attempts", fmt.Errorf("want 1 to 100, got %d", wy.MaxAttempts)
	}
	for _, d := range []struct {
		field, v string
		dst      *time.Duration
	}{{"timeout", wy.Timeout, &w.Timeout}, {"max_age", wy.MaxAge, &w.MaxAge}} {
		if d.v == "" {
			continue
		}
		v, err := time.ParseDuration(d.v)
		if err != nil || v <= 0 {
			return nil, d.field, fmt.Errorf("want a positive duration such as 10s, got %q", d.v)
		}
		*d.dst = v
	}
	return w, "", nil
}

// redactURL is a URL as an error may quote it: without its user info.
func redactURL(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		return u.Redacted()
	}
	return "(unparsable)"
}

// resolveSecret reads a credential from the environment or a file. Errors
// name the variable or the file, never the value.
func resolveSecret(s secretYAML, lookupEnv func(string) (string, bool)) (string, error) {
	return credential.Resolve(s.Env, s.File, lookupEnv)
}

// operation returns the operation of a call to path (relative to the
// route's prefix) with method, and the fields left out of its fingerprint
// and kept secret; ok is false when the route declares operations and none
// matches.
func (r *Route) operation(method, path string) (name string, drop, secret []string, ok bool) {
	if len(r.Operations) == 0 {
		return strings.ToLower(method) + " " + path, r.Drop, r.Secret, true
	}
	segs := strings.Split(strings.TrimPrefix(path, "/"), "/")
	for _, op := range r.Operations {
		if op.Method == method && matchPath(op.Path, segs) {
			return op.Name, append(slices.Clip(r.Drop), op.Drop...), append(slices.Clip(r.Secret), op.Secret...), true
		}
	}
	return "", nil, nil, false
}

func matchPath(pattern, segs []string) bool {
	for i, p := range pattern {
		if p == "*" {
			return true
		}
		if i >= len(segs) {
			return false
		}
		if strings.HasPrefix(p, "{") && strings.HasSuffix(p, "}") {
			if segs[i] == "" {
				return false
			}
			continue
		}
		if p != segs[i] {
			return false
		}
	}
	return len(segs) == len(pattern)
}

// hasDotSegment reports whether an escaped path holds a "." or ".."
// segment, in any encoding, also once an encoded slash or backslash in it
// is taken for a separator (as many servers and frameworks in front of an
// API do), and also once matrix parameters are cut from it (Tomcat, Jetty
// and Spring strip ";params" from a segment before resolving dot segments,
// so "..;x" is ".." to them): forwarded, it could leave the upstream's base
// path.
func hasDotSegment(escaped string) bool {
	for _, seg := range strings.Split(escaped, "/") {
		s, err := url.PathUnescape(seg)
		if err != nil {
			return true
		}
		for _, part := range strings.FieldsFunc(s, func(r rune) bool { return r == '/' || r == '\\' }) {
			part, _, _ = strings.Cut(part, ";")
			if part == "." || part == ".." {
				return true
			}
		}
	}
	return false
}
