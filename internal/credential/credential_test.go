package credential_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/internal/credential"
)

const secret = "sk_test_0123456789"

func lookup(name string) (string, bool) {
	v, ok := map[string]string{"KEY": secret, "EMPTY": ""}[name]
	return v, ok
}

func TestResolve(t *testing.T) {
	dir := t.TempDir()
	withNewline, empty := filepath.Join(dir, "key"), filepath.Join(dir, "empty")
	if err := os.WriteFile(withNewline, []byte(secret+"\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, env, file, field string
	}{
		{name: "env", env: "KEY"},
		{name: "file without its newline", file: withNewline},
		{name: "both", env: "KEY", file: withNewline, field: "file"},
		{name: "unset", env: "NOPE", field: "env"},
		{name: "set empty", env: "EMPTY", field: "env"},
		{name: "empty file", file: empty, field: "file"},
		{name: "missing file", file: filepath.Join(dir, "nope"), field: "file"},
		{name: "neither", field: "env"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := credential.Resolve(tc.env, tc.file, lookup)
			if tc.field == "" {
				if err != nil || got != secret {
					t.Fatalf("got %q, %v; want the secret", got, err)
				}
				return
			}
			var ce *credential.Error
			if !errors.As(err, &ce) || ce.Field != tc.field || strings.Contains(err.Error(), secret) {
				t.Fatalf("error %v, want an *Error on %s that does not print the secret", err, tc.field)
			}
		})
	}
}

func TestHeader(t *testing.T) {
	for _, tc := range []struct {
		scheme, header, secret, name, value string
	}{
		{"", "", "tok", "Authorization", "Bearer tok"},
		{"basic", "", "sk_live:", "Authorization", "Basic c2tfbGl2ZTo="},
		{"header", "x-api-key", "tok", "X-Api-Key", "tok"},
	} {
		name, value, err := credential.Header(tc.scheme, tc.header, tc.secret)
		if err != nil || name != tc.name || value != tc.value {
			t.Fatalf("%s: got %s: %s, %v", tc.scheme, name, value, err)
		}
	}
	for scheme, field := range map[string]string{"header": "header", "digest": "scheme"} {
		var ce *credential.Error
		if _, _, err := credential.Header(scheme, "", "tok"); !errors.As(err, &ce) || ce.Field != field {
			t.Fatalf("%s: error %v, want an *Error on %s", scheme, err, field)
		}
	}
}
