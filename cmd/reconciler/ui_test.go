package main

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestUIUsage(t *testing.T) {
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	if err := os.WriteFile(tokens, []byte("alice alice-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"ui", "--database-url", "postgres://x"}, 2, "say how reviewers are known"},
		{[]string{"ui", "--database-url", "postgres://x", "--trusted-user-header", "X-Forwarded-User", "--tokens-file", tokens}, 2, "not both"},
		{[]string{"ui", "--database-url", "postgres://x", "--trusted-proxy", "10.0.0.1"}, 2, "--trusted-proxy needs --trusted-user-header"},
		{[]string{"ui", "--database-url", "postgres://x", "--trusted-user-header", "X-Forwarded-User"}, 2, "at least one trusted proxy"},
		{[]string{"ui", "--database-url", "postgres://x", "--trusted-user-header", "X-Forwarded-User", "--trusted-proxy", "nonsense"}, 2, "neither an address nor a CIDR"},
		{[]string{"ui", "--database-url", "postgres://x", "--tokens-file", filepath.Join(dir, "missing")}, 1, "tokens file"},
	} {
		code, _, errOut := runCLI(t, "", c.args...)
		if code != c.code || !strings.Contains(errOut, c.contains) || strings.Count(errOut, "\n") != 1 {
			t.Errorf("%v: exit %d, stderr %q; want exit %d, one line with %q", c.args, code, errOut, c.code, c.contains)
		}
	}
}

// `reconciler ui` serves the queue behind its proxy's header, from the
// --trusted-proxy address only, and stops on its context.
func TestUIServes(t *testing.T) {
	url := pgtest.NewDatabase(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	var errOut bytes.Buffer
	stop := startCLI(t, &errOut, "ui", "--database-url", url, "--listen", addr,
		"--trusted-user-header", "X-Forwarded-User", "--trusted-proxy", "127.0.0.1/32")
	get := func() (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/", nil)
		req.Header.Set("X-Forwarded-User", "alice")
		return http.DefaultClient.Do(req)
	}
	deadline := time.Now().Add(30 * time.Second)
	var resp *http.Response
	for {
		if resp, err = get(); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ui never answered: %v; stderr %s", err, errOut.String())
		}
		time.Sleep(20 * time.Millisecond) // polling a condition: the listener is up
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "Nothing is held for review") {
		t.Fatalf("queue: %d\n%s", resp.StatusCode, body)
	}
	if code := stop(); code != 0 {
		t.Fatalf("exit %d; stderr %s", code, errOut.String())
	}
	if !strings.Contains(errOut.String(), `"msg":"ui stopped"`) {
		t.Errorf("stderr %s", errOut.String())
	}
}
