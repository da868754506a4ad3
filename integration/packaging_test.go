package integration

import (
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/receiptledger/reconciler/internal/pgtest"
)

// TestPackaging checks the Dockerfile, compose.yaml, deploy/ and monitoring/
// against the binary they package. No container engine, cluster or systemd
// runs here: what is checked is that each file parses, that the binary the
// Dockerfile's build line makes is static and is its entrypoint, that every
// command, flag and RECONCILER_* variable the files use exists in that
// binary, that the probes' paths answer on a running daemon, that the
// compose stack's SQL and adapters file work against a real Postgres under
// the roles of docs/roles.sql, and that every metric the alert rules and the
// dashboard read is exported by the daemon.
func TestPackaging(t *testing.T) {
	bin := buildLikeDockerfile(t)
	help := newCLIHelp(bin)

	t.Run("FilesParse", func(t *testing.T) {
		yamlFiles, jsonFiles := packagingFiles(t)
		if len(yamlFiles) < 8 || len(jsonFiles) < 1 {
			t.Fatalf("found %d YAML and %d JSON files, want the packaging's", len(yamlFiles), len(jsonFiles))
		}
		for _, p := range yamlFiles {
			if docs := yamlDocs(t, p); len(docs) == 0 {
				t.Errorf("%s: no YAML document", p)
			}
		}
		for _, p := range jsonFiles {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			var v any
			if err := json.Unmarshal(b, &v); err != nil {
				t.Errorf("%s: %v", p, err)
			}
		}
	})

	t.Run("DockerfileRunsTheBinaryAsNonRoot", func(t *testing.T) { checkDockerfile(t) })
	t.Run("DockerignoreKeepsTheBuildInputs", func(t *testing.T) { checkDockerignore(t) })

	t.Run("CommandsFlagsAndVariablesExist", func(t *testing.T) {
		invs := composeInvocations(t)
		invs = append(invs, kubernetesInvocations(t)...)
		invs = append(invs, systemdInvocations(t)...)
		if len(invs) < 8 {
			t.Fatalf("found %d invocations of the binary, want those of compose, kubernetes and systemd", len(invs))
		}
		for _, inv := range invs {
			help.check(t, inv)
		}
	})

	t.Run("AdaptersFilesAreValid", func(t *testing.T) {
		files := map[string]string{"deploy/compose/adapters.yaml": filepath.Join(repoRoot, "deploy/compose/adapters.yaml")}
		for _, doc := range yamlDocs(t, filepath.Join(repoRoot, "deploy/kubernetes/adapters-configmap.yaml")) {
			content, _ := dig(doc, "data", "adapters.yaml").(string)
			if content == "" {
				t.Fatal("adapters-configmap.yaml has no data.adapters.yaml")
			}
			files["the ConfigMap's adapters.yaml"] = writeFile(t, "adapters.yaml", content)
		}
		for name, p := range files {
			cmd := exec.Command(bin, "adapters", "check", "--config", p)
			cmd.Env = append(os.Environ(), "BLOG_API_READ_TOKEN=test-token")
			if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "valid") {
				t.Errorf("adapters check %s: %v\n%s", name, err, out)
			}
		}
	})

	t.Run("ComposeStackSettlesAndAPersonResolves", func(t *testing.T) { checkComposeScenario(t, bin) })
	t.Run("ProbesAndMonitoringMatchTheDaemon", func(t *testing.T) { checkDaemonServes(t, bin) })
}

