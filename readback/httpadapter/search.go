package httpadapter

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/readback"
)

// search lists the candidates page by page and matches them.
//
// An absence is authoritative only if the read covered every candidate
// (SPEC §5a): not truncated by max_pages, read to the list's declared end
// (a cursor list whose has_more is missing, or a page-number list whose
// server ignores the page parameter, is not); for an unpaged list (style
// none), known to be the whole list: declared so (whole_list), or narrowed
// to the receipt's key with every item returned carrying the marker, since
// one response of a paginated API is its first page and looks the same;
// and, for a list whose pages
// concurrent writes can shift (page numbers, offsets, Link headers carrying
// them), confirmed: the whole list came in one response, or the query is
// narrowed to the receipt's key and every item returned carries the marker,
// or a second full pass, begun after the first ended, saw the same items in
// the same order.
func (a *Adapter) search(ctx context.Context, sc *scope) (readback.Result, error) {
	s := a.cfg.search
	pg := a.cfg.pagination
	first, err := a.firstPage(sc, s.path, s.query)
	if err != nil {
		return readback.Result{}, err
	}
	start, end := sc.start.UTC(), sc.end.UTC()
	ev := &Evidence{WindowStart: &start, WindowEnd: &end}
	res := readback.Result{Query: s.method + " " + first.Redacted(), Evidence: ev}
	m, err := a.matcher(sc)
	if err != nil {
		return readback.Result{}, err
	}
	present := func(p *pass) (readback.Result, error) {
		res.ExternalIDs, ev.MatchedBy = p.matches, p.matchedBy
		res.Verdict, res.Authoritative = readback.VerdictPresent, true
		return res, nil
	}
	// incomplete: nothing found in what was read, but the read did not
	// cover the list: never proof.
	incomplete := func(p *pass) (readback.Result, error) {
		ev.Truncated, ev.Reason = p.truncated, p.incomplete
		res.Verdict, res.Authoritative = readback.VerdictAbsent, false
		return res, nil
	}
	rt := a.retrier(ctx, ev)
	p1, err := a.readPass(ctx, rt, sc, first, m, ev)
	if err != nil {
		return readback.Result{}, err
	}
	switch {
	case len(p1.matches) > 0:
		return present(p1)
	case p1.incomplete != "":
		return incomplete(p1)
	case pg.Style == "none":
		return a.unpagedAbsence(res, ev, p1)
	case !a.cfg.shiftable():
		// Cursors (read until has_more is false) cannot skip an item.
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	case p1.requests == 1:
		// The first response was the whole list: no page boundary for a
		// concurrent write to shift an item across.
		ev.Confirmation = "single_response"
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	case s.narrowed && p1.nonEmpty <= 1 && p1.foreign == 0:
		// The query asks for the receipt's key and the server honoured it
		// (every item returned carries the marker, none in the window): only
		// the key's own resources could shift, and there was one page of them.
		ev.Confirmation = "narrowed"
		res.Verdict, res.Authoritative = readback.VerdictAbsent, true
		return res, nil
	}
	// A page-number or offset list can skip an item under concurrent
	// writes (one deleted on page 1 shifts ours back onto page 1 after it
	// was read): read it all again, after the first pass ended.
	p2, err := a.readPass(ctx, rt, sc, first, m, ev)
	if err != nil {
		return readback.Result{}, err
	}
	switch {
	case len(p2.matches) > 0:
		return present(p2)
	case p2.incomplete != "":
		return incomplete(p2)
	case !slices.Equal(p1.ids, p2.ids):
		ev.Reason = fmt.Sprintf("the list changed between two passes (%d items, then %d): "+
			"a %s list can skip items under concurrent writes, so its absence is not proof; "+
			"narrow the search to the receipt's key to avoid the second pass", len(p1.ids), len(p2.ids), pg.Style)
		res.Verdict, res.Authoritative = readback.VerdictInconclusive, false
		return res, nil
	}
	ev.Confirmation = "two_passes"
	res.Verdict, res.Authoritative = readback.VerdictAbsent, true
	return res, nil
}

