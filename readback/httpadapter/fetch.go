package httpadapter

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/receiptledger/reconciler/fingerprint"
	"github.com/receiptledger/reconciler/readback"
)

// fetchOne reads one resource: existence for deletes, fields for updates.
func (a *Adapter) fetchOne(ctx context.Context, sc *scope) (readback.Result, error) {
	f := a.cfg.fetch
	u, err := a.buildURL(sc, f.path, f.query)
	if err != nil {
		return readback.Result{}, err
	}
	ev := &Evidence{}
	res := readback.Result{Query: f.method + " " + u.Redacted(), Evidence: ev, Authoritative: true}
	var resp *response
	err = a.retrier(ctx, ev).do(ctx, 0, 0, func() error {
		r, err := a.do(ctx, f.method, u, f.gone)
		if err == nil && r.status >= 200 && r.status <= 299 {
			// A body that does not decode is retried like a failed read.
			_, err = a.decode(u, r.body, nil, defaultMaxPageItems)
		}
		resp = r
		return err
	})
	if err != nil {
		return readback.Result{}, err
	}
	ev.Status = resp.status
	if resp.status < 200 || resp.status > 299 {
		if len(a.cfg.compare) > 0 {
			// The update's target is gone: neither done nor untouched.
			res.Verdict = readback.VerdictDiverged
			ev.Reason = fmt.Sprintf("the resource is gone (HTTP %d)", resp.status)
			return res, nil
		}
		res.Verdict = readback.VerdictAbsent
		return res, nil
	}
	doc, err := a.decode(u, resp.body, nil, defaultMaxPageItems)
	if err != nil {
		return readback.Result{}, err
	}
	id, err := idOf(doc, f.id)
	if err != nil {
		return readback.Result{}, readback.PermanentError(fmt.Errorf("%s: %w", u.Redacted(), err))
	}
	if why := usableID(id); why != "" {
		return readback.Result{}, readback.PermanentError(fmt.Errorf("%s: the id at %q is %s: it cannot be recorded "+
			"as the external id", u.Redacted(), f.id.text, why))
	}
	return a.judgeResource(sc, doc, id, res, ev)
}

// judgeResource classifies the fetched resource doc (whose id is id) for
// sc's receipt, as fetchOne and decideFetched both do: guarded for a
// delete, compared for an update.
func (a *Adapter) judgeResource(sc *scope, doc any, id string, res readback.Result, ev *Evidence) (readback.Result, error) {
	for _, p := range a.cfg.compare {
		if want, ok := p.payload.get(sc.payload); ok && holdsSecretMarker(want) {
			// The intended value is not in the receipt: "other" would read
			// as diverged, and "pre_image" as an absence it cannot prove.
			return readback.Result{}, readback.PermanentError(fmt.Errorf("receipt %d: compare field %s: %w",
				sc.r.ID, p.payload.text, errSecretField))
		}
	}
	res.ExternalIDs = []string{id}
	if len(a.cfg.compare) == 0 {
		res.Verdict = a.guard(sc, doc, ev)
		return res, nil
	}
	res.Verdict = a.compare(sc, doc, ev)
	if res.Verdict != readback.VerdictPresent {
		res.ExternalIDs = nil
	}
	return res, nil
}

// guard classifies a delete's still-present resource: present (the delete
// did not happen) while the guarded fields hold the pre-image, diverged when
// someone else changed them (retrying the delete would destroy their work).
// Without a guard or a pre-image, present.
func (a *Adapter) guard(sc *scope, doc any, ev *Evidence) readback.Verdict {
	if len(a.cfg.guard) == 0 || len(sc.r.PreImage) == 0 {
		return readback.VerdictPresent
	}
	var pre any
	if err := decodeJSON(sc.r.PreImage, &pre); err != nil {
		return readback.VerdictPresent
	}
	ev.Fields = map[string]string{}
	verdict := readback.VerdictPresent
	for _, p := range a.cfg.guard {
		cur, curOK := p.get(doc)
		old, oldOK := p.get(pre)
		state := "pre_image"
		if curOK != oldOK || (curOK && !sameJSON(cur, old)) {
			state, verdict = "other", readback.VerdictDiverged
			ev.Reason = "the resource is still there and was changed since plan time"
		}
		ev.Fields[p.text] = state
	}
	return verdict
}

// compare classifies an update: every field as intended (present), every
// field as the pre-image (absent), else diverged.
func (a *Adapter) compare(sc *scope, doc any, ev *Evidence) readback.Verdict {
	var pre any
	if len(sc.r.PreImage) > 0 {
		if err := decodeJSON(sc.r.PreImage, &pre); err != nil {
			pre = nil
		}
	}
	ev.Fields = map[string]string{}
	allIntended, allPre := true, pre != nil
	for _, p := range a.cfg.compare {
		cur, curOK := p.resource.get(doc)
		want, wantOK := p.payload.get(sc.payload)
		old, oldOK := p.resource.get(pre)
		state := "other"
		switch {
		case curOK && wantOK && sameJSON(cur, want):
			state = "intended"
			// A field the update does not change is both intended and
			// pre-image; it must not spoil either verdict.
			if !(oldOK && sameJSON(cur, old)) {
				allPre = false
			}
		case curOK && oldOK && sameJSON(cur, old):
			state = "pre_image"
			allIntended = false
		default:
			allIntended, allPre = false, false
		}
		ev.Fields[p.resource.text] = state
	}
	switch {
	case allIntended:
		return readback.VerdictPresent
	case allPre:
		return readback.VerdictAbsent
	case pre == nil:
		ev.Reason = "no pre-image was recorded at plan time: the update's absence cannot be proven"
	default:
		ev.Reason = "the resource holds neither the intended fields nor the pre-image"
	}
	return readback.VerdictDiverged
}

// sameJSON compares two decoded JSON values canonically (1.0 equals 1).
func sameJSON(a, b any) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	if err1 != nil || err2 != nil {
		return false
	}
	ca, err1 := fingerprint.Canonicalize(ja)
	cb, err2 := fingerprint.Canonicalize(jb)
	if err1 != nil || err2 != nil {
		return bytes.Equal(ja, jb)
	}
	return bytes.Equal(ca, cb)
}
