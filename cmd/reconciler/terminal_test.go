package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
	"github.com/receiptledger/reconciler/ledger"
	"github.com/receiptledger/reconciler/review"
	"github.com/receiptledger/reconciler/statemachine"
)

// evil is what a hostile API or agent puts in a field: clear the screen, an
// OSC 8 hyperlink, a carriage return and a backspace to overwrite what was
// printed, a C1 CSI, a bidi override and isolate, DEL.
const evil = "\x1b[2J\x1b]8;;http://evil\x07link\x1b]8;;\x07\rX\bY\u009b31m\u202eevil\u2066z\u2069\x7f"

// evilShown are pieces of evil as a terminal must show them: escaped, and
// still recognizable.
var evilShown = []string{`\x1b[2J`, `\x1b]8;;http://evil\x07link`, `\r`, `\x08`, `\u009b31m`, `\u202eevil`, `\x7f`}

// evilFolded is evil as an error line shows it: folded on one line (CR
// becomes a space, see oneLine), then escaped.
var evilFolded = []string{`\x1b[2J`, `\x1b]8;;http://evil\x07link`, `\x08`, `\u009b31m`, `\u202eevil`, `\x7f`}

// rawControls lists the characters in s that must not reach a terminal:
// every control character but the layout's "\n" and "\t", and bytes that
// are not UTF-8.
func rawControls(s string) []string {
	var bad []string
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			bad = append(bad, fmt.Sprintf("byte %#x at %d", s[i], i))
		case r == '\n' || r == '\t':
		case r < 0x20, r >= 0x7f && r <= 0x9f, r >= 0x2028 && r <= 0x202e, r >= 0x2066 && r <= 0x2069,
			r == 0x061c, r == 0x200e, r == 0x200f, r == 0xfeff:
			bad = append(bad, fmt.Sprintf("%U at %d", r, i))
		}
		i += n
	}
	return bad
}

// assertShown fails unless out has no raw control character and shows
// every one of want.
func assertShown(t *testing.T, what, out string, want ...string) {
	t.Helper()
	if bad := rawControls(out); len(bad) > 0 {
		t.Errorf("%s: raw control characters %v in:\n%q", what, bad, out)
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("%s: output lacks %q:\n%s", what, w, out)
		}
	}
}

// Issue 8, item 7: the screen escapes every argument (a value cannot forge
// a line or a column), the guard escapes whatever else reaches the writer,
// and jsonText leaves JSON valid, meaning the same, with no raw control
// character.
func TestTerminalEscaping(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{"plain", "articles.create", "articles.create"},
		{"CSI clear", "a\x1b[2Jb", `a\x1b[2Jb`},
		{"OSC 8 link", "\x1b]8;;http://evil\x07x", `\x1b]8;;http://evil\x07x`},
		{"CR and backspace", "ok\rno\bpe", `ok\rno\x08pe`},
		{"forged line", "x\nreceipt 1  succeeded\ty", `x\nreceipt 1  succeeded\ty`},
		{"C1 CSI", "\u009b31m", `\u009b31m`},
		{"bidi", "\u202eevil\u2066x\u2069", `\u202eevil\u2066x\u2069`},
		{"separators", "a\u2028b\u2029c", `a\u2028b\u2029c`},
		{"DEL", "a\x7fb", `a\x7fb`},
		{"invalid byte", "a\x9bb", `a\x9bb`},
		{"printable unicode", "café ✓ 日本", "café ✓ 日本"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			s := newScreen(&b)
			s.Printf("[%s] %d %v %s\n", tt.in, 7, statemachine.Actor("agent:"+tt.in), fmt.Errorf("e: %s", tt.in))
			tw := s.Table()
			tw.Printf("A\tB\n%s\t%s\n", tt.in, []byte(tt.in))
			if err := tw.Flush(); err != nil {
				t.Fatal(err)
			}
			out := b.String()
			assertShown(t, "screen", out, "["+tt.want+"] 7 agent:"+tt.want+" e: "+tt.want)
			if lines := strings.Count(out, "\n"); lines != 3 {
				t.Errorf("%d lines, want 3:\n%s", lines, out)
			}
			// Text laid out by a printer keeps its "\n" and "\t", nothing else.
			b.Reset()
			_, _ = s.Write([]byte("laid out\t" + tt.in + "\n"))
			assertShown(t, "guard", b.String(), "laid out\t"+strings.NewReplacer(`\n`, "\n", `\t`, "\t").Replace(tt.want))

			// encoding/json escapes C0 but not DEL, C1 or bidi controls,
			// and copies a RawMessage (read from jsonb) as it is.
			raw, err := json.Marshal(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			var j bytes.Buffer
			if err := writeJSON(&j, map[string]any{"v": tt.in, "raw": json.RawMessage(raw)}); err != nil {
				t.Fatal(err)
			}
			assertShown(t, "json", j.String())
			var back struct{ V string }
			if err := json.Unmarshal(j.Bytes(), &back); err != nil {
				t.Fatalf("invalid JSON %q: %v", j.String(), err)
			}
			if utf8.ValidString(tt.in) && back.V != tt.in {
				t.Errorf("JSON reads back %q, want %q", back.V, tt.in)
			}
		})
	}
}

