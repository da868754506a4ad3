package reconcile

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"

	"github.com/receiptledger/reconciler/internal/sanitize"
)

// Bounds on text from outside (an API's answer, an adapter's evidence) that
// the reconciler stores (issue 8): every such string passes through
// sanitize.Text or sanitize.JSON with one of them before it is written.
const (
	// MaxErrorBytes bounds a check's error and a settlement's error message.
	MaxErrorBytes = 2048
	// MaxExternalIDBytes bounds an external id. An id longer than this, or
	// one that had to be altered, is not stored as the receipt's external id
	// (see trustedID).
	MaxExternalIDBytes = 255
	// MaxEvidenceStringBytes bounds each string inside evidence (the query,
	// each matched id, each string of the adapter's evidence).
	MaxEvidenceStringBytes = 2048
	// MaxEvidenceBytes bounds a whole evidence or detail document.
	MaxEvidenceBytes = 64 << 10
	// maxMatched bounds how many matched ids evidence lists.
	maxMatched = 100
)

// text sanitizes s with bound max, and notes in *changed if it altered it.
func text(s string, max int, changed *bool) string {
	out, ch := sanitize.Text(s, max)
	if ch {
		*changed = true
	}
	return out
}

// trustedID returns id if it can be stored as an external id unaltered
// (valid UTF-8, no control characters, at most MaxExternalIDBytes), else "":
// an id that had to change names nothing the API knows, and readbacks
// would look it up. ok reports whether id was trusted.
func trustedID(id string) (string, bool) {
	if id == "" {
		return "", true
	}
	if s, ch := sanitize.Text(id, MaxExternalIDBytes); ch || sanitize.Terminal(s) != s {
		return "", false
	}
	return id, true
}

// idDigest is the SHA-256 of an untrusted raw id, recorded in its place.
func idDigest(id string) string {
	h := sha256.Sum256([]byte(id))
	return "sha256:" + hex.EncodeToString(h[:])
}

// sanitized returns o with every string that came from outside made safe to
// store, bounded, and marked in its evidence ("sanitized": true) where
// anything changed. o itself (and its evidence) is not modified.
func (o Outcome) sanitized() Outcome {
	if o.Detail.Error != nil {
		e := *o.Detail.Error
		var ch bool
		e.Code = text(e.Code, 64, &ch)
		e.Message = text(e.Message, MaxErrorBytes, &ch)
		o.Detail.Error = &e
	}
	o.Detail.Reason, _ = sanitize.Text(o.Detail.Reason, 64)
	if ev := o.Detail.Evidence; ev != nil {
		c := *ev
		ch := c.Sanitized
		c.Query = text(c.Query, MaxEvidenceStringBytes, &ch)
		if len(c.Matched) > 0 {
			if len(c.Matched) > maxMatched {
				c.Matched, ch = c.Matched[:maxMatched], true
			}
			m := make([]string, len(c.Matched))
			for i, id := range c.Matched {
				m[i] = text(id, MaxEvidenceStringBytes, &ch)
			}
			c.Matched = m
		}
		if len(c.AdapterEvidence) > 0 {
			j, jch := sanitize.JSON(c.AdapterEvidence, MaxEvidenceStringBytes, MaxEvidenceBytes/2)
			c.AdapterEvidence, ch = j, ch || jch
		}
		if id, ok := trustedID(o.ExternalID); !ok {
			c.UntrustedExternalID = &UntrustedID{Excerpt: text(o.ExternalID, MaxExternalIDBytes, &ch),
				SHA256: idDigest(o.ExternalID), Bytes: len(o.ExternalID)}
			o.ExternalID, ch = id, true
		}
		c.Sanitized = ch
		o.Detail.Evidence = &c
	} else if id, ok := trustedID(o.ExternalID); !ok {
		o.ExternalID = id
	}
	if len(o.Duplicates) > 0 {
		d := make([]string, 0, min(len(o.Duplicates), maxMatched))
		for _, id := range o.Duplicates[:min(len(o.Duplicates), maxMatched)] {
			s, _ := sanitize.Text(id, MaxExternalIDBytes)
			d = append(d, s)
		}
		o.Duplicates = d
	}
	o.Adapter, _ = sanitize.Text(o.Adapter, 255)
	if c := o.Check; c != nil {
		r := c.sanitized()
		o.Check = &r
	}
	return o
}

// sanitized returns a copy of c with its text from outside made safe to
// store and bounded, its evidence marked where anything changed.
func (c *CheckRecord) sanitized() CheckRecord {
	r := *c
	var ch bool
	r.Adapter = text(r.Adapter, 255, &ch)
	r.Error = text(r.Error, MaxErrorBytes, &ch)
	if len(r.Evidence) > 0 {
		r.Evidence, _ = sanitize.JSON(r.Evidence, MaxEvidenceStringBytes, MaxEvidenceBytes)
	}
	if ch {
		r.Evidence = markSanitized(r.Evidence)
	}
	return r
}

// markSanitized adds "sanitized": true to a check's evidence (an object, or
// none).
func markSanitized(ev json.RawMessage) json.RawMessage {
	m := map[string]any{}
	if len(ev) > 0 && json.Unmarshal(ev, &m) != nil {
		m = map[string]any{"evidence": ev}
	}
	m["sanitized"] = true
	j, err := json.Marshal(m)
	if err != nil {
		return json.RawMessage(`{"sanitized":true}`)
	}
	return j
}