// buildLikeDockerfile runs the Dockerfile's `go build` line (its variables,
// flags and package; the output in a temporary directory) and checks the
// result is a static binary, as the distroless base needs.
func buildLikeDockerfile(t *testing.T) string {
	t.Helper()
	var env, args []string
	for _, in := range readDockerfile(t, filepath.Join(repoRoot, "Dockerfile")) {
		if in.cmd != "RUN" || !strings.Contains(in.args, "go build") {
			continue
		}
		words, err := shellWords(in.args)
		if err != nil {
			t.Fatal(err)
		}
		for len(words) > 0 && strings.Contains(words[0], "=") {
			env, words = append(env, words[0]), words[1:]
		}
		args = words
	}
	if len(args) < 3 || args[0] != "go" || args[1] != "build" {
		t.Fatalf("Dockerfile: no `RUN [VAR=value ...] go build ...` line (got %q)", args)
	}
	if !slices.Contains(env, "CGO_ENABLED=0") {
		t.Errorf("Dockerfile: the build does not set CGO_ENABLED=0 (env %q): the binary would need libc", env)
	}
	bin := filepath.Join(t.TempDir(), "reconciler")
	args = slices.Clone(args)
	o := slices.Index(args, "-o")
	if o < 0 || o+1 >= len(args) {
		t.Fatalf("Dockerfile: the build line has no -o: %q", args)
	}
	args[o+1] = bin
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the Dockerfile's build line: %v\n%s", err, out)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the image's binary has a program interpreter: it is not static")
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("the image's binary links %v (%v): it is not static", libs, err)
	}
	return bin
}

