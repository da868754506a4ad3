package integration

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// This file reads the packaging files the way their tools would (Dockerfile
// instructions, YAML documents, systemd units, PromQL selectors, Prometheus
// text exposition) and asks the built binary what it accepts, so that
// packaging_test.go can check one against the other. None of it is a full
// implementation of those formats: each reader covers what the files in
// this repository use and fails loudly on what it does not understand.

// repoRoot is the checkout, seen from this package's directory.
const repoRoot = ".."

// --- the CLI, as the built binary describes itself -------------------------

// cliHelp answers questions about the real binary's commands by running
// `<bin> <path...> --help` and reading the help urfave/cli prints, so the
// packaging files are checked against what the binary accepts, not against
// a list kept by hand.
type cliHelp struct {
	bin   string
	cache map[string]*commandHelp
}

// commandHelp is what one command's --help says.
type commandHelp struct {
	exists      bool
	subcommands []string
	flags       map[string]bool // name -> takes a value
	env         map[string]bool // RECONCILER_* variables of its flags
}

var (
	helpSection = regexp.MustCompile(`^([A-Z][A-Z ]*):\s*$`)
	envInHelp   = regexp.MustCompile(`\$([A-Z][A-Z0-9_]*)`)
	flagInHelp  = regexp.MustCompile(`--?([a-z0-9][a-z0-9-]*)`)
)

func newCLIHelp(bin string) *cliHelp { return &cliHelp{bin: bin, cache: map[string]*commandHelp{}} }

// command returns the help of the command at path (nil path: the app).
func (c *cliHelp) command(t *testing.T, path []string) *commandHelp {
	t.Helper()
	key := strings.Join(path, " ")
	if h, ok := c.cache[key]; ok {
		return h
	}
	h := &commandHelp{flags: map[string]bool{}, env: map[string]bool{}}
	c.cache[key] = h
	out, err := exec.Command(c.bin, append(slices.Clone(path), "--help")...).CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatalf("%s %s --help: %v", c.bin, key, err)
		}
		return h // an unknown command: usage error
	}
	name := strings.TrimSpace("reconciler " + key)
	lines := strings.Split(string(out), "\n")
	if len(lines) < 2 || !strings.HasPrefix(strings.TrimSpace(lines[1]), name+" - ") {
		return h // urfave prints the parent's help for an unknown subcommand
	}
	h.exists = true
	section := ""
	for _, line := range lines {
		if m := helpSection.FindStringSubmatch(line); m != nil {
			section = m[1]
			continue
		}
		head, _, _ := strings.Cut(strings.TrimSpace(line), "  ")
		if head == "" {
			continue
		}
		switch section {
		case "COMMANDS":
			for _, n := range strings.Split(head, ",") {
				if n = strings.TrimSpace(n); n != "help" && n != "h" {
					h.subcommands = append(h.subcommands, n)
				}
			}
		case "OPTIONS", "GLOBAL OPTIONS":
			if !strings.HasPrefix(head, "-") {
				continue
			}
			value := strings.Contains(head, " value")
			for _, m := range flagInHelp.FindAllStringSubmatch(head, -1) {
				h.flags[m[1]] = value
			}
			if i := strings.LastIndex(line, "[$"); i >= 0 {
				for _, m := range envInHelp.FindAllStringSubmatch(line[i:], -1) {
					h.env[m[1]] = true
				}
			}
		}
	}
	return h
}

// allEnv returns every RECONCILER_* variable any command reads.
func (c *cliHelp) allEnv(t *testing.T) map[string]bool {
	t.Helper()
	all := map[string]bool{}
	var walk func(path []string)
	walk = func(path []string) {
		h := c.command(t, path)
		for v := range h.env {
			all[v] = true
		}
		for _, sub := range h.subcommands {
			walk(append(slices.Clone(path), sub))
		}
	}
	walk(nil)
	return all
}

// invocation is one way a packaging file starts the binary: the arguments
// after the binary's name and the RECONCILER_* variables it sets.
type invocation struct {
	where string
	args  []string
	env   []string
}

