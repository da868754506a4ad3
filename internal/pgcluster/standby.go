package pgcluster

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// serverOptions are the postgres options of a cluster on port with its
// socket in dir, plus settings ("name=value").
func serverOptions(port int, dir string, settings []string) string {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c max_connections=300 -c shared_buffers=256MB", port, dir)
	for _, s := range settings {
		opts += " -c " + s
	}
	return opts
}

// Port returns the port the cluster listens on.
func (c *Cluster) Port() int {
	var port int
	_, _ = fmt.Sscanf(c.opts, "-p %d", &port)
	return port
}

// Standby starts a streaming standby of c: a base backup (pg_basebackup
// -R, a fast checkpoint) in a new directory, on a port of its own,
// connecting to c as application_name name (what c's
// synchronous_standby_names names). Its URL points at the standby; Stop
// removes it. settings are added to the standby's server options.
func (c *Cluster) Standby(name string, settings ...string) (*Cluster, error) {
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	s := &Cluster{dir: dir, bin: c.bin, cred: c.cred}
	if s.cred != nil {
		if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", c.Port(), name)
	if err := s.run("pg_basebackup", "-D", filepath.Join(dir, "data"), "-d", conninfo, "-R",
		"--checkpoint=fast", "--no-sync", "-X", "stream"); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := s.serve(settings); err != nil {
		return nil, err
	}
	return s, nil
}

// Promote makes a standby the primary (pg_ctl promote, waiting for it).
func (c *Cluster) Promote() error {
	return c.run("pg_ctl", "-D", filepath.Join(c.dir, "data"), "-w", "-t", "60", "promote")
}

// Kill sends SIGKILL to the server's postmaster, as the loss of its host
// would end it: no shutdown checkpoint, no goodbye to standbys. Its
// children notice and exit; the files stay (Stop removes them).
func (c *Cluster) Kill() error { return KillPostmaster(filepath.Join(c.dir, "data")) }

// KillPostmaster sends SIGKILL to the postmaster that postmaster.pid in
// the data directory pgdata names (one already gone is no error): Kill for
// a server this package did not start.
func KillPostmaster(pgdata string) error {
	raw, err := os.ReadFile(filepath.Join(pgdata, "postmaster.pid"))
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(raw), "\n", 2)[0]))
	if err != nil || pid <= 0 {
		return fmt.Errorf("pgcluster: postmaster.pid: %q", raw)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	return nil
}

// Credential returns the uid and gid the servers run as when the tests
// run as root (the postgres user), nil otherwise: a test that runs other
// server programs (pg_autoctl) runs them so too.
func Credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root and no postgres user to drop to: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// ServerBin returns the directory of the newest local server binaries.
func ServerBin() (string, error) { return findServerBin() }
