package httpadapter

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/receiptledger/reconciler/readback"
)

// pass is one read of the whole list, from its first page to its end.
type pass struct {
	requests int
	// nonEmpty counts the pages that held at least one item.
	nonEmpty int
	// ids are every item's identity, in the order served (duplicates
	// kept): two passes agree when these are equal.
	ids []string
	// foreign counts the items that do not carry the receipt's marker.
	foreign   int
	matches   []string
	matchedBy string
	// truncated: max_pages stopped the pass; incomplete says why the pass
	// did not reach the end of the list ("" when it did).
	truncated  bool
	incomplete string
	// insane counts unmarked items whose creation time is outside any
	// sane range (saneTime); insaneReason describes the first. Such a
	// pass proves no absence (incompleteAfter, applied once the pass ends).
	insane          int
	insaneReason    string
	incompleteAfter string
}

// readPass reads the list once, from first to its end or the page bound,
// adding what it saw to ev. A pass that saw an unmarked item with an absurd
// creation time is incomplete: its absence proves nothing.
func (a *Adapter) readPass(ctx context.Context, rt *retrier, sc *scope, first *url.URL, m *itemMatcher, ev *Evidence) (*pass, error) {
	p, err := a.readPassOnce(ctx, rt, sc, first, m, ev)
	if err == nil && p.incomplete == "" && p.incompleteAfter != "" {
		p.incomplete = p.incompleteAfter
	}
	return p, err
}

