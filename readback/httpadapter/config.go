package httpadapter

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"sort"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/receiptledger/reconciler/internal/credential"
	"github.com/receiptledger/reconciler/readback"
)

// The settings block under `http:`. Every key is optional in the YAML
// because a preset may supply it; validation after the merge decides.
type settingsYAML struct {
	Preset       string            `yaml:"preset"`
	BaseURL      string            `yaml:"base_url"`
	Auth         *authYAML         `yaml:"auth"`
	Timeout      string            `yaml:"timeout"`
	Headers      map[string]string `yaml:"headers"`
	WindowSkew   string            `yaml:"window_skew"`
	IntentFields map[string]string `yaml:"intent_fields"`
	Search       *searchYAML       `yaml:"search"`
	Fetch        *fetchYAML        `yaml:"fetch"`
	Match        *matchYAML        `yaml:"match"`
	Compare      *compareYAML      `yaml:"compare"`
	Guard        *guardYAML        `yaml:"guard"`
	RateLimit    *rateLimitYAML    `yaml:"rate_limit"`
	// Retry says how a request failing transiently is retried within a
	// check (retry.go).
	Retry *retryYAML `yaml:"retry"`
	// MaxResponseBytes bounds one response body (default 8 MiB).
	MaxResponseBytes int `yaml:"max_response_bytes"`
	// SecretFields lists payload pointers the agent declares secret
	// (ledger.Input.Secret): a template, compare or fingerprint field over
	// one of them (or inside one) is refused when the file loads.
	SecretFields []string `yaml:"secret_fields"`
}

type authYAML struct {
	Scheme string `yaml:"scheme"`
	Header string `yaml:"header"`
	Env    string `yaml:"env"`
	File   string `yaml:"file"`
}

type searchYAML struct {
	Method          string            `yaml:"method"`
	Path            string            `yaml:"path"`
	Query           map[string]string `yaml:"query"`
	Items           *string           `yaml:"items"`
	ID              string            `yaml:"id"`
	CreatedAt       string            `yaml:"created_at"`
	CreatedAtFormat string            `yaml:"created_at_format"`
	Pagination      *paginationYAML   `yaml:"pagination"`
	// MaxPageItems bounds the items of one page (default 1000).
	MaxPageItems int `yaml:"max_page_items"`
	// Batch declares that the list, read over a time window without the
	// key filter, answers many receipts at once (batch.go).
	Batch *batchYAML `yaml:"batch"`
}

type paginationYAML struct {
	Style    string `yaml:"style"`
	Cursor   string `yaml:"cursor"`
	HasMore  string `yaml:"has_more"`
	Param    string `yaml:"param"`
	Start    *int   `yaml:"start"`
	MaxPages int    `yaml:"max_pages"`
	// Stable (style link only) declares that the Link header carries
	// server cursors, which concurrent writes cannot shift; by default a
	// Link list is taken to carry page numbers (GitHub's do).
	Stable bool `yaml:"stable"`
	// WholeList (style none only) declares that the endpoint answers the
	// whole collection in one response, never a first page. Nothing in a
	// response says so: a paginated API read without pagination answers
	// its first page, which looks exactly like a short whole list, and a
	// positive control on that first page (the newest item of a list
	// sorted newest first) passes. Only the operator can vouch for it;
	// without it an unpaged absence is authoritative only when the query
	// is narrowed to the receipt's key.
	WholeList bool `yaml:"whole_list"`
}

type fetchYAML struct {
	Method string            `yaml:"method"`
	Path   string            `yaml:"path"`
	Query  map[string]string `yaml:"query"`
	ID     string            `yaml:"id"`
	Gone   []int             `yaml:"gone"`
	// Batch declares a fetch of many resources by id in one request
	// (batchfetch.go).
	Batch *fetchBatchYAML `yaml:"batch"`
}

type matchYAML struct {
	Marker      *markerYAML      `yaml:"marker"`
	Fingerprint *fingerprintYAML `yaml:"fingerprint"`
}

