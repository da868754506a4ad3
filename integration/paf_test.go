package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/receiptledger/reconciler/internal/pgcluster"
)

// pafFormation is a pg_auto_failover formation of local processes on
// loopback ports: a monitor, and two Postgres nodes each run by its
// pg_autoctl keeper (the first becomes the primary, the second its
// synchronous secondary: pg_auto_failover's default). Every process runs
// as the postgres user when the tests run as root.
type pafFormation struct {
	dir  string
	bin  string
	cred *syscall.Credential
	// monitorPort and ports (node_1, node_2) are the servers' ports.
	monitorPort int
	ports       [2]int
	procs       []*exec.Cmd
}

// pafInstall says how to get pg_auto_failover (.ci/run does).
const pafInstall = "apt-get install -y postgresql-15-auto-failover pg-auto-failover-cli"

// startFormation starts a monitor with health checks tightened from
// pg_auto_failover's defaults (a node unhealthy after 3 s, not 20 s, so
// the test's failover takes seconds), then node_1, then node_2, and
// returns once node_1 is primary and node_2 its secondary. Everything
// stops, and its files go, at the test's end.
func startFormation(t *testing.T) *pafFormation {
	t.Helper()
	if _, err := exec.LookPath("pg_autoctl"); err != nil {
		t.Fatalf("the failover test needs pg_auto_failover's pg_autoctl: %s", pafInstall)
	}
	bin, err := pgcluster.ServerBin()
	if err != nil {
		t.Fatal(err)
	}
	cred, err := pgcluster.Credential()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "reconciler-paf-")
	if err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	f := &pafFormation{dir: dir, bin: bin, cred: cred}
	t.Cleanup(f.stop)
	for i := range 3 {
		port, err := strconv.Atoi(strings.TrimPrefix(freeAddr(t), "127.0.0.1:"))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			f.monitorPort = port
		} else {
			f.ports[i-1] = port
		}
	}
	ctx := context.Background()
	// The monitor's and node_1's clusters are made here, without the
	// fsyncs pg_autoctl's initdb would pay (seconds each on a busy
	// machine); pg_autoctl takes an existing data directory. pg_basebackup
	// of the secondary asks node_1 for a spread checkpoint: minutes on a
	// fresh node unless the spread is 0.
	f.initdb(t, "monitor")
	f.initdb(t, "node_1")
	conf, err := os.OpenFile(filepath.Join(f.pgdata("node_1"), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conf.WriteString("checkpoint_completion_target = 0\n"); err != nil {
		t.Fatal(err)
	}
	conf.Close()
	f.run(t, "monitor", "create", "monitor", "--pgdata", f.pgdata("monitor"), "--pgport", strconv.Itoa(f.monitorPort),
		"--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl", "--run")
	monitor := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/pg_auto_failover?sslmode=disable", f.monitorPort)
	f.waitQuery(t, monitor, "the monitor", `SELECT count(*) >= 0 FROM pgautofailover.node`)
	mc, err := pgx.Connect(ctx, monitor)
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close(ctx)
	for _, s := range []string{"health_check_period = 1000", "health_check_retry_delay = 500", "health_check_timeout = 1000",
		"node_considered_unhealthy_timeout = 3000", "startup_grace_period = 2000"} {
		if _, err := mc.Exec(ctx, "ALTER SYSTEM SET pgautofailover."+s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := mc.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	for i, port := range f.ports {
		name := "node_" + strconv.Itoa(i+1)
		f.run(t, name, "create", "postgres", "--pgdata", f.pgdata(name), "--pgport", strconv.Itoa(port),
			"--hostname", "127.0.0.1", "--name", name, "--auth", "trust", "--no-ssl", "--dbname", "app",
			"--monitor", fmt.Sprintf("postgres://autoctl_node@127.0.0.1:%d/pg_auto_failover?sslmode=disable", f.monitorPort), "--run")
		if i == 0 {
			f.waitState(t, mc, map[int]string{port: "single"})
		}
	}
	f.waitState(t, mc, map[int]string{f.ports[0]: "primary", f.ports[1]: "secondary"})
	return f
}

func (f *pafFormation) pgdata(name string) string { return filepath.Join(f.dir, name) }

// nodeURL is the URL of node i's app database.
func (f *pafFormation) nodeURL(i int) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/app?sslmode=disable", f.ports[i])
}

// URL is the formation's multi-host URL: whichever node is the primary.
func (f *pafFormation) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?target_session_attrs=read-write&sslmode=disable&connect_timeout=2",
		f.ports[0], f.ports[1])
}

