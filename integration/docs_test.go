package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocsGoBlocksCompile type-checks every ```go block of README.md and
// docs/*.md (issue 10, item 5: the README's example did not compile). A
// block of statements is the body of a function whose parameters are the
// names the docs leave to the reader (ctx, taskID, stepID, customerID,
// agent); a block of declarations stands at file level. Imports are
// added for the packages a block names; nothing else is added, so an
// unused variable or a wrong name fails the test, as it would fail a user.
func TestDocsGoBlocksCompile(t *testing.T) {
	files, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append([]string{"../README.md"}, files...)
	block := regexp.MustCompile("(?s)```go\n(.*?)```")
	dir, err := os.MkdirTemp(".", "_docsgo") // "_": no wildcard of the go tool sees it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := 0
	for _, f := range files {
		doc, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range block.FindAllSubmatch(doc, -1) {
			n++
			src := wrapGoBlock(string(m[1]), n)
			name := filepath.Join(dir, "block"+string(rune('a'+n-1))+".go")
			if err := os.WriteFile(name, []byte(src), 0o600); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: block %d -> %s", f, n, name)
		}
	}
	if n == 0 {
		t.Fatal("no Go blocks found: the extractor is broken")
	}
	// The blocks share one package: each stands in its own function, and
	// the helper types the docs assume live in one file.
	if err := os.WriteFile(filepath.Join(dir, "assumed.go"), []byte(assumedDecls), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "vet", "./"+filepath.ToSlash(dir))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("a Go block of the docs does not compile:\n%s", out)
	}
}

// assumedDecls declares what the docs' examples take as given: the ticket
// adapter of docs/adapters.md's "Writing a Go adapter".
const assumedDecls = `package docsgo

import (
	"context"
	"net/http"

	"github.com/receiptledger/reconciler/readback"
)

type ticketAdapter struct {
	base   string
	client *http.Client
}

func (ticketAdapter) Check(context.Context, readback.Receipt) (readback.Result, error) {
	return readback.Result{}, nil
}
`

// packages maps the package names the docs use to their import paths.
var packages = map[string]string{
	"bytes": "bytes", "context": "context", "errors": "errors", "fmt": "fmt", "log": "log",
	"os": "os", "strings": "strings", "time": "time", "http": "net/http", "url": "net/url",
	"json":    "encoding/json",
	"pgxpool": "github.com/jackc/pgx/v5/pgxpool", "yaml": "go.yaml.in/yaml/v3",
	"ledger": "github.com/receiptledger/reconciler/ledger", "readback": "github.com/receiptledger/reconciler/readback",
	"httpadapter": "github.com/receiptledger/reconciler/readback/httpadapter",
	"reconcile":   "github.com/receiptledger/reconciler/reconcile",
}

func wrapGoBlock(code string, n int) string {
	var body string
	if regexp.MustCompile(`(?m)^(type|func|var|const) `).MatchString(code) {
		body = code
	} else {
		body = "func example" + string(rune('A'+n-1)) +
			"(ctx context.Context, taskID, stepID, customerID string, agent *ledger.Client) error {\n" +
			code + "\nreturn nil\n}\n"
	}
	// A package named only in a comment is not imported.
	code = regexp.MustCompile(`(?m)\s//[^"\n]*$`).ReplaceAllString(body, "")
	var imports []string
	for name, path := range packages {
		if regexp.MustCompile(`\b` + name + `\.`).MatchString(code) {
			imports = append(imports, `"`+path+`"`)
		}
	}
	return "package docsgo\n\nimport (\n" + strings.Join(imports, "\n") + "\n)\n\n" + body
}