// check reports, as test errors, every subcommand, flag or variable of inv
// the binary does not know. Flags are looked up on the command and on each
// command above it (they may be given anywhere on the line); so are
// variables. An invocation without arguments (a service the operator runs
// with a command of their choosing) may set any variable some command reads.
func (c *cliHelp) check(t *testing.T, inv invocation) {
	t.Helper()
	var path []string
	i := 0
	for ; i < len(inv.args) && !strings.HasPrefix(inv.args[i], "-"); i++ {
		next := append(slices.Clone(path), inv.args[i])
		if !c.command(t, next).exists {
			if len(c.command(t, path).subcommands) > 0 || len(path) == 0 {
				t.Errorf("%s: `reconciler %s` is not a command of the binary", inv.where, strings.Join(next, " "))
				return
			}
			break // a positional argument
		}
		path = next
	}
	flags, env := map[string]bool{}, map[string]bool{}
	for n := 0; n <= len(path); n++ {
		h := c.command(t, path[:n])
		for f, v := range h.flags {
			flags[f] = v
		}
		for e := range h.env {
			env[e] = true
		}
	}
	for ; i < len(inv.args); i++ {
		a := inv.args[i]
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		takesValue, ok := flags[name]
		if !ok {
			t.Errorf("%s: `reconciler %s` has no flag --%s", inv.where, strings.Join(path, " "), name)
			continue
		}
		if takesValue && !hasValue {
			i++ // its value
		}
	}
	if len(inv.args) == 0 {
		env = c.allEnv(t)
	}
	for _, e := range inv.env {
		if strings.HasPrefix(e, "RECONCILER_") && !env[e] {
			t.Errorf("%s: `reconciler %s` reads no variable %s", inv.where, strings.Join(path, " "), e)
		}
	}
}

// --- Dockerfile --------------------------------------------------------------

// dockerInstruction is one instruction of a Dockerfile, continuation lines
// joined.
type dockerInstruction struct {
	stage int // index of the FROM it follows
	cmd   string
	args  string
}

func readDockerfile(t *testing.T, path string) []dockerInstruction {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []dockerInstruction
	stage, pending := -1, ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if pending == "" && (line == "" || strings.HasPrefix(line, "#")) {
			continue
		}
		if strings.HasSuffix(line, `\`) {
			pending += strings.TrimSuffix(line, `\`) + " "
			continue
		}
		line, pending = pending+line, ""
		cmd, args, _ := strings.Cut(line, " ")
		cmd = strings.ToUpper(cmd)
		if cmd == "FROM" {
			stage++
		}
		out = append(out, dockerInstruction{stage: stage, cmd: cmd, args: strings.TrimSpace(args)})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// shellWords splits a shell command line into words, honouring single and
// double quotes (enough for a Dockerfile's RUN line; no expansions).
func shellWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case ' ', '\t':
			if inWord {
				words, inWord = append(words, cur.String()), false
				cur.Reset()
			}
		case '\'', '"':
			j := strings.IndexByte(s[i+1:], c)
			if j < 0 {
				return nil, fmt.Errorf("unterminated %c in %q", c, s)
			}
			cur.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case '&', ';', '|', '$', '`', '\\':
			return nil, fmt.Errorf("shell syntax %q in %q: keep the build line a plain command", c, s)
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}

// --- YAML --------------------------------------------------------------------

// yamlDocs decodes every document of a YAML file.
func yamlDocs(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var docs []map[string]any
	dec := yaml.NewDecoder(f)
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if doc != nil {
			docs = append(docs, doc)
		}
	}
}

// dig walks maps by keys; nil when a key is missing or a value is no map.
func dig(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

func strs(v any) []string {
	list, _ := v.([]any)
	out := make([]string, 0, len(list))
	for _, x := range list {
		out = append(out, fmt.Sprint(x))
	}
	return out
}

func maps(v any) []map[string]any {
	list, _ := v.([]any)
	out := make([]map[string]any, 0, len(list))
	for _, x := range list {
		if m, ok := x.(map[string]any); ok {
			out = append(out, m)
		}
	}
	return out
}

// --- systemd units -----------------------------------------------------------

// unitDirectives returns the directives of one section of a systemd unit,
// in order (a key may repeat).
func unitDirectives(t *testing.T, path, section string) [][2]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out [][2]string
	cur := ""
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";"):
		case strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]"):
			cur = line[1 : len(line)-1]
		case cur == section:
			k, v, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s: [%s] line %q is no key=value", path, section, line)
			}
			out = append(out, [2]string{strings.TrimSpace(k), strings.TrimSpace(v)})
		}
	}
	return out
}

// envFileKeys returns the variable names an EnvironmentFile sets.
func envFileKeys(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, _, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: line %q is no NAME=value", path, line)
		}
		keys = append(keys, k)
	}
	return keys
}

// --- PromQL selectors ----------------------------------------------------------

// promSelector is a metric named in a PromQL expression, with its label
// matchers.
type promSelector struct {
	name     string
	matchers []promMatcher
}

type promMatcher struct{ label, op, value string }

