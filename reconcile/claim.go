package reconcile

import (
	"container/heap"
	"context"
	"sync"
	"time"
)

func (s *session) claimLoop(once bool, wake <-chan struct{}) error {
	p := s.p
	cfg := p.cfg
	poll := time.NewTicker(cfg.PollInterval)
	defer poll.Stop()
	var lastSweep, lastMetrics time.Time
	// Nothing is compared with a stored time before the clock has read the
	// database's.
	for {
		err := p.syncClock(s.stop)
		if err == nil {
			break
		}
		if s.stop.Err() != nil {
			return nil
		}
		s.dbError("clock", err)
		if once {
			return err
		}
		s.pause(wake, poll.C, cfg.PollInterval)
	}
	// A restart under the same instance name takes back at once the rows
	// its previous process held, instead of waiting out their leases.
	if n, err := p.store.ReclaimOwn(s.stop, cfg.Now(), cfg.SweepTimeout); err != nil {
		if s.stop.Err() == nil {
			s.dbError("reclaim own leases", err)
		}
	} else if n > 0 {
		p.log.Info("took back the rows a previous process of this instance held", "rows", n)
	}
	sweep := func() error {
		orphans, err := p.store.SweepOrphans(s.stop, cfg.Now(), cfg.OrphanTimeout, cfg.BatchSize, cfg.SweepTimeout)
		for _, o := range orphans {
			p.log.Info("orphaned submitted receipt moved to outcome_unknown",
				"receipt_id", o.ID, "dependency", o.Dependency)
		}
		if p.m != nil {
			p.m.Orphans.Add(float64(len(orphans)))
		}
		s.mu.Lock()
		s.summary.Orphans += len(orphans)
		s.mu.Unlock()
		return err
	}
	if err := sweep(); err != nil && s.stop.Err() == nil {
		s.dbError("orphan sweep", err)
		if once {
			return err
		}
	}
	lastSweep = time.Now()
	// Drain works what is due at its start: rows it reschedules are due
	// later and wait for the next run, so a cron run always ends. Only the
	// "due by" cut-off is fixed: every claim's lease runs from the claim.
	cutoff := cfg.Now()
	dbFailures := 0
	for s.stop.Err() == nil {
		if !once && time.Since(lastSweep) >= cfg.PollInterval {
			if err := p.syncClock(s.stop); err != nil && s.stop.Err() == nil {
				s.dbError("clock", err)
			}
			if err := sweep(); err != nil && s.stop.Err() == nil {
				s.dbError("orphan sweep", err)
			}
			lastSweep = time.Now()
		}
		if !once && p.m != nil && time.Since(lastMetrics) >= cfg.MetricsInterval {
			p.refreshGauges(s.stop)
			lastMetrics = time.Now()
		}
		// Claim what the workers can start on soon (the idle ones, plus
		// the prefetch), within the room left for rows in flight. Claim
		// again only once half a prefetch is missing, so a slow adapter
		// does not cost a claim statement per finished check.
		room := int64(cfg.MaxInFlight) - s.inflight.Load()
		prefetch := s.prefetch()
		need := int64(cfg.Workers) + prefetch - s.unchecked.Load()
		if s.inflight.Load() > 0 && (room < int64(min(cfg.BatchSize, cfg.MaxInFlight/2)) || need < (prefetch+1)/2) {
			s.waitSpace()
			continue
		}
		limit := int(max(1, min(room, need, int64(cfg.BatchSize))))
		if pause, refused := p.refusedPause(); refused {
			// The database refuses every outcome as such (a privilege,
			// the schema): claiming more would only read the APIs for
			// outcomes that cannot be written. A drain ends; a run probes
			// with one row at a time, after a growing pause, until an
			// outcome goes through.
			if once {
				return p.WritesRefused()
			}
			if s.inflight.Load() > 0 {
				s.waitSpace()
				continue
			}
			s.sleep(pause)
			if s.stop.Err() != nil {
				break
			}
			limit = 1
		}
		now := cfg.Now()
		dueBy := now
		if once {
			dueBy = cutoff
		}
		// Every recorded due time up to now is covered by this claim.
		s.takeDue(now)
		// The claim outlives the stop signal: cancelled mid-statement it
		// could commit leases this process would never hear of, leaving
		// rows held until their lease expires.
		claimCtx, cancel := context.WithTimeout(context.WithoutCancel(s.stop), 30*time.Second)
		rows, refused, err := s.claim(claimCtx, dueBy, now, limit)
		cancel()
		if err != nil {
			if s.stop.Err() != nil {
				break
			}
			s.dbError("claim", err)
			if classifyDB(err) == dbStatementRefused {
				p.refusals.note("claim", err)
			}
			dbFailures++
			if once && dbFailures >= 3 {
				return err
			}
			s.pause(wake, poll.C, min(time.Duration(dbFailures)*time.Second, cfg.PollInterval))
			continue
		}
		dbFailures = 0
		p.refusals.clear("claim")
		if len(rows) > 0 {
			s.hold(rows)
			s.inflight.Add(int64(len(rows)))
			s.unchecked.Add(int64(len(rows)))
			if p.m != nil {
				p.m.Claimed.Add(float64(len(rows)))
			}
			s.mu.Lock()
			s.summary.Claimed += len(rows)
			s.mu.Unlock()
		}
		s.dispatch(rows, len(rows)+refused == limit)
		if len(rows)+refused == limit {
			// Maybe more due: the receipts whose claim was refused are
			// left out of the next claim, so it takes the rows behind.
			continue
		}
		if once {
			if s.inflight.Load() == 0 {
				// The last outcomes may have been refused while this
				// claim ran, after the check at the top of the loop.
				return p.WritesRefused()
			}
			s.waitSpace()
			continue
		}
		s.idle(wake, poll.C)
	}
	return nil
}

