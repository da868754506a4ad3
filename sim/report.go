package sim

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is what a Run measured: the profile and the settings, and one
// Result per strategy.
type Report struct {
	Profile         string   `json:"profile"`
	Why             string   `json:"profile_why"`
	Transient       float64  `json:"transient"`
	Hang            float64  `json:"hang"`
	Malformed       float64  `json:"malformed"`
	LagMS           float64  `json:"visibility_lag_ms"`
	HangMS          float64  `json:"hang_ms"`
	AmbiguousWindow float64  `json:"ambiguous_window"`
	Tasks           int      `json:"tasks"`
	Seed            uint64   `json:"seed"`
	Concurrency     int      `json:"concurrency"`
	Attempts        int      `json:"attempts"`
	Results         []Result `json:"strategies"`
}

// Result is what one strategy achieved over the run's tasks.
type Result struct {
	Strategy    string `json:"strategy"`
	Description string `json:"description"`
	// Strict counts tasks that ended with the right answer and exactly
	// one draft and one published record of theirs in the API.
	Strict    int     `json:"strict_success"`
	StrictPct float64 `json:"strict_success_pct"`
	// Correct counts tasks whose agent gave the right answer.
	Correct    int     `json:"correct_answer"`
	CorrectPct float64 `json:"correct_answer_pct"`
	// Duplicates counts records beyond one draft and one post of a task
	// that published; Orphans the drafts left by tasks that published
	// nothing. Every record beyond the one draft and one post a task
	// should leave is counted once, in one or the other.
	Duplicates int `json:"duplicates"`
	Orphans    int `json:"orphans"`
	// Unresolved counts tasks that ended not knowing whether a write took
	// effect (through the ledger: a receipt left unsettled); ManualReview
	// tasks with a receipt held for a person.
	Unresolved   int     `json:"unresolved"`
	ManualReview int     `json:"manual_review"`
	P50MS        float64 `json:"p50_task_ms"`
	P95MS        float64 `json:"p95_task_ms"`
	// APICalls counts the agents' calls to the API (compensators
	// included); ReadbackCalls the reconciler's.
	APICalls      int64 `json:"api_calls"`
	ReadbackCalls int64 `json:"readback_calls"`
	// Short lists the tasks that did not end in strict success, and why.
	Short []Shortfall `json:"short"`

	faults map[string][]Draw
}

// Shortfall is one task that did not end in strict success.
type Shortfall struct {
	Task int    `json:"task"`
	Why  string `json:"why"`
}

// Faults returns every fault stream's draws in call order, for checking
// that a seed injects the same faults.
func (r Result) Faults() map[string][]Draw { return r.faults }

// score audits the API's records and the agents' answers of one strategy.
// unsettled and held are the ledger's counts by task (nil without one).
func score(seed uint64, strategy string, results []taskResult, drafts, posts map[int][]record, unsettled, held map[int]int) Result {
	res := Result{Strategy: strategy, Description: descriptions[strategy]}
	lat := make([]time.Duration, len(results))
	for i, r := range results {
		lat[i] = r.latency
		docs, facts := truth(seed, i)
		right := docs + facts
		correct := r.answered && r.answer == right
		d, p := len(drafts[i]), len(posts[i])
		dup, orphans := 0, 0
		if p > 0 {
			dup = p - 1 + max(0, d-1)
		} else {
			orphans = d
		}
		unresolved, manual := r.unresolved, false
		if unsettled != nil {
			unresolved, manual = unsettled[i] > 0, held[i] > 0
		}
		strict := correct && p == 1 && d == 1 && posts[i][0].Answer == right
		if correct {
			res.Correct++
		}
		if strict {
			res.Strict++
		}
		res.Duplicates += dup
		res.Orphans += orphans
		if unresolved {
			res.Unresolved++
		}
		if manual {
			res.ManualReview++
		}
		if !strict {
			res.Short = append(res.Short, Shortfall{Task: i, Why: shortfall(r, right, d, p, dup, orphans)})
		}
	}
	n := float64(len(results))
	res.StrictPct = math.Round(1000*float64(res.Strict)/n) / 10
	res.CorrectPct = math.Round(1000*float64(res.Correct)/n) / 10
	slices.Sort(lat)
	res.P50MS, res.P95MS = ms(percentile(lat, 0.50)), ms(percentile(lat, 0.95))
	return res
}

