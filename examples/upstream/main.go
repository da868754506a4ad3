// Command upstream is a small articles API that loses answers, to run the
// receipt gateway, the reconciler and the example agents against on one
// machine (docs/quickstart.md). A fault-rate share of its writes lose their
// answer: half of those after storing the article (a 504, a dropped
// connection, or an answer held until the caller gives up), half before (a
// 503). Reads never fail, so the reconciler can find out what happened.
//
//	POST /api/articles            {"title": ..., "marker": ...} -> 201 {"id", "title", "marker", "created_at"}
//	GET  /api/articles?marker=M   {"items": [...]}: the articles carrying marker M (page=2 and on: empty)
//	GET  /api/articles/{id}       one article, or 404
//
// With ARTICLES_API_KEY set, every request must carry it as a bearer token
// (the gateway's route and the adapter inject it; agents never hold it).
// On SIGINT or SIGTERM it prints how many articles it stores and how many
// markers were stored more than once, the duplicates a lost answer retried
// blindly would have made.
package main

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "address to serve on")
	faultRate := flag.Float64("fault-rate", 0.4, "share of writes whose answer is lost (0 to 1)")
	seed := flag.Uint64("seed", 1, "seed of the faults")
	flag.Parse()
	if *faultRate < 0 || *faultRate > 1 {
		fmt.Fprintln(os.Stderr, "upstream: --fault-rate must be between 0 and 1")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	api := newArticles(*seed, *faultRate, os.Getenv("ARTICLES_API_KEY"), time.Now)
	if err := serve(ctx, *listen, api, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "upstream:", err)
		os.Exit(1)
	}
}

// serve runs api on addr until ctx ends, then prints the audit to w.
func serve(ctx context.Context, addr string, api *articles, w io.Writer) error {
	srv := &http.Server{Addr: addr, Handler: api, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(w, "upstream: articles API on http://%s/api: %.0f%% of writes lose their answer (half of those after storing the article)\n",
		addr, api.fault*100)
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	api.release()
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	n, dups := api.audit()
	fmt.Fprintf(w, "upstream: %d articles stored, duplicates=%d\n", n, dups)
	return nil
}

type article struct {
	ID        string    `json:"id"`
	Title     string    `json:"title"`
	Marker    string    `json:"marker"`
	CreatedAt time.Time `json:"created_at"`
}

// articles is the API. Its faults are drawn from one seeded stream, so a
// seed replays the same sequence of fates.
type articles struct {
	key   string
	now   func() time.Time
	fault float64
	log   *slog.Logger

	mu     sync.Mutex
	rng    *rand.Rand
	stored []article
	hang   chan struct{}
	once   sync.Once
}

func newArticles(seed uint64, fault float64, key string, now func() time.Time) *articles {
	return &articles{key: key, now: now, fault: fault, rng: rand.New(rand.NewPCG(seed, seed)),
		hang: make(chan struct{}), log: slog.New(slog.NewTextHandler(os.Stderr, nil))}
}

// release ends every held answer (at shutdown).
func (a *articles) release() { a.once.Do(func() { close(a.hang) }) }

func (a *articles) audit() (n, dups int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	seen := map[string]bool{}
	for _, s := range a.stored {
		if seen[s.Marker] {
			dups++
		}
		seen[s.Marker] = true
	}
	return len(a.stored), dups
}

func (a *articles) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if a.key != "" && subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), []byte("Bearer "+a.key)) != 1 {
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "a valid bearer token is required"})
		return
	}
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/api/articles":
		a.create(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/api/articles":
		a.list(w, r)
	case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/api/articles/"):
		a.get(w, strings.TrimPrefix(r.URL.Path, "/api/articles/"))
	default:
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such route"})
	}
}

func (a *articles) create(w http.ResponseWriter, r *http.Request) {
	var in article
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&in); err != nil || in.Title == "" || in.Marker == "" {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"error": "title and marker are required"})
		return
	}
	a.mu.Lock()
	fault := a.rng.Float64() < a.fault
	stored := !fault || a.rng.IntN(2) == 0
	mode := a.rng.IntN(3)
	if stored {
		in.ID = "art_" + strconv.Itoa(1000+len(a.stored))
		in.CreatedAt = a.now().UTC()
		a.stored = append(a.stored, in)
	}
	a.mu.Unlock()
	switch {
	case !fault:
		writeJSON(w, http.StatusCreated, in)
	case !stored:
		a.log.Info("write refused before storing: 503", "marker", in.Marker)
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "overloaded"})
	case mode == 0:
		a.log.Info("stored, answer lost: 504", "marker", in.Marker, "id", in.ID)
		writeJSON(w, http.StatusGatewayTimeout, map[string]string{"error": "upstream timed out"})
	case mode == 1:
		a.log.Info("stored, answer lost: connection dropped", "marker", in.Marker, "id", in.ID)
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
	default:
		a.log.Info("stored, answer lost: held past the caller's timeout", "marker", in.Marker, "id", in.ID)
		select {
		case <-a.hang:
		case <-r.Context().Done():
		}
	}
}

func (a *articles) list(w http.ResponseWriter, r *http.Request) {
	items := []article{}
	if page := r.URL.Query().Get("page"); page == "" || page == "1" {
		marker := r.URL.Query().Get("marker")
		a.mu.Lock()
		for _, s := range a.stored {
			if marker == "" || s.Marker == marker {
				items = append(items, s)
			}
		}
		a.mu.Unlock()
	}
	writeJSON(w, http.StatusOK, map[string]any{"items": items})
}

func (a *articles) get(w http.ResponseWriter, id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range a.stored {
		if s.ID == id {
			writeJSON(w, http.StatusOK, s)
			return
		}
	}
	writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such article"})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