// dueGrain is how finely due times are told apart: the wake-ups for rows
// released to become due within one grain are one claim, and a row released
// due at once (or in the past) is claimed within a grain, so a gate that
// keeps deferring to the past cannot make the claim loop spin.
const dueGrain = 100 * time.Millisecond

// maxDueTimes bounds the due times remembered; beyond it a new time is not
// recorded and the poll interval covers it.
const maxDueTimes = 4096

// dueTimes is a min-heap of distinct due times.
type dueTimes []time.Time

func (h dueTimes) Len() int           { return len(h) }
func (h dueTimes) Less(i, j int) bool { return h[i].Before(h[j]) }
func (h dueTimes) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *dueTimes) Push(x any)        { *h = append(*h, x.(time.Time)) }
func (h *dueTimes) Pop() any {
	old := *h
	t := old[len(old)-1]
	*h = old[:len(old)-1]
	return t
}

// noteDue records that released rows become due at the times given
// (database clock), for Run's wake-ups. A time already passed counts as
// now: it is claimed within a grain.
func (s *session) noteDue(times []time.Time) {
	if !s.run || len(times) == 0 {
		return
	}
	grain := min(dueGrain, s.p.cfg.PollInterval)
	now := s.p.cfg.Now()
	s.dueMu.Lock()
	earlier := false
	for _, t := range times {
		t = later(t, now)
		r := t.Truncate(grain)
		if r.Before(t) {
			r = r.Add(grain)
		}
		if _, ok := s.dueSet[r.UnixNano()]; ok || len(s.due) >= maxDueTimes {
			continue
		}
		if s.dueSet == nil {
			s.dueSet = map[int64]struct{}{}
		}
		s.dueSet[r.UnixNano()] = struct{}{}
		heap.Push(&s.due, r)
		earlier = earlier || s.due[0].Equal(r)
	}
	s.dueMu.Unlock()
	if earlier {
		select {
		case s.rearm <- struct{}{}:
		default:
		}
	}
}

// takeDue forgets the due times up to now: the claim about to run at now
// covers their rows.
func (s *session) takeDue(now time.Time) {
	s.dueMu.Lock()
	defer s.dueMu.Unlock()
	for len(s.due) > 0 && !s.due[0].After(now) {
		delete(s.dueSet, heap.Pop(&s.due).(time.Time).UnixNano())
	}
}

// nextDue returns how long until the earliest recorded due time (at most
// zero when it has passed), and whether there is one.
func (s *session) nextDue() (time.Duration, bool) {
	s.dueMu.Lock()
	defer s.dueMu.Unlock()
	if len(s.due) == 0 {
		return 0, false
	}
	return s.due[0].Sub(s.p.cfg.Now()), true
}