// plantHostile writes receipts as a hostile API or agent (or a row written
// before the schema refused control characters) leaves them:
//   - held: in manual_review, with evil in its operation, dependency, target,
//     key and external id (set with the triggers off, as rows planned before
//     migration 00005 may hold), the actor and external id of its first
//     event, its error message, evidence and reason;
//   - clean: in manual_review, fields clean, for the commands to act on.
func plantHostile(t *testing.T, pool *pgxpool.Pool) (held, clean, requeued int64) {
	t.Helper()
	ctx := context.Background()
	hold := func(n int, d ledger.Detail) int64 {
		t.Helper()
		r := unknownReceipt(t, pool, "items.create", "shop-api", n)
		rc, err := ledger.New(pool, "reconciler:t")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := rc.Transition(ctx, ledger.Move{ID: r.ID, From: statemachine.OutcomeUnknown,
			To: statemachine.ManualReview, Detail: d}); err != nil {
			t.Fatal(err)
		}
		return r.ID
	}
	held = hold(10, ledger.Detail{Reason: "REASON" + evil,
		Error:    &ledger.CallError{Code: "CODE" + evil, Message: "ERROR" + evil},
		Evidence: map[string]any{"note": "EVIDENCE" + evil}})
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, q := range []string{
			`ALTER TABLE reconciler.receipts DISABLE TRIGGER USER`,
			`ALTER TABLE reconciler.receipt_events DISABLE TRIGGER USER`,
			`UPDATE reconciler.receipts SET operation = 'OP' || $1, dependency = 'DEP' || $1,
				target = '/TARGET' || $1, idempotency_key = 'KEY' || $1, external_id = 'EXT' || $1 WHERE id = $2`,
			`UPDATE reconciler.receipt_events SET actor = 'agent:ACTOR' || $1, external_id = 'EVTEXT' || $1
				WHERE receipt_id = $2 AND seq = 1`,
			`ALTER TABLE reconciler.receipt_events ENABLE TRIGGER USER`,
			`ALTER TABLE reconciler.receipts ENABLE TRIGGER USER`,
		} {
			var args []any
			if strings.Contains(q, "$1") {
				args = []any{evil, held}
			}
			if _, err := tx.Exec(ctx, q, args...); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("plant: %v", err)
	}
	clean = hold(11, ledger.Detail{Reason: "bound_reached"})
	requeued = hold(12, ledger.Detail{Reason: "bound_reached"})
	return held, clean, requeued
}

