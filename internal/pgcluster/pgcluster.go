// Package pgcluster starts a throwaway PostgreSQL cluster from the local
// server binaries, for tests and for the demo when no database is given.
package pgcluster

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// Cluster is a running throwaway cluster.
type Cluster struct {
	// URL connects to its postgres database as the superuser.
	URL  string
	dir  string
	bin  string
	cred *syscall.Credential
	// opts are the server options Start used, for Resume.
	opts string
}

// Start runs initdb and postgres from the newest local server binaries
// (/usr/lib/postgresql/<ver>/bin, else PATH) in a temporary directory,
// listening on a free loopback port. Postgres refuses to run as root, so as
// root the server runs as the postgres user.
func Start() (*Cluster, error) {
	return StartWith()
}

// StartWith is Start with extra server settings, each "name=value" (passed
// as -c name=value), e.g. "synchronous_standby_names=standby".
func StartWith(settings ...string) (*Cluster, error) {
	bin, err := findServerBin()
	if err != nil {
		return nil, err
	}
	reapOrphans(bin)
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, bin: bin}
	if c.cred, err = Credential(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if c.cred != nil {
		if err := os.Chown(dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	data := filepath.Join(dir, "data")
	if err := c.run("initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := c.serve(settings); err != nil {
		return nil, err
	}
	return c, nil
}

// serve starts the server on the data directory c.dir/data holds (made by
// initdb or pg_basebackup) on a free port, records the owning process and
// sets URL. On failure it removes c.dir.
func (c *Cluster) serve(settings []string) error {
	port, err := freePort()
	if err != nil {
		os.RemoveAll(c.dir)
		return err
	}
	c.opts = serverOptions(port, c.dir, settings)
	if err := c.Resume(); err != nil {
		os.RemoveAll(c.dir)
		return err
	}
	// Recorded only once the server runs, so reapOrphans never mistakes a
	// cluster being set up for a dead one.
	if err := os.WriteFile(filepath.Join(c.dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		_ = c.Stop()
		return err
	}
	c.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	return nil
}

// Stop shuts the server down and removes its files.
func (c *Cluster) Stop() error {
	err := c.run("pg_ctl", "-D", filepath.Join(c.dir, "data"), "-m", "immediate", "-w", "stop")
	if rerr := os.RemoveAll(c.dir); err == nil {
		err = rerr
	}
	return err
}

// Pause stops the server as a crash would (immediate shutdown: clients see
// their connections cut) and keeps its files, for tests of a database
// outage; Resume starts it again.
func (c *Cluster) Pause() error {
	return c.run("pg_ctl", "-D", filepath.Join(c.dir, "data"), "-m", "immediate", "-w", "stop")
}

// Resume starts the server, on the port and with the files it had: after
// Pause, it recovers from the crash and serves the same databases.
func (c *Cluster) Resume() error {
	return c.run("pg_ctl", "-D", filepath.Join(c.dir, "data"), "-l", filepath.Join(c.dir, "log"), "-w", "-t", "60", "-o", c.opts, "start")
}

func (c *Cluster) run(name string, args ...string) error {
	cmd := exec.Command(filepath.Join(c.bin, name), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	cmd.Dir = c.dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", name, err, lastLines(string(out), 5))
	}
	return nil
}

const (
	dirPrefix = "reconciler-pg-"
	// ownerFile holds the pid of the process that started the cluster.
	ownerFile = "owner.pid"
)

// reapOrphans stops and removes clusters left behind by processes that died
// without stopping them (a test binary killed by a timeout or a panic), so
// a developer's machine does not fill with idle servers.
func reapOrphans(bin string) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, dir := range dirs {
		raw, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue // being set up, or not ours
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
		if err != nil || pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			continue // the owner is alive (or cannot be told dead)
		}
		c := &Cluster{dir: dir, bin: bin}
		if info, err := os.Stat(dir); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok && os.Geteuid() == 0 && st.Uid != 0 {
				c.cred = &syscall.Credential{Uid: st.Uid, Gid: st.Gid}
			}
		}
		_ = c.Stop()
	}
}

func findServerBin() (string, error) {
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		if p, err := exec.LookPath("initdb"); err == nil {
			return filepath.Dir(p), nil
		}
		return "", errors.New("no initdb under /usr/lib/postgresql/*/bin or on PATH (apt-get install -y postgresql)")
	}
	sort.Slice(matches, func(i, j int) bool { return version(matches[i]) > version(matches[j]) })
	return filepath.Dir(matches[0]), nil
}

func version(initdb string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(initdb))))
	return v
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