// checkDockerfile: the build stage's Go is not older than go.mod's, its
// package is the command, the final stage copies that build's output and
// runs it as ENTRYPOINT, as a numeric non-root user.
func checkDockerfile(t *testing.T) {
	ins := readDockerfile(t, filepath.Join(repoRoot, "Dockerfile"))
	stages := map[string]int{}
	var froms []string
	var out, pkg, copied, entry, user string
	for _, in := range ins {
		switch in.cmd {
		case "FROM":
			f := strings.Fields(in.args)
			froms = append(froms, f[0])
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				stages[f[2]] = in.stage
			}
		case "RUN":
			if words, err := shellWords(in.args); err == nil && slices.Contains(words, "build") {
				if o := slices.Index(words, "-o"); o >= 0 && o+1 < len(words) {
					out, pkg = words[o+1], words[len(words)-1]
				}
			}
		case "COPY":
			f := strings.Fields(in.args)
			if len(f) == 3 && strings.HasPrefix(f[0], "--from=") && f[1] == out && in.stage == len(froms)-1 {
				if _, ok := stages[strings.TrimPrefix(f[0], "--from=")]; ok {
					copied = f[2]
				}
			}
		case "ENTRYPOINT":
			var exe []string
			if err := json.Unmarshal([]byte(in.args), &exe); err != nil || len(exe) == 0 {
				t.Fatalf("ENTRYPOINT %s: want the exec form [\"/path/to/reconciler\"] (%v)", in.args, err)
			}
			entry = exe[0]
		case "USER":
			if in.stage == len(froms)-1 {
				user = in.args
			}
		}
	}
	if len(froms) < 2 {
		t.Fatalf("Dockerfile has %d stages, want a build stage and a runtime stage", len(froms))
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+)\.(\d+)`).FindStringSubmatch(readString(t, filepath.Join(repoRoot, "go.mod")))
	image := regexp.MustCompile(`^golang:(\d+)\.(\d+)`).FindStringSubmatch(froms[0])
	if goVersion == nil || image == nil {
		t.Errorf("build stage %q: want golang:<major>.<minor>… matching go.mod", froms[0])
	} else if atoi(image[1])*1000+atoi(image[2]) < atoi(goVersion[1])*1000+atoi(goVersion[2]) {
		t.Errorf("build stage %s is older than go.mod's go %s.%s", froms[0], goVersion[1], goVersion[2])
	}
	if strings.HasPrefix(froms[len(froms)-1], "golang") {
		t.Errorf("the runtime stage is %s: ship the binary alone", froms[len(froms)-1])
	}
	if pkg != "./cmd/reconciler" || !strings.Contains(readString(t, filepath.Join(repoRoot, "cmd/reconciler/main.go")), "package main") {
		t.Errorf("the build line builds %q, want ./cmd/reconciler (the command)", pkg)
	}
	if out == "" || copied == "" || entry != copied {
		t.Errorf("ENTRYPOINT %q, want the binary the build stage wrote to %q and the runtime stage copied (to %q)", entry, out, copied)
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("runtime USER %q: want a numeric non-root uid (runAsNonRoot checks it)", user)
	}
}

// checkDockerignore: nothing the build needs (go.mod, go.sum, the packages,
// the embedded migrations) is left out of the context.
func checkDockerignore(t *testing.T) {
	var patterns []string
	for _, line := range strings.Split(readString(t, filepath.Join(repoRoot, ".dockerignore")), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			patterns = append(patterns, strings.TrimPrefix(strings.TrimPrefix(line, "**/"), "/"))
		}
	}
	if !slices.Contains(patterns, ".git") {
		t.Error(".dockerignore does not leave .git out of the build context")
	}
	for _, need := range []string{"go.mod", "go.sum", "cmd/reconciler/main.go", "migrations/00001_receipts.sql",
		"ledger", "reconcile", "readback", "internal", "fingerprint", "statemachine", "review"} {
		for _, p := range patterns {
			first, _, _ := strings.Cut(need, "/")
			if ok, _ := filepath.Match(p, need); ok || p == first {
				t.Errorf(".dockerignore pattern %q leaves %s out of the build", p, need)
			}
		}
	}
}

// composeInvocations: the services that run the image, with their command
// and environment.
func composeInvocations(t *testing.T) []invocation {
	t.Helper()
	doc := yamlDocs(t, filepath.Join(repoRoot, "compose.yaml"))[0]
	services, _ := doc["services"].(map[string]any)
	var out []invocation
	for name, s := range services {
		if dig(s, "build") == nil {
			continue // not this image
		}
		if img, _ := dig(s, "image").(string); img == "" {
			t.Errorf("compose service %s builds the image but names no image", name)
		}
		inv := invocation{where: "compose.yaml: " + name, args: strs(dig(s, "command"))}
		env, _ := dig(s, "environment").(map[string]any)
		for k := range env {
			inv.env = append(inv.env, k)
		}
		out = append(out, inv)
	}
	for _, want := range []string{"migrate", "reconciler", "demo"} {
		if dig(services, want, "build") == nil {
			t.Errorf("compose.yaml has no service %s running the image", want)
		}
	}
	return out
}

// kubernetesInvocations: every container running the reconciler image,
// with its probes, volumes and secrets checked against the other manifests.
func kubernetesInvocations(t *testing.T) []invocation {
	t.Helper()
	dir := filepath.Join(repoRoot, "deploy/kubernetes")
	secrets, configMaps := map[string]map[string]any{}, map[string]map[string]any{}
	var pods []struct {
		where string
		spec  map[string]any
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	for _, e := range entries {
		for _, doc := range yamlDocs(t, filepath.Join(dir, e.Name())) {
			kind, _ := doc["kind"].(string)
			name, _ := dig(doc, "metadata", "name").(string)
			kinds[kind] = true
			var spec any
			switch kind {
			case "Secret":
				secrets[name], _ = doc["stringData"].(map[string]any)
			case "ConfigMap":
				configMaps[name], _ = doc["data"].(map[string]any)
			case "Deployment", "Job":
				spec = dig(doc, "spec", "template", "spec")
			case "CronJob":
				spec = dig(doc, "spec", "jobTemplate", "spec", "template", "spec")
			}
			if m, ok := spec.(map[string]any); ok {
				pods = append(pods, struct {
					where string
					spec  map[string]any
				}{e.Name() + ": " + kind + " " + name, m})
			}
		}
	}
	for _, k := range []string{"Deployment", "CronJob", "Job", "Secret", "ConfigMap"} {
		if !kinds[k] {
			t.Errorf("deploy/kubernetes has no %s", k)
		}
	}
	var out []invocation
	sidecars, probed := 0, map[string]bool{}
	for _, pod := range pods {
		volumes := map[string]string{} // volume -> ConfigMap
		for _, v := range maps(pod.spec["volumes"]) {
			cm, _ := dig(v, "configMap", "name").(string)
			if _, ok := configMaps[cm]; !ok {
				t.Errorf("%s: volume %v mounts ConfigMap %q, which no manifest defines", pod.where, v["name"], cm)
			}
			volumes[fmt.Sprint(v["name"])] = cm
		}
		containers := maps(pod.spec["containers"])
		for _, c := range containers {
			where := fmt.Sprintf("%s, container %v", pod.where, c["name"])
			for _, e := range maps(c["env"]) {
				if ref := dig(e, "valueFrom", "secretKeyRef"); ref != nil {
					sec, key := fmt.Sprint(dig(ref, "name")), fmt.Sprint(dig(ref, "key"))
					if _, ok := secrets[sec][key]; !ok {
						t.Errorf("%s: %v reads key %s of Secret %s, which secrets.example.yaml lacks", where, e["name"], key, sec)
					}
				}
			}
			if img, _ := c["image"].(string); !strings.Contains(img, "/reconciler:") {
				continue
			}
			if c["command"] != nil {
				t.Errorf("%s: sets command, overriding the image's ENTRYPOINT (the binary): use args", where)
			}
			inv := invocation{where: "deploy/kubernetes/" + where, args: strs(c["args"])}
			for _, e := range maps(c["env"]) {
				inv.env = append(inv.env, fmt.Sprint(e["name"]))
			}
			out = append(out, inv)
			if slices.Contains(inv.args, "--adapters") {
				checkAdaptersMount(t, where, inv.args, c, volumes, configMaps)
			}
			if len(containers) > 1 {
				sidecars++
			}
			metricsPort := flagValue(inv.args, "--metrics-addr")
			ports := map[string]string{}
			for _, p := range maps(c["ports"]) {
				ports[fmt.Sprint(p["name"])] = fmt.Sprint(p["containerPort"])
			}
			for _, probe := range []string{"livenessProbe", "readinessProbe", "startupProbe"} {
				get := dig(c, probe, "httpGet")
				if get == nil {
					continue
				}
				path, port := fmt.Sprint(dig(get, "path")), fmt.Sprint(dig(get, "port"))
				probed[path] = true
				if p, ok := ports[port]; ok {
					port = p
				}
				if metricsPort == "" || !strings.HasSuffix(metricsPort, ":"+port) {
					t.Errorf("%s: %s on port %s, but the daemon serves on --metrics-addr %q", where, probe, port, metricsPort)
				}
			}
		}
	}
	if sidecars == 0 {
		t.Error("deploy/kubernetes: no reconciler container next to another (the sidecar)")
	}
	if !probed["/healthz"] || !probed["/readyz"] {
		t.Errorf("deploy/kubernetes probes %v, want /healthz (liveness) and /readyz (readiness)", probed)
	}
	return out
}

// checkAdaptersMount: the --adapters file of a container is a key of the
// ConfigMap mounted at its directory.
func checkAdaptersMount(t *testing.T, where string, args []string, c map[string]any, volumes map[string]string, configMaps map[string]map[string]any) {
	t.Helper()
	file := flagValue(args, "--adapters")
	for _, m := range maps(c["volumeMounts"]) {
		if fmt.Sprint(m["mountPath"]) == filepath.Dir(file) {
			if _, ok := configMaps[volumes[fmt.Sprint(m["name"])]][filepath.Base(file)]; ok {
				return
			}
		}
	}
	t.Errorf("%s: --adapters %s is in no mounted ConfigMap", where, file)
}

// systemdInvocations: ExecStart of every unit, with the variables its
// Environment= lines and the example EnvironmentFile set.
func systemdInvocations(t *testing.T) []invocation {
	t.Helper()
	dir := filepath.Join(repoRoot, "deploy/systemd")
	units, err := filepath.Glob(filepath.Join(dir, "*.service"))
	if err != nil || len(units) == 0 {
		t.Fatalf("deploy/systemd: no unit (%v)", err)
	}
	exampleEnv := envFileKeys(t, filepath.Join(dir, "reconciler.env.example"))
	var out []invocation
	for _, u := range units {
		inv := invocation{where: "deploy/systemd/" + filepath.Base(u)}
		hardening := map[string]string{}
		for _, kv := range unitDirectives(t, u, "Service") {
			hardening[kv[0]] = kv[1]
			switch kv[0] {
			case "ExecStart":
				f := strings.Fields(kv[1])
				if len(f) == 0 || filepath.Base(f[0]) != "reconciler" || !filepath.IsAbs(f[0]) {
					t.Errorf("%s: ExecStart %q does not run the reconciler binary by absolute path", u, kv[1])
				} else {
					inv.args = f[1:]
				}
			case "Environment":
				k, _, _ := strings.Cut(kv[1], "=")
				inv.env = append(inv.env, k)
			case "EnvironmentFile":
				inv.env = append(inv.env, exampleEnv...)
			}
		}
		for k, want := range map[string]string{"DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
			"CapabilityBoundingSet": "", "PrivateTmp": "yes", "MemoryDenyWriteExecute": "yes"} {
			if got, ok := hardening[k]; !ok || got != want {
				t.Errorf("%s: %s=%q, want %q", u, k, got, want)
			}
		}
		out = append(out, inv)
	}
	return out
}

// checkComposeScenario runs the compose stack's one-shot steps against a
// real Postgres as the stack does, with the binary in place of the image:
// docs/roles.sql and logins.sql as the owner (login names made unique,
// since roles are server-wide), agent-example.sql as the agent login twice
// (it must be idempotent), `run --once` with the stack's adapters file as
// the worker login, then the review commands compose.yaml's comment shows,
// as the reviewer login.
func checkComposeScenario(t *testing.T, bin string) {
	ctx := context.Background()
	dbURL := pgtest.NewDatabase(t)
	owner := pgtest.Pool(t, dbURL)
	apply := func(what, sql string, p *pgxpool.Pool) {
		t.Helper()
		if _, err := p.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	apply("docs/roles.sql", readString(t, filepath.Join(repoRoot, "docs/roles.sql")), owner)
	tag := "compose_" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36) + "_"
	logins := readString(t, filepath.Join(repoRoot, "deploy/compose/logins.sql"))
	if !strings.Contains(logins, "'compose_worker'") {
		t.Fatal("logins.sql no longer creates compose_worker: update this test")
	}
	t.Cleanup(func() {
		for _, r := range []string{"worker", "agent", "reviewer"} {
			id := pgx.Identifier{tag + r}.Sanitize()
			if _, err := owner.Exec(ctx, `DROP ROLE IF EXISTS `+id); err != nil {
				t.Errorf("drop %s: %v", id, err)
			}
		}
	})
	apply("logins.sql", strings.ReplaceAll(logins, "'compose_", "'"+tag), owner)
	loginURL := func(role, password string) string {
		u, err := url.Parse(dbURL)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(tag+role, password)
		return u.String()
	}
	agent := pgtest.Pool(t, loginURL("agent", "agent"))
	for range 2 {
		apply("agent-example.sql as the agent", readString(t, filepath.Join(repoRoot, "deploy/compose/agent-example.sql")), agent)
	}
	var id int64
	var state string
	if err := owner.QueryRow(ctx, `SELECT id, state FROM reconciler.receipts`).Scan(&id, &state); err != nil || state != "outcome_unknown" {
		t.Fatalf("after agent-example.sql: receipt %d %q (%v), want one outcome_unknown receipt", id, state, err)
	}

	runAs := func(url string, args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "RECONCILER_DATABASE_URL="+url)
		out, err := cmd.Output()
		if err != nil {
			var stderr []byte
			if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
				stderr = ee.Stderr
			}
			t.Fatalf("reconciler %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
		}
		return string(out)
	}
	out := runAs(loginURL("worker", "worker"), "run", "--once", "--adapters", filepath.Join(repoRoot, "deploy/compose/adapters.yaml"))
	if !strings.Contains(out, "settled_manual_review=1") || !strings.Contains(out, "reason_blind=1") {
		t.Fatalf("run --once as the worker settled:\n%s\nwant the mail receipt in manual_review, reason blind", out)
	}
	reviewer := loginURL("reviewer", "reviewer")
	var held []map[string]any
	if err := json.Unmarshal([]byte(runAs(reviewer, "review", "list", "--json")), &held); err != nil || len(held) != 1 || held[0]["reason"] != "blind" {
		t.Fatalf("review list --json as the reviewer = %v (%v), want the one receipt, reason blind", held, err)
	}
	runAs(reviewer, "review", "resolve", strconv.FormatInt(id, 10), "--as", "rejected", "--reason", "mail bounced, see ticket 12", "--operator", "compose-operator")
	if err := owner.QueryRow(ctx, `SELECT state FROM reconciler.receipts WHERE id = $1`, id).Scan(&state); err != nil || state != "rejected" {
		t.Fatalf("after review resolve: %q (%v), want rejected", state, err)
	}
}

// checkDaemonServes starts the real daemon with adapters that make every
// labelled metric family appear (a present answer, an authoritative absence
// with no positive control, a blind dependency, and an API that answers 503
// behind a breaker opening on the first failure), then checks that the
// probes' paths answer 200 and that every metric and label value the alert
// rules and the dashboard select is in its /metrics.
func checkDaemonServes(t *testing.T, bin string) {
	dbURL := pgtest.NewDatabase(t)
	db := pgtest.Pool(t, dbURL)
	for _, dep := range []string{"present-api", "absent-api", "mailer", "flaky-api"} {
		ids := seed(t, db, 3, "things.create", dep, "outcome_unknown")
		if dep == "absent-api" {
			// An answer recorded an hour after its absence window: the
			// receipt goes to manual_review, lifetime_exceeded, and the
			// alarm's metric appears. (Written as the owner, with its time.)
			if _, err := db.Exec(context.Background(), `INSERT INTO reconciler.late_outcomes
				(receipt_id, actor, outcome, http_status, at) VALUES ($1, 'agent:test', 'outcome_unknown', 504,
				clock_timestamp() + interval '1 hour')`, ids[0]); err != nil {
				t.Fatal(err)
			}
		}
	}
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "down for maintenance", http.StatusServiceUnavailable)
	}))
	t.Cleanup(down.Close)
	adapters := writeFile(t, "adapters.yaml", fmt.Sprintf(`
