// Package credential resolves the credentials a configuration file names
// without holding them: a secret read from an environment variable or a
// file, and the HTTP header that carries it to an API. The adapters file
// (readback/httpadapter) and the gateway's routes file share it, so both
// read a secret and build its header the same way.
package credential

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// Error is a credential that cannot be resolved. Field names the key of
// the credential's block that is wrong (env, file, scheme or header); the
// message names a variable or a file, never a secret.
type Error struct {
	Field string
	Err   error
}

func (e *Error) Error() string { return e.Err.Error() }

// Unwrap returns the underlying error.
func (e *Error) Unwrap() error { return e.Err }

// Resolve reads a secret from the environment variable env (through
// lookupEnv) or from the file at path file, trailing newlines removed;
// exactly one of them must be set, and the secret must not be empty.
// Every error is an *Error.
func Resolve(env, file string, lookupEnv func(string) (string, bool)) (string, error) {
	switch {
	case env != "" && file != "":
		return "", &Error{"file", errors.New("set env or file, not both")}
	case env != "":
		v, ok := lookupEnv(env)
		if !ok || v == "" {
			return "", &Error{"env", fmt.Errorf("environment variable %s is not set", env)}
		}
		return v, nil
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			// The path is not secret; the content is never printed.
			return "", &Error{"file", err}
		}
		v := strings.TrimRight(string(b), "\r\n")
		if v == "" {
			return "", &Error{"file", fmt.Errorf("%s is empty", file)}
		}
		return v, nil
	}
	return "", &Error{"env", errors.New("needs env (an environment variable) or file")}
}

// Header returns the header that carries secret under scheme: bearer (the
// default) and basic in Authorization, basic's secret being
// "user:password" (Stripe: "sk_...:"); header in the header named. Every
// error is an *Error.
func Header(scheme, header, secret string) (name, value string, err error) {
	switch scheme {
	case "", "bearer":
		return "Authorization", "Bearer " + secret, nil
	case "basic":
		user, pass, _ := strings.Cut(secret, ":")
		r := &http.Request{Header: http.Header{}}
		r.SetBasicAuth(user, pass)
		return "Authorization", r.Header.Get("Authorization"), nil
	case "header":
		if header == "" {
			return "", "", &Error{"header", errors.New("is required with scheme header")}
		}
		return http.CanonicalHeaderKey(header), secret, nil
	}
	return "", "", &Error{"scheme", fmt.Errorf("want bearer, basic or header, got %q", scheme)}
}