type markerYAML struct {
	Pointer  string `yaml:"pointer"`
	Equals   string `yaml:"equals"`
	Contains string `yaml:"contains"`
}

type fingerprintYAML struct {
	Fields map[string]string `yaml:"fields"`
	Drop   []string          `yaml:"drop"`
}

type compareYAML struct {
	Fields map[string]string `yaml:"fields"`
}

// guardYAML lists resource fields a delete expects to find as in the
// pre-image while the resource is still there.
type guardYAML struct {
	Fields []string `yaml:"fields"`
}

type rateLimitYAML struct {
	RemainingHeader string `yaml:"remaining_header"`
	ResetHeader     string `yaml:"reset_header"`
	ResetFormat     string `yaml:"reset_format"`
}

// config is a validated, compiled settings block.
type config struct {
	name       string
	preset     string
	base       *url.URL
	timeout    time.Duration
	headers    http.Header
	skew       time.Duration
	intent     map[string]string // name -> payload pointer
	auth       *auth
	search     *searchConfig
	fetch      *fetchConfig
	marker     *markerConfig
	fp         *fpConfig
	compare    []fieldPair
	guard      []pointer
	rateLimit  rateLimitYAML
	pagination paginationYAML
	retry      retryPolicy
	// maxBytes bounds a response body (max_response_bytes).
	maxBytes int
	// secret are the payload pointers declared secret (secret_fields).
	secret []pointer
}

type auth struct {
	header string // header name
	value  string // full header value: the secret, never logged
	secret string
}

type searchConfig struct {
	method          string
	path            template
	query           map[string]template
	items           pointer
	id              pointer
	createdAt       pointer
	createdAtFormat string
	maxItems        int
	// narrowed: the path or query names the receipt's key or id, so the
	// API returns only the receipt's own resources (if it honours the
	// filter: the search checks that every item returned carries the
	// marker before relying on it).
	narrowed bool
	// batch is the shared read of many receipts, nil when not declared.
	batch *batchConfig
}

type fetchConfig struct {
	method string
	path   template
	query  map[string]template
	id     pointer
	gone   []int
	// batch is the fetch of many resources at once, nil when not declared.
	batch *fetchBatchConfig
}

type markerConfig struct {
	pointer  pointer
	equals   template
	contains template
}

type fpConfig struct {
	fields []fieldPair
	drop   []string
}

// fieldPair maps a payload field of the intent to a field of the resource.
type fieldPair struct {
	payload  pointer
	resource pointer
}

// fieldErr names a field of the settings block.
func fieldErr(field string, format string, args ...any) error {
	return &readback.FieldError{Field: field, Err: fmt.Errorf(format, args...)}
}

// checkUnknown refuses a key of n that t (a struct type with yaml tags)
// does not declare, naming its dotted path: a typo must fail at start.
func checkUnknown(n *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if n == nil || n.Kind == yaml.AliasNode {
		return nil
	}
	join := func(k string) string {
		if path == "" {
			return k
		}
		return path + "." + k
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			if n.Tag == "!!null" {
				return nil
			}
			return fieldErr(pathOr(path), "must be a mapping")
		}
		fields := map[string]reflect.Type{}
		for i := 0; i < t.NumField(); i++ {
			tag, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ",")
			fields[tag] = t.Field(i).Type
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i].Value
			ft, ok := fields[k]
			if !ok {
				return fieldErr(join(k), "unknown field")
			}
			if err := checkUnknown(n.Content[i+1], ft, join(k)); err != nil {
				return err
			}
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode && n.Tag != "!!null" {
			return fieldErr(pathOr(path), "must be a mapping")
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			if v := n.Content[i+1]; v.Kind != yaml.ScalarNode {
				return fieldErr(join(n.Content[i].Value), "must be a string")
			}
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode && n.Tag != "!!null" {
			return fieldErr(pathOr(path), "must be a list")
		}
	default:
		if n.Kind != yaml.ScalarNode {
			return fieldErr(pathOr(path), "must be a single value")
		}
	}
	return nil
}