// Words of PromQL that are neither metrics nor functions; the grouping ones
// are followed by a list of label names.
var (
	promGrouping = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}
	promKeywords = map[string]bool{"and": true, "or": true, "unless": true, "offset": true, "bool": true, "atan2": true}
)

func isIdentStart(c byte) bool {
	return c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

func isIdent(c byte) bool { return isIdentStart(c) || (c >= '0' && c <= '9') }

// promSelectors returns every metric an expression reads. It tokenizes
// rather than parses: strings, ranges and durations are skipped, a word
// followed by "(", "by (" or "without (" is a function or an aggregation,
// the words after by,
// without, on and ignoring are labels; every other word is a metric.
func promSelectors(expr string) ([]promSelector, error) {
	var out []promSelector
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			_, end, err := promString(expr, i)
			if err != nil {
				return nil, err
			}
			i = end
		case c == '[':
			j := strings.IndexByte(expr[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("unterminated [ in %q", expr)
			}
			i += j + 1
		case c == '{':
			return nil, fmt.Errorf("a selector without a metric name in %q", expr)
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := j
			for k < len(expr) && (expr[k] == ' ' || expr[k] == '\n' || expr[k] == '\t') {
				k++
			}
			next := byte(0)
			if k < len(expr) {
				next = expr[k]
			}
			switch {
			case promGrouping[word]:
				i = j
				if next == '(' {
					end := strings.IndexByte(expr[k:], ')')
					if end < 0 {
						return nil, fmt.Errorf("unterminated %s ( in %q", word, expr)
					}
					i = k + end + 1
				}
				continue
			case promKeywords[word], next == '(', aggregationModifier(expr[k:]):
				i = j
				continue
			}
			sel := promSelector{name: word}
			i = j
			if next == '{' {
				ms, end, err := promMatchers(expr, k)
				if err != nil {
					return nil, err
				}
				sel.matchers, i = ms, end
			}
			out = append(out, sel)
		case c >= '0' && c <= '9' || c == '.':
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++ // a number or a duration
			}
		default:
			i++
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no metric in %q", expr)
	}
	return out, nil
}

// aggregationModifier reports whether s starts with `by (` or `without (`:
// the word before it is an aggregation (`sum by (state) (x)`).
func aggregationModifier(s string) bool {
	for _, w := range []string{"by", "without"} {
		if rest, ok := strings.CutPrefix(s, w); ok && strings.HasPrefix(strings.TrimLeft(rest, " \n\t"), "(") {
			return true
		}
	}
	return false
}

// promMatchers reads `{label op "value", ...}` starting at s[i] == '{'; it
// returns the matchers and the index after the closing brace. It also reads
// the label set of an exposition line (where every op is "=").
func promMatchers(s string, i int) ([]promMatcher, int, error) {
	var out []promMatcher
	i++ // {
	for {
		for i < len(s) && (s[i] == ' ' || s[i] == ',') {
			i++
		}
		if i >= len(s) {
			return nil, 0, fmt.Errorf("unterminated { in %q", s)
		}
		if s[i] == '}' {
			return out, i + 1, nil
		}
		j := i
		for j < len(s) && isIdent(s[j]) {
			j++
		}
		if j == i {
			return nil, 0, fmt.Errorf("no label name at %d in %q", i, s)
		}
		m := promMatcher{label: s[i:j]}
		for j < len(s) && s[j] == ' ' {
			j++
		}
		for _, op := range []string{"=~", "!~", "!=", "="} {
			if strings.HasPrefix(s[j:], op) {
				m.op = op
				break
			}
		}
		if m.op == "" {
			return nil, 0, fmt.Errorf("no matcher operator after %q in %q", m.label, s)
		}
		j += len(m.op)
		for j < len(s) && s[j] == ' ' {
			j++
		}
		v, end, err := promString(s, j)
		if err != nil {
			return nil, 0, err
		}
		m.value, i = v, end
		out = append(out, m)
	}
}

// promString reads a quoted string starting at s[i] and returns its value
// and the index after the closing quote.
func promString(s string, i int) (string, int, error) {
	if i >= len(s) || (s[i] != '"' && s[i] != '\'' && s[i] != '`') {
		return "", 0, fmt.Errorf("no string at %d in %q", i, s)
	}
	q := s[i]
	var b strings.Builder
	for j := i + 1; j < len(s); j++ {
		switch {
		case s[j] == q:
			return b.String(), j + 1, nil
		case s[j] == '\\' && q != '`' && j+1 < len(s):
			j++
			switch s[j] {
			case 'n':
				b.WriteByte('\n')
			default:
				b.WriteByte(s[j])
			}
		default:
			b.WriteByte(s[j])
		}
	}
	return "", 0, fmt.Errorf("unterminated string in %q", s)
}