// idle waits, between claims of Run, for min(poll interval, earliest due
// time − now): a NOTIFY, the poll tick, the earliest time a released row
// becomes due, or the stop. A due time recorded meanwhile that is earlier
// than the one waited for re-arms the timer.
func (s *session) idle(wake <-chan struct{}, poll <-chan time.Time) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		var due <-chan time.Time
		if d, ok := s.nextDue(); ok {
			if d <= 0 {
				return
			}
			t.Reset(d)
			due = t.C
		} else {
			t.Stop()
		}
		select {
		case <-s.stop.Done():
			return
		case <-wake:
			return
		case <-poll:
			return
		case <-due:
			return
		case <-s.rearm:
		}
	}
}

// prefetch is how many rows beyond the workers the next claim may take:
// the checks the workers finish in PrefetchFor at the measured cost of a
// row, at least one and at most BatchSize.
func (s *session) prefetch() int64 {
	cfg := s.p.cfg
	cost := s.rowCost.Load()
	if cost <= 0 {
		return 1
	}
	n := (int64(cfg.Workers)*int64(cfg.PrefetchFor) + cost - 1) / cost
	return min(max(n, 1), int64(cfg.BatchSize))
}

// measure folds the time one row kept a worker into rowCost (a moving
// average weighting the newest row 1/8).
func (s *session) measure(d time.Duration) {
	ns := max(int64(d), 1)
	for {
		old := s.rowCost.Load()
		next := ns
		if old > 0 {
			next = max(old+(ns-old)/8, 1)
		}
		if s.rowCost.CompareAndSwap(old, next) {
			return
		}
	}
}

// signalSpace tells a waiting claim loop that a worker or room in flight
// was freed.
func (s *session) signalSpace() {
	select {
	case s.space <- struct{}{}:
	default:
	}
}

// waitSpace waits until a worker finishes a row or the completer frees
// room, or the session stops.
func (s *session) waitSpace() {
	select {
	case <-s.space:
	case <-s.stop.Done():
	}
}

// claim leases up to limit rows due by dueBy, leaving out the receipts
// whose claim the database refused, and returns how many it refused this
// time besides. If it refuses this claim for one row's sake (a row-level
// SQLSTATE: a trigger's RAISE, a constraint), retrying it would fail alike
// forever, and since the claim takes rows in due order, the refused
// receipt would stop every row behind it: the candidates are claimed apart
// instead, the batch split in halves down to the receipts refused on their
// own, which are reported (claimRefused) and left out of claims for a
// while. A transient failure, a refusal of the statement itself, or a
// refusal once MaxUnclaimable receipts are left out (the database refuses
// claims wholesale: one statement per row would walk every due row) is
// returned as before.
func (s *session) claim(ctx context.Context, dueBy, now time.Time, limit int) ([]Claimed, int, error) {
	p := s.p
	args := claimArgs{dueBy: dueBy, now: now, limit: limit, lease: p.cfg.Lease, skip: p.unclaimable.skip(now)}
	rows, err := p.store.claim(ctx, args)
	if err == nil || classifyDB(err) != dbRowRefused || p.unclaimable.full() {
		p.unclaimable.forget(rows)
		return rows, 0, err
	}
	ids, derr := p.store.due(ctx, dueBy, limit, args.skip)
	if derr != nil {
		return nil, 0, derr
	}
	var a apart
	rows = s.claimApart(ctx, args, ids, &a)
	p.unclaimable.forget(rows)
	if len(rows) == 0 && a.full != nil {
		return nil, a.refused, a.full
	}
	return rows, a.refused, nil
}

// apart is what claimApart met besides the rows it claimed: the receipts
// it left out, and the refusal it could not leave out (unclaimable full).
type apart struct {
	refused int
	full    error
}