func pathOr(p string) string {
	if p == "" {
		return "http"
	}
	return p
}

// mergeNodes returns base with over laid on top: mappings merge key by key
// (recursively), anything else in over replaces. Presets are YAML, so the
// operator overrides any default with the same syntax.
func mergeNodes(base, over *yaml.Node) *yaml.Node {
	if base == nil {
		return over
	}
	if over == nil {
		return base
	}
	if base.Kind != yaml.MappingNode || over.Kind != yaml.MappingNode {
		return over
	}
	out := &yaml.Node{Kind: yaml.MappingNode, Tag: base.Tag, Line: over.Line, Column: over.Column}
	idx := map[string]int{}
	for i := 0; i+1 < len(base.Content); i += 2 {
		idx[base.Content[i].Value] = len(out.Content)
		out.Content = append(out.Content, base.Content[i], base.Content[i+1])
	}
	for i := 0; i+1 < len(over.Content); i += 2 {
		k := over.Content[i].Value
		if j, ok := idx[k]; ok {
			out.Content[j+1] = mergeNodes(out.Content[j+1], over.Content[i+1])
			continue
		}
		out.Content = append(out.Content, over.Content[i], over.Content[i+1])
	}
	return out
}

// parseSettings merges the preset named in n (if any) under n, checks for
// unknown fields, decodes and validates.
func parseSettings(name string, n *yaml.Node, o *options) (*config, error) {
	if n == nil {
		return nil, fieldErr("base_url", "is required (the http block is missing)")
	}
	if err := checkUnknown(n, reflect.TypeFor[settingsYAML](), ""); err != nil {
		return nil, err
	}
	var head struct {
		Preset string `yaml:"preset"`
	}
	if err := n.Decode(&head); err != nil {
		return nil, err // the loader names the http block
	}
	merged := n
	if head.Preset != "" {
		text, ok := presets()[head.Preset]
		if !ok {
			return nil, fieldErr("preset", "unknown preset %q (known: %s)", head.Preset, strings.Join(presetNames(), ", "))
		}
		var doc yaml.Node
		if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
			return nil, fmt.Errorf("preset %s: %w", head.Preset, err) // a bug in this package
		}
		merged = mergeNodes(doc.Content[0], n)
	}
	var s settingsYAML
	if err := merged.Decode(&s); err != nil {
		return nil, err
	}
	return compile(name, s, o)
}

