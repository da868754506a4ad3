package sim

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Headers every client of the fake API sends, so that the API knows whose
// stream a call draws its fault from and whom to count it against.
const (
	headerTask   = "X-Sim-Task"   // the task number, for an agent's call
	headerCaller = "X-Sim-Caller" // "agent" or "reconciler"
	headerKey    = "Idempotency-Key"
)

// api is the fake API of one strategy's run: a knowledge base the agents
// read (two read tools) and a CMS they write to (drafts, then posts that
// publish a draft). Every call meets the fault its stream draws; a write
// whose fault is drawn with Applied stores its record before failing. Lists
// see a record only Lag after it was stored. The CMS deduplicates a write
// by its Idempotency-Key header when one is sent, as the article's
// idempotency pattern needs; nothing else deduplicates.
type api struct {
	seed    uint64
	sched   *schedule
	lag     time.Duration
	hangFor time.Duration
	stop    chan struct{}

	agentCalls, readbackCalls atomic.Int64

	mu      sync.Mutex
	nextID  int
	records []*record
	keys    map[string][]byte // idempotency key -> stored answer
}

// record is one draft or post in the CMS.
type record struct {
	ID      string    `json:"id"`
	Kind    string    `json:"-"`
	Task    int       `json:"task"`
	Marker  string    `json:"marker"`
	Answer  int       `json:"answer"`
	DraftID string    `json:"draft_id,omitempty"`
	stored  time.Time // when it was stored
	deleted bool
}

// writeBody is what the agents send to create a draft or a post.
type writeBody struct {
	Task    int    `json:"task"`
	Marker  string `json:"marker"`
	Answer  int    `json:"answer"`
	DraftID string `json:"draft_id,omitempty"`
}

func newAPI(seed uint64, p Profile, hangFor time.Duration) *api {
	return &api{seed: seed, sched: newSchedule(seed, p), lag: p.Lag, hangFor: hangFor,
		stop: make(chan struct{}), keys: map[string][]byte{}}
}

// truth returns the values the two read tools hold for a task; the right
// answer is their sum. Values have three digits, so a body cut after the
// first digit parses, leniently, as another number.
func truth(seed uint64, task int) (docs, facts int) {
	return 100 + int(hashOf(seed, "docs", task)%900), 100 + int(hashOf(seed, "facts", task)%900)
}

// snapshot is the degradation pattern's fallback for a read tool: a cached
// copy, taken before the last edit for one task in five (a stale value).
func snapshot(seed uint64, tool string, task int) int {
	docs, facts := truth(seed, task)
	v := docs
	if tool == toolFacts {
		v = facts
	}
	if hashOf(seed, "stale", task)%5 == 0 {
		v++
	}
	return v
}

func hashOf(seed uint64, what string, task int) uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%s/%d", seed, what, task)
	return h.Sum64()
}

// The API's tools, as the streams and the counts name them.
const (
	toolDocs        = "docs.read"
	toolFacts       = "facts.read"
	toolDraft       = "drafts.create"
	toolPost        = "posts.create"
	toolDraftList   = "drafts.list"
	toolPostList    = "posts.list"
	toolDraftDelete = "drafts.delete"
)

func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(headerCaller) == "reconciler" {
		a.readbackCalls.Add(1)
	} else {
		a.agentCalls.Add(1)
	}
	task := r.Header.Get(headerTask)
	switch {
	case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/kb/"):
		tool, n := toolDocs, strings.TrimPrefix(r.URL.Path, "/kb/docs/")
		if strings.HasPrefix(r.URL.Path, "/kb/facts/") {
			tool, n = toolFacts, strings.TrimPrefix(r.URL.Path, "/kb/facts/")
		}
		i, err := strconv.Atoi(n)
		if err != nil {
			http.Error(w, "no such document", http.StatusNotFound)
			return
		}
		d := a.sched.next(tool + "|" + n)
		docs, facts := truth(a.seed, i)
		v := docs
		if tool == toolFacts {
			v = facts
		}
		a.answer(w, r, d, fmt.Sprintf(`{"task":%d,"value":%d,"checksum":"%x"}`, i, v, v*31))
	case r.Method == http.MethodPost && (r.URL.Path == "/cms/drafts" || r.URL.Path == "/cms/posts"):
		a.write(w, r, task)
	case r.Method == http.MethodGet && (r.URL.Path == "/cms/drafts" || r.URL.Path == "/cms/posts"):
		marker := r.URL.Query().Get("marker")
		tool := toolDraftList
		if r.URL.Path == "/cms/posts" {
			tool = toolPostList
		}
		d := a.sched.next(tool + "|" + marker)
		page, _ := json.Marshal(map[string]any{"data": a.visible(kindOf(r.URL.Path), marker)})
		a.answer(w, r, d, string(page))
	case r.Method == http.MethodDelete && r.URL.Path == "/cms/drafts":
		d := a.sched.next(toolDraftDelete + "|" + task)
		n := 0
		if d.Applied {
			n = a.deleteDrafts(r.URL.Query().Get("marker"))
		}
		a.answer(w, r, d, fmt.Sprintf(`{"deleted":%d}`, n))
	default:
		http.Error(w, "no such endpoint", http.StatusNotFound)
	}
}

