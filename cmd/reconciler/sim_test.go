package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSimCommand runs `reconciler sim` on the article's strategies (no
// database needed): --json parses, --csv parses, --svg writes well-formed
// XML, the table names every strategy, and progress goes to stderr only.
func TestSimCommand(t *testing.T) {
	chart := filepath.Join(t.TempDir(), "chart.svg")
	base := []string{"reconciler", "sim", "--tasks", "6", "--seed", "2", "--strategies", "baseline,retries,all-patterns"}

	var out, errOut bytes.Buffer
	if code := run(context.Background(), append(base, "--json", "--svg", chart), strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	var rep struct {
		Profile    string
		Strategies []struct{ Strategy string }
	}
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil || rep.Profile != "medium" || len(rep.Strategies) != 3 {
		t.Fatalf("--json: %v: %s", err, out.String())
	}
	if !strings.Contains(errOut.String(), "all-patterns: 6 tasks done") {
		t.Errorf("no progress on stderr: %q", errOut.String())
	}
	svg, err := os.ReadFile(chart)
	if err != nil {
		t.Fatal(err)
	}
	for d := xml.NewDecoder(bytes.NewReader(svg)); ; {
		if _, err := d.Token(); err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatalf("--svg is not well-formed: %v", err)
			}
			break
		}
	}

	out.Reset()
	if code := run(context.Background(), append(base, "--csv"), strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("--csv: exit %d", code)
	}
	if rows, err := csv.NewReader(&out).ReadAll(); err != nil || len(rows) != 4 {
		t.Fatalf("--csv: %v: %q", err, rows)
	}

	out.Reset()
	if code := run(context.Background(), base, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("table: exit %d", code)
	}
	for _, s := range []string{"baseline", "retries", "all-patterns", "strict", "profile medium"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, out.String())
		}
	}
}

// TestSimUsageErrors: a bad profile or strategy, or two output formats, is
// a usage error (exit 2) that names the problem.
func TestSimUsageErrors(t *testing.T) {
	for args, want := range map[string]string{
		"sim --profile apocalyptic":    "unknown profile",
		"sim --strategies prayer":      "unknown strategy",
		"sim --json --csv":             "exclusive",
		"sim --tasks 0 --profile none": "at least 1",
	} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), append([]string{"reconciler"}, strings.Fields(args)...), strings.NewReader(""), &out, &errOut)
		if code != 2 || !strings.Contains(errOut.String(), want) {
			t.Errorf("%s: exit %d, stderr %q; want 2 and %q", args, code, errOut.String(), want)
		}
	}
}