func compile(name string, s settingsYAML, o *options) (*config, error) {
	c := &config{name: name, preset: s.Preset, headers: http.Header{}, intent: map[string]string{}}
	if s.BaseURL == "" {
		return nil, fieldErr("base_url", "is required")
	}
	u, err := url.Parse(s.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fieldErr("base_url", "want an absolute http(s) URL, got %q", s.BaseURL)
	}
	if u.User != nil {
		return nil, fieldErr("base_url", "must not hold credentials (use auth with env or file)")
	}
	c.base = u
	c.timeout = 10 * time.Second
	if s.Timeout != "" {
		if c.timeout, err = time.ParseDuration(s.Timeout); err != nil || c.timeout <= 0 {
			return nil, fieldErr("timeout", "want a positive duration such as 10s, got %q", s.Timeout)
		}
	}
	c.skew = 5 * time.Minute
	if s.WindowSkew != "" {
		if c.skew, err = time.ParseDuration(s.WindowSkew); err != nil || c.skew < 0 {
			return nil, fieldErr("window_skew", "want a duration such as 5m, got %q", s.WindowSkew)
		}
	}
	for k, v := range s.Headers {
		if strings.EqualFold(k, "Authorization") || strings.EqualFold(k, "Cookie") {
			// Headers in the file are not secret; a credential here would be
			// stored in plain text and shown by `adapters check`.
			return nil, fieldErr("headers."+k, "credentials go in auth (env or file), not in headers")
		}
		c.headers.Set(k, v)
	}
	if c.retry, err = compileRetry(s.Retry); err != nil {
		return nil, err
	}
	c.maxBytes = defaultMaxResponseBytes
	if s.MaxResponseBytes != 0 {
		if s.MaxResponseBytes < 1024 || s.MaxResponseBytes > maxMaxResponseBytes {
			return nil, fieldErr("max_response_bytes", "want 1024 to %d, got %d", maxMaxResponseBytes, s.MaxResponseBytes)
		}
		c.maxBytes = s.MaxResponseBytes
	}
	for i, v := range s.SecretFields {
		p, err := parsePointer(v)
		if err != nil || len(p.tokens) == 0 {
			if err == nil {
				err = errors.New("must name a payload field")
			}
			return nil, fieldErr(fmt.Sprintf("secret_fields[%d]", i), "%v", err)
		}
		c.secret = append(c.secret, p)
	}
	for k, v := range s.IntentFields {
		p, err := parsePointer(v)
		if err != nil {
			return nil, fieldErr("intent_fields."+k, "%v", err)
		}
		if sp, ok := c.secretOver(p); ok {
			// The stored intent holds a marker in its place: a template
			// over it would search for the marker and find nothing.
			return nil, fieldErr("intent_fields."+k, "%s is a secret field (secret_fields: %s): the receipt stores "+
				"a redaction marker in its place, so no template can use it", v, sp)
		}
		c.intent[k] = v
	}
	if c.auth, err = compileAuth(s.Auth, o); err != nil {
		return nil, err
	}
	if s.Search != nil && s.Fetch != nil {
		return nil, fieldErr("fetch", "search (create) and fetch (update, delete) exclude each other")
	}
	if s.Search == nil && s.Fetch == nil {
		return nil, fieldErr("search", "one of search (create) or fetch (update, delete) is required")
	}
	if s.Search != nil {
		if err := c.compileSearch(s); err != nil {
			return nil, err
		}
	} else {
		if err := c.compileFetch(s); err != nil {
			return nil, err
		}
	}
	if s.RateLimit != nil {
		switch s.RateLimit.ResetFormat {
		case "", "unix", "seconds":
		default:
			return nil, fieldErr("rate_limit.reset_format", "want unix (epoch seconds) or seconds (delta), got %q", s.RateLimit.ResetFormat)
		}
		c.rateLimit = *s.RateLimit
	}
	return c, nil
}

// secretOver reports the secret pointer that p names or lies inside (or
// that lies inside p: an object holding a secret field), if any.
func (c *config) secretOver(p pointer) (string, bool) {
	for _, sp := range c.secret {
		n := min(len(sp.tokens), len(p.tokens))
		if slices.Equal(sp.tokens[:n], p.tokens[:n]) {
			return sp.text, true
		}
	}
	return "", false
}

// checkSecretPairs refuses a compare or fingerprint field over a secret
// payload field: the stored intent holds a marker in its place.
func (c *config) checkSecretPairs(field string, pairs []fieldPair) error {
	for _, p := range pairs {
		if sp, ok := c.secretOver(p.payload); ok {
			return fieldErr(field+"."+p.payload.text, "%s is a secret field (secret_fields: %s): the receipt stores "+
				"a redaction marker in its place, so it cannot be compared", p.payload.text, sp)
		}
	}
	return nil
}

func compileAuth(a *authYAML, o *options) (*auth, error) {
	if a == nil {
		return nil, nil
	}
	secret, err := credential.Resolve(a.Env, a.File, o.lookupEnv)
	if err != nil {
		return nil, authErr(err)
	}
	header, value, err := credential.Header(a.Scheme, a.Header, secret)
	if err != nil {
		return nil, authErr(err)
	}
	return &auth{header: header, value: value, secret: secret}, nil
}