func kindOf(path string) string { return strings.TrimPrefix(path, "/cms/") }

// write creates a draft or a post, or, for a known Idempotency-Key, answers
// what the first call that stored it answered.
func (a *api) write(w http.ResponseWriter, r *http.Request, task string) {
	kind := kindOf(r.URL.Path)
	var in writeBody
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Marker == "" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	tool := toolDraft
	if kind == "posts" {
		tool = toolPost
	}
	d := a.sched.next(tool + "|" + task)
	key := r.Header.Get(headerKey)
	var body []byte
	if d.Applied {
		a.mu.Lock()
		if prev, ok := a.keys[kind+"|"+key]; ok && key != "" {
			body = prev
		} else {
			a.nextID++
			rec := &record{ID: fmt.Sprintf("%s-%d", kind[:1], a.nextID), Kind: kind, Task: in.Task,
				Marker: in.Marker, Answer: in.Answer, DraftID: in.DraftID, stored: time.Now()}
			a.records = append(a.records, rec)
			body, _ = json.Marshal(rec)
			if key != "" {
				a.keys[kind+"|"+key] = body
			}
		}
		a.mu.Unlock()
	}
	a.answer(w, r, d, string(body))
}

// answer sends body, or the fault d draws instead.
func (a *api) answer(w http.ResponseWriter, r *http.Request, d Draw, body string) {
	switch d.Fault {
	case Transient:
		http.Error(w, "upstream unavailable", http.StatusServiceUnavailable)
		return
	case Hang:
		select {
		case <-time.After(a.hangFor):
		case <-r.Context().Done():
			return
		case <-a.stop:
			return
		}
		http.Error(w, "gateway timeout", http.StatusGatewayTimeout)
		return
	case Malformed:
		// Cut right after the first digit of the first number; a write
		// that stored nothing gets the start of a record all the same (a
		// proxy's truncated 200 says nothing about the effect).
		if body == "" {
			body = `{"id":"`
		} else if i := strings.IndexAny(body, "0123456789"); i >= 0 {
			body = body[:i+1]
		}
	}
	w.Header().Set("Content-Type", "application/json")
	if r.Method == http.MethodPost && d.Fault == OK {
		w.WriteHeader(http.StatusCreated)
	}
	_, _ = w.Write([]byte(body))
}

// visible lists the live records of kind with marker that were stored at
// least the visibility lag ago.
func (a *api) visible(kind, marker string) []*record {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := []*record{}
	for _, rec := range a.records {
		if rec.Kind == kind && rec.Marker == marker && !rec.deleted && time.Since(rec.stored) >= a.lag {
			out = append(out, rec)
		}
	}
	return out
}

// deleteDrafts deletes every draft with marker, visible yet or not: the
// API's own delete is authoritative.
func (a *api) deleteDrafts(marker string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, rec := range a.records {
		if rec.Kind == "drafts" && rec.Marker == marker && !rec.deleted {
			rec.deleted = true
			n++
		}
	}
	return n
}

// close ends every hanging call.
func (a *api) close() { close(a.stop) }

// liveRecords returns, per task, the drafts and posts left in the CMS.
func (a *api) liveRecords() (drafts, posts map[int][]record) {
	a.mu.Lock()
	defer a.mu.Unlock()
	drafts, posts = map[int][]record{}, map[int][]record{}
	for _, rec := range a.records {
		switch {
		case rec.deleted:
		case rec.Kind == "drafts":
			drafts[rec.Task] = append(drafts[rec.Task], *rec)
		default:
			posts[rec.Task] = append(posts[rec.Task], *rec)
		}
	}
	return drafts, posts
}
