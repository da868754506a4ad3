package main

import (
	"encoding/json"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

func TestNormalizeArgs(t *testing.T) {
	app := newApp(strings.NewReader(""), io.Discard, io.Discard)
	tests := []struct{ in, want string }{
		{"migrate up --database-url U", "migrate up --database-url U"},
		{"--database-url U migrate status", "migrate status --database-url U"},
		{"migrate --database-url U down", "migrate down --database-url U"},
		{"migrate down --database-url=U", "migrate down --database-url=U"},
		// A group without its subcommand prints its help: the flags its
		// subcommands take are dropped, as for every group.
		{"migrate --database-url U", "migrate"},
		{"review --database-url U", "review"},
		{"review --bogus", "review --bogus"},
		{"review show 12 --json", "review show --json 12"},
		{"--json review show 12 --database-url U", "review show --json --database-url U 12"},
		{"review resolve 12 --as rejected --reason gone", "review resolve --as rejected --reason gone 12"},
		{"review list --older-than -1h", "review list --older-than -1h"},
		{"migrate up --help", "migrate up --help"},
		{"--help migrate up", "migrate up --help"},
		{"-h stats", "stats -h"},
		{"stats --json extra", "stats --json extra"},
		{"run --once --database-url U", "run --once --database-url U"},
		{"adapters check --receipt 7 --config f.yaml", "adapters check --receipt 7 --config f.yaml"},
		{"fingerprint --drop /a canonicalize", "fingerprint --drop /a canonicalize"},
		{"review show -- --json", "review show -- --json"},
		{"review show 12 --json -- x", "review show --json -- 12 x"},
		{"review show 12 --help", "review show --help"},
		// A command with subcommands takes no argument.
		{"review 12 show", `unknown command "reconciler review 12" (see reconciler review --help)`},
		{"--database-url U migrate nonsense", `unknown command "reconciler migrate nonsense" (see reconciler migrate --help)`},
		{"nonsense", `unknown command "reconciler nonsense" (see reconciler --help)`},
		{"migrate help", "migrate help"},
		{"review resolve 4 --as rejected --reason", "review resolve: flag needs an argument: --reason"},
		// A flag no command on the path declares stays on the last one,
		// whose parser refuses it by name.
		{"migrate up --bogus", "migrate up --bogus"},
	}
	for _, tt := range tests {
		args, unknown := normalizeArgs(app, append([]string{"reconciler"}, strings.Fields(tt.in)...))
		got := unknown
		if unknown == "" {
			got = strings.Join(args[1:], " ")
		}
		if got != tt.want {
			t.Errorf("%s:\n got %s\nwant %s", tt.in, got, tt.want)
		}
	}
}

// TestFlagNamesAgree guards normalizeArgs, which must know whether a flag
// takes a value before it knows the command: a flag name is boolean
// everywhere in the tree or nowhere.
func TestFlagNamesAgree(t *testing.T) {
	app := newApp(strings.NewReader(""), io.Discard, io.Discard)
	seen := map[string]bool{}
	for _, lf := range leaves(app.Commands, nil) {
		for _, f := range lf.flags {
			for _, n := range f.Names() {
				tv := takesValue(f)
				if prev, ok := seen[n]; ok && prev != tv {
					t.Errorf("flag --%s takes a value in one command and not in another (%s)", n, lf.path)
				}
				seen[n] = tv
			}
		}
	}
}

type leaf struct {
	path  string
	cmd   *cli.Command
	flags []cli.Flag // its own and its parents'
}

func leaves(cmds []*cli.Command, parent *leaf) []leaf {
	var out []leaf
	for _, c := range cmds {
		l := leaf{path: c.Name, cmd: c, flags: slices.Clone(c.Flags)}
		if parent != nil {
			l.path = parent.path + " " + c.Name
			l.flags = append(l.flags, parent.flags...)
		}
		if c.Action != nil && (len(c.Subcommands) == 0 || len(c.Flags) > 0) {
			out = append(out, l)
		}
		out = append(out, leaves(c.Subcommands, &l)...)
	}
	return out
}

func takesValue(f cli.Flag) bool {
	tv, ok := f.(cli.DocGenerationFlag)
	return !ok || tv.TakesValue()
}

// sampleValue is a valid value for the flag, so that only its placement is
// under test.
func sampleValue(f cli.Flag) []string {
	name := "--" + f.Names()[0]
	switch f.(type) {
	case *cli.BoolFlag:
		return []string{name}
	case *cli.IntFlag, *cli.Int64Flag, *cli.Uint64Flag:
		return []string{name, "3"}
	case *cli.Float64Flag:
		return []string{name, "0.5"}
	case *cli.DurationFlag:
		return []string{name, "90s"}
	case *cli.GenericFlag:
		return []string{name, "/a"}
	default:
		return []string{name, "x"}
	}
}

// TestFlagPlacements runs every command, for every flag it takes, with the
// flag before the command, right after it, after a positional argument and
// in --name=value form, each with --help so that nothing runs: a flag the
// parser did not accept is a usage error (exit 2), help is exit 0.
func TestFlagPlacements(t *testing.T) {
	app := newApp(strings.NewReader(""), io.Discard, io.Discard)
	all := leaves(app.Commands, nil)
	if len(all) < 12 {
		t.Fatalf("found only %d commands: %v", len(all), all)
	}
	for _, lf := range all {
		path := strings.Fields(lf.path)
		for _, f := range lf.flags {
			fl := sampleValue(f)
			placements := map[string][]string{
				"before the command":  slices.Concat(fl, path, []string{"--help"}),
				"after the command":   slices.Concat(path, fl, []string{"--help"}),
				"after a positional":  slices.Concat(path, []string{"12"}, fl, []string{"--help"}),
				"after help":          slices.Concat(path, []string{"--help"}, fl),
				"inline value":        slices.Concat(path, []string{"--help", strings.Join(fl, "=")}),
				"between subcommands": nil,
			}
			if len(lf.cmd.Subcommands) > 0 {
				delete(placements, "after a positional") // takes a subcommand, not an argument
			}
			if len(path) > 1 {
				placements["between subcommands"] = slices.Concat(path[:1], fl, path[1:], []string{"--help"})
			}
			for where, args := range placements {
				if args == nil {
					continue
				}
				code, out, errOut := runCLI(t, "", args...)
				if code != 0 || !strings.Contains(out, "USAGE:") {
					t.Errorf("%s (--%s %s): %q: exit %d, stderr %q", lf.path, f.Names()[0], where, args, code, errOut)
				}
			}
		}
		if code, out, _ := runCLI(t, "", append(path, "--help")...); code != 0 || !strings.Contains(out, "reconciler "+lf.path) {
			t.Errorf("%s --help: exit %d, %q", lf.path, code, out)
		}
	}
}

func TestUnknownCommands(t *testing.T) {
	for _, args := range [][]string{
		{"nonsense"}, {"migrate", "nonsense"}, {"review", "nonsense"}, {"adapters", "nonsense"},
		{"receipts", "nonsense"}, {"bench", "nonsense"}, {"--json", "nonsense"},
	} {
		code, out, errOut := runCLI(t, "", args...)
		if code != 2 || out != "" || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "unknown command") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 2 and one line", args, code, out, errOut)
		}
	}
}

