package main

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	urfavecli "github.com/urfave/cli/v2"
)

// runFingerprintCLI runs `reconciler fingerprint args...` in an app that holds
// only fingerprintCommand, and returns the exit status, stdout and stderr the
// way main reports them (the ExitCoder's message on one stderr line).
func runFingerprintCLI(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	app := &urfavecli.App{
		Name:           "reconciler",
		Reader:         strings.NewReader(stdin),
		Writer:         &out,
		ErrWriter:      &errOut,
		ExitErrHandler: func(*urfavecli.Context, error) {},
		Commands:       []*urfavecli.Command{fingerprintCommand()},
	}
	refuseUnknownSubcommands("reconciler", app.Commands) // as newApp does: usage errors exit 2
	err := app.Run(append([]string{"reconciler", "fingerprint"}, args...))
	if err == nil {
		return 0, out.String(), errOut.String()
	}
	var ec urfavecli.ExitCoder
	if !errors.As(err, &ec) {
		t.Fatalf("%v: error %v is not a cli.ExitCoder", args, err)
	}
	fmt.Fprintln(&errOut, err)
	return ec.ExitCode(), out.String(), errOut.String()
}

// goldenFingerprint is the SHA-256 of
// {"method":"POST","payload":{"amount":100,"currency":"EUR"},"target":"/v1/refunds"}.
const goldenFingerprint = "sha256:62098b4fbd6294bed51bfcc0100322fa21d6607c17437b6851f50e70e58d48ac"

func TestFingerprintCommand(t *testing.T) {
	tests := []struct {
		name    string
		stdin   string
		args    []string
		code    int
		stdout  string // exact, when code is 0
		errText string // substring of stderr, when code is not 0
	}{
		{
			name:   "good input",
			stdin:  "{\n  \"currency\": \"EUR\",\n  \"amount\": 100\n}\n",
			args:   []string{"--method", "post", "--target", "/v1/refunds"},
			stdout: goldenFingerprint + "\n",
		},
		{
			name:   "volatile fields",
			stdin:  `{"request_id":"r-9","amount":1e2,"meta":{"nonce":"x"},"currency":"EUR"}`,
			args:   []string{"--method", "POST", "--target", "/v1/refunds", "--drop", "/request_id", "--drop=/meta"},
			stdout: goldenFingerprint + "\n",
		},
		{
			name:   "pointer with a comma is not split",
			stdin:  `{"a,b":1,"amount":100,"currency":"EUR"}`,
			args:   []string{"--method", "POST", "--target", "/v1/refunds", "--drop", "/a,b"},
			stdout: goldenFingerprint + "\n",
		},
		{
			name:    "bad JSON",
			stdin:   `{"amount":100,`,
			args:    []string{"--method", "POST", "--target", "/v1/refunds"},
			code:    1,
			errText: "invalid JSON",
		},
		{
			name:    "empty stdin",
			args:    []string{"--method", "POST", "--target", "/v1/refunds"},
			code:    1,
			errText: "empty input",
		},
		{
			name:    "lossy number",
			stdin:   `{"amount":9007199254740993}`,
			args:    []string{"--method", "POST", "--target", "/v1/refunds"},
			code:    1,
			errText: `"9007199254740993" at "/amount" would be canonicalized as 9007199254740992`,
		},
		{
			name:    "duplicate key",
			stdin:   `{"amount":1,"amount":2}`,
			args:    []string{"--method", "POST", "--target", "/v1/refunds"},
			code:    1,
			errText: "duplicate object key",
		},
		{
			name:    "invalid UTF-8",
			stdin:   "\"\xff\"",
			args:    []string{"--method", "POST", "--target", "/v1/refunds"},
			code:    1,
			errText: "invalid UTF-8",
		},
		{
			name:    "payload over --max-bytes",
			stdin:   `{"amount":100,"currency":"EUR"}`,
			args:    []string{"--method", "POST", "--target", "/v1/refunds", "--max-bytes", "10"},
			code:    1,
			errText: "payload too large",
		},
		{
			name:   "--max-bytes 0 means no limit",
			stdin:  `{"amount":100,"currency":"EUR"}`,
			args:   []string{"--method", "POST", "--target", "/v1/refunds", "--max-bytes", "0"},
			stdout: goldenFingerprint + "\n",
		},
		{
			name:    "missing --method",
			stdin:   `{}`,
			args:    []string{"--target", "/v1/refunds"},
			code:    2,
			errText: "--method is required",
		},
		{
			name:    "missing --target",
			stdin:   `{}`,
			args:    []string{"--method", "POST"},
			code:    2,
			errText: "--target is required",
		},
		{
			name:    "unknown flag",
			stdin:   `{}`,
			args:    []string{"--method", "POST", "--target", "/t", "--bogus"},
			code:    2,
			errText: "bogus",
		},
		{
			name:    "unexpected argument",
			stdin:   `{}`,
			args:    []string{"--method", "POST", "--target", "/t", "payload.json"},
			code:    2,
			errText: `unexpected argument "payload.json"`,
		},
		{
			name:    "malformed pointer",
			stdin:   `{}`,
			args:    []string{"--method", "POST", "--target", "/t", "--drop", "request_id"},
			code:    2,
			errText: "invalid JSON pointer",
		},
		{
			name:    "method that is not a token",
			stdin:   `{}`,
			args:    []string{"--method", "GE T", "--target", "/t"},
			code:    2,
			errText: "invalid method",
		},
		{
			name:    "negative --max-bytes",
			stdin:   `{}`,
			args:    []string{"--method", "POST", "--target", "/t", "--max-bytes", "-1"},
			code:    2,
			errText: "--max-bytes",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runFingerprintCLI(t, tc.stdin, tc.args...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d (stdout %q, stderr %q)", code, tc.code, stdout, stderr)
			}
			if tc.code == 0 {
				if stdout != tc.stdout || stderr != "" {
					t.Errorf("stdout %q, stderr %q; want stdout %q and no stderr", stdout, stderr, tc.stdout)
				}
				return
			}
			if stdout != "" {
				t.Errorf("stdout %q on failure, want nothing", stdout)
			}
			if !strings.Contains(stderr, tc.errText) {
				t.Errorf("stderr %q does not contain %q", stderr, tc.errText)
			}
			if strings.Count(stderr, "\n") != 1 || !strings.HasSuffix(stderr, "\n") {
				t.Errorf("stderr %q is not exactly one line", stderr)
			}
		})
	}
}

