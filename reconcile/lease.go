package reconcile

import (
	"context"
	"time"
)

// heldLease is a row in flight: its lease token and current expiry.
type heldLease struct {
	token   string
	expires time.Time
}

// hold records claimed rows as in flight, for the heartbeat.
func (s *session) hold(rows []Claimed) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	for _, c := range rows {
		s.leases[c.ID] = heldLease{token: c.Lease, expires: c.LeaseExpires}
	}
}

// release forgets written (or abandoned) rows.
func (s *session) release(batch []Outcome) {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	for _, o := range batch {
		if h, ok := s.leases[o.ID]; ok && h.token == o.Lease {
			delete(s.leases, o.ID)
		}
	}
}

// leaseExpiry returns the current expiry of c's lease (zero once lost).
func (s *session) leaseExpiry(c Claimed) time.Time {
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	if h, ok := s.leases[c.ID]; ok && h.token == c.Lease {
		return h.expires
	}
	return c.LeaseExpires
}

// heartbeat renews the leases of the rows in flight every Heartbeat, in one
// statement per batch of rows, until ctx ends. A row the renewal no longer
// finds leased by its token (it expired and was claimed elsewhere) is
// marked lost: no check starts on it, and its outcome will be refused by
// the lease guard.
func (s *session) heartbeat(ctx context.Context) {
	p := s.p
	cfg := p.cfg
	t := time.NewTicker(cfg.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.leaseMu.Lock()
		ids := make([]int64, 0, len(s.leases))
		tokens := make([]string, 0, len(s.leases))
		for id, h := range s.leases {
			ids = append(ids, id)
			tokens = append(tokens, h.token)
		}
		s.leaseMu.Unlock()
		for i := 0; i < len(ids); i += cfg.BatchSize {
			j := min(i+cfg.BatchSize, len(ids))
			expires := cfg.Now().Add(cfg.Lease)
			rctx, cancel := context.WithTimeout(ctx, max(cfg.Lease/2, cfg.Heartbeat))
			renewed, err := p.store.Renew(rctx, ids[i:j], tokens[i:j], expires)
			cancel()
			if err != nil {
				if ctx.Err() == nil {
					s.dbError("renew leases", err)
				}
				break
			}
			ok := make(map[int64]bool, len(renewed))
			for _, id := range renewed {
				ok[id] = true
			}
			s.leaseMu.Lock()
			for k, id := range ids[i:j] {
				h, held := s.leases[id]
				if !held || h.token != tokens[i+k] {
					continue // written meanwhile
				}
				if ok[id] {
					h.expires = expires
				} else if !h.expires.After(cfg.Now()) {
					h.expires = time.Time{}
				}
				s.leases[id] = h
			}
			s.leaseMu.Unlock()
		}
	}
}