// Issue 8, item 7: no command prints a control character it did not put
// there itself. Receipts carry ESC sequences, CR, backspace, C1, bidi
// overrides and DEL in their operation, dependency, target, key, external
// id, actor, reason, operator, evidence and error; every human output (and
// every --json output) escapes them and still shows them recognizably, and
// --json decodes back to the stored value.
func TestHostileFieldsAreEscaped(t *testing.T) {
	t.Setenv("RECONCILER_OPERATOR", "")
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	url := pgtest.NewDatabase(t)
	pool := pgtest.Pool(t, url)
	held, clean, requeued := plantHostile(t, pool)
	id := func(n int64) string { return fmt.Sprint(n) }
	esc := termText

	// A hostile API: the item it returns has evil in its id and fields; a
	// second one answers 503 with evil in the body.
	unknown := unknownReceipt(t, pool, "items.create", "shop-api", 1)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		items := []any{}
		if req.URL.Query().Get("page") == "1" {
			items = append(items, map[string]any{"id": "APIID" + evil, "title": "TITLE" + evil,
				"created_at": time.Now().UTC().Format(time.RFC3339),
				"metadata":   map[string]any{"idempotency_key": unknown.IdempotencyKey}})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"items": items})
	}))
	defer api.Close()
	config := writeAdapters(t, api.URL)
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte("BODY" + evil))
	}))
	defer down.Close()
	downConfig := writeAdapters(t, down.URL)

	cases := []struct {
		name string
		args []string
		code int
		want []string // in stdout+stderr, besides evilShown when evil is expected
		evil []string // pieces of evil the output must show, escaped
		json bool     // stdout is JSON
	}{
		{"receipts show", []string{"receipts", "show", id(held)}, 0,
			[]string{esc("OP" + evil), esc("DEP" + evil), esc("/TARGET" + evil), esc("KEY" + evil),
				"external id  " + esc("EXT"+evil), "by " + esc("agent:ACTOR"+evil), "reason:     " + esc("REASON"+evil),
				`EVIDENCE\u001b[2J`, `ERROR\u001b[2J`, "external id: " + esc("EVTEXT"+evil)}, evilShown, false},
		{"receipts show --json", []string{"receipts", "show", "--json", id(held)}, 0, []string{`\u001b[2J`, `\u009b`, `\u202e`}, nil, true},
		{"review show", []string{"review", "show", id(held)}, 0, []string{esc("OP" + evil), esc("agent:ACTOR" + evil)}, evilShown, false},
		{"review show --json", []string{"review", "show", id(held), "--json"}, 0, []string{`\u001b[2J`}, nil, true},
		{"review list", []string{"review", "list"}, 0, []string{esc("OP" + evil), esc("DEP" + evil), esc("REASON"+evil) + " (" + esc("CODE"+evil) + ")"}, evilShown, false},
		{"review list --json", []string{"review", "list", "--json"}, 0, []string{`\u001b[2J`}, nil, true},
		{"review resolve", []string{"review", "resolve", id(clean), "--as", "succeeded", "--reason", "REASON" + evil,
			"--operator", "OPERATOR" + evil, "--external-id", "FOUND" + evil}, 0,
			[]string{"manual_review -> succeeded by human:" + esc("OPERATOR"+evil)}, evilShown, false},
		{"review resolve again: the error names who moved it", []string{"review", "resolve", id(clean), "--as", "rejected",
			"--reason", "again", "--operator", "ops"}, 1, []string{"moved there by human:" + esc(oneLine("OPERATOR"+evil))}, evilFolded, false},
		{"review requeue", []string{"review", "requeue", id(requeued), "--reason", "REASON" + evil, "--operator", "OPERATOR" + evil}, 0,
			[]string{"manual_review -> outcome_unknown by human:" + esc("OPERATOR"+evil)}, evilShown, false},
		{"receipts show after the decision", []string{"receipts", "show", id(clean)}, 0,
			[]string{"by human:" + esc("OPERATOR"+evil), "reason:     " + esc("REASON"+evil),
				// An external id with control characters is not stored (the
				// ledger keeps its hash and an excerpt): the excerpt shows.
				`"untrusted_external_id"`, `FOUND\\x1b[2J`,
				`"operator":"OPERATOR\u001b[2J`}, evilShown, false},
		{"adapters check, settled", []string{"adapters", "check", "--config", config, "--receipt", id(clean)}, 0,
			[]string{"by human:" + esc("OPERATOR"+evil), "(" + esc("REASON"+evil) + ")"}, evilShown, false},
		{"adapters check, no adapter", []string{"adapters", "check", "--config", config, "--receipt", id(held)}, 0,
			[]string{esc("OP"+evil) + " on " + esc("DEP"+evil), "adapter: none"}, evilShown, false},
		{"adapters check, the API's answer", []string{"adapters", "check", "--config", config, "--receipt", id(unknown.ID)}, 0,
			// An id with control characters names nothing the API knows
			// once cleaned: the adapter refuses it (issue 8) and says why.
			[]string{"error: permanent", "holds a control character", "decision: manual_review"}, nil, false},
		{"adapters check, the API's error", []string{"adapters", "check", "--config", downConfig, "--receipt", id(unknown.ID)}, 0,
			[]string{"error: ", "HTTP 503", `BODY\x1b[2J`, "decision: "}, nil, false},
		{"stats", []string{"stats"}, 0, []string{"manual_review="}, nil, false},
		{"stats --json", []string{"stats", "--json"}, 0, []string{`"manual_review"`}, nil, true},
		{"error with an undefined flag", []string{"review", "list", "1", "--" + evil}, 2,
			[]string{"flag provided but not defined: --" + esc(oneLine(evil))}, evilFolded, false},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runCLI(t, "", append(tt.args, "--database-url", url)...)
			if code != tt.code {
				t.Fatalf("exit %d, want %d:\n%s\n%s", code, tt.code, out, errOut)
			}
			want := tt.want
			want = append(want, tt.evil...)
			assertShown(t, "stdout+stderr", out+errOut, want...)
			if strings.Contains(out+errOut, adaptersSecret) {
				t.Errorf("the secret is printed")
			}
			if tt.json && !json.Valid([]byte(out)) {
				t.Errorf("invalid JSON:\n%s", out)
			}
		})
	}

	// --json reads back exactly what is stored.
	_, out, _ := runCLI(t, "", "receipts", "show", "--json", id(held), "--database-url", url)
	var tl review.Timeline
	if err := json.Unmarshal([]byte(out), &tl); err != nil {
		t.Fatal(err)
	}
	var ev struct{ Note string }
	if err := json.Unmarshal(tl.Events[len(tl.Events)-1].Evidence, &ev); err != nil {
		t.Fatal(err)
	}
	if tl.Receipt.Operation != "OP"+evil || tl.Receipt.ExternalID != "EXT"+evil ||
		string(tl.Events[0].Actor) != "agent:ACTOR"+evil || ev.Note != "EVIDENCE"+evil {
		t.Errorf("--json does not read back the stored values: %+v", tl)
	}
}

