package main

import (
	"fmt"
	"io/fs"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/migrations"
)

// buildVersion is what `reconciler version` prints.
type buildVersion struct {
	Version string `json:"version"`
	// Commit is the VCS revision the binary was built from ("" when the
	// build recorded none, e.g. `go install module@version`).
	Commit   string `json:"commit"`
	Modified bool   `json:"modified"`
	Go       string `json:"go"`
	// Schema is the schema version this binary needs: the highest embedded
	// migration, which `reconciler migrate up` applies.
	Schema          int64  `json:"schema_version"`
	SchemaMigration string `json:"schema_migration"`
}

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:   "version",
		Usage:  "print the version, commit and Go version of this binary and the schema version it needs",
		Flags:  []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print JSON"}},
		Action: printVersion,
	}
}

// printVersion is `reconciler version` and `reconciler --version`.
func printVersion(c *cli.Context) error {
	v, err := readVersion()
	if err != nil {
		return cli.Exit("version: "+err.Error(), 1)
	}
	if c.Bool("json") {
		return writeJSON(c.App.Writer, v)
	}
	commit := v.Commit
	if commit == "" {
		commit = "unknown"
	}
	if v.Modified {
		commit += " (modified)"
	}
	scr := newScreen(c.App.Writer)
	scr.Printf("reconciler %s\ncommit: %s\ngo: %s\nschema: %d (%s)\n", v.Version, commit, v.Go, v.Schema, v.SchemaMigration)
	return nil
}

func readVersion() (buildVersion, error) {
	v := buildVersion{Version: "(devel)", Go: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Version != "" {
			v.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				v.Commit = s.Value
			case "vcs.modified":
				v.Modified = s.Value == "true"
			}
		}
	}
	var err error
	v.Schema, v.SchemaMigration, err = schemaVersion(migrations.FS())
	return v, err
}

// schemaVersion is the highest version among the embedded goose migrations,
// read from their file names (00005_input_limits.sql is version 5).
func schemaVersion(fsys fs.FS) (int64, string, error) {
	var best int64 = -1
	var name string
	err := fs.WalkDir(fsys, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".sql") {
			return err
		}
		base := d.Name()
		num, _, ok := strings.Cut(base, "_")
		if !ok {
			return nil
		}
		n, perr := strconv.ParseInt(num, 10, 64)
		if perr != nil {
			return nil
		}
		if n > best {
			best, name = n, base
		}
		return nil
	})
	if err != nil {
		return 0, "", err
	}
	if best < 0 {
		return 0, "", fmt.Errorf("no migrations embedded")
	}
	return best, name, nil
}
