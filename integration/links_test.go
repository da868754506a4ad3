package integration

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// TestDocsLinks checks that every link of README.md and docs/*.md resolves
// inside the repository: a relative path names a file or directory of the
// checkout (never one outside it, such as a path on the machine the docs
// were written on), and an #anchor names a heading of the page it points
// to (GitHub's anchors: lower case, punctuation dropped, spaces as
// hyphens, repeats numbered). Links in code blocks and code spans are
// text, not links; http(s) and mailto links are not followed.
func TestDocsLinks(t *testing.T) {
	root, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{filepath.Join(root, "README.md")}, pages...)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(path string) map[string]bool {
		if a, ok := anchors[path]; ok {
			return a
		}
		a := headingAnchors(readString(t, path))
		anchors[path] = a
		return a
	}
	link := regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	n := 0
	for _, page := range pages {
		rel, _ := filepath.Rel(root, page)
		for i, line := range proseLines(readString(t, page)) {
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				n++
				where := rel + ":" + strconv.Itoa(i+1)
				file, anchor, _ := strings.Cut(target, "#")
				dest := page
				if file != "" {
					dest = filepath.Join(filepath.Dir(page), filepath.FromSlash(file))
					if r, err := filepath.Rel(root, dest); err != nil || r == ".." || strings.HasPrefix(r, ".."+string(filepath.Separator)) {
						t.Errorf("%s: link %s leaves the repository", where, target)
						continue
					}
					if _, err := os.Stat(dest); err != nil {
						t.Errorf("%s: link %s: no such file in the repository", where, target)
						continue
					}
				}
				if anchor == "" {
					continue
				}
				if !strings.HasSuffix(dest, ".md") {
					t.Errorf("%s: link %s: an anchor into a file that is not Markdown", where, target)
					continue
				}
				if !anchorsOf(dest)[anchor] {
					t.Errorf("%s: link %s: %s has no heading with anchor #%s", where, target, filepath.Base(dest), anchor)
				}
			}
		}
	}
	if n < 20 {
		t.Fatalf("found %d links in README.md and docs/*.md: the extractor is broken", n)
	}
}

// proseLines returns the page's lines with fenced code blocks and code
// spans blanked, so that line numbers still match the file.
func proseLines(doc string) []string {
	lines := strings.Split(doc, "\n")
	span := regexp.MustCompile("`[^`]*`")
	fence := false
	for i, l := range lines {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fence = !fence
			lines[i] = ""
			continue
		}
		if fence {
			lines[i] = ""
			continue
		}
		lines[i] = span.ReplaceAllString(l, "``")
	}
	return lines
}

// headingAnchors returns the anchors GitHub gives the page's headings.
func headingAnchors(doc string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	heading := regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	fence := false
	for _, l := range strings.Split(doc, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fence = !fence
			continue
		}
		m := heading.FindStringSubmatch(l)
		if fence || m == nil {
			continue
		}
		slug := githubSlug(m[1])
		if k := seen[slug]; k > 0 {
			out[slug+"-"+strconv.Itoa(k)] = true
		} else {
			out[slug] = true
		}
		seen[slug]++
	}
	return out
}

// githubSlug is GitHub's anchor for a heading's text: markup removed, lower
// case, every character but letters, digits, spaces, hyphens and
// underscores dropped, spaces as hyphens.
func githubSlug(text string) string {
	text = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(text, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}