// claimApart claims the rows ids alone, splitting on a row-level refusal
// down to the receipts refused on their own (claimRefused, counted in
// a). A transient failure ends it with the rows claimed so far (the next
// claim meets it again), and so does a full unclaimable set (in a).
func (s *session) claimApart(ctx context.Context, args claimArgs, ids []int64, a *apart) []Claimed {
	if len(ids) == 0 {
		return nil
	}
	args.only, args.limit = ids, len(ids)
	rows, err := s.p.store.claim(ctx, args)
	switch {
	case err == nil:
		return rows
	case classifyDB(err) != dbRowRefused:
		s.dbError("claim", err)
		return nil
	case len(ids) == 1:
		if s.p.unclaimable.full() {
			a.full = err
			return nil
		}
		s.claimRefused(ids[0], err, args.now)
		a.refused++
		return nil
	}
	half := len(ids) / 2
	rows = s.claimApart(ctx, args, ids[:half], a)
	if ctx.Err() != nil || a.full != nil {
		return rows
	}
	return append(rows, s.claimApart(ctx, args, ids[half:], a)...)
}

// claimRefused reports a receipt whose claim the database refused for its
// own sake: an ERROR naming it, the SQLSTATE and what to do, the count by
// statement and SQLSTATE class, and the receipt left out of claims until
// its time (unclaimable). Nothing was written: it stays as it was.
func (s *session) claimRefused(id int64, err error, now time.Time) {
	p := s.p
	until := p.unclaimable.add(id, now)
	if p.m != nil {
		p.m.WritesRefused.WithLabelValues("claim", sqlStateClass(err)).Inc()
	}
	s.mu.Lock()
	s.summary.Refused++
	s.mu.Unlock()
	p.log.Error("claim refused by the database; the receipt is left out of claims for a while",
		"receipt_id", id, "statement", "claim", "sqlstate", sqlState(err), "error", refusal(err),
		"hint", refusalHint(err), "retry_at", until)
}

// unclaimable are receipts whose claim the database refused for their own
// sake. Each is left out of claims for WriteRefusedRetry, doubling with
// each refusal in a row up to MaxUnclaimablePause, and forgotten once a
// claim takes it. Safe for concurrent use.
type unclaimable struct {
	mu sync.Mutex
	by map[int64]unclaimableRow
}

type unclaimableRow struct {
	until   time.Time
	strikes int
}

// MaxUnclaimable bounds the receipts left out of claims at once. A
// database that refuses more receipts' claims than that refuses claims
// wholesale, whatever its SQLSTATE says: each further refusal is the
// claim's, which backs off as any failed claim does, rather than one
// statement, one ERROR and one id more per due row.
const MaxUnclaimable = 1024

// full reports whether MaxUnclaimable receipts are left out already.
func (u *unclaimable) full() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.by) >= MaxUnclaimable
}

// MaxUnclaimablePause bounds how long a receipt whose claim the database
// refused is left out of claims before it is tried again.
const MaxUnclaimablePause = time.Hour

// add records a refusal of id's claim at now and returns when it is tried
// again.
func (u *unclaimable) add(id int64, now time.Time) time.Time {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.by == nil {
		u.by = map[int64]unclaimableRow{}
	}
	r := u.by[id]
	wait := WriteRefusedRetry
	for i := 0; i < r.strikes && wait < MaxUnclaimablePause; i++ {
		wait *= 2
	}
	r.strikes++
	r.until = now.Add(min(wait, MaxUnclaimablePause))
	u.by[id] = r
	return r.until
}

// skip returns the receipts to leave out of a claim at now (nil: none).
func (u *unclaimable) skip(now time.Time) []int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	var ids []int64
	for id, r := range u.by {
		switch {
		case now.Before(r.until):
			ids = append(ids, id)
		case now.Sub(r.until) > MaxUnclaimablePause:
			// Settled by someone else, or quiet long enough: its next
			// refusal starts the doubling over.
			delete(u.by, id)
		}
	}
	return ids
}

// forget drops the receipts a claim took: their refusal is over.
func (u *unclaimable) forget(rows []Claimed) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, c := range rows {
		delete(u.by, c.ID)
	}
}

// sleep waits d or the stop: nothing else shortens it.
func (s *session) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.stop.Done():
	}
}

// pause waits d, a wake-up, or the stop.
func (s *session) pause(wake <-chan struct{}, poll <-chan time.Time, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-wake:
	case <-poll:
	case <-s.stop.Done():
	}
}

func (s *session) dbError(what string, err error) {
	s.p.log.Error("database statement failed", "statement", what, "error", err)
	if s.p.m != nil {
		s.p.m.DBErrors.Inc()
	}
	s.mu.Lock()
	s.summary.DBErrors++
	s.mu.Unlock()
}
