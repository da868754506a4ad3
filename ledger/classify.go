package ledger

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"

	"github.com/receiptledger/reconciler/internal/jsonpointer"
	"github.com/receiptledger/reconciler/internal/sanitize"
)

// safeClassify is classify turning a panic of a Classify override or an
// ExternalID extractor into an outcome_unknown verdict that carries the
// panic (sanitized): the request was sent, so its effect is unknown, and the
// receipt must not stay submitted.
func (c *Caller) safeClassify(ex Exchange) (v Verdict, overridden bool) {
	defer func() {
		if p := recover(); p != nil {
			msg, _ := sanitize.Text(fmt.Sprintf("Classify panicked: %v", p), maxMessageBytes)
			v, overridden = Verdict{Outcome: OutcomeUnknown, Code: CodeClassifyPanic, Message: msg}, true
		}
	}()
	return c.classify(ex)
}

// classify applies the override, then the default, and completes the
// verdict: codes and messages default, and a succeeded verdict gets its
// external id from the body.
func (c *Caller) classify(ex Exchange) (v Verdict, overridden bool) {
	def := DefaultClassify(ex)
	v = def
	if c.Classify != nil {
		if ov, ok := c.Classify(ex); ok {
			v, overridden = ov, true
			if !v.Outcome.Valid() {
				v = Verdict{Outcome: OutcomeUnknown, Code: CodeInvalidVerdict,
					Message: fmt.Sprintf("Classify returned outcome %q", ov.Outcome)}
			}
			if v.Outcome != OutcomeSucceeded {
				if v.Code == "" {
					v.Code = def.Code
				}
				if v.Code == "" {
					v.Code = statusCode(ex)
				}
				if v.Message == "" {
					v.Message = def.Message
				}
				if v.Message == "" {
					v.Message = statusMessage(ex)
				}
			}
		}
	}
	if v.Outcome == OutcomeSucceeded && v.ExternalID == "" {
		extract := c.ExternalID
		if extract == nil {
			extract = defaultExternalID
		}
		id, err := extract(ex.Body)
		if err != nil {
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: "external id: " + err.Error()}, overridden
		}
		v.ExternalID = id
	}
	return v, overridden
}

// DefaultClassify is the classification of SPEC §4:
//
//   - nothing sent (any failure before the transport had a connection,
//     including the send deadline passing first): rejected, retryable,
//     not_sent;
//   - sent, then no response (timeout, reset, EOF, canceled): outcome_unknown;
//   - 2xx whose body was read whole and, when it is or looks like JSON,
//     parses: succeeded; otherwise outcome_unknown (truncated_body,
//     malformed_body, body_too_large);
//   - 3xx: outcome_unknown. Do follows no redirect, so the request was
//     delivered and answered with one; whether it took effect is unknown.
//     A 303 See Other to a POST, PUT, PATCH or DELETE usually means the
//     server did the work and points at the result: the message says the
//     effect likely exists. The Location (without user info, query or
//     fragment) is recorded in the detail's extra as "location";
//   - 408: outcome_unknown (gateways and proxies send it after they
//     forwarded the request, so it may have taken effect): not retryable;
//   - 429: rejected, retryable, rate_limited; 425: rejected, retryable
//     (the server refused to process early data); other 4xx: rejected;
//   - 5xx (500, 502, 503, 504, ...), and any other status: outcome_unknown.
func DefaultClassify(ex Exchange) Verdict {
	if ex.Response == nil {
		if ex.Err == nil {
			return Verdict{Outcome: OutcomeUnknown, Code: CodeTransportError, Message: "no response and no error"}
		}
		msg := safeErrorText(ex.Err, ex.Request)
		if !ex.Sent {
			return Verdict{Outcome: OutcomeRejected, Code: CodeNotSent, Message: msg, Retryable: true}
		}
		return Verdict{Outcome: OutcomeUnknown, Code: transportCode(ex.Err), Message: msg}
	}
	status := ex.Response.StatusCode
	switch {
	case status >= 200 && status <= 299:
		switch {
		case errors.Is(ex.Err, ErrResponseTooLarge):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeBodyTooLarge, Message: ex.Err.Error()}
		case errors.Is(ex.Err, ErrUndecodableBody):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: fmt.Sprintf("%s with a body that cannot be read: %s", statusMessage(ex), safeErrorText(ex.Err, ex.Request))}
		case ex.Err != nil:
			return Verdict{Outcome: OutcomeUnknown, Code: CodeTruncatedBody,
				Message: fmt.Sprintf("%s after %d bytes: %s", statusMessage(ex), len(ex.Body), safeErrorText(ex.Err, ex.Request))}
		case looksJSON(ex.Response.Header.Get("Content-Type"), ex.Body) && !json.Valid(ex.Body):
			return Verdict{Outcome: OutcomeUnknown, Code: CodeMalformedBody,
				Message: fmt.Sprintf("%s with a body of %d bytes that is not valid JSON", statusMessage(ex), len(ex.Body))}
		}
		return Verdict{Outcome: OutcomeSucceeded}
	case status >= 300 && status <= 399:
		msg := statusMessage(ex) + ": redirect not followed; the request was delivered and answered with a redirect, its effect is unknown"
		if status == http.StatusSeeOther && ex.Request != nil && effectMethod(ex.Request.Method) {
			msg = statusMessage(ex) + " to a " + strings.ToUpper(ex.Request.Method) +
				": the effect likely exists (the server usually did the work and points at the result); redirect not followed"
		}
		return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex), Message: msg}
	case status == http.StatusRequestTimeout:
		return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex),
			Message: statusMessage(ex) + ": gateways send it after forwarding the request, so its effect is unknown"}
	case status == http.StatusTooManyRequests:
		return Verdict{Outcome: OutcomeRejected, Code: CodeRateLimited, Message: statusMessage(ex), Retryable: true}
	case status == http.StatusTooEarly:
		return Verdict{Outcome: OutcomeRejected, Code: statusCode(ex), Message: statusMessage(ex), Retryable: true}
	case status >= 400 && status <= 499:
		return Verdict{Outcome: OutcomeRejected, Code: statusCode(ex), Message: statusMessage(ex)}
	}
	return Verdict{Outcome: OutcomeUnknown, Code: statusCode(ex), Message: statusMessage(ex)}
}

