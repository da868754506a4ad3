package httpadapter

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"sort"
	"time"

	"github.com/receiptledger/reconciler/readback"
)

// batchYAML is search.batch: the list read over a time window, without the
// key filter, answers every receipt whose window it covers (issue 22).
type batchYAML struct {
	// MaxReceipts bounds the receipts one shared read answers (default
	// 1000).
	MaxReceipts int `yaml:"max_receipts"`
	// Path and Query are the shared read's request (default: the search's
	// path, and its query without the parameters that name the receipt's
	// key). Neither may name the key: the read is everyone's.
	Path  string            `yaml:"path"`
	Query map[string]string `yaml:"query"`
}

// batchConfig is the compiled search.batch.
type batchConfig struct {
	max   int
	path  template
	query map[string]template
}

// The bounds of search.batch.max_receipts.
const (
	defaultBatchReceipts = 1000
	maxBatchReceipts     = 100000
)

// compileBatch compiles search.batch, if declared. A batch read is never
// narrowed to a key, so an unpaged list must be declared whole: otherwise
// no absence it reads would be authoritative.
func (c *config) compileBatch(b *batchYAML) error {
	if b == nil {
		return nil
	}
	bc := &batchConfig{max: defaultBatchReceipts}
	if b.MaxReceipts != 0 {
		if b.MaxReceipts < 1 || b.MaxReceipts > maxBatchReceipts {
			return fieldErr("search.batch.max_receipts", "want 1 to %d, got %d", maxBatchReceipts, b.MaxReceipts)
		}
		bc.max = b.MaxReceipts
	}
	var err error
	bc.path = c.search.path
	if b.Path != "" {
		if bc.path, err = c.tmpl("search.batch.path", b.Path); err != nil {
			return err
		}
	}
	if bc.path.namesKey() {
		return fieldErr("search.batch.path", "names the receipt's key or id: a shared read lists every receipt's "+
			"resources (declare search.batch.path without the key)")
	}
	if b.Query == nil {
		bc.query = map[string]template{}
		for k, t := range c.search.query {
			if !t.namesKey() {
				bc.query[k] = t
			}
		}
	} else {
		if bc.query, err = c.queryTemplates("search.batch.query", b.Query); err != nil {
			return err
		}
		for k, t := range bc.query {
			if t.namesKey() {
				return fieldErr("search.batch.query."+k, "names the receipt's key or id: a shared read lists every "+
					"receipt's resources")
			}
		}
	}
	if c.pagination.Style == "none" && !c.pagination.WholeList {
		return fieldErr("search.batch", "an unpaged list (pagination style none) read without the key proves no "+
			"absence: declare the pagination, or search.pagination.whole_list if the endpoint answers the whole collection")
	}
	c.search.batch = bc
	return nil
}

// MaxBatch implements readback.Batcher: search.batch.max_receipts or
// fetch.batch.max_receipts, or 0 when the block declares no batch.
func (a *Adapter) MaxBatch() int {
	switch {
	case a.cfg.search != nil && a.cfg.search.batch != nil:
		return a.cfg.search.batch.max
	case a.cfg.fetch != nil && a.cfg.fetch.batch != nil:
		return a.cfg.fetch.batch.max
	}
	return 0
}

// member is one receipt of a shared read, and what the read found for it.
type member struct {
	i  int // its index among CheckBatch's receipts
	sc *scope
	m  *itemMatcher
	// ans is set once the receipt is decided.
	ans     readback.Answer
	decided bool
	// What the current pass found: the matching ids, how, the marked ones
	// outside its window, the first unmarked item with an absurd creation
	// time (its absence then proves nothing) and the first item that makes
	// its check fail (as Check would).
	matches       []string
	matchedBy     string
	seen          map[string]bool
	markedOutside []string
	insane        string
	err           error
}