version: 1
defaults:
  consistency_window: 0s
  max_request_lifetime: 0s
  max_checks: 1000
  deadline: 1h
  backoff: {base: 10ms, cap: 50ms}
adapters:
  - {name: present, type: static, kind: create, dependency: present-api, static: {verdict: present}}
  - {name: absent, type: static, kind: create, dependency: absent-api, static: {verdict: absent, authoritative: true}}
  - {name: mailer, type: blind, dependency: mailer}
  - name: flaky
    type: http
    kind: create
    dependency: flaky-api
    http: {preset: rest, base_url: %q, retry: {attempts: 0}}
dependencies:
  flaky-api:
    breaker: {failures: 1, cooldown: 1h}
`, down.URL))
	addr := freeAddr(t)
	d := startDaemon(t, bin, dbURL, "--adapters", adapters, "--metrics-addr", addr,
		"--poll-interval", "100ms", "--log-level", "warn")

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	var selectors []promSelector
	var where []string
	for _, rule := range ruleExprs(t) {
		sels, err := promSelectors(rule[1])
		if err != nil {
			t.Errorf("monitoring/alerts.yaml %s: %v", rule[0], err)
		}
		for _, s := range sels {
			selectors, where = append(selectors, s), append(where, "alerts.yaml "+rule[0])
		}
	}
	for _, expr := range dashboardExprs(t) {
		sels, err := promSelectors(expr)
		if err != nil {
			t.Errorf("monitoring/grafana-dashboard.json: %v", err)
		}
		for _, s := range sels {
			selectors, where = append(selectors, s), append(where, "grafana-dashboard.json")
		}
	}
	var lack []string
	waitFor(t, time.Minute, "every metric the monitoring reads", func() (bool, string) {
		code, body := get("/metrics")
		if code != http.StatusOK {
			return false, fmt.Sprintf("GET /metrics: %d %s; daemon stderr:\n%s", code, body, d.stderr.String())
		}
		exp, err := parseExposition(body)
		if err != nil {
			t.Fatalf("/metrics: %v", err)
		}
		lack = lack[:0]
		for i, s := range selectors {
			if m := exp.missing(s); m != "" {
				lack = append(lack, where[i]+": "+m)
			}
		}
		return len(lack) == 0, strings.Join(lack, "; ")
	})
	for _, path := range []string{"/healthz", "/readyz"} {
		if code, body := get(path); code != http.StatusOK {
			t.Errorf("GET %s (a probe of deploy/kubernetes) = %d %s", path, code, body)
		}
	}
	if err, _ := d.stop(t, 30*time.Second); err != nil {
		t.Fatalf("daemon exited with %v; stderr:\n%s", err, d.stderr.String())
	}
}

// ruleExprs returns [alert, expr] of every rule, checking each rule is
// complete and the rules cover what an operator must hear about.
func ruleExprs(t *testing.T) [][2]string {
	t.Helper()
	doc := yamlDocs(t, filepath.Join(repoRoot, "monitoring/alerts.yaml"))[0]
	var out [][2]string
	all := ""
	duration := regexp.MustCompile(`^[0-9]+(ms|s|m|h|d|w|y)$`)
	for _, g := range maps(doc["groups"]) {
		for _, r := range maps(g["rules"]) {
			name, _ := r["alert"].(string)
			expr, _ := r["expr"].(string)
			if name == "" || expr == "" {
				t.Errorf("alerts.yaml group %v: a rule without alert or expr: %v", g["name"], r)
				continue
			}
			if f, ok := r["for"].(string); ok && !duration.MatchString(f) {
				t.Errorf("alerts.yaml %s: for %q is no Prometheus duration", name, f)
			}
			if sev := dig(r, "labels", "severity"); sev != "warning" && sev != "critical" {
				t.Errorf("alerts.yaml %s: severity %v, want warning or critical", name, sev)
			}
			if s, _ := dig(r, "annotations", "summary").(string); s == "" {
				t.Errorf("alerts.yaml %s: no summary", name)
			}
			out = append(out, [2]string{name, expr})
			all += expr + "\n"
		}
	}
	// What issue 10 asks the rules to watch, by the metric that shows it.
	for what, metric := range map[string]string{
		"oldest outcome_unknown age":    "reconciler_oldest_outcome_unknown_age_seconds",
		"manual_review backlog growing": `reconciler_backlog{state="manual_review"} offset`,
		"breaker open":                  `reconciler_breaker_state{state="open"}`,
		"duplicates detected":           "reconciler_duplicates_detected_total",
		"late answer after the window":  "reconciler_lifetime_exceeded_total",
		"clock skew":                    "reconciler_clock_skew_seconds",
		"no progress":                   "reconciler_claimed_total",
	} {
		if !strings.Contains(all, metric) {
			t.Errorf("alerts.yaml: no rule on %s (%s)", what, metric)
		}
	}
	return out
}

// dashboardExprs returns every query of the dashboard's panels.
func dashboardExprs(t *testing.T) []string {
	t.Helper()
	var dash map[string]any
	if err := json.Unmarshal([]byte(readString(t, filepath.Join(repoRoot, "monitoring/grafana-dashboard.json"))), &dash); err != nil {
		t.Fatal(err)
	}
	var out []string
	ids := map[float64]bool{}
	for _, p := range maps(dash["panels"]) {
		id, _ := p["id"].(float64)
		if ids[id] {
			t.Errorf("grafana-dashboard.json: panel id %v repeats", id)
		}
		ids[id] = true
		for _, tgt := range maps(p["targets"]) {
			if e, _ := tgt["expr"].(string); e != "" {
				out = append(out, e)
			}
		}
	}
	if len(out) < 10 {
		t.Fatalf("grafana-dashboard.json: %d queries, want the dashboard's", len(out))
	}
	return out
}

// flagValue returns the value given to flag in args ("" when absent).
func flagValue(args []string, flag string) string {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func readString(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}