// authErr is a credential's error as a field error of the auth block.
func authErr(err error) error {
	var ce *credential.Error
	if errors.As(err, &ce) {
		return fieldErr("auth."+ce.Field, "%v", ce.Err)
	}
	return err
}

func (c *config) tmpl(field, s string) (template, error) {
	t, err := compileTemplate(s, c.intent)
	if err != nil {
		return template{}, fieldErr(field, "%v", err)
	}
	return t, nil
}

func (c *config) ptr(field, s string) (pointer, error) {
	p, err := parsePointer(s)
	if err != nil {
		return pointer{}, fieldErr(field, "%v", err)
	}
	return p, nil
}

func (c *config) queryTemplates(field string, q map[string]string) (map[string]template, error) {
	out := map[string]template{}
	for k, v := range q {
		t, err := c.tmpl(field+"."+k, v)
		if err != nil {
			return nil, err
		}
		out[k] = t
	}
	return out, nil
}

func method(field, m string) (string, error) {
	switch strings.ToUpper(m) {
	case "", http.MethodGet:
		return http.MethodGet, nil
	case http.MethodPost:
		// Some search APIs take POST; the adapter never sends a body, and
		// the operator vouches that the endpoint only reads.
		return http.MethodPost, nil
	}
	return "", fieldErr(field, "want GET or POST (a readback never changes anything), got %q", m)
}

func (c *config) compileSearch(s settingsYAML) error {
	sy := s.Search
	sc := &searchConfig{createdAtFormat: sy.CreatedAtFormat}
	var err error
	if sc.method, err = method("search.method", sy.Method); err != nil {
		return err
	}
	if sy.Path == "" {
		return fieldErr("search.path", "is required")
	}
	if sc.path, err = c.tmpl("search.path", sy.Path); err != nil {
		return err
	}
	if sc.query, err = c.queryTemplates("search.query", sy.Query); err != nil {
		return err
	}
	sc.narrowed = sc.path.namesKey()
	for _, t := range sc.query {
		sc.narrowed = sc.narrowed || t.namesKey()
	}
	if sy.Items == nil {
		return fieldErr("search.items", "is required (a JSON pointer to the list; empty for a top-level array)")
	}
	if sc.items, err = c.ptr("search.items", *sy.Items); err != nil {
		return err
	}
	if sy.ID == "" {
		return fieldErr("search.id", "is required (a JSON pointer to each item's id)")
	}
	if sc.id, err = c.ptr("search.id", sy.ID); err != nil {
		return err
	}
	if sy.CreatedAt == "" {
		return fieldErr("search.created_at", "is required (a JSON pointer to each item's creation time)")
	}
	if sc.createdAt, err = c.ptr("search.created_at", sy.CreatedAt); err != nil {
		return err
	}
	sc.maxItems = defaultMaxPageItems
	if sy.MaxPageItems != 0 {
		if sy.MaxPageItems < 1 || sy.MaxPageItems > maxMaxPageItems {
			return fieldErr("search.max_page_items", "want 1 to %d, got %d", maxMaxPageItems, sy.MaxPageItems)
		}
		sc.maxItems = sy.MaxPageItems
	}
	switch sy.CreatedAtFormat {
	case "", "rfc3339", "unix", "unix_ms":
	default:
		return fieldErr("search.created_at_format", "want rfc3339, unix or unix_ms, got %q", sy.CreatedAtFormat)
	}
	c.search = sc
	if err := c.compilePagination(sy.Pagination); err != nil {
		return err
	}
	if s.Compare != nil {
		return fieldErr("compare", "applies to fetch (update), not to search")
	}
	if s.Guard != nil {
		return fieldErr("guard", "applies to fetch (delete), not to search")
	}
	if s.Match == nil || (s.Match.Marker == nil && s.Match.Fingerprint == nil) {
		return fieldErr("match", "a search needs match.marker or match.fingerprint")
	}
	if m := s.Match.Marker; m != nil {
		mc := &markerConfig{}
		if mc.pointer, err = c.ptr("match.marker.pointer", m.Pointer); err != nil {
			return err
		}
		if m.Pointer == "" {
			return fieldErr("match.marker.pointer", "is required")
		}
		if (m.Equals == "") == (m.Contains == "") {
			return fieldErr("match.marker.equals", "set exactly one of equals or contains")
		}
		if mc.equals, err = c.tmpl("match.marker.equals", m.Equals); err != nil {
			return err
		}
		if mc.contains, err = c.tmpl("match.marker.contains", m.Contains); err != nil {
			return err
		}
		c.marker = mc
	}
	if f := s.Match.Fingerprint; f != nil {
		if len(f.Fields) == 0 {
			return fieldErr("match.fingerprint.fields", "is required: payload pointer -> item pointer")
		}
		fc := &fpConfig{drop: f.Drop}
		if fc.fields, err = c.pairs("match.fingerprint.fields", f.Fields); err != nil {
			return err
		}
		if err := c.checkSecretPairs("match.fingerprint.fields", fc.fields); err != nil {
			return err
		}
		for i, d := range f.Drop {
			if _, err := parsePointer(d); err != nil {
				return fieldErr(fmt.Sprintf("match.fingerprint.drop[%d]", i), "%v", err)
			}
		}
		c.fp = fc
	}
	return c.compileBatch(sy.Batch)
}

