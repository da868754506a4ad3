package retention

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// Sink stores archive files. Write stores the file name, whose content
// (JSON Lines, uncompressed) write streams, and returns where it is and
// the SHA-256 (hex) of the bytes stored. An error means the file may be
// missing or incomplete: the archiver then deletes nothing of it.
type Sink interface {
	Write(ctx context.Context, name string, write func(io.Writer) error) (location, sum string, err error)
}

// Dir is a Sink writing gzip-compressed files into a directory, each with
// a "<name>.sha256" file beside it in sha256sum's format (so
// `sha256sum -c` checks it). A file is written to a temporary name, synced,
// renamed and its directory synced before Write returns: a crash leaves
// either the whole file or none under its name.
type Dir string

// Write implements Sink.
func (d Dir) Write(_ context.Context, name string, write func(io.Writer) error) (string, string, error) {
	final := filepath.Join(string(d), name)
	h := sha256.New()
	if err := atomicWrite(final, func(w io.Writer) error {
		zw := gzip.NewWriter(io.MultiWriter(w, h))
		if err := write(zw); err != nil {
			return err
		}
		return zw.Close()
	}); err != nil {
		return "", "", err
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if err := atomicWrite(final+".sha256", func(w io.Writer) error {
		_, err := fmt.Fprintf(w, "%s  %s\n", sum, name)
		return err
	}); err != nil {
		return "", "", err
	}
	dir, err := os.Open(string(d))
	if err != nil {
		return "", "", fmt.Errorf("retention: sync %s: %w", d, err)
	}
	defer dir.Close()
	if err := dir.Sync(); err != nil {
		return "", "", fmt.Errorf("retention: sync %s: %w", d, err)
	}
	return final, sum, nil
}

// atomicWrite writes path through a synced temporary file renamed over it.
func atomicWrite(path string, write func(io.Writer) error) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("retention: create %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	bw := bufio.NewWriterSize(f, 1<<20)
	if err := write(bw); err != nil {
		return fmt.Errorf("retention: write %s: %w", path, err)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("retention: write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("retention: sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("retention: close %s: %w", path, err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("retention: rename %s: %w", path, err)
	}
	return nil
}

// Line is one line of an archive: a row of table, as Postgres's to_jsonb
// wrote it (column names as keys, times in RFC 3339).
type Line struct {
	Table string          `json:"table"`
	Row   json.RawMessage `json:"row"`
}

// ErrChecksum is the error of an archive whose bytes do not match the
// SHA-256 written beside it.
var ErrChecksum = errors.New("retention: archive does not match its checksum")

// ReadFile reads an archive written by Dir, after checking it against its
// ".sha256" file (ErrChecksum when they differ).
func ReadFile(path string) ([]Line, error) {
	want, err := os.ReadFile(path + ".sha256")
	if err != nil {
		return nil, fmt.Errorf("retention: %w", err)
	}
	fields := strings.Fields(string(want))
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("retention: %w", err)
	}
	got := sha256.Sum256(data)
	if len(fields) < 1 || fields[0] != hex.EncodeToString(got[:]) {
		return nil, fmt.Errorf("%w: %s", ErrChecksum, path)
	}
	zr, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("retention: %s: %w", path, err)
	}
	defer zr.Close()
	var lines []Line
	dec := json.NewDecoder(zr)
	for {
		var l Line
		if err := dec.Decode(&l); errors.Is(err, io.EOF) {
			return lines, nil
		} else if err != nil {
			return nil, fmt.Errorf("retention: %s: line %d: %w", path, len(lines)+1, err)
		}
		lines = append(lines, l)
	}
}