// TestSharedFlagsAgainstADatabase runs the examples for real.
func TestSharedFlagsAgainstADatabase(t *testing.T) {
	t.Setenv("RECONCILER_DATABASE_URL", "")
	os.Unsetenv("RECONCILER_DATABASE_URL")
	url := pgtest.NewEmptyDatabase(t)
	steps := []struct {
		args     []string
		code     int
		contains string
	}{
		{[]string{"migrate", "status", "--database-url", url}, 0, "pending"},
		{[]string{"migrate", "up", "--database-url", url}, 0, "the schema is at version"},
		{[]string{"--database-url", url, "migrate", "status"}, 0, "applied"},
		{[]string{"stats", "--json", "--database-url", url}, 0, "{"},
		{[]string{"--database-url", url, "review", "list", "--json"}, 0, "[]"},
		{[]string{"review", "list", "--database-url=" + url, "--json"}, 0, "[]"},
		{[]string{"receipts", "show", "999999", "--json", "--database-url", url}, 1, ""},
		{[]string{"review", "show", "999999", "--database-url", url, "--json"}, 1, ""},
	}
	for _, s := range steps {
		code, out, errOut := runCLI(t, "", s.args...)
		if code != s.code || !strings.Contains(out, s.contains) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit %d and %q", s.args, code, out, errOut, s.code, s.contains)
		}
		if code == 1 && (strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "999999")) {
			t.Errorf("%v: want one line naming the receipt, got %q", s.args, errOut)
		}
	}
}

func TestVersion(t *testing.T) {
	code, out, errOut := runCLI(t, "", "version")
	if code != 0 || !strings.Contains(out, "reconciler ") || !strings.Contains(out, "go: go1.") {
		t.Fatalf("version: exit %d %q %q", code, out, errOut)
	}
	want, name, err := schemaVersion(os.DirFS("../../migrations"))
	if err != nil || want < 5 || !strings.HasPrefix(name, "000") {
		t.Fatalf("schema version of the migrations directory: %d %q %v", want, name, err)
	}
	if !strings.Contains(out, "schema: "+strconv.FormatInt(want, 10)+" ("+name+")") {
		t.Errorf("version does not name schema %d (%s): %q", want, name, out)
	}
	code, out, _ = runCLI(t, "", "--json", "version")
	var v buildVersion
	if code != 0 || json.Unmarshal([]byte(out), &v) != nil || v.Schema != want || v.Go == "" || v.Version == "" {
		t.Fatalf("version --json: exit %d, %q", code, out)
	}
	if code, _, _ := runCLI(t, "", "version", "extra"); code != 2 {
		t.Errorf("version extra: exit %d, want 2", code)
	}
}
