package gateway_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestExampleAgentsExitNonZeroWhenCallsFail runs the example agents against
// a gateway that refuses every call (422, the key names another call: the
// agent must give up): each still prints its report, and exits 1 so that a
// script running it can tell (issue 23: both exited 0 after 10 × 422).
func TestExampleAgentsExitNonZeroWhenCallsFail(t *testing.T) {
	python, node, tsc := lookTool(t, "python3"), lookTool(t, "node"), lookTool(t, "tsc")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(`{"type":"https://receiptledger.dev/problems/idempotency-key-reused","title":"the key names another call","status":422,"retry":"no"}`))
	}))
	defer refusing.Close()

	examples := filepath.Join("..", "examples")
	tsOut := t.TempDir()
	if out, err := exec.CommandContext(ctx, tsc, "--strict", "--target", "es2020", "--module", "commonjs",
		"--lib", "es2020,dom", "--outDir", tsOut, filepath.Join(examples, "typescript", "agent.ts")).CombinedOutput(); err != nil {
		t.Fatalf("tsc: %v\n%s", err, out)
	}
	for _, agent := range []struct{ name, tool, script string }{
		{"python", python, filepath.Join(examples, "python", "agent.py")},
		{"typescript", node, filepath.Join(tsOut, "agent.js")},
	} {
		t.Run(agent.name, func(t *testing.T) {
			cmd := exec.CommandContext(ctx, agent.tool, agent.script)
			cmd.Env = append(os.Environ(), "GATEWAY_URL="+refusing.URL, "GATEWAY_TOKEN=t", "AGENT_CALLS=10")
			out, err := cmd.Output()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 1 {
				t.Fatalf("every call refused: exit %v, want status 1; stdout %s", err, out)
			}
			var rep agentReport
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rep); err != nil {
				t.Fatalf("report %q: %v", out, err)
			}
			if rep.Done != 0 || len(rep.Failed) != 10 {
				t.Errorf("report %+v, want 0 done and 10 failed", rep)
			}
		})
	}
}
