package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestQuickstart runs the two shell blocks of docs/quickstart.md as a user
// pastes them, in one shell, on one fresh database: the gateway, the
// daemon and the Python agent against examples/upstream (an API losing 40 %
// of answers), then the operator's set-up and loop. What the test changes
// in the blocks, and only that: the ports (free ones, in the blocks and in
// copies of the example's routes and adapters files) and the login names
// of deploy/compose/logins.sql (made unique, in a copy: roles are
// server-wide and other tests create them too). It checks what the page
// promises: every call done, nothing left unsettled, no duplicate in the
// API, the planted receipt held then resolved by a person.
func TestQuickstart(t *testing.T) {
	for _, tool := range []string{"python3", "psql"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not installed: docs/quickstart.md needs it (./test.sh installs what the suite needs)", tool)
		}
	}
	doc := readString(t, filepath.Join(repoRoot, "docs/quickstart.md"))
	block := func(name string) string {
		m := regexp.MustCompile("(?s)<!-- quickstart: " + name + " -->\n```sh\n(.*?)```").FindStringSubmatch(doc)
		if m == nil {
			t.Fatalf("docs/quickstart.md has no sh block marked %q", name)
		}
		return m[1]
	}
	gatewayBlock, operatorBlock := block("gateway"), block("operator")
	// The README shows the operator's block: the same one, so that it runs.
	readme := readString(t, filepath.Join(repoRoot, "README.md"))
	if m := regexp.MustCompile("(?s)<!-- quickstart: operator -->\n```sh\n(.*?)```").FindStringSubmatch(readme); m == nil || m[1] != operatorBlock {
		t.Errorf("README.md's operator block differs from docs/quickstart.md's (or is gone): keep them the same")
	}

	dir := t.TempDir()
	ports := map[string]string{}
	for _, p := range []string{"8081", "7070", "9090"} {
		addr := freeAddr(t)
		_, port, _ := strings.Cut(addr, ":")
		ports["127.0.0.1:"+p] = addr
		gatewayBlock = strings.ReplaceAll(gatewayBlock, "127.0.0.1:"+p, addr)
		gatewayBlock = regexp.MustCompile(`(for port in [0-9 ]*)\b`+p+`\b`).ReplaceAllString(gatewayBlock, "${1}"+port)
	}
	for _, f := range []string{"routes.yaml", "adapters.yaml"} {
		text := readString(t, filepath.Join(repoRoot, "examples/upstream", f))
		for from, to := range ports {
			text = strings.ReplaceAll(text, from, to)
		}
		copyPath := filepath.Join(dir, f)
		if err := os.WriteFile(copyPath, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		gatewayBlock = strings.ReplaceAll(gatewayBlock, "examples/upstream/"+f, copyPath)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dbURL := pgtest.NewDatabase(t)
	owner := pgtest.Pool(t, dbURL)
	tag := "qs_" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36) + "_"
	logins := readString(t, filepath.Join(repoRoot, "deploy/compose/logins.sql"))
	loginsCopy := filepath.Join(dir, "logins.sql")
	if err := os.WriteFile(loginsCopy, []byte(strings.ReplaceAll(logins, "'compose_", "'"+tag)), 0o600); err != nil {
		t.Fatal(err)
	}
	operatorBlock = strings.ReplaceAll(operatorBlock, "deploy/compose/logins.sql", loginsCopy)
	operatorBlock = strings.ReplaceAll(operatorBlock, "as compose_", "as "+tag)
	t.Cleanup(func() {
		for _, r := range []string{"worker", "agent", "reviewer"} {
			if _, err := owner.Exec(context.Background(), `DROP ROLE IF EXISTS `+pgx.Identifier{tag + r}.Sanitize()); err != nil {
				t.Errorf("drop login %s: %v", tag+r, err)
			}
		}
	})

	gobin := filepath.Join(dir, "bin")
	cmd := exec.CommandContext(ctx, "bash", "-e", "-o", "pipefail", "-c", gatewayBlock+"\n"+operatorBlock)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "GOBIN="+gobin, "PATH="+gobin+string(os.PathListSeparator)+os.Getenv("PATH"),
		"RECONCILER_DATABASE_URL="+dbURL)
	// Its own process group: whatever the blocks leave running is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// A file, not a pipe: a process the blocks leave behind would hold a
	// pipe open and Wait with it.
	outFile, err := os.Create(filepath.Join(dir, "output"))
	if err != nil {
		t.Fatal(err)
	}
	defer outFile.Close()
	cmd.Stdout, cmd.Stderr = outFile, outFile
	err = cmd.Run()
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	text := readString(t, outFile.Name())
	t.Logf("the blocks' output:\n%s", text)
	if err != nil {
		t.Fatalf("the quickstart's blocks failed: %v", err)
	}

	var report struct {
		Done   int      `json:"done"`
		Failed []string `json:"failed"`
		Waits  int      `json:"waits"`
	}
	line := regexp.MustCompile(`(?m)^\{"done".*$`).FindString(text)
	if err := json.Unmarshal([]byte(line), &report); err != nil {
		t.Fatalf("the agent's report %q: %v", line, err)
	}
	if report.Done != 20 || len(report.Failed) != 0 {
		t.Errorf("agent report %+v: want 20 done, none failed", report)
	}
	for _, want := range []string{
		"(?m)^outcome_unknown=0$", "(?m)^reconciling=0$", "(?m)^submitted=0$", "(?m)^duplicates_detected=0$",
		`upstream: 20 articles stored, duplicates=0`,
		"(?m)^settled_manual_review=1$", "(?m)^reason_blind=1$",
		`receipt \d+: manual_review -> succeeded by human:alice`,
		`manual_review -> succeeded  by human:alice`,
	} {
		if !regexp.MustCompile(want).MatchString(text) {
			t.Errorf("the blocks' output lacks %s", want)
		}
	}
}
