package contentcoding

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

type failing struct{ err error }

func (f failing) Read([]byte) (int, error) { return 0, f.err }

func response(coding string, body io.Reader) *http.Response {
	h := http.Header{}
	if coding != "" {
		h.Set("Content-Encoding", coding)
	}
	h.Set("Content-Length", "3")
	return &http.Response{StatusCode: http.StatusOK, Header: h, Body: io.NopCloser(body)}
}

// A body is decoded whole, or fails with ErrUndecodable, or with the
// body's own error when reading it failed: never passed on encoded.
func TestDecode(t *testing.T) {
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("hello"))
	_ = zw.Close()
	reset := errors.New("connection reset")
	for _, tc := range []struct {
		name, coding string
		body         io.Reader
		want         string
		decodeErr    bool
		readErr      error
	}{
		{name: "identity", coding: "identity", body: strings.NewReader("abc"), want: "abc"},
		{name: "gzip", coding: "GZIP", body: bytes.NewReader(gz.Bytes()), want: "hello"},
		{name: "empty body", coding: "gzip, br", body: strings.NewReader(""), want: ""},
		{name: "unknown coding", coding: "gzip, zstd", body: strings.NewReader("abc"), decodeErr: true},
		{name: "corrupt", coding: "gzip", body: strings.NewReader("not gzip at all"), readErr: ErrUndecodable},
		{name: "truncated", coding: "x-gzip", body: bytes.NewReader(gz.Bytes()[:gz.Len()-4]), readErr: ErrUndecodable},
		{name: "the body's own failure", coding: "br", body: failing{reset}, readErr: reset},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := response(tc.coding, tc.body)
			err := Decode(resp)
			if tc.decodeErr {
				if !errors.Is(err, ErrUndecodable) || resp.Header.Get("Content-Encoding") == "" {
					t.Fatalf("Decode = %v, header %v; want ErrUndecodable, resp as it was", err, resp.Header)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			if tc.readErr != nil {
				if !errors.Is(err, tc.readErr) || (tc.readErr == reset && errors.Is(err, ErrUndecodable)) {
					t.Fatalf("read: %q, %v; want %v", got, err, tc.readErr)
				}
				return
			}
			if err != nil || string(got) != tc.want || (tc.coding != "identity" && resp.Header.Get("Content-Length") != "") {
				t.Fatalf("read: %q, %v, header %v; want %q without Content-Length", got, err, resp.Header, tc.want)
			}
		})
	}
}
