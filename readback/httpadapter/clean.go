package httpadapter

import (
	"errors"
	"strings"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/internal/sanitize"
	"github.com/receiptledger/reconciler/readback"
)

// Bounds on the text a check puts in a Result or an error. Everything that
// came from a response (or from a receipt, rendered into a URL) goes through
// clean with one of them before it leaves the adapter: valid UTF-8, no NUL,
// bounded (internal/sanitize's Text), so one hostile byte never fails the
// batched write that stores it.
const (
	// maxIDBytes bounds an external id. An id longer than this, or one
	// that is not valid UTF-8 or holds a NUL, is not used at all (see
	// usableID): a cleaned id names another resource.
	maxIDBytes = 255
	// maxQueryBytes bounds Result.Query (the first request's URL).
	maxQueryBytes = 2048
	// maxReasonBytes bounds each string of the evidence.
	maxReasonBytes = 1024
	// maxErrorBytes bounds an error's text.
	maxErrorBytes = 2048
	// maxExcerptBytes bounds a response excerpt quoted in an error.
	maxExcerptBytes = 200
)

// clean is sanitize.Text: s as valid UTF-8 without NUL, cut to max bytes.
func clean(s string, max int) string {
	out, _ := sanitize.Text(s, max)
	return out
}

// usableID reports why id cannot be recorded as an external id, or "" when
// it can: it must be valid UTF-8 (without U+FFFD, which the JSON decoder
// puts in place of invalid bytes) without NUL or other control characters,
// and at most maxIDBytes long. A cleaned or cut id would name another
// resource (a later fetch by {receipt.external_id} would read a 404 there
// and call the resource gone), so such an id is never altered and used: the
// check fails with a permanent error instead (manual_review).
func usableID(id string) string {
	switch {
	case len(id) > maxIDBytes:
		return "is longer than 255 bytes"
	case !utf8.ValidString(id) || strings.ContainsRune(id, utf8.RuneError):
		// encoding/json decodes invalid UTF-8 in a string as U+FFFD: an id
		// holding one was (almost surely) altered on the way.
		return "is not valid UTF-8"
	case strings.ContainsFunc(id, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return "holds a control character"
	}
	return ""
}

// cleanErr bounds and sanitizes an error's text while keeping its chain
// (errors.As still finds a *StatusError inside).
type cleanErr struct{ err error }

func (e *cleanErr) Error() string { return clean(e.err.Error(), maxErrorBytes) }
func (e *cleanErr) Unwrap() error { return e.err }

// cleanError returns err with a sanitized, bounded text, its class and
// requested pause unchanged.
func cleanError(err error) error {
	if err == nil {
		return nil
	}
	var re *readback.Error
	if errors.As(err, &re) {
		return &readback.Error{Class: re.Class, RetryAfter: re.RetryAfter, Err: &cleanErr{re.Err}}
	}
	return &cleanErr{err}
}

// cleanResult sanitizes every string of res that may hold text from a
// response: the query, the external ids (already checked by usableID) and
// the evidence's strings; the evidence records "sanitized": true when
// anything changed.
func cleanResult(res readback.Result) readback.Result {
	changed := false
	c := func(s string, limit int) string {
		out, ch := sanitize.Text(s, limit)
		changed = changed || ch
		return out
	}
	res.Query = c(res.Query, maxQueryBytes)
	for i, id := range res.ExternalIDs {
		res.ExternalIDs[i] = c(id, maxIDBytes)
	}
	if ev, ok := res.Evidence.(*Evidence); ok && ev != nil {
		ev.Reason = c(ev.Reason, maxReasonBytes)
		ev.Confirmation = c(ev.Confirmation, maxReasonBytes)
		ev.MatchedBy = c(ev.MatchedBy, maxReasonBytes)
		for i, id := range ev.MarkedOutsideWindow {
			ev.MarkedOutsideWindow[i] = c(id, maxIDBytes)
		}
		if len(ev.Fields) > 0 {
			fields := make(map[string]string, len(ev.Fields))
			for k, v := range ev.Fields {
				fields[c(k, maxReasonBytes)] = c(v, maxReasonBytes)
			}
			ev.Fields = fields
		}
		ev.Sanitized = ev.Sanitized || changed
	}
	return res
}
