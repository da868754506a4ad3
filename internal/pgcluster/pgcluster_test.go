package pgcluster

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A cluster whose owner died is stopped and removed by the next Start; a
// live owner's cluster is left alone.
func TestReapOrphans(t *testing.T) {
	orphan, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	live, err := Start()
	if err != nil {
		orphan.Stop()
		t.Fatal(err)
	}
	defer live.Stop()

	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(orphan.dir, ownerFile), []byte(strconv.Itoa(dead.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	reapOrphans(orphan.bin)

	if _, err := os.Stat(orphan.dir); !os.IsNotExist(err) {
		orphan.Stop()
		t.Fatalf("orphaned cluster's directory still there: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, orphan.URL); err == nil {
		conn.Close(ctx)
		t.Fatal("orphaned cluster still answers")
	}
	conn, err := pgx.Connect(ctx, live.URL)
	if err != nil {
		t.Fatalf("the live owner's cluster was reaped: %v", err)
	}
	conn.Close(ctx)
}

// Pause stops the server as a crash would and Resume brings it back on the
// same URL with its data: what the fault tests' database outage relies on.
func TestPauseResume(t *testing.T) {
	c, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	exec := func(sql string) error {
		conn, err := pgx.Connect(ctx, c.URL)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, sql)
		return err
	}
	if err := exec(`CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := c.Pause(); err != nil {
		t.Fatal(err)
	}
	if err := exec(`SELECT 1`); err == nil {
		t.Fatal("a paused cluster answers")
	}
	if err := c.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := exec(`DO $$ BEGIN PERFORM 1 FROM kept WHERE x = 1; IF NOT FOUND THEN RAISE 'row lost'; END IF; END $$`); err != nil {
		t.Fatalf("after Resume: %v", err)
	}
}
