package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocsPythonBlocks checks every ```python block of README.md and
// docs/*.md: a block whose first line is "# from PATH" must be a verbatim
// excerpt of that file of the repository (an example the end-to-end tests
// run), any other block must compile (python3 -m py_compile).
func TestDocsPythonBlocks(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is not installed (./test.sh installs what the suite needs): %v", err)
	}
	pages, err := filepath.Glob(filepath.Join(repoRoot, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{filepath.Join(repoRoot, "README.md")}, pages...)
	block := regexp.MustCompile("(?s)```python\n(.*?)```")
	dir := t.TempDir()
	n := 0
	for _, page := range pages {
		for _, m := range block.FindAllStringSubmatch(readString(t, page), -1) {
			n++
			code := m[1]
			if first, rest, _ := strings.Cut(code, "\n"); strings.HasPrefix(first, "# from ") {
				src := strings.TrimSpace(strings.TrimPrefix(first, "# from "))
				if !strings.Contains(readString(t, filepath.Join(repoRoot, src)), rest) {
					t.Errorf("%s: a python block says it is from %s but is not a verbatim excerpt of it", page, src)
				}
				continue
			}
			file := filepath.Join(dir, "block.py")
			if err := os.WriteFile(file, []byte(code), 0o600); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command(python, "-m", "py_compile", file).CombinedOutput(); err != nil {
				t.Errorf("%s: a python block does not compile: %v\n%s\n%s", page, err, out, code)
			}
		}
	}
	if n < 2 {
		t.Fatalf("found %d python blocks: the extractor is broken", n)
	}
}

// TestReadmeLayout checks the README's layout picture against the tree:
// every directory it names exists, and every top-level directory of the
// repository is named.
func TestReadmeLayout(t *testing.T) {
	readme := readString(t, filepath.Join(repoRoot, "README.md"))
	_, after, ok := strings.Cut(readme, "## Layout\n")
	if !ok {
		t.Fatal("README.md has no Layout section")
	}
	pic := regexp.MustCompile("(?s)```text\n(.*?)```").FindStringSubmatch(after)
	if pic == nil {
		t.Fatal("README.md's Layout section has no picture")
	}
	named := map[string]bool{}
	parent := ""
	for _, line := range strings.Split(pic[1], "\n") {
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "                        ") {
			continue // a description's continuation
		}
		// The directories a line names: its first words ending in "/" (or
		// "/,"); an indented line's are inside the line above.
		for _, word := range strings.Fields(line) {
			word = strings.TrimSuffix(word, ",")
			if !strings.HasSuffix(word, "/") && word != strings.Fields(line)[0] {
				break
			}
			path := strings.Trim(word, "/")
			if strings.HasPrefix(line, "  ") {
				path = parent + "/" + path
			} else {
				parent = path
			}
			for p := path; p != "."; p = filepath.Dir(p) {
				named[p] = true
			}
			if fi, err := os.Stat(filepath.Join(repoRoot, path)); err != nil || !fi.IsDir() {
				t.Errorf("README.md's layout names %s/, which is not a directory of the repository", path)
			}
		}
	}
	entries, err := os.ReadDir(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") && !named[e.Name()] {
			t.Errorf("README.md's layout does not name the top-level directory %s/", e.Name())
		}
	}
}
