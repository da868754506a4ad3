package httpadapter

import (
	"context"
	"fmt"
	"strings"

	"github.com/receiptledger/reconciler/readback"
)

// fetchBatchYAML is fetch.batch: the API fetches many resources by id in
// one request (GET /items?ids=a,b,c), answering the list of those that
// exist.
type fetchBatchYAML struct {
	// MaxReceipts bounds the ids of one request (default 100).
	MaxReceipts int `yaml:"max_receipts"`
	// Path and Query are the request (default: fetch.path and no query);
	// neither may name a receipt: the request is every receipt's.
	Path  string            `yaml:"path"`
	Query map[string]string `yaml:"query"`
	// Param is the query parameter given the ids, comma-separated
	// (default ids).
	Param string `yaml:"param"`
	// ID is each receipt's resource id (default {receipt.external_id}).
	ID string `yaml:"id"`
	// Items points to the list of resources in the answer (required; empty
	// for a top-level array). Each resource's id is at fetch.id.
	Items *string `yaml:"items"`
}

// fetchBatchConfig is the compiled fetch.batch.
type fetchBatchConfig struct {
	max   int
	path  template
	query map[string]template
	param string
	id    template
	items pointer
}

// The bounds of fetch.batch.max_receipts.
const (
	defaultFetchBatch = 100
	maxFetchBatch     = 1000
)

// compileFetchBatch compiles fetch.batch, if declared.
func (c *config) compileFetchBatch(b *fetchBatchYAML) error {
	if b == nil {
		return nil
	}
	fc := &fetchBatchConfig{max: defaultFetchBatch, param: b.Param}
	if b.MaxReceipts != 0 {
		if b.MaxReceipts < 1 || b.MaxReceipts > maxFetchBatch {
			return fieldErr("fetch.batch.max_receipts", "want 1 to %d, got %d", maxFetchBatch, b.MaxReceipts)
		}
		fc.max = b.MaxReceipts
	}
	if fc.param == "" {
		fc.param = "ids"
	}
	if b.Path == "" {
		return fieldErr("fetch.batch.path", "is required (the path that fetches many resources by id)")
	}
	var err error
	if fc.path, err = c.tmpl("fetch.batch.path", b.Path); err != nil {
		return err
	}
	if fc.query, err = c.queryTemplates("fetch.batch.query", b.Query); err != nil {
		return err
	}
	if fc.path.namesReceipt() {
		return fieldErr("fetch.batch.path", "names the receipt: one request fetches every receipt's resource")
	}
	for k, t := range fc.query {
		if t.namesReceipt() {
			return fieldErr("fetch.batch.query."+k, "names the receipt: one request fetches every receipt's resource")
		}
	}
	id := b.ID
	if id == "" {
		id = "{receipt.external_id}"
	}
	if fc.id, err = c.tmpl("fetch.batch.id", id); err != nil {
		return err
	}
	if b.Items == nil {
		return fieldErr("fetch.batch.items", "is required (a JSON pointer to the list; empty for a top-level array)")
	}
	if fc.items, err = c.ptr("fetch.batch.items", *b.Items); err != nil {
		return err
	}
	c.fetch.batch = fc
	return nil
}

// namesReceipt reports whether t has a placeholder of the receipt or of
// its intent (anything but the time window).
func (t template) namesReceipt() bool {
	for _, p := range t.parts {
		if p.ref != "" && !strings.HasPrefix(p.ref, "window.") {
			return true
		}
	}
	return false
}

