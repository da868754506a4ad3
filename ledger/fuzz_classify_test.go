package ledger

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"unicode/utf8"

	"github.com/receiptledger/reconciler/internal/sanitize"
)

// Issue 9, item 6: Caller.Do's classification (safeClassify, as Do calls
// it) under fuzzed exchanges: status 0-999 (0: no response), Content-Type,
// Retry-After and Location headers, body bytes possibly cut short by an
// io.ErrUnexpectedEOF, sent or not, transport errors, and a Classify
// override that declines, panics, returns a garbage outcome or a fuzzed
// verdict. No panic escapes; the verdict's outcome is one of the three;
// the default classification keeps SPEC §4 as DefaultClassify implements
// it; a non-succeeded verdict has a code and a message; and the message as
// settle stores it is valid UTF-8 without NUL. Pure unit: no database.
func FuzzClassify(f *testing.F) {
	f.Add(uint16(200), "application/json", "", "", []byte(`{"id":"ch_1"}`), uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(200), "application/json", "", "", []byte(`{"id":"ch_1"`), uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(201), "text/plain", "", "", []byte(`{"id":`), uint8(3), uint8(0), true, uint8(0), "")
	f.Add(uint16(200), "", "", "", []byte(`[1,2]`), uint8(0), uint8(1), true, uint8(0), "")
	f.Add(uint16(303), "", "", "/v1/charges/ch_1?token=x#f", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(301), "", "", "http://[::1", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(408), "", "", "", []byte("timeout"), uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(429), "", "120", "", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(425), "", "", "", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(404), "application/problem+json", "", "", []byte(`{"error":"no"}`), uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(503), "", "Wed, 21 Oct 2015 07:28:00 GMT", "", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(999), "", "", "", []byte{0xff, 0xfe}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(99), "", "", "", []byte{}, uint8(0), uint8(0), true, uint8(0), "")
	f.Add(uint16(0), "", "", "", []byte{}, uint8(0), uint8(0), false, uint8(0), "")
	f.Add(uint16(0), "", "", "", []byte{}, uint8(0), uint8(2), true, uint8(0), "")
	f.Add(uint16(0), "", "", "", []byte{}, uint8(0), uint8(5), false, uint8(0), "dial tcp: \xff\x00 refused")
	f.Add(uint16(200), "application/json", "", "", []byte(`{"id":"a"}`), uint8(0), uint8(0), true, uint8(1), "boom \xff")
	f.Add(uint16(500), "", "", "", []byte{}, uint8(0), uint8(0), true, uint8(2), "exploded")
	f.Add(uint16(409), "", "", "", []byte{}, uint8(0), uint8(0), true, uint8(3), "succeeded")
	f.Add(uint16(200), "", "", "", []byte(`{"id":"x"}`), uint8(0), uint8(0), true, uint8(4), "\x00bad\xc3")
	f.Add(uint16(200), "", "", "", []byte(`{"id":"x"}`), uint8(0), uint8(0), true, uint8(5), "")
	f.Add(uint16(200), "", "", "", []byte(`{"id":"x"}`), uint8(0), uint8(0), true, uint8(6), "id panic")

	f.Fuzz(func(t *testing.T, status uint16, ctype, retryAfter, location string, body []byte,
		cut, errKind uint8, sent bool, mode uint8, s string) {
		req, err := http.NewRequest([]string{"POST", "GET", "PUT", "DELETE", "patch"}[int(errKind)%5],
			"https://user:pw@api.example/v1/charges?api_key=sk_secret", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer sk_secret")
		ex := Exchange{Request: req, Sent: sent}
		code := int(status % 1000)
		if code == 0 {
			// No response: a transport error (nil only in mode 7 of errKind).
			ex.Err = []error{
				io.ErrUnexpectedEOF, io.EOF, syscall.ECONNRESET, context.DeadlineExceeded,
				context.Canceled, &url.Error{Op: "Post", URL: req.URL.String(), Err: errors.New(s + "x")},
				fmt.Errorf("wrapped: %w", errors.New("x"+s)), nil,
			}[int(errKind)%8]
		} else {
			h := http.Header{}
			if ctype != "" {
				h.Set("Content-Type", ctype)
			}
			if retryAfter != "" {
				h.Set("Retry-After", retryAfter)
			}
			if location != "" {
				h.Set("Location", location)
			}
			ex.Response = &http.Response{StatusCode: code, Status: fmt.Sprint(code), Header: h, Request: req}
			ex.Body = body
			switch {
			case cut > 0 && cut%16 == 15:
				ex.Err = ErrResponseTooLarge
			case cut > 0:
				if n := int(cut) % (len(body) + 1); n < len(body) {
					ex.Body = body[:n]
				}
				ex.Err = io.ErrUnexpectedEOF
			}
		}
		c := &Caller{}
		switch mode % 8 {
		case 1: // a panicking override (a fuzzed value)
			c.Classify = func(Exchange) (Verdict, bool) { panic(s) }
		case 2: // a panicking override (an error value)
			c.Classify = func(Exchange) (Verdict, bool) { panic(errors.New(s)) }
		case 3: // a garbage or valid outcome, fuzzed code and message
			c.Classify = func(Exchange) (Verdict, bool) {
				return Verdict{Outcome: Outcome(s), Code: s, Message: s, Retryable: len(s)%2 == 0}, true
			}
		case 4: // a valid outcome with a fuzzed (maybe empty) code and message
			c.Classify = func(Exchange) (Verdict, bool) {
				o := []Outcome{OutcomeSucceeded, OutcomeRejected, OutcomeUnknown}[len(s)%3]
				return Verdict{Outcome: o, Message: s}, true
			}
		case 5: // an override that declines
			c.Classify = func(Exchange) (Verdict, bool) { return Verdict{Outcome: "garbage"}, false }
		case 6: // an ExternalID extractor that panics
			c.ExternalID = func([]byte) (string, error) { panic(s) }
		case 7: // an ExternalID extractor that fails with a fuzzed error
			c.ExternalID = func([]byte) (string, error) { return "", errors.New(s) }
		}

		v, overridden := c.safeClassify(ex)

		if !v.Outcome.Valid() {
			t.Fatalf("outcome %q is not one of the three", v.Outcome)
		}
		switch mode % 8 {
		case 1, 2:
			if v.Outcome != OutcomeUnknown || v.Code != CodeClassifyPanic || !overridden {
				t.Fatalf("a panicking override gave %+v (overridden %v)", v, overridden)
			}
		case 3:
			if !Outcome(s).Valid() && (v.Outcome != OutcomeUnknown || v.Code != CodeInvalidVerdict) {
				t.Fatalf("garbage outcome %q gave %+v", s, v)
			}
		case 6:
			if v.Outcome == OutcomeSucceeded {
				t.Fatalf("a panicking ExternalID gave %+v", v)
			}
		case 7:
			if v.Outcome == OutcomeSucceeded && s != "" {
				// errors.New("") is still an error.
				t.Fatalf("a failing ExternalID gave %+v", v)
			}
		}
		if !overridden {
			checkDefault(t, ex, v)
		}
		if v.Outcome != OutcomeSucceeded {
			if v.Code == "" {
				t.Errorf("%s verdict without a code: %+v", v.Outcome, v)
			}
			// The message as settle stores it.
			msg, _ := sanitize.Text(redactRequestText(v.Message, ex.Request), maxMessageBytes)
			if !utf8.ValidString(msg) || strings.ContainsRune(msg, 0) {
				t.Errorf("stored message is not clean UTF-8: %q", msg)
			}
			if strings.Contains(msg, "sk_secret") {
				t.Errorf("stored message carries the request's credential: %q", msg)
			}
		}
		if ex.Response != nil && code >= 300 && code <= 399 {
			loc := redirectLocation(ex)
			if strings.Contains(loc, "api_key") || strings.Contains(loc, "pw@") {
				t.Errorf("recorded location keeps user info or query: %q", loc)
			}
		}
	})
}

// checkDefault checks a verdict of the default classification (no override
// took part) against SPEC §4 as DefaultClassify implements it.
func checkDefault(t *testing.T, ex Exchange, v Verdict) {
	t.Helper()
	if ex.Response == nil {
		switch {
		case ex.Err == nil:
			if v.Outcome != OutcomeUnknown {
				t.Errorf("no response and no error gave %+v", v)
			}
		case !ex.Sent:
			if v.Outcome != OutcomeRejected || !v.Retryable || v.Code != CodeNotSent {
				t.Errorf("nothing sent gave %+v, want rejected, retryable, not_sent", v)
			}
		default:
			if v.Outcome != OutcomeUnknown {
				t.Errorf("sent, no response gave %+v, want outcome_unknown", v)
			}
		}
		return
	}
	s := ex.Response.StatusCode
	switch {
	case s >= 200 && s <= 299:
		if ex.Err != nil && v.Outcome == OutcomeSucceeded {
			t.Errorf("%d with read error %v gave succeeded", s, ex.Err)
		}
		if v.Outcome == OutcomeRejected {
			t.Errorf("%d gave rejected: %+v", s, v)
		}
	case s >= 300 && s <= 399, s == 408, s >= 500:
		if v.Outcome != OutcomeUnknown {
			t.Errorf("%d gave %+v, want outcome_unknown", s, v)
		}
	case s >= 400 && s <= 499:
		if v.Outcome != OutcomeRejected {
			t.Errorf("%d gave %+v, want rejected", s, v)
		}
		if (s == 429 || s == 425) != v.Retryable {
			t.Errorf("%d gave retryable %v", s, v.Retryable)
		}
	default: // 1-199
		if v.Outcome != OutcomeUnknown {
			t.Errorf("%d gave %+v, want outcome_unknown", s, v)
		}
	}
	if v.Outcome != OutcomeSucceeded && v.Message == "" {
		t.Errorf("%s verdict for %d without a message", v.Outcome, s)
	}
}