// CheckBatch implements readback.Batcher. A fetch block fetches the
// receipts' resources by id in one request (fetchBatch). A search block
// reads the list once over the
// union of the receipts' windows and decides each receipt from the same
// pages by its own marker or fingerprint and its own window, with the
// authority rules of search: a cursor list read to has_more false, a
// page-number or offset list confirmed (one response, or two passes that
// agree), never past max_pages. Receipts whose rendered request differs
// (a path over {receipt.target}) are read apart. A read that reaches
// max_pages before the end splits its undecided receipts into two
// windows, the later one starting later; a receipt that no split can
// narrow further is answered Alone, for its own Check.
func (a *Adapter) CheckBatch(ctx context.Context, read readback.SharedRead, rs []readback.Receipt) ([]readback.Answer, error) {
	if a.MaxBatch() == 0 {
		return nil, readback.PermanentError(fmt.Errorf("adapter %s declares no search.batch or fetch.batch", a.cfg.name))
	}
	if a.cfg.fetch != nil {
		return a.fetchBatch(ctx, read, rs), nil
	}
	answers := make([]readback.Answer, len(rs))
	ms := make([]*member, 0, len(rs))
	for i, r := range rs {
		sc, err := a.scope(r)
		var m *itemMatcher
		if err == nil {
			m, err = a.matcher(sc)
		}
		if err != nil {
			answers[i].Err = cleanError(err)
			continue
		}
		ms = append(ms, &member{i: i, sc: sc, m: m})
	}
	a.readGroup(ctx, read, ms)
	for _, mb := range ms {
		ans := mb.ans
		switch {
		case ans.Err != nil:
			ans.Err = cleanError(ans.Err)
		case ans.Alone:
		case ans.Result.Verdict != readback.VerdictPresent && a.cfg.fp != nil && holdsSecretMarker(mb.sc.payload):
			// As in Check: a fingerprint cannot recognize an intent whose
			// secret fields are stored as markers.
			ans = readback.Answer{Err: cleanError(readback.PermanentError(fmt.Errorf("receipt %d: %w: match.fingerprint cannot "+
				"recognize the effect of an intent with secret fields, and no item carries the marker", mb.sc.r.ID, errSecretField)))}
		default:
			ans.Result = cleanResult(ans.Result)
		}
		answers[mb.i] = ans
	}
	return answers, nil
}

// groupWindow is the union of the members' windows.
func groupWindow(ms []*member) (start, end time.Time) {
	for i, mb := range ms {
		if i == 0 || mb.sc.start.Before(start) {
			start = mb.sc.start
		}
		if i == 0 || mb.sc.end.After(end) {
			end = mb.sc.end
		}
	}
	return start, end
}

// firstURL renders the shared read's first page for mb under the window.
func (a *Adapter) firstURL(mb *member, start, end time.Time) (*url.URL, error) {
	b := a.cfg.search.batch
	gsc := *mb.sc
	gsc.start, gsc.end = start, end
	return a.firstPage(&gsc, b.path, b.query)
}

// readGroup reads the members' list once per distinct request over the
// union of their windows and decides them. A read that fails answers its
// undecided members with its error (a refusal of read.Call among them).
func (a *Adapter) readGroup(ctx context.Context, read readback.SharedRead, ms []*member) {
	if len(ms) == 0 {
		return
	}
	start, end := groupWindow(ms)
	byURL := map[string][]*member{}
	var order []string
	firsts := map[string]*url.URL{}
	for _, mb := range ms {
		u, err := a.firstURL(mb, start, end)
		if err != nil {
			mb.ans, mb.decided = readback.Answer{Err: err}, true
			continue
		}
		k := u.String()
		if _, ok := byURL[k]; !ok {
			order = append(order, k)
			firsts[k] = u
		}
		byURL[k] = append(byURL[k], mb)
	}
	for _, k := range order {
		a.readShared(ctx, read, firsts[k], start, end, byURL[k])
	}
}