// --- the exposition the daemon serves --------------------------------------

// exposition is a scrape of /metrics: the label sets of each sample name
// (a histogram's are name_bucket, name_sum and name_count).
type exposition struct {
	series map[string][]map[string]string
}

func parseExposition(body string) (exposition, error) {
	e := exposition{series: map[string][]map[string]string{}}
	for _, line := range strings.Split(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue // HELP and TYPE
		}
		j := 0
		for j < len(line) && isIdent(line[j]) {
			j++
		}
		name, labels := line[:j], map[string]string{}
		if j < len(line) && line[j] == '{' {
			ms, _, err := promMatchers(line, j)
			if err != nil {
				return e, err
			}
			for _, m := range ms {
				labels[m.label] = m.value
			}
		}
		if name == "" {
			return e, fmt.Errorf("exposition line %q", line)
		}
		e.series[name] = append(e.series[name], labels)
	}
	return e, nil
}

// missing says what of sel the exposition lacks ("" when nothing): the
// metric itself, or a series with each label value an equality matcher asks for,
// or the label of any other matcher.
func (e exposition) missing(sel promSelector) string {
	sets, ok := e.series[sel.name]
	if !ok {
		return "metric " + sel.name
	}
	for _, m := range sel.matchers {
		found := false
		for _, ls := range sets {
			v, has := ls[m.label]
			if has && (m.op != "=" || v == m.value) {
				found = true
				break
			}
		}
		if !found {
			if m.op == "=" {
				return fmt.Sprintf("%s{%s=%q}", sel.name, m.label, m.value)
			}
			return fmt.Sprintf("label %s of %s", m.label, sel.name)
		}
	}
	return ""
}

// packagingFiles lists the YAML and JSON files the packaging adds.
func packagingFiles(t *testing.T) (yamlFiles, jsonFiles []string) {
	t.Helper()
	yamlFiles = append(yamlFiles, filepath.Join(repoRoot, "compose.yaml"))
	for _, dir := range []string{"deploy", "monitoring"} {
		err := filepath.WalkDir(filepath.Join(repoRoot, dir), func(p string, d os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			switch filepath.Ext(p) {
			case ".yaml", ".yml":
				yamlFiles = append(yamlFiles, p)
			case ".json":
				jsonFiles = append(jsonFiles, p)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return yamlFiles, jsonFiles
}

// The reader of PromQL must find every metric, and only metrics: a label
// or function taken for a metric would fail TestPackaging for nothing, and
// a metric it skipped would go unchecked.
func TestPromSelectors(t *testing.T) {
	for expr, want := range map[string]string{
		`max by (dependency) (reconciler_breaker_state{state="open"}) == 1`:                       `reconciler_breaker_state{state="open"}`,
		`sum(rate(a_total[$__rate_interval])) by (x, y) > 0.5 and on () b offset 1h`:              `a_total b`,
		`histogram_quantile(0.99, sum without (i) (rate(h_bucket{le=~".+", a!="x,}"}[5m])))`:      `h_bucket{le=~".+",a!="x,}"}`,
		`abs(c) > 6 * 3600 unless ignoring (j) group_left (k) d{e='f\'g'}`:                        `c d{e="f'g"}`,
		"process_resident_memory_bytes and on (instance, job) reconciler_claimed_total":           `process_resident_memory_bytes reconciler_claimed_total`,
		"max(reconciler_backlog{state=\"manual_review\"})\n  > max(reconciler_backlog offset 1h)": `reconciler_backlog{state="manual_review"} reconciler_backlog`,
	} {
		sels, err := promSelectors(expr)
		if err != nil {
			t.Errorf("%s: %v", expr, err)
			continue
		}
		var got []string
		for _, s := range sels {
			var ms []string
			for _, m := range s.matchers {
				ms = append(ms, fmt.Sprintf("%s%s%q", m.label, m.op, m.value))
			}
			if len(ms) > 0 {
				got = append(got, s.name+"{"+strings.Join(ms, ",")+"}")
			} else {
				got = append(got, s.name)
			}
		}
		if strings.Join(got, " ") != want {
			t.Errorf("%s:\n got %s\nwant %s", expr, strings.Join(got, " "), want)
		}
	}
	if _, err := promSelectors(`sum({__name__="x"})`); err == nil {
		t.Error("a selector without a metric name was accepted")
	}
}
