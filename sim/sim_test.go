package sim

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestLedgerReconcilerLeavesNoDuplicateNorOrphan is the experiment's claim:
// on every profile and five seeds, agents that write through the ledger
// with the reconciler settling their unknown outcomes leave neither a
// duplicate nor an orphan in the API, while plain retries of the same
// faults do duplicate writes (so the experiment can show what it fixes).
func TestLedgerReconcilerLeavesNoDuplicateNorOrphan(t *testing.T) {
	// Ten runs at a time, each on at most testConns connections: the
	// server may be shared with other test processes.
	slots := make(chan struct{}, 10)
	var mu sync.Mutex
	retryDuplicates := 0
	for _, p := range Profiles {
		for seed := uint64(1); seed <= 5; seed++ {
			t.Run(fmt.Sprintf("%s/seed=%d", p.Name, seed), func(t *testing.T) {
				t.Parallel()
				slots <- struct{}{}
				defer func() { <-slots }()
				rep := run(t, Options{Tasks: 24, Profile: p, Seed: seed, Concurrency: 24,
					Strategies: []string{Retries, LedgerReconciler}, Database: testDatabase(t)})
				res, _ := rep.Result(LedgerReconciler)
				if res.Duplicates != 0 || res.Orphans != 0 {
					t.Errorf("ledger+reconciler left duplicates=%d orphans=%d; short: %+v", res.Duplicates, res.Orphans, res.Short)
				}
				if res.Unresolved != 0 {
					t.Errorf("ledger+reconciler left %d task(s) with an unsettled receipt: %+v", res.Unresolved, res.Short)
				}
				if p.Name == "none" && res.Strict != rep.Tasks {
					t.Errorf("without faults ledger+reconciler succeeded strictly on %d of %d tasks: %+v", res.Strict, rep.Tasks, res.Short)
				}
				r, _ := rep.Result(Retries)
				mu.Lock()
				retryDuplicates += r.Duplicates
				mu.Unlock()
			})
		}
	}
	t.Cleanup(func() {
		if !t.Failed() && retryDuplicates == 0 {
			t.Error("retries without idempotency produced no duplicate on any profile or seed: the experiment shows nothing")
		}
	})
}

// TestRetriesDuplicateOnMedium pins one case docs/experiment.md's table shows:
// retries without idempotency keys duplicate writes on the medium profile.
func TestRetriesDuplicateOnMedium(t *testing.T) {
	rep := run(t, Options{Tasks: 48, Seed: 1, Strategies: []string{Retries, RetriesIdempotency}})
	if r, _ := rep.Result(Retries); r.Duplicates == 0 {
		t.Errorf("retries left no duplicate: %+v", r)
	}
	if r, _ := rep.Result(RetriesIdempotency); r.Duplicates != 0 {
		t.Errorf("retries+idempotency left %d duplicate(s)", r.Duplicates)
	}
}

// TestSameSeedSameFaults runs one strategy at two concurrencies: the faults
// injected, call by call on every stream, and so the duplicates they cause,
// are the same. Another seed injects other faults.
func TestSameSeedSameFaults(t *testing.T) {
	o := Options{Tasks: 24, Seed: 3, Strategies: []string{Retries}}
	o.Concurrency = 1
	one, _ := run(t, o).Result(Retries)
	o.Concurrency = 24
	many, _ := run(t, o).Result(Retries)
	if len(one.Faults()) == 0 {
		t.Fatal("no fault stream recorded")
	}
	if !reflect.DeepEqual(one.Faults(), many.Faults()) {
		t.Errorf("seed 3 injected different faults at concurrency 1 and 24")
	}
	if one.Duplicates != many.Duplicates || one.Strict != many.Strict {
		t.Errorf("concurrency changed the outcome: %d/%d duplicates, %d/%d strict",
			one.Duplicates, many.Duplicates, one.Strict, many.Strict)
	}
	o.Seed = 4
	other, _ := run(t, o).Result(Retries)
	if reflect.DeepEqual(one.Faults(), other.Faults()) {
		t.Error("seeds 3 and 4 injected the same faults")
	}
}

// TestReportFormats checks that the JSON and CSV parse back to what was
// measured and that the chart is well-formed SVG.
func TestReportFormats(t *testing.T) {
	rep := run(t, Options{Tasks: 8, Seed: 2, Strategies: []string{Baseline, Retries, AllPatterns}})

	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Fatalf("JSON does not parse: %v", err)
	}
	if len(back.Results) != 3 || back.Results[1].Strategy != Retries || back.Results[1].Strict != rep.Results[1].Strict {
		t.Errorf("JSON holds %+v", back.Results)
	}

	var cs bytes.Buffer
	if err := rep.WriteCSV(&cs); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&cs).ReadAll()
	if err != nil {
		t.Fatalf("CSV does not parse: %v", err)
	}
	if len(rows) != 4 || rows[0][3] != "strategy" || rows[3][3] != AllPatterns {
		t.Errorf("CSV rows: %q", rows)
	}

	var svg bytes.Buffer
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	if err := wellFormed(svg.Bytes()); err != nil {
		t.Errorf("SVG is not well-formed XML: %v\n%s", err, svg.String())
	}

	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{Baseline, Retries, AllPatterns, "strict", "duplicates", "profile medium"} {
		if !bytes.Contains(table.Bytes(), []byte(s)) {
			t.Errorf("table lacks %q:\n%s", s, table.String())
		}
	}
}

// TestOptionsRefused checks the refusals a caller can act on.
func TestOptionsRefused(t *testing.T) {
	for _, o := range []Options{
		{Strategies: []string{"prayer"}},
		{Strategies: []string{LedgerReconciler}}, // no server
		{Tasks: -1},
	} {
		if _, err := Run(context.Background(), o); !errors.Is(err, ErrInvalidOptions) {
			t.Errorf("Run(%+v) = %v, want ErrInvalidOptions", o, err)
		}
	}
	if _, err := ProfileNamed("apocalyptic"); !errors.Is(err, ErrInvalidOptions) {
		t.Errorf("ProfileNamed: %v", err)
	}
}

const testConns = 4

// testDatabase gives each strategy a database cloned from the test
// process's migrated template (pgtest), dropped when the test ends.
func testDatabase(t *testing.T) func(context.Context, string) (*pgxpool.Pool, func(), error) {
	return func(ctx context.Context, _ string) (*pgxpool.Pool, func(), error) {
		cfg, err := pgxpool.ParseConfig(pgtest.NewDatabase(t))
		if err != nil {
			return nil, nil, err
		}
		cfg.MaxConns = testConns
		db, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, nil, err
		}
		return db, db.Close, nil
	}
}

func run(t *testing.T, o Options) *Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rep, err := Run(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// wellFormed decodes every token of doc and wants one root element, svg.
func wellFormed(doc []byte) error {
	d := xml.NewDecoder(bytes.NewReader(doc))
	root := ""
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if se, ok := tok.(xml.StartElement); ok && root == "" {
			root = se.Name.Local
		}
	}
	if root != "svg" {
		return fmt.Errorf("root element %q, want svg", root)
	}
	return nil
}
