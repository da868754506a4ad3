package httpadapter

import "sort"

// presets returns the preset settings blocks by name. They are YAML so an
// operator overrides any default with the same syntax: the operator's block
// is merged over the preset key by key. A function, not a variable, so no
// caller can change a preset for everybody.
func presets() map[string]string {
	return map[string]string{
		// Stripe: the agent puts the step's logical key (ledger.Key, shared
		// by every attempt) in metadata['idempotency_key'] (Stripe keeps
		// metadata on every object and indexes it for search). The key, not
		// the receipt id: an agent going through ledger.Caller builds the
		// request before the receipt exists, and knows only the key. Search is
		// GET /v1/<objects>/search?query=... answering a search_result with
		// has_more/next_page, the next page asked for with page=<next_page>.
		// The query names the key and nothing else: no created>= clause,
		// since a marked charge is the step's whatever its creation time,
		// and a server-side time filter would drop it if Stripe's clock and
		// the database's differed by more than window_skew.
		// Search results may lag writes (about a minute in Stripe's
		// documentation): set consistency_window accordingly.
		"stripe": `
base_url: https://api.stripe.com
auth: {scheme: bearer}
search:
  method: GET
  path: /v1/charges/search
  query:
    query: "metadata['idempotency_key']:'{receipt.logical_key|squote}'"
    limit: "100"
  items: /data
  id: /id
  created_at: /created
  created_at_format: unix
  pagination: {style: cursor, cursor: /next_page, has_more: /has_more, param: page, max_pages: 10}
match:
  marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`,
		// GitHub issues and comments: the agent ends the body with a hidden
		// HTML comment <!-- receipt:KEY -->, KEY the receipt's idempotency
		// key. The list endpoint is the path the agent posted to
		// (GET /repos/{o}/{r}/issues, or /repos/{o}/{r}/issues/{n}/comments),
		// filtered with since= and, for issues, creator= (set it in query);
		// pages follow the Link header. A 403 with X-RateLimit-Remaining: 0
		// is a rate limit.
		"github": `
base_url: https://api.github.com
auth: {scheme: bearer}
headers:
  Accept: application/vnd.github+json
  X-GitHub-Api-Version: "2022-11-28"
search:
  method: GET
  path: "{receipt.target}"
  query:
    since: "{window.start}"
    state: all
    per_page: "100"
    sort: created
    direction: desc
  items: ""
  id: /id
  created_at: /created_at
  created_at_format: rfc3339
  pagination: {style: link, max_pages: 10}
match:
  marker: {pointer: /body, contains: "<!-- receipt:{receipt.logical_key} -->"}
rate_limit: {remaining_header: X-RateLimit-Remaining, reset_header: X-RateLimit-Reset, reset_format: unix}
`,
		// A generic JSON REST collection: GET <the path the agent posted
		// to>?created_after=...&page=N answering {"items": [...]} until a
		// page comes back empty; the agent puts the step's logical key in
		// metadata.idempotency_key. The path is the receipt's target, never
		// a fixed collection: a fixed path read for every receipt would
		// answer "absent" for effects made elsewhere. Page numbers can skip
		// items under concurrent writes: an absence is confirmed by a
		// second pass unless the query names the key (see docs/adapters.md).
		"rest": `
search:
  method: GET
  path: "{receipt.target}"
  query: {created_after: "{window.start}"}
  items: /items
  id: /id
  created_at: /created_at
  created_at_format: rfc3339
  pagination: {style: page, max_pages: 10}
match:
  marker: {pointer: /metadata/idempotency_key, equals: "{receipt.logical_key}"}
`,
	}
}

func presetNames() []string {
	var names []string
	for k := range presets() {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}