// pairs compiles a payload-pointer -> resource-pointer map in a stable order.
func (c *config) pairs(field string, m map[string]string) ([]fieldPair, error) {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]fieldPair, 0, len(keys))
	probe := map[string]any{}
	for _, k := range keys {
		pp, err := c.ptr(field+"."+k, k)
		if err != nil {
			return nil, err
		}
		if len(pp.tokens) == 0 {
			return nil, fieldErr(field+"."+k, "the payload pointer must name a field")
		}
		if err := pp.set(probe, true); err != nil {
			return nil, fieldErr(field+"."+k, "%v", err)
		}
		rp, err := c.ptr(field+"."+k, m[k])
		if err != nil {
			return nil, err
		}
		out = append(out, fieldPair{payload: pp, resource: rp})
	}
	return out, nil
}

func (c *config) compilePagination(p *paginationYAML) error {
	pg := paginationYAML{Style: "none", MaxPages: 10}
	if p != nil {
		pg = *p
		if pg.Style == "" {
			pg.Style = "none"
		}
		if pg.MaxPages == 0 {
			pg.MaxPages = 10
		}
	}
	if pg.MaxPages < 1 || pg.MaxPages > 1000 {
		return fieldErr("search.pagination.max_pages", "want 1 to 1000, got %d", pg.MaxPages)
	}
	if pg.Stable && pg.Style != "link" {
		return fieldErr("search.pagination.stable", "applies to style link only (cursor lists are stable, page and offset lists never are)")
	}
	if pg.WholeList && pg.Style != "none" {
		return fieldErr("search.pagination.whole_list", "applies to style none only (a paginated list is read to its end instead)")
	}
	switch pg.Style {
	case "none", "link":
	case "cursor":
		if pg.Cursor == "" {
			return fieldErr("search.pagination.cursor", "is required with style cursor (a JSON pointer to the next cursor)")
		}
		if _, err := c.ptr("search.pagination.cursor", pg.Cursor); err != nil {
			return err
		}
		// Without a "more pages" flag, a cursor pointer that names nothing
		// (a typo, another API version) reads as "no next page": the first
		// page would pass for the whole list, and a control served on it
		// (the newest item of a list sorted newest first) would pass too.
		if pg.HasMore == "" {
			return fieldErr("search.pagination.has_more", "is required with style cursor (a JSON pointer to the boolean "+
				"saying more pages follow): without it a wrong cursor pointer reads as the end of the list")
		}
		if _, err := c.ptr("search.pagination.has_more", pg.HasMore); err != nil {
			return err
		}
		if pg.Param == "" {
			return fieldErr("search.pagination.param", "is required with style cursor (the query parameter carrying the cursor)")
		}
	case "page", "offset":
		if pg.Param == "" {
			// Named like the style, so switching a preset's page list to
			// offsets never sends offsets as page numbers.
			pg.Param = pg.Style
		}
		if pg.Start == nil {
			first := 1 // page numbers start at 1, offsets at 0
			if pg.Style == "offset" {
				first = 0
			}
			pg.Start = &first
		}
		if *pg.Start < 0 {
			return fieldErr("search.pagination.start", "must not be negative, got %d", *pg.Start)
		}
	default:
		return fieldErr("search.pagination.style", "want none, cursor, link, page or offset, got %q", pg.Style)
	}
	if pg.Style != "page" && pg.Style != "offset" {
		zero := 0 // unused by the other styles
		pg.Start = &zero
	}
	c.pagination = pg
	return nil
}

