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