// unpagedAbsence decides whether nothing found in the one response of an
// unpaged list (style none) is proof. The response says nothing about
// whether it is the whole list or the first page of a paginated one (a
// misconfiguration: the API pages, the file says none), and a positive
// control does not tell them apart when the control's item is on that
// first page. So the absence is authoritative only when the file vouches
// that the endpoint answers the whole collection (whole_list), or when the
// query names the receipt's key and the API honoured it (every item
// returned carries the marker; since a marked item matches, that means
// none came back): a first page of the key's own items holds ours if any.
func (a *Adapter) unpagedAbsence(res readback.Result, ev *Evidence, p *pass) (readback.Result, error) {
	res.Verdict = readback.VerdictAbsent
	switch {
	case a.cfg.pagination.WholeList:
		ev.Confirmation, res.Authoritative = "whole_list", true
	case a.cfg.search.narrowed && p.foreign == 0:
		ev.Confirmation, res.Authoritative = "narrowed", true
	case a.cfg.search.narrowed:
		ev.Reason = fmt.Sprintf("unpaged list (pagination style none): the query names the receipt's key but %d item(s) "+
			"returned do not carry its marker, so the API ignored the filter and the response may be the first page "+
			"of a longer list; declare the pagination, or search.pagination.whole_list if the endpoint always "+
			"answers the whole collection", p.foreign)
	default:
		ev.Reason = "unpaged list (pagination style none) not narrowed to the receipt's key: one response may be " +
			"the first page of a paginated list, so it does not prove an absence; declare the pagination, name " +
			"the key in the query, or set search.pagination.whole_list if the endpoint always answers the whole collection"
	}
	return res, nil
}

func (a *Adapter) createdAt(item any) (time.Time, error) {
	s := a.cfg.search
	v, ok := s.createdAt.get(item)
	if !ok {
		return time.Time{}, fmt.Errorf("no created-at at %q", s.createdAt.text)
	}
	switch x := v.(type) {
	case json.Number:
		n, err := x.Float64()
		if err != nil || s.createdAtFormat == "rfc3339" {
			return time.Time{}, fmt.Errorf("created-at %q at %q is not %s", x, s.createdAt.text, firstNonEmpty(s.createdAtFormat, "a time"))
		}
		if s.createdAtFormat == "unix_ms" {
			return time.UnixMilli(int64(n)), nil
		}
		return time.Unix(int64(n), 0), nil
	case string:
		if s.createdAtFormat == "unix" || s.createdAtFormat == "unix_ms" {
			n, err := strconv.ParseInt(x, 10, 64)
			if err != nil {
				return time.Time{}, fmt.Errorf("created-at %q at %q is not %s", x, s.createdAt.text, s.createdAtFormat)
			}
			if s.createdAtFormat == "unix_ms" {
				return time.UnixMilli(n), nil
			}
			return time.Unix(n, 0), nil
		}
		t, err := time.Parse(time.RFC3339Nano, x)
		if err != nil {
			return time.Time{}, fmt.Errorf("created-at %q at %q is not RFC 3339", x, s.createdAt.text)
		}
		return t, nil
	}
	return time.Time{}, fmt.Errorf("created-at at %q is %s, want a time", s.createdAt.text, jsonType(v))
}

// minSaneTime is the earliest creation time taken at face value: nothing a
// readback looks for was created before 2000.
var minSaneTime = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// maxFutureSkew is how far past the window's end a creation time may lie
// before it is absurd rather than a clock offset.
const maxFutureSkew = 24 * time.Hour

// saneTime says why t cannot be a creation time seen by a check whose
// window ends at end ("" when it can): before 2000, or more than a day
// after the window.
func saneTime(t, end time.Time) string {
	switch {
	case t.Before(minSaneTime):
		return "before 2000"
	case t.After(end.Add(maxFutureSkew)):
		return "more than a day after the window's end"
	}
	return ""
}