// shiftable reports whether concurrent writes can move items between the
// pages of the search's list, so that one pass may skip an item: page
// numbers, offsets, and Link headers unless declared stable.
func (c *config) shiftable() bool {
	switch c.pagination.Style {
	case "page", "offset":
		return true
	case "link":
		return !c.pagination.Stable
	}
	return false
}

func (c *config) compileFetch(s settingsYAML) error {
	fy := s.Fetch
	fc := &fetchConfig{gone: fy.Gone}
	var err error
	if fc.method, err = method("fetch.method", fy.Method); err != nil {
		return err
	}
	path := fy.Path
	if path == "" {
		path = "{receipt.target}"
	}
	if fc.path, err = c.tmpl("fetch.path", path); err != nil {
		return err
	}
	if fc.query, err = c.queryTemplates("fetch.query", fy.Query); err != nil {
		return err
	}
	if fc.id, err = c.ptr("fetch.id", fy.ID); err != nil {
		return err
	}
	if fy.ID == "" {
		return fieldErr("fetch.id", "is required (a JSON pointer to the resource's id)")
	}
	if len(fc.gone) == 0 {
		fc.gone = []int{http.StatusNotFound, http.StatusGone}
	}
	for i, g := range fc.gone {
		if g < 400 || g > 499 || g == http.StatusUnauthorized || g == http.StatusForbidden || g == http.StatusTooManyRequests {
			return fieldErr(fmt.Sprintf("fetch.gone[%d]", i), "%d cannot mean the resource is gone", g)
		}
	}
	if s.Match != nil {
		return fieldErr("match", "applies to search (create), not to fetch")
	}
	if s.Guard != nil {
		if s.Compare != nil {
			return fieldErr("guard", "guard (delete) and compare (update) exclude each other")
		}
		if len(s.Guard.Fields) == 0 {
			return fieldErr("guard.fields", "is required: resource pointers")
		}
		for i, g := range s.Guard.Fields {
			p, err := c.ptr(fmt.Sprintf("guard.fields[%d]", i), g)
			if err != nil {
				return err
			}
			c.guard = append(c.guard, p)
		}
	}
	if s.Compare != nil {
		if len(s.Compare.Fields) == 0 {
			return fieldErr("compare.fields", "is required: payload pointer -> resource pointer")
		}
		if c.compare, err = c.pairs("compare.fields", s.Compare.Fields); err != nil {
			return err
		}
		if err := c.checkSecretPairs("compare.fields", c.compare); err != nil {
			return err
		}
	}
	c.fetch = fc
	return c.compileFetchBatch(fy.Batch)
}

// kinds returns the operation kinds this configuration can read back.
func (c *config) kinds() []readback.Kind {
	switch {
	case c.search != nil:
		return []readback.Kind{readback.Create}
	case len(c.compare) > 0:
		return []readback.Kind{readback.Update}
	}
	return []readback.Kind{readback.Delete}
}