// readShared reads one list for ms, as search reads it for one receipt.
func (a *Adapter) readShared(ctx context.Context, read readback.SharedRead, first *url.URL, start, end time.Time, ms []*member) {
	s := a.cfg.search
	pg := a.cfg.pagination
	ws, we := start.UTC(), end.UTC()
	ev := &Evidence{WindowStart: &ws, WindowEnd: &we}
	query := s.method + " " + first.Redacted()
	rt := a.retrier(ctx, ev)
	failed := func(ms []*member, err error) {
		for _, mb := range ms {
			if !mb.decided {
				mb.ans, mb.decided = readback.Answer{Err: err}, true
			}
		}
	}
	p1, times, err := a.readSharedPass(ctx, read, rt, first, end, ms, ev)
	if err != nil {
		failed(ms, err)
		return
	}
	rest := a.decideMatched(ms, query, ev, times)
	switch {
	case len(rest) == 0:
		return
	case p1.truncated && len(rest) > 1:
		a.split(ctx, read, first, rest)
		return
	case p1.truncated:
		// Alone, its own read may fit the page bound (narrowed to its key).
		rest[0].ans, rest[0].decided = readback.Answer{Alone: true}, true
		return
	case p1.incomplete != "":
		a.decideRest(rest, query, ev, times, func(e *Evidence, r *readback.Result) {
			e.Reason = p1.incomplete
			r.Verdict = readback.VerdictAbsent
		})
		return
	}
	rest = a.decideInsane(rest, query, ev, times)
	switch {
	case len(rest) == 0:
	case pg.Style == "none":
		// compileBatch admits an unpaged list only when declared whole.
		a.decideRest(rest, query, ev, times, func(e *Evidence, r *readback.Result) {
			e.Confirmation, r.Verdict, r.Authoritative = "whole_list", readback.VerdictAbsent, true
		})
	case !a.cfg.shiftable():
		a.decideRest(rest, query, ev, times, func(_ *Evidence, r *readback.Result) {
			r.Verdict, r.Authoritative = readback.VerdictAbsent, true
		})
	case p1.requests == 1:
		a.decideRest(rest, query, ev, times, func(e *Evidence, r *readback.Result) {
			e.Confirmation, r.Verdict, r.Authoritative = "single_response", readback.VerdictAbsent, true
		})
	default:
		// A page-number or offset list: read it all again, after the first
		// pass ended, for the receipts the first did not find.
		p2, times2, err := a.readSharedPass(ctx, read, rt, first, end, rest, ev)
		if err != nil {
			failed(rest, err)
			return
		}
		rest = a.decideMatched(rest, query, ev, times2)
		rest = a.decideInsane(rest, query, ev, times2)
		switch {
		case len(rest) == 0:
		case p2.incomplete != "":
			a.decideRest(rest, query, ev, times2, func(e *Evidence, r *readback.Result) {
				e.Truncated, e.Reason, r.Verdict = p2.truncated, p2.incomplete, readback.VerdictAbsent
			})
		case !slices.Equal(p1.ids, p2.ids):
			reason := fmt.Sprintf("the list changed between two passes (%d items, then %d): "+
				"a %s list can skip items under concurrent writes, so its absence is not proof", len(p1.ids), len(p2.ids), pg.Style)
			a.decideRest(rest, query, ev, times2, func(e *Evidence, r *readback.Result) {
				e.Reason, r.Verdict = reason, readback.VerdictInconclusive
			})
		default:
			a.decideRest(rest, query, ev, times2, func(e *Evidence, r *readback.Result) {
				e.Confirmation, r.Verdict, r.Authoritative = "two_passes", readback.VerdictAbsent, true
			})
		}
	}
}

// split reads the undecided members of a read cut short by max_pages in
// two windows: the later half's starts later, so its list is shorter. A
// group that no split can narrow (every member's own request is the
// group's) is answered Alone.
func (a *Adapter) split(ctx context.Context, read readback.SharedRead, first *url.URL, ms []*member) {
	sort.SliceStable(ms, func(i, j int) bool { return ms[i].sc.start.Before(ms[j].sc.start) })
	// The boundary nearest the middle at which the later half's request
	// differs from the whole group's.
	cut := -1
	for d := 0; d < len(ms); d++ {
		for _, i := range []int{len(ms)/2 + d, len(ms)/2 - d} {
			if cut >= 0 || i < 1 || i >= len(ms) || !ms[i-1].sc.start.Before(ms[i].sc.start) {
				continue
			}
			start, end := groupWindow(ms[i:])
			if u, err := a.firstURL(ms[i], start, end); err == nil && u.String() != first.String() {
				cut = i
			}
		}
		if cut >= 0 {
			break
		}
	}
	if cut < 0 {
		for _, mb := range ms {
			mb.ans, mb.decided = readback.Answer{Alone: true}, true
		}
		return
	}
	for _, half := range [][]*member{ms[:cut], ms[cut:]} {
		a.readGroup(ctx, read, half)
	}
}

// reset forgets what a pass found for mb.
func (mb *member) reset() {
	mb.matches, mb.matchedBy, mb.seen, mb.markedOutside, mb.insane, mb.err = nil, "", nil, nil, "", nil
}