func (a *Adapter) readPassOnce(ctx context.Context, rt *retrier, sc *scope, first *url.URL, m *itemMatcher, ev *Evidence) (*pass, error) {
	s := a.cfg.search
	pg := a.cfg.pagination
	p := &pass{}
	ev.Passes++
	defer func() { ev.PassItems = append(ev.PassItems, len(p.ids)) }()
	seen := map[string]bool{}
	var prevPage []string
	u := first
	page := *pg.Start
	for {
		// A failed page (timeout, 5xx, a short Retry-After, a cut or
		// garbled body: a proxy's fault) is asked again within the pass,
		// at the same URL: the pages before it stay read, and the pass
		// goes on from it exactly as if the first answer had been good.
		var resp *response
		var doc any
		err := rt.do(ctx, ev.Passes, p.requests+1, func() (err error) {
			resp, doc, err = a.getList(ctx, s.method, u, &s.items, s.maxItems)
			return err
		})
		if err != nil {
			return nil, err
		}
		p.requests++
		ev.Pages++
		raw, ok := s.items.get(doc)
		list, isList := raw.([]any)
		if !ok || !isList {
			return nil, readback.PermanentError(fmt.Errorf("%s: items pointer %q does not name a list in the response", u.Redacted(), s.items.text))
		}
		if len(list) > 0 {
			p.nonEmpty++
		}
		pageIDs := make([]string, 0, len(list))
		for i, item := range list {
			ev.Items++
			pageIDs = append(pageIDs, identity(item, s.id))
			marked := m.marker(item)
			if !marked {
				p.foreign++
			}
			// A marked item is the receipt's step's whatever its creation
			// time: the window (an API clock off by more than window_skew
			// would put ours outside it) filters only fingerprint matches,
			// which cannot tell two identical calls apart. So its time may
			// even be missing or absurd.
			created, err := a.createdAt(item)
			if err != nil && !marked {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if why := saneTime(created, sc.end); err == nil && why != "" && !marked && a.cfg.fp != nil {
				// Not a time this item can have (milliseconds read as
				// seconds, seconds as milliseconds, a placeholder): whether
				// it lies in the window is unknown, so it might be ours
				// (a fingerprint match). Unmarked items matter only to the
				// fingerprint: with a marker alone, their time is moot.
				p.insane++
				if p.insaneReason == "" {
					p.insaneReason = a.insaneReason(i, created, why)
				}
				continue
			}
			outside := err != nil || created.Before(sc.start) || created.After(sc.end)
			by := ""
			if marked {
				by = "marker"
			} else if outside {
				ev.OutsideWindow++
				continue
			} else if by, err = m.fingerprint(item); err != nil {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if by == "" {
				continue
			}
			id, err := idOf(item, s.id)
			if err != nil {
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			}
			if why := usableID(id); why != "" {
				// The effect is there, but its id cannot be recorded as is.
				return nil, readback.PermanentError(fmt.Errorf("%s: item %d matched by %s, but its id at %q %s: "+
					"it cannot be recorded as the external id", u.Redacted(), i, by, s.id.text, why))
			}
			if !seen[id] { // pages may overlap when the list moves under us
				seen[id] = true
				p.matches = append(p.matches, id)
				p.matchedBy = by
				if outside && !slices.Contains(ev.MarkedOutsideWindow, id) {
					ev.MarkedOutsideWindow = append(ev.MarkedOutsideWindow, id)
				}
			}
		}
		p.ids = append(p.ids, pageIDs...)
		if p.insane > 0 && p.incomplete == "" {
			p.incompleteAfter = p.insaneReason
		}
		next, err := a.turnPage(first, u, doc, resp.header, len(list), p.requests, &page, pageIDs, prevPage, &p.incomplete, &p.truncated)
		if err != nil {
			return nil, err
		}
		if next == nil {
			return p, nil
		}
		prevPage = pageIDs
		u = next
	}
}

// turnPage decides where a pass goes after its page number requests (the
// page at u, whose len(pageIDs) = n items follow prevPage): the next page's
// URL, or nil when the pass ends, setting incomplete (and truncated) when
// it ends before the end of the list.
func (a *Adapter) turnPage(first, u *url.URL, doc any, h http.Header, n, requests int, page *int, pageIDs, prevPage []string, incomplete *string, truncated *bool) (*url.URL, error) {
	pg := a.cfg.pagination
	if (pg.Style == "page" || pg.Style == "offset") && len(pageIDs) > 0 && slices.Equal(pageIDs, prevPage) {
		// A static list: the server answers every page with the same
		// items, so the list has no end to read up to.
		*incomplete = fmt.Sprintf("page %d holds the same items as the page before it: the server ignores the %q parameter "+
			"(check search.pagination.param), so the list cannot be read to its end", requests, pg.Param)
		return nil, nil
	}
	next, why, err := a.nextPage(first, u, doc, h, n, page)
	if err != nil {
		return nil, err
	}
	if why != "" {
		*incomplete = fmt.Sprintf("page %d: %s", requests, why)
		return nil, nil
	}
	if next == nil {
		return nil, nil
	}
	if next.String() == u.String() {
		*incomplete = fmt.Sprintf("page %d: the next page is the page just read, so the list cannot be read to its end", requests)
		return nil, nil
	}
	if requests >= pg.MaxPages {
		*truncated = true
		*incomplete = fmt.Sprintf("page bound (%d) reached before the end of the list", pg.MaxPages)
		return nil, nil
	}
	return next, nil
}

// firstPage renders the list's first page for sc: the URL of path and
// query, asking for the first page explicitly when paged by number or
// offset (APIs differ on the default).
func (a *Adapter) firstPage(sc *scope, path template, query map[string]template) (*url.URL, error) {
	u, err := a.buildURL(sc, path, query)
	if err != nil {
		return nil, err
	}
	if pg := a.cfg.pagination; pg.Style == "page" || pg.Style == "offset" {
		q := u.Query()
		q.Set(pg.Param, strconv.Itoa(*pg.Start))
		u.RawQuery = q.Encode()
	}
	return u, nil
}

// identity names an item for comparing two passes: its id, or its JSON
// when it has none.
func identity(item any, id pointer) string {
	if s, err := idOf(item, id); err == nil {
		return "id:" + s
	}
	b, _ := json.Marshal(item)
	return "json:" + string(b)
}

// nextPage returns the next page's URL, or nil at the end of the list.
// why is set when the page does not say whether the list goes on: the
// list was not read to its end.
func (a *Adapter) nextPage(first, cur *url.URL, doc any, h http.Header, n int, page *int) (next *url.URL, why string, err error) {
	pg := a.cfg.pagination
	switch pg.Style {
	case "cursor":
		// has_more is required with style cursor (compilePagination): the
		// end of the list is where the API says so, never where a cursor
		// pointer happens to name nothing.
		v, ok := lookup(doc, pg.HasMore)
		more, isBool := v.(bool)
		if !ok || !isBool {
			// A missing indicator is not "no more": a proxy, an API
			// version or an error shape may have dropped it.
			return nil, fmt.Sprintf("no boolean at has_more %q, so the list may go on", pg.HasMore), nil
		}
		if !more {
			return nil, "", nil
		}
		v, ok = lookup(doc, pg.Cursor)
		cursor := ""
		if ok && v != nil {
			cursor, _ = scalarString(v)
		}
		if cursor == "" {
			return nil, fmt.Sprintf("has_more is true but there is no cursor at %q", pg.Cursor), nil
		}
		u := *first
		q := u.Query()
		q.Set(pg.Param, cursor)
		u.RawQuery = q.Encode()
		return &u, "", nil
	case "link":
		target := linkNext(h.Values("Link"))
		if target == "" {
			return nil, "", nil
		}
		u, err := cur.Parse(target)
		if err != nil {
			return nil, "", readback.PermanentError(fmt.Errorf("%s: bad Link header: %w", cur.Redacted(), err))
		}
		// Credentials go only to the configured host.
		if u.Scheme != a.cfg.base.Scheme || u.Host != a.cfg.base.Host {
			return nil, "", readback.PermanentError(fmt.Errorf("%s: Link rel=next points to another host (%s)", cur.Redacted(), u.Host))
		}
		return u, "", nil
	case "page", "offset":
		if n == 0 {
			return nil, "", nil
		}
		if pg.Style == "page" {
			*page++
		} else {
			*page += n
		}
		u := *first
		q := u.Query()
		q.Set(pg.Param, strconv.Itoa(*page))
		u.RawQuery = q.Encode()
		return &u, "", nil
	}
	return nil, "", nil
}

// linkNext returns the rel="next" target of RFC 8288 Link header values.
func linkNext(values []string) string {
	for _, v := range values {
		for _, link := range strings.Split(v, ",") {
			segs := strings.Split(link, ";")
			target := strings.TrimSpace(segs[0])
			if !strings.HasPrefix(target, "<") || !strings.HasSuffix(target, ">") {
				continue
			}
			for _, p := range segs[1:] {
				k, val, _ := strings.Cut(strings.TrimSpace(p), "=")
				if strings.EqualFold(k, "rel") {
					for _, rel := range strings.Fields(strings.Trim(val, `"`)) {
						if strings.EqualFold(rel, "next") {
							return target[1 : len(target)-1]
						}
					}
				}
			}
		}
	}
	return ""
}
