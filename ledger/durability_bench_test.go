package ledger_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/receiptledger/reconciler/internal/pgcluster"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/migrations"
)

// BenchmarkRequireSynchronousStandby measures what requiring a synchronous
// standby costs an agent: PlanAndSubmit on a primary with one synchronous
// standby (loopback), with and without RequireSynchronousStandby (one read
// of the durability a second, shared by the client's calls), and the read
// itself ("read", what each period costs one call).
//
//	go test ./ledger -run '^$' -bench RequireSynchronousStandby -benchtime 2000x
func BenchmarkRequireSynchronousStandby(b *testing.B) {
	primary, err := pgcluster.Start()
	if err != nil {
		b.Fatal(err)
	}
	defer primary.Stop()
	ctx := context.Background()
	pool, err := ledger.NewPool(ctx, primary.URL)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		b.Fatal(err)
	}
	for _, q := range []string{"ALTER SYSTEM SET synchronous_standby_names = 's1'", "SELECT pg_reload_conf()"} {
		if _, err := pool.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	standby, err := primary.Standby("s1")
	if err != nil {
		b.Fatal(err)
	}
	defer standby.Stop()
	base, err := ledger.New(pool, "agent:bench")
	if err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if d, err := base.Durability(ctx); err == nil && d.Replicated() {
			break
		} else if time.Now().After(deadline) {
			b.Fatalf("no synchronous standby: %v %v", d, err)
		}
	}
	run := 0
	for _, tc := range []struct {
		name   string
		client *ledger.Client
	}{{"plain", base}, {"required", base.RequireSynchronousStandby(ledger.DefaultDurabilityRecheck)}} {
		b.Run(tc.name, func(b *testing.B) {
			run++
			for i := range b.N {
				key := ledger.Key("bench-"+strconv.Itoa(run), strconv.Itoa(i), "things.create")
				if _, err := tc.client.PlanAndSubmit(ctx, ledger.Intent{IdempotencyKey: key, Operation: "things.create",
					Dependency: "api", Method: "POST", Target: "/things", Payload: []byte(`{"r":` + strconv.Itoa(run) + `,"i":` + strconv.Itoa(i) + `}`)}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("read", func(b *testing.B) {
		for range b.N {
			if _, err := ledger.ReadDurability(ctx, pool); err != nil {
				b.Fatal(err)
			}
		}
	})
}
