package reviewui

import (
	"context"
	"time"
)

// DefaultCountsEvery is how often the summary bar and the filters' counts
// are read again by default.
const DefaultCountsEvery = 5 * time.Second

// counts is what every page shows that costs a pass over all held
// receipts: the summary bar and the filters' choices with their counts.
// With 100,000 receipts held one such pass takes longer than a page may
// take, so it is read at most every CountsEvery, shared by every reviewer,
// and a page says when it was read. The queue's rows and the number that
// match a filter are read for each page.
type counts struct {
	Summary summary
	Facets  facets
	At      time.Time
}

// counts returns the latest counts. The first page waits for them; later
// pages get the ones read last, and a page that finds them older than
// countsEvery (or made stale by a decision) starts one read in the
// background for the pages after it.
func (s *Server) counts(ctx context.Context) (*counts, error) {
	s.mu.Lock()
	c, stale := s.last, s.last == nil || s.dirty || s.now().Sub(s.last.At) >= s.countsEvery
	start := stale && c != nil && !s.reading
	if start {
		s.reading = true
		s.wg.Add(1)
	}
	s.mu.Unlock()
	if c == nil {
		return s.readCounts(ctx)
	}
	if start {
		go func() {
			defer s.wg.Done()
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			if _, err := s.readCounts(rctx); err != nil {
				s.log.Error("ui: counts", "err", err)
			}
			s.mu.Lock()
			s.reading = false
			s.mu.Unlock()
		}()
	}
	return c, nil
}

// readCounts reads the counts and keeps them as the latest.
func (s *Server) readCounts(ctx context.Context) (*counts, error) {
	at := s.now()
	sum, err := s.summary(ctx)
	if err != nil {
		return nil, err
	}
	f, err := s.facets(ctx)
	if err != nil {
		return nil, err
	}
	c := &counts{Summary: sum, Facets: f, At: at}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.last == nil || !s.last.At.After(at) {
		s.last, s.dirty = c, false
	}
	return c, nil
}

// countsChanged marks the counts stale after a decision, so the next page
// starts reading them again.
func (s *Server) countsChanged() {
	s.mu.Lock()
	s.dirty = true
	s.mu.Unlock()
}

// Close waits for a background read of the counts to end.
func (s *Server) Close() {
	s.wg.Wait()
}