// initdb makes the cluster of name (no fsync: a test's data).
func (f *pafFormation) initdb(t *testing.T, name string) {
	t.Helper()
	cmd := exec.Command(filepath.Join(f.bin, "initdb"), "-D", f.pgdata(name), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
	cmd.Dir = f.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: f.cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("initdb %s: %v\n%s", name, err, out)
	}
}

// run starts `pg_autoctl args...` in the background, its output in
// <name>.log, in a process group of its own (stop kills the group: the
// keeper, its supervisor and its Postgres).
func (f *pafFormation) run(t *testing.T, name string, args ...string) {
	t.Helper()
	log, err := os.Create(filepath.Join(f.dir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command("pg_autoctl", args...)
	cmd.Dir = f.dir
	cmd.Env = append(os.Environ(), "PATH="+f.bin+":"+os.Getenv("PATH"), "HOME="+f.dir,
		"XDG_CONFIG_HOME="+filepath.Join(f.dir, "config"), "XDG_DATA_HOME="+filepath.Join(f.dir, "share"))
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: f.cred, Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.procs = append(f.procs, cmd)
}

// stop kills every process group started and removes the files.
func (f *pafFormation) stop() {
	for i := len(f.procs) - 1; i >= 0; i-- {
		p := f.procs[i]
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
		_ = p.Wait()
	}
	_ = os.RemoveAll(f.dir)
}

// killPostmaster sends SIGKILL to node i's postmaster: the primary lost
// as a crash loses it (its keeper, alive, restarts it, and the monitor
// fails over meanwhile).
func (f *pafFormation) killPostmaster(t *testing.T, i int) {
	t.Helper()
	if err := pgcluster.KillPostmaster(f.pgdata("node_" + strconv.Itoa(i+1))); err != nil {
		t.Fatal(err)
	}
}

// waitPromoted waits until node i is the formation's writable primary.
func (f *pafFormation) waitPromoted(t *testing.T, i int) {
	t.Helper()
	f.waitQuery(t, f.nodeURL(i), "node "+strconv.Itoa(i+1)+" promoted", `SELECT NOT pg_is_in_recovery()`)
}

// waitQuery waits until q, run on url, returns true.
func (f *pafFormation) waitQuery(t *testing.T, url, what, q string) {
	t.Helper()
	waitFor(t, 2*time.Minute, what, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			return false, err.Error()
		}
		defer c.Close(ctx)
		var ok bool
		if err := c.QueryRow(ctx, q).Scan(&ok); err != nil {
			return false, err.Error()
		}
		return ok, "not yet"
	})
}

// waitState waits until the monitor reports each node (by port) in its
// state.
func (f *pafFormation) waitState(t *testing.T, mc *pgx.Conn, want map[int]string) {
	t.Helper()
	waitFor(t, 3*time.Minute, fmt.Sprintf("pg_auto_failover states %v", want), func() (bool, string) {
		rows, err := mc.Query(context.Background(), `SELECT nodeport, reportedstate::text FROM pgautofailover.node`)
		if err != nil {
			return false, err.Error()
		}
		got := map[int]string{}
		for rows.Next() {
			var port int
			var st string
			if err := rows.Scan(&port, &st); err != nil {
				return false, err.Error()
			}
			got[port] = st
		}
		if rows.Err() != nil {
			return false, rows.Err().Error()
		}
		for port, st := range want {
			if got[port] != st {
				return false, fmt.Sprint(got)
			}
		}
		return true, ""
	})
}