// shortfall says why a task missed strict success.
func shortfall(r taskResult, right, drafts, posts, dup, orphans int) string {
	var why []string
	if r.reason != "" {
		why = append(why, r.reason)
	}
	if r.answered && r.answer != right {
		why = append(why, fmt.Sprintf("answered %d, the right answer is %d", r.answer, right))
	}
	if !r.answered && r.reason == "" {
		why = append(why, "no answer")
	}
	why = append(why, fmt.Sprintf("left %d draft(s) and %d post(s)", drafts, posts))
	if dup > 0 {
		why = append(why, fmt.Sprintf("%d duplicate(s)", dup))
	}
	if orphans > 0 {
		why = append(why, fmt.Sprintf("%d orphan(s)", orphans))
	}
	return strings.Join(why, "; ")
}

// percentile is the nearest-rank percentile of sorted durations.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// Result returns the result of strategy, and whether it ran.
func (r *Report) Result(strategy string) (Result, bool) {
	for _, res := range r.Results {
		if res.Strategy == strategy {
			return res, true
		}
	}
	return Result{}, false
}

// Header describes the run in two lines, for people.
func (r *Report) Header() string {
	return fmt.Sprintf("profile %s: %s%% transient errors, %s%% hangs (%g ms), %s%% malformed answers; "+
		"a failing write stores its effect first %s%% of the time; lists lag %g ms\n"+
		"%d tasks per strategy, seed %d, %d at once, up to %d attempts per call",
		r.Profile, pct(r.Transient), pct(r.Hang), r.HangMS, pct(r.Malformed), pct(r.AmbiguousWindow), r.LagMS,
		r.Tasks, r.Seed, r.Concurrency, r.Attempts)
}

func pct(f float64) string { return strconv.FormatFloat(math.Round(1000*f)/10, 'f', -1, 64) }

// columns are the table's and the CSV's columns, after the strategy.
var columns = []string{"strict", "correct", "duplicates", "orphans", "unresolved", "manual_review",
	"p50_ms", "p95_ms", "api_calls", "readback_calls"}

func (res Result) cells(pctSign string) []string {
	return []string{
		strconv.FormatFloat(res.StrictPct, 'f', 1, 64) + pctSign,
		strconv.FormatFloat(res.CorrectPct, 'f', 1, 64) + pctSign,
		strconv.Itoa(res.Duplicates), strconv.Itoa(res.Orphans), strconv.Itoa(res.Unresolved),
		strconv.Itoa(res.ManualReview),
		strconv.FormatFloat(res.P50MS, 'f', 0, 64), strconv.FormatFloat(res.P95MS, 'f', 0, 64),
		strconv.FormatInt(res.APICalls, 10), strconv.FormatInt(res.ReadbackCalls, 10),
	}
}

// WriteTable prints the report for people: the run, a row per strategy,
// and the tasks ledger+reconciler left short, with why (the JSON has every
// strategy's).
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	b.WriteString(r.Header() + "\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "strategy\t%s\t\n", strings.Join(columns, "\t"))
	for _, res := range r.Results {
		fmt.Fprintf(tw, "%s\t%s\t\n", res.Strategy, strings.Join(res.cells("%"), "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, res := range r.Results {
		if res.Strategy != LedgerReconciler || len(res.Short) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\n%s fell short on %d task(s):\n", res.Strategy, len(res.Short))
		for _, s := range res.Short {
			fmt.Fprintf(&b, "  task %d: %s\n", s.Task, s.Why)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteJSON writes the report as one JSON document.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteCSV writes a header and a row per strategy.
func (r *Report) WriteCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	head := append([]string{"profile", "seed", "tasks", "strategy"}, columns...)
	if err := cw.Write(head); err != nil {
		return err
	}
	for _, res := range r.Results {
		row := append([]string{r.Profile, strconv.FormatUint(r.Seed, 10), strconv.Itoa(r.Tasks), res.Strategy}, res.cells("")...)
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}