// fetchBatch fetches the receipts' resources by id in requests of at most
// max_receipts ids, and answers each receipt as fetchOne would from its
// resource: the guard or the comparison decides a resource in the answer;
// a resource missing from it reads like the single fetch's 404 (absent for
// a delete, diverged for an update). A receipt whose id cannot be rendered
// (no external id recorded) is answered Alone, for its own fetch.
func (a *Adapter) fetchBatch(ctx context.Context, read readback.SharedRead, rs []readback.Receipt) []readback.Answer {
	fb := a.cfg.fetch.batch
	answers := make([]readback.Answer, len(rs))
	type wanted struct {
		i  int
		sc *scope
		id string
	}
	var ws []wanted
	for i, r := range rs {
		sc, err := a.scope(r)
		if err != nil {
			answers[i].Err = cleanError(err)
			continue
		}
		id, err := fb.id.render(sc, false)
		if err != nil || id == "" {
			answers[i].Alone = true
			continue
		}
		ws = append(ws, wanted{i: i, sc: sc, id: id})
	}
	for lo := 0; lo < len(ws); lo += fb.max {
		chunk := ws[lo:min(lo+fb.max, len(ws))]
		var ids []string
		seen := map[string]bool{}
		for _, w := range chunk {
			if !seen[w.id] {
				seen[w.id] = true
				ids = append(ids, w.id)
			}
		}
		found, query, status, err := a.fetchMany(ctx, read, chunk[0].sc, ids)
		for _, w := range chunk {
			if err != nil {
				answers[w.i].Err = cleanError(err)
				continue
			}
			res, err := a.decideFetched(w.sc, found[w.id], query, status)
			if err != nil {
				answers[w.i].Err = cleanError(err)
				continue
			}
			answers[w.i].Result = cleanResult(res)
		}
	}
	return answers
}

// fetchMany makes one batch request for ids and returns the resources in
// its answer by id.
func (a *Adapter) fetchMany(ctx context.Context, read readback.SharedRead, sc *scope, ids []string) (map[string]any, string, int, error) {
	f, fb := a.cfg.fetch, a.cfg.fetch.batch
	u, err := a.buildURL(sc, fb.path, fb.query)
	if err != nil {
		return nil, "", 0, err
	}
	q := u.Query()
	q.Set(fb.param, strings.Join(ids, ","))
	u.RawQuery = q.Encode()
	query := f.method + " " + u.Redacted()
	var doc any
	var status int
	err = a.retrier(ctx, &Evidence{}).do(ctx, 0, 0, func() error {
		return read.Request(ctx, func() error {
			r, d, err := a.getList(ctx, f.method, u, &fb.items, max(len(ids), defaultMaxPageItems))
			if err != nil {
				return err
			}
			doc, status = d, r.status
			return nil
		})
	})
	if err != nil {
		return nil, "", 0, err
	}
	raw, ok := fb.items.get(doc)
	list, isList := raw.([]any)
	if !ok || !isList {
		return nil, "", 0, readback.PermanentError(fmt.Errorf("%s: items pointer %q does not name a list in the response", u.Redacted(), fb.items.text))
	}
	found := map[string]any{}
	for i, item := range list {
		id, err := idOf(item, f.id)
		if err != nil {
			return nil, "", 0, readback.PermanentError(fmt.Errorf("%s: item %d: %w", u.Redacted(), i, err))
		}
		found[id] = item
	}
	return found, query, status, nil
}

// decideFetched answers one receipt from its resource in a batch answer
// (nil when the answer did not hold it), as fetchOne does.
func (a *Adapter) decideFetched(sc *scope, doc any, query string, status int) (readback.Result, error) {
	ev := &Evidence{Status: status}
	res := readback.Result{Query: query, Evidence: ev, Authoritative: true}
	if doc == nil {
		if len(a.cfg.compare) > 0 {
			res.Verdict = readback.VerdictDiverged
			ev.Reason = "the resource is gone (not in the batch answer)"
			return res, nil
		}
		res.Verdict = readback.VerdictAbsent
		return res, nil
	}
	id, err := idOf(doc, a.cfg.fetch.id)
	if err != nil {
		return readback.Result{}, readback.PermanentError(err)
	}
	if why := usableID(id); why != "" {
		return readback.Result{}, readback.PermanentError(fmt.Errorf("the id at %q is %s: it cannot be recorded "+
			"as the external id", a.cfg.fetch.id.text, why))
	}
	return a.judgeResource(sc, doc, id, res, ev)
}