// answer decides mb from the shared evidence ev, with its own fields.
func (a *Adapter) answer(mb *member, query string, ev *Evidence, times []time.Time, set func(*Evidence, *readback.Result)) {
	own := *ev
	own.PassItems = slices.Clone(ev.PassItems)
	own.Retries = slices.Clone(ev.Retries)
	own.MarkedOutsideWindow = mb.markedOutside
	// Items ignored because they were created outside mb's window.
	lo := sort.Search(len(times), func(i int) bool { return !times[i].Before(mb.sc.start) })
	hi := sort.Search(len(times), func(i int) bool { return times[i].After(mb.sc.end) })
	own.OutsideWindow = lo + len(times) - hi
	res := readback.Result{Query: query, Evidence: &own}
	set(&own, &res)
	mb.ans, mb.decided = readback.Answer{Result: res}, true
}

// decideMatched decides the members that failed or were found, and
// returns the others.
func (a *Adapter) decideMatched(ms []*member, query string, ev *Evidence, times []time.Time) []*member {
	var rest []*member
	for _, mb := range ms {
		switch {
		case mb.decided:
		case mb.err != nil:
			mb.ans, mb.decided = readback.Answer{Err: mb.err}, true
		case len(mb.matches) > 0:
			a.answer(mb, query, ev, times, func(e *Evidence, r *readback.Result) {
				e.MatchedBy = mb.matchedBy
				r.ExternalIDs, r.Verdict, r.Authoritative = mb.matches, readback.VerdictPresent, true
			})
		default:
			rest = append(rest, mb)
		}
	}
	return rest
}

// decideInsane decides the members for which an unmarked item had an
// absurd creation time (their absence proves nothing), and returns the
// others.
func (a *Adapter) decideInsane(ms []*member, query string, ev *Evidence, times []time.Time) []*member {
	var rest []*member
	for _, mb := range ms {
		if mb.insane == "" {
			rest = append(rest, mb)
			continue
		}
		a.answer(mb, query, ev, times, func(e *Evidence, r *readback.Result) {
			e.Reason, r.Verdict = mb.insane, readback.VerdictAbsent
		})
	}
	return rest
}

// decideRest decides every member of ms alike.
func (a *Adapter) decideRest(ms []*member, query string, ev *Evidence, times []time.Time, set func(*Evidence, *readback.Result)) {
	for _, mb := range ms {
		a.answer(mb, query, ev, times, set)
	}
}

// sharedPass is one read of the shared list, from its first page to its
// end or the page bound.
type sharedPass struct {
	requests   int
	ids        []string
	truncated  bool
	incomplete string
}

// matchIndex finds, for an item, the members it may belong to.
type matchIndex struct {
	equals   map[string][]*member
	contains []*member
	// fps maps each fingerprint to its members; calls lists the distinct
	// method and target pairs the item's fingerprint is computed for.
	fps   map[string][]*member
	calls [][2]string
}

func (a *Adapter) index(ms []*member) *matchIndex {
	x := &matchIndex{equals: map[string][]*member{}, fps: map[string][]*member{}}
	seen := map[[2]string]bool{}
	for _, mb := range ms {
		mb.reset()
		mb.seen = map[string]bool{}
		if mb.m.equals != "" {
			x.equals[mb.m.equals] = append(x.equals[mb.m.equals], mb)
		}
		if mb.m.contains != "" {
			x.contains = append(x.contains, mb)
		}
		if a.cfg.fp != nil {
			x.fps[mb.sc.r.Fingerprint] = append(x.fps[mb.sc.r.Fingerprint], mb)
			call := [2]string{mb.sc.r.Method, mb.sc.r.Target}
			if !seen[call] {
				seen[call] = true
				x.calls = append(x.calls, call)
			}
		}
	}
	return x
}

// markedBy returns the members whose marker item carries.
func (a *Adapter) markedBy(x *matchIndex, item any) []*member {
	mc := a.cfg.marker
	if mc == nil {
		return nil
	}
	v, ok := mc.pointer.get(item)
	if !ok {
		return nil
	}
	s, err := scalarString(v)
	if err != nil {
		return nil
	}
	out := slices.Clone(x.equals[s])
	for _, mb := range x.contains {
		if mb.m.marker(item) {
			out = append(out, mb)
		}
	}
	return out
}

