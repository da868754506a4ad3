package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/fingerprint"
)

// Exit statuses of the fingerprint commands.
const (
	exitBadInput = 1 // the payload or document was refused
	exitUsage    = 2 // missing or malformed flags and arguments
)

// fingerprintCommand is `reconciler fingerprint`: the intent fingerprint of
// the JSON payload on stdin, and `reconciler fingerprint canonicalize`: the
// RFC 8785 form of the JSON document on stdin.
func fingerprintCommand() *cli.Command {
	return &cli.Command{
		Name:  "fingerprint",
		Usage: "print the intent fingerprint of the JSON payload read from stdin",
		UsageText: "reconciler fingerprint --method M --target T [--drop /pointer ...] [--secret /pointer ... [--secret-key-env NAME] [--secret-key-id ID]] [--max-bytes N] < payload.json\n" +
			"reconciler fingerprint canonicalize < doc.json",
		Description: "Prints sha256:<64 hex>, the SHA-256 of the RFC 8785 canonical JSON of\n" +
			`{"method": UPPER(M), "target": T, "payload": payload}` + ", followed by a newline.\n" +
			"--drop leaves a volatile field (RFC 6901 JSON pointer into the payload) out of the\n" +
			"fingerprint (a pointer that matches nothing is ignored); --secret marks a field whose\n" +
			"value is replaced, before canonicalization, by \"hmac-sha256:<key id>:<hex>\", the\n" +
			"HMAC-SHA256 of its RFC 8785 form under the deployment's key, read from the environment\n" +
			"variable --secret-key-env names (RECONCILER_SECRET_KEY: hex or base64, at least 32\n" +
			"bytes) with the id --secret-key-id (default: RECONCILER_SECRET_KEY_ID, else derived\n" +
			"from the key). A secret field without a key, or a secret pointer that matches nothing,\n" +
			"is refused. Both flags may repeat. Numbers that RFC 8785 would round\n" +
			"(9007199254740993, 0.10000000000000001), duplicate keys and invalid UTF-8 are refused.\n" +
			"Exit status: 0 success, 1 refused input, 2 usage error.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "method", Usage: "HTTP method of the call (upper-cased)"},
			&cli.StringFlag{Name: "target", Usage: "target of the call, e.g. the request path"},
			&cli.GenericFlag{Name: "drop", Usage: "JSON pointer of a volatile field to leave out (repeatable)", Value: &pointerList{}},
			&cli.GenericFlag{Name: "secret", Usage: "JSON pointer of a secret field (repeatable)", Value: &pointerList{}},
			&cli.StringFlag{Name: "secret-key-env", Usage: "environment variable holding the secret key (hex or base64, >= 32 bytes)", Value: fingerprint.SecretKeyEnv},
			&cli.StringFlag{Name: "secret-key-id", Usage: "key id recorded in keyed values (default $" + fingerprint.SecretKeyIDEnv + ", else derived from the key)"},
			&cli.IntFlag{Name: "max-bytes", Usage: "largest payload accepted, in bytes; 0 for no limit", Value: fingerprint.DefaultMaxBytes},
		},
		HideHelpCommand: true,
		Action:          runFingerprint,
		Subcommands: []*cli.Command{
			{
				Name:      "canonicalize",
				Usage:     "print the RFC 8785 canonical form of the JSON document read from stdin",
				UsageText: "reconciler fingerprint canonicalize < doc.json",
				Description: "Prints exactly the canonical bytes, with no trailing newline, so that the output\n" +
					"can be hashed or compared as is. Refuses only what RFC 8785 refuses: invalid JSON,\n" +
					"invalid UTF-8 or lone surrogates, duplicate keys, numbers beyond the double range.\n" +
					"Exit status: 0 success, 1 refused input, 2 usage error.",
				Action: runCanonicalize,
			},
		},
	}
}

