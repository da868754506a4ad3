// Package contentcoding decodes the content codings of an HTTP response
// (RFC 9110 §8.4): gzip and x-gzip, deflate (zlib-wrapped as the RFC says,
// or raw as some servers send it), br, and any stack of them. A body must
// be decoded before anything reads it for meaning: an external id, a
// verdict, or a credential echoed in it that must be removed. An upstream
// may compress its answer whatever it was asked, so a body in a coding
// that cannot be decoded is one that cannot be read at all.
package contentcoding

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/andybalholm/brotli"
)

// ErrUndecodable is matched (errors.Is) by every failure to decode a body:
// a coding this package does not know, or content its coding cannot decode.
// A failure to read the body itself (a reset) is returned as it is.
var ErrUndecodable = errors.New("the response body's content coding cannot be decoded")

// Decode replaces resp.Body with its content decoded from every coding
// Content-Encoding lists (last applied, first undone) and removes
// Content-Encoding and Content-Length, which no longer describe it. Bound
// the decoded body, not the encoded one: a few kilobytes can inflate to
// gigabytes. A coding it does not know is an error matching ErrUndecodable,
// and resp is left as it was; content that does not decode fails the
// body's reads with such an error. A response without a body (to HEAD, or
// 204, 304) is left as it is.
func Decode(resp *http.Response) error {
	codings := list(resp.Header.Values("Content-Encoding"))
	if len(codings) == 0 {
		return nil
	}
	if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified ||
		(resp.Request != nil && resp.Request.Method == http.MethodHead) {
		return nil
	}
	for _, c := range codings {
		if !known(c) {
			return fmt.Errorf("%w: %q", ErrUndecodable, c)
		}
	}
	src := &source{r: resp.Body}
	var r io.Reader = src
	for i := len(codings) - 1; i >= 0; i-- {
		r = &decoder{coding: codings[i], in: r, src: src}
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{r, resp.Body}
	resp.Header.Del("Content-Encoding")
	resp.Header.Del("Content-Length")
	resp.ContentLength = -1
	resp.Uncompressed = true
	return nil
}

// list returns the codings named in Content-Encoding values, lower-cased,
// without identity (which changes nothing).
func list(values []string) []string {
	var out []string
	for _, v := range values {
		for _, c := range strings.Split(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				out = append(out, c)
			}
		}
	}
	return out
}

func known(coding string) bool {
	switch coding {
	case "gzip", "x-gzip", "deflate", "br":
		return true
	}
	return false
}

// source is the encoded body; it keeps its own read error, so a decoder's
// failure is told from the body's.
type source struct {
	r   io.Reader
	err error
}

func (s *source) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

// decoder undoes one coding of in, opened at the first read (opening reads
// the coding's header) so that an empty body decodes to an empty one.
type decoder struct {
	coding string
	in     io.Reader
	src    *source
	out    io.Reader
	err    error
}

func (d *decoder) Read(p []byte) (int, error) {
	if d.err != nil {
		return 0, d.err
	}
	if d.out == nil {
		d.out, d.err = d.open()
		if d.err != nil {
			d.err = d.fail(d.err)
			return 0, d.err
		}
	}
	n, err := d.out.Read(p)
	if err != nil && err != io.EOF {
		d.err = d.fail(err)
		err = d.err
	}
	return n, err
}

// fail is err as a decoding failure, unless it is the body's own.
func (d *decoder) fail(err error) error {
	if err == io.EOF {
		return io.EOF
	}
	if d.src.err != nil {
		return d.src.err
	}
	if errors.Is(err, ErrUndecodable) {
		return err
	}
	return fmt.Errorf("%w: %s: %w", ErrUndecodable, d.coding, err)
}

func (d *decoder) open() (io.Reader, error) {
	br := bufio.NewReader(d.in)
	head, err := br.Peek(2)
	if len(head) == 0 && err == io.EOF {
		return eof{}, nil
	}
	switch d.coding {
	case "gzip", "x-gzip":
		return gzip.NewReader(br)
	case "deflate":
		// RFC 9110's deflate is zlib (RFC 1950): CM 8 and a header
		// checksum; some servers send raw deflate (RFC 1951) instead.
		if len(head) == 2 && head[0]&0x0f == 8 && (uint16(head[0])<<8|uint16(head[1]))%31 == 0 {
			return zlib.NewReader(br)
		}
		return flate.NewReader(br), nil
	case "br":
		return brotli.NewReader(br), nil
	}
	return nil, fmt.Errorf("%w: %q", ErrUndecodable, d.coding)
}

type eof struct{}

func (eof) Read([]byte) (int, error) { return 0, io.EOF }