// readSharedPass reads the list once for ms, recording in each member what
// it found; times are the creation times of the items read (sorted), for
// the evidence's outside-window counts.
func (a *Adapter) readSharedPass(ctx context.Context, read readback.SharedRead, rt *retrier, first *url.URL, end time.Time, ms []*member, ev *Evidence) (*sharedPass, []time.Time, error) {
	s := a.cfg.search
	pg := a.cfg.pagination
	x := a.index(ms)
	p := &sharedPass{}
	ev.Passes++
	defer func() { ev.PassItems = append(ev.PassItems, len(p.ids)) }()
	var times []time.Time
	var prevPage []string
	u := first
	page := *pg.Start
	for {
		var resp *response
		var doc any
		err := rt.do(ctx, ev.Passes, p.requests+1, func() error {
			return read.Request(ctx, func() (err error) {
				resp, doc, err = a.getList(ctx, s.method, u, &s.items, s.maxItems)
				return err
			})
		})
		if err != nil {
			return nil, nil, err
		}
		p.requests++
		ev.Pages++
		raw, ok := s.items.get(doc)
		list, isList := raw.([]any)
		if !ok || !isList {
			return nil, nil, readback.PermanentError(fmt.Errorf("%s: items pointer %q does not name a list in the response", u.Redacted(), s.items.text))
		}
		pageIDs := make([]string, 0, len(list))
		for i, item := range list {
			ev.Items++
			pageIDs = append(pageIDs, identity(item, s.id))
			if t, err := a.matchItem(x, ms, u, i, item, end); err == nil {
				times = append(times, t)
			}
		}
		p.ids = append(p.ids, pageIDs...)
		next, err := a.turnPage(first, u, doc, resp.header, len(list), p.requests, &page, pageIDs, prevPage, &p.incomplete, &p.truncated)
		if err != nil {
			return nil, nil, err
		}
		if next == nil {
			break
		}
		prevPage = pageIDs
		u = next
	}
	slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
	return p, times, nil
}

// matchItem records item in the members it matches, as readPass does for
// one receipt: a marked item matches its members whatever its creation
// time; an unmarked one matches by fingerprint only within a member's
// window, fails the members' checks when its creation time is missing, and
// makes their absence unproven when that time is absurd (with a
// fingerprint configured). It returns the item's creation time.
func (a *Adapter) matchItem(x *matchIndex, ms []*member, u *url.URL, i int, item any, end time.Time) (time.Time, error) {
	s := a.cfg.search
	marked := a.markedBy(x, item)
	unmarked := func(f func(mb *member)) {
		for _, mb := range ms {
			if mb.err == nil && !slices.Contains(marked, mb) {
				f(mb)
			}
		}
	}
	created, terr := a.createdAt(item)
	if terr != nil {
		err := readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, terr))
		unmarked(func(mb *member) { mb.err = err })
	}
	match := func(mb *member, by string) {
		if mb.err != nil {
			return
		}
		id, err := idOf(item, s.id)
		if err == nil {
			if why := usableID(id); why != "" {
				err = fmt.Errorf("matched by %s, but its id at %q %s: it cannot be recorded as the external id", by, s.id.text, why)
			}
		}
		if err != nil {
			mb.err = readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			return
		}
		if !mb.seen[id] {
			mb.seen[id] = true
			mb.matches = append(mb.matches, id)
			mb.matchedBy = by
			if (terr != nil || created.Before(mb.sc.start) || created.After(mb.sc.end)) && !slices.Contains(mb.markedOutside, id) {
				mb.markedOutside = append(mb.markedOutside, id)
			}
		}
	}
	for _, mb := range marked {
		match(mb, "marker")
	}
	if terr != nil {
		return time.Time{}, terr
	}
	if why := saneTime(created, end); why != "" && a.cfg.fp != nil {
		reason := a.insaneReason(i, created, why)
		unmarked(func(mb *member) {
			if mb.insane == "" {
				mb.insane = reason
			}
		})
		return created, nil
	}
	for _, call := range x.calls {
		fp, err := a.itemFingerprint(call[0], call[1], item)
		if err != nil {
			perr := readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
			unmarked(func(mb *member) {
				if mb.sc.r.Method == call[0] && mb.sc.r.Target == call[1] && !created.Before(mb.sc.start) && !created.After(mb.sc.end) {
					mb.err = perr
				}
			})
			continue
		}
		for _, mb := range x.fps[fp] {
			if mb.sc.r.Method == call[0] && mb.sc.r.Target == call[1] && !slices.Contains(marked, mb) &&
				!created.Before(mb.sc.start) && !created.After(mb.sc.end) {
				match(mb, "fingerprint")
			}
		}
	}
	return created, nil
}