func runFingerprint(c *cli.Context) error {
	if c.Args().Present() {
		return cli.Exit(fmt.Sprintf("fingerprint: unexpected argument %q", c.Args().First()), exitUsage)
	}
	method, target := c.String("method"), c.String("target")
	if method == "" {
		return cli.Exit("fingerprint: --method is required", exitUsage)
	}
	if target == "" {
		return cli.Exit("fingerprint: --target is required", exitUsage)
	}
	maxBytes := c.Int("max-bytes")
	if maxBytes < 0 {
		return cli.Exit("fingerprint: --max-bytes must not be negative", exitUsage)
	}

	payload, err := readInput(c.App.Reader, maxBytes)
	if err != nil {
		return cli.Exit(fmt.Sprintf("fingerprint: reading stdin: %v", err), exitBadInput)
	}
	if maxBytes > 0 && len(payload) > maxBytes {
		// readInput stopped one byte past the limit; say so rather than
		// report that truncated length as the payload's size.
		return cli.Exit(fmt.Sprintf("%v: more than %d bytes on stdin (see --max-bytes)", fingerprint.ErrTooLarge, maxBytes), exitBadInput)
	}
	keyOpt, err := secretKeyOption(c)
	if err != nil {
		return cli.Exit("fingerprint: "+err.Error(), exitUsage)
	}
	res, err := fingerprint.Compute(method, target, payload,
		fingerprint.WithDrop(pointers(c, "drop")...),
		fingerprint.WithSecret(pointers(c, "secret")...),
		fingerprint.WithMaxBytes(maxBytes),
		keyOpt,
	)
	if err != nil {
		code := exitBadInput
		if errors.Is(err, fingerprint.ErrInvalidMethod) || errors.Is(err, fingerprint.ErrInvalidTarget) ||
			errors.Is(err, fingerprint.ErrInvalidPointer) || errors.Is(err, fingerprint.ErrSecretKeyRequired) ||
			errors.Is(err, fingerprint.ErrInvalidSecretKey) {
			code = exitUsage
		}
		return cli.Exit(err.Error(), code)
	}
	_, err = fmt.Fprintln(c.App.Writer, res.Fingerprint)
	return err
}

// secretKeyOption reads the key --secret-key-env names, when set, as the
// fingerprint option; nil when the variable is unset or empty.
func secretKeyOption(c *cli.Context) (fingerprint.Option, error) {
	name := c.String("secret-key-env")
	getenv := func(k string) string {
		switch k {
		case fingerprint.SecretKeyEnv:
			return os.Getenv(name)
		case fingerprint.SecretKeyIDEnv:
			if id := c.String("secret-key-id"); id != "" {
				return id
			}
		}
		return os.Getenv(k)
	}
	id, key, ok, err := fingerprint.SecretKeyFromEnv(getenv)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if !ok {
		return nil, nil
	}
	return fingerprint.WithSecretKey(id, key), nil
}

func runCanonicalize(c *cli.Context) error {
	doc, err := readInput(c.App.Reader, 0)
	if err != nil {
		return cli.Exit(fmt.Sprintf("fingerprint canonicalize: reading stdin: %v", err), exitBadInput)
	}
	out, err := fingerprint.Canonicalize(doc)
	if err != nil {
		return cli.Exit(err.Error(), exitBadInput)
	}
	_, err = c.App.Writer.Write(out)
	return err
}

// readInput reads r to the end, but no more than one byte past maxBytes
// (when positive): enough for the size check to refuse an oversized payload
// without holding all of it.
func readInput(r io.Reader, maxBytes int) ([]byte, error) {
	if maxBytes > 0 && maxBytes < math.MaxInt {
		r = io.LimitReader(r, int64(maxBytes)+1)
	}
	return io.ReadAll(r)
}

// pointers returns the values of a repeatable pointer flag.
func pointers(c *cli.Context, name string) []string {
	if list, ok := c.Generic(name).(*pointerList); ok {
		return *list
	}
	return nil
}

// pointerList is a repeatable flag value. Unlike cli.StringSliceFlag it never
// splits a value on commas, which may appear in JSON pointers ("/a,b").
type pointerList []string

// Set appends one flag value.
func (l *pointerList) Set(v string) error {
	*l = append(*l, v)
	return nil
}

// String returns the values joined for help output.
func (l *pointerList) String() string {
	return strings.Join(*l, " ")
}