// Issue 8, item 7: `adapters check --control` shows no raw control
// character of what the API answered for a declared control.
func TestAdaptersControlOutputIsEscaped(t *testing.T) {
	t.Setenv("SHOP_TOKEN", adaptersSecret)
	t.Setenv("RECONCILER_DATABASE_URL", "")
	made := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	api, _ := controlAPI(t, map[string]any{"id": "CONTROLID" + evil, "created_at": made.Format(time.RFC3339),
		"metadata": map[string]any{"idempotency_key": "bootstrap:shop-control:items.create"}})
	path := filepath.Join(t.TempDir(), "adapters.yaml")
	if err := os.WriteFile(path, []byte(fmt.Sprintf(`version: 1
adapters:
  - name: shop-items
    type: http
    kind: create
    dependency: shop-api
    operations: [items.create]
    http: {preset: rest, base_url: %s, auth: {env: SHOP_TOKEN}}
    control:
      idempotency_key: "bootstrap:shop-control:items.create#2"
      target: /items
      submitted_at: %s
`, api.URL, made.Format(time.RFC3339))), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "", "adapters", "check", "--config", path, "--control")
	// An id with control characters is never recorded (issue 8): the
	// control fails, saying why, and nothing of the id reaches the screen raw.
	if code != 1 {
		t.Fatalf("exit %d, want 1:\n%s\n%s", code, out, errOut)
	}
	assertShown(t, "adapters check --control", out+errOut, "shop-items: failed", "holds a control character")
}

// Issue 8, item 7: the daemon's JSON log lines escape what encoding/json
// leaves raw (DEL, C1, bidi controls) and stay valid JSON that reads back
// the same text.
func TestLogLinesAreEscaped(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(jsonLines{&buf}, nil))
	log.Info("readback check failed", "error", "BODY"+evil)
	line := strings.TrimSuffix(buf.String(), "\n")
	if strings.ContainsFunc(line, func(r rune) bool { return r == 0x7f || r >= 0x80 && r <= 0x9f || r == 0x202e }) {
		t.Fatalf("raw control character in the log line: %q", line)
	}
	var rec struct{ Error string }
	if err := json.Unmarshal([]byte(line), &rec); err != nil || rec.Error != "BODY"+evil {
		t.Fatalf("the log line does not read back: %v %q", err, rec.Error)
	}
}