// insaneReason says why item i, whose creation time created is not one it
// can have (why, from saneTime), leaves an absence unproven.
func (a *Adapter) insaneReason(i int, created time.Time, why string) string {
	s := a.cfg.search
	return fmt.Sprintf("item %d: created-at %s at %q is %s (created_at_format %q?): "+
		"an item whose creation time is unknown may be the receipt's, so no absence is proven",
		i, created.UTC().Format(time.RFC3339), s.createdAt.text, why, firstNonEmpty(s.createdAtFormat, "rfc3339"))
}

func idOf(item any, p pointer) (string, error) {
	v, ok := p.get(item)
	if !ok {
		return "", fmt.Errorf("no id at %q", p.text)
	}
	id, err := scalarString(v)
	if err != nil || id == "" {
		return "", fmt.Errorf("id at %q is %s, want a string or number", p.text, jsonType(v))
	}
	return id, nil
}

// itemMatcher recognizes the receipt's effect among listed items.
type itemMatcher struct {
	a                *Adapter
	sc               *scope
	equals, contains string // the rendered marker
}

// matcher renders the receipt's marker once per check.
func (a *Adapter) matcher(sc *scope) (*itemMatcher, error) {
	m := &itemMatcher{a: a, sc: sc}
	var err error
	if mc := a.cfg.marker; mc != nil {
		if m.equals, err = mc.equals.render(sc, false); err != nil {
			return nil, readback.PermanentError(err)
		}
		if m.contains, err = mc.contains.render(sc, false); err != nil {
			return nil, readback.PermanentError(err)
		}
	}
	return m, nil
}

// marker reports whether item carries the receipt's marker.
func (m *itemMatcher) marker(item any) bool {
	mc := m.a.cfg.marker
	if mc == nil {
		return false
	}
	v, ok := mc.pointer.get(item)
	if !ok {
		return false
	}
	s, err := scalarString(v)
	if err != nil {
		return false
	}
	return (m.equals != "" && s == m.equals) || (m.contains != "" && strings.Contains(s, m.contains))
}

// fingerprint says "fingerprint" when item matches the receipt's intent
// fingerprint, "" when it does not (or no fingerprint is configured). The
// marker is tried before it (readPass): it is the stronger evidence.
func (m *itemMatcher) fingerprint(item any) (string, error) {
	if m.a.cfg.fp != nil {
		ok, err := m.a.fingerprintMatches(m.sc, item)
		if err != nil || !ok {
			return "", err
		}
		return "fingerprint", nil
	}
	return "", nil
}

// fingerprintMatches rebuilds the payload from the item's fields and
// recomputes the intent fingerprint with the agent's normalization.
func (a *Adapter) fingerprintMatches(sc *scope, item any) (bool, error) {
	fp, err := a.itemFingerprint(sc.r.Method, sc.r.Target, item)
	return fp != "" && fp == sc.r.Fingerprint, err
}

// itemFingerprint is the intent fingerprint a call of method to target
// whose payload held item's fields would have: "" for an item that cannot
// be any agent's (a field missing, a number the fingerprint refuses).
func (a *Adapter) itemFingerprint(method, target string, item any) (string, error) {
	f := a.cfg.fp
	payload := map[string]any{}
	for _, p := range f.fields {
		v, ok := p.resource.get(item)
		if !ok {
			return "", nil // an item without the field is not ours
		}
		if err := p.payload.set(payload, v); err != nil {
			return "", err
		}
	}
	b, err := json.Marshal(payload)
	if err != nil {
		return "", err
	}
	fp, err := fingerprint.Compute(method, target, b, fingerprint.WithDrop(f.drop...))
	if err != nil {
		// An item the fingerprint refuses (an imprecise number) cannot be
		// the agent's: its own payload was accepted.
		return "", nil
	}
	return fp.Fingerprint, nil
}