// effectMethod reports whether a 303 answering method points at the
// result of an effect.
func effectMethod(method string) bool {
	switch strings.ToUpper(method) {
	case http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		return true
	}
	return false
}

// redirectLocation returns a 3xx response's Location resolved against the
// request's URL, without user info, query or fragment, bounded; "" when
// there is none.
func redirectLocation(ex Exchange) string {
	raw := ex.Response.Header.Get("Location")
	if raw == "" {
		return ""
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "[unparseable Location]"
	}
	if ex.Request != nil && ex.Request.URL != nil {
		u = ex.Request.URL.ResolveReference(u)
	}
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	loc, _ := sanitize.Text(u.String(), maxMessageBytes)
	return loc
}

func statusCode(ex Exchange) string {
	if ex.Response == nil {
		return CodeTransportError
	}
	return "http_" + strconv.Itoa(ex.Response.StatusCode)
}

func statusMessage(ex Exchange) string {
	if ex.Response == nil {
		return ""
	}
	s := ex.Response.StatusCode
	return strings.TrimSpace(strconv.Itoa(s) + " " + http.StatusText(s))
}

func transportCode(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errTransportResend):
		return CodeTransportResend
	case errors.Is(err, errCutMidWrite):
		return CodeSendDeadlineMidWrite
	case errors.Is(err, context.Canceled):
		return CodeCanceled
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return CodeTimeout
	case errors.Is(err, syscall.ECONNRESET):
		return CodeConnectionReset
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return CodeConnectionClosed
	}
	return CodeTransportError
}

// looksJSON reports whether a body should parse as JSON: its media type is
// JSON, or it starts like a JSON object or array.
func looksJSON(contentType string, body []byte) bool {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return false
	}
	if mt, _, err := mime.ParseMediaType(contentType); err == nil &&
		(mt == "application/json" || strings.HasSuffix(mt, "+json")) {
		return true
	}
	return trimmed[0] == '{' || trimmed[0] == '['
}

const maxMessageBytes = 512

// ExternalIDAt returns an extractor, for Caller.ExternalID, of the string
// or number at pointer (RFC 6901, e.g. "/data/id") in a JSON body. A body
// that is empty or lacks the pointer's target (or holds null there) has no
// id; a body that is not JSON, or a target that is neither a string nor a
// number, is an error.
func ExternalIDAt(pointer string) (func(body []byte) (string, error), error) {
	tokens, err := jsonpointer.Parse(pointer)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	return func(body []byte) (string, error) {
		if len(bytes.TrimSpace(body)) == 0 {
			return "", nil
		}
		if !json.Valid(body) {
			return "", errors.New("response body is not valid JSON")
		}
		raw, ok := lookup(body, tokens)
		if !ok {
			return "", nil
		}
		id, ok := scalarID(raw)
		if !ok {
			return "", fmt.Errorf("the value at %q is not a string or number", pointer)
		}
		return id, nil
	}, nil
}

// defaultExternalID is the top-level "id" of a JSON object; any other body
// (not JSON, not an object, no scalar "id") has none. Whether a 2xx body
// that looks like JSON parses is the classification's concern.
func defaultExternalID(body []byte) (string, error) {
	if !json.Valid(body) {
		return "", nil
	}
	raw, ok := lookup(body, []string{"id"})
	if !ok {
		return "", nil
	}
	id, _ := scalarID(raw)
	return id, nil
}

// lookup resolves tokens in a valid JSON document.
func lookup(doc []byte, tokens []string) (json.RawMessage, bool) {
	cur := json.RawMessage(doc)
	for _, tok := range tokens {
		trimmed := bytes.TrimSpace(cur)
		if len(trimmed) == 0 {
			return nil, false
		}
		switch trimmed[0] {
		case '{':
			var obj map[string]json.RawMessage
			if json.Unmarshal(trimmed, &obj) != nil {
				return nil, false
			}
			next, ok := obj[tok]
			if !ok {
				return nil, false
			}
			cur = next
		case '[':
			var arr []json.RawMessage
			if json.Unmarshal(trimmed, &arr) != nil {
				return nil, false
			}
			i, ok := jsonpointer.ArrayIndex(tok)
			if !ok || i >= len(arr) {
				return nil, false
			}
			cur = arr[i]
		default:
			return nil, false
		}
	}
	cur = bytes.TrimSpace(cur)
	if string(cur) == "null" {
		return nil, false
	}
	return cur, true
}

// scalarID renders a JSON string (unquoted) or number (its literal text).
func scalarID(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 {
		return "", false
	}
	switch c := raw[0]; {
	case c == '"':
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return "", false
		}
		return s, true
	case c == '-' || (c >= '0' && c <= '9'):
		return string(raw), true
	}
	return "", false
}