func TestFingerprintCanonicalizeCommand(t *testing.T) {
	tests := []struct {
		name    string
		stdin   string
		args    []string
		code    int
		stdout  string
		errText string
	}{
		{
			name:   "exact canonical bytes, no trailing newline",
			stdin:  "{ \"b\": [1.0, 1E2, \"\\u00e9\"],\n  \"a\": null }\n",
			stdout: "{\"a\":null,\"b\":[1,100,\"\u00e9\"]}",
		},
		{
			name:   "lossy numbers are canonicalized, as RFC 8785 says",
			stdin:  `[9007199254740993, 0.10000000000000001]`,
			stdout: `[9007199254740992,0.1]`,
		},
		{name: "bad JSON", stdin: `[1,]`, code: 1, errText: "invalid JSON"},
		{name: "duplicate key", stdin: `{"a":1,"a":1}`, code: 1, errText: "duplicate object key"},
		{name: "lone surrogate", stdin: `"\ud800"`, code: 1, errText: "lone UTF-16 surrogate"},
		{name: "unexpected argument", stdin: `{}`, args: []string{"doc.json"}, code: 2, errText: "unexpected argument"},
		{name: "unknown flag", stdin: `{}`, args: []string{"--method", "POST"}, code: 2, errText: "method"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runFingerprintCLI(t, tc.stdin, append([]string{"canonicalize"}, tc.args...)...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d (stdout %q, stderr %q)", code, tc.code, stdout, stderr)
			}
			if tc.code == 0 {
				if stdout != tc.stdout || stderr != "" {
					t.Errorf("stdout %q, stderr %q; want stdout %q and no stderr", stdout, stderr, tc.stdout)
				}
				return
			}
			if stdout != "" || !strings.Contains(stderr, tc.errText) || strings.Count(stderr, "\n") != 1 {
				t.Errorf("stdout %q, stderr %q; want no stdout and one stderr line containing %q", stdout, stderr, tc.errText)
			}
		})
	}
}

func TestFingerprintHelp(t *testing.T) {
	code, stdout, _ := runFingerprintCLI(t, "", "--help")
	if code != 0 || !strings.Contains(stdout, "--method") || !strings.Contains(stdout, "canonicalize") {
		t.Errorf("--help: exit %d, stdout %q", code, stdout)
	}
}

// Issue 8, item 6: `reconciler fingerprint --secret` keys secret values with
// the deployment's key from the environment (docs/concepts.md's example), and
// refuses a secret field without a key or a secret pointer that matches
// nothing, without printing the value.
func TestFingerprintSecretKey(t *testing.T) {
	t.Setenv("I8_TEST_KEY", "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
	t.Setenv("RECONCILER_SECRET_KEY", "")
	const payload = `{"pin": 1234, "card_number": "4111111111111111", "amount": 500}`
	args := []string{"--method", "post", "--target", "/v1/charges", "--secret", "/card_number", "--secret", "/pin"}
	code, out, errOut := runFingerprintCLI(t, payload, append(args, "--secret-key-env", "I8_TEST_KEY", "--secret-key-id", "2025-01")...)
	if want := "sha256:fc8e1ee07a44f000bcf1efd1ec3d66b35c73472e5fcc87b8d4cac3464feea824\n"; code != 0 || out != want {
		t.Errorf("keyed: exit %d, stdout %q, stderr %q; want %q", code, out, errOut, want)
	}
	code, _, errOut = runFingerprintCLI(t, payload, args...)
	if code != exitUsage || !strings.Contains(errOut, "secret key is required") {
		t.Errorf("no key: exit %d, stderr %q", code, errOut)
	}
	code, _, errOut = runFingerprintCLI(t, `{"card_number": 9111111111111111}`, "--method", "POST", "--target", "/x",
		"--secret", "/card_number", "--secret-key-env", "I8_TEST_KEY")
	if code != exitBadInput || strings.Contains(errOut, "9111111111111111") {
		t.Errorf("number error: exit %d, stderr %q", code, errOut)
	}
	code, _, errOut = runFingerprintCLI(t, payload, "--method", "POST", "--target", "/x",
		"--secret", "/cardnumber", "--secret-key-env", "I8_TEST_KEY")
	if code != exitBadInput || !strings.Contains(errOut, "secret field not found") {
		t.Errorf("missing secret: exit %d, stderr %q", code, errOut)
	}
}
