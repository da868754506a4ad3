package protect

import "time"

// windowBuckets is the resolution of a sliding window: the window keeps
// this many buckets, so an event leaves it between (n-1)/n and n/n of the
// window after it happened (with a 1m window, within 55–60s).
const windowBuckets = 12

// counter names what a window counts.
type counter int

const (
	cSuccess   counter = iota // outcome Success
	cTransient                // outcome Transient
	cFirst                    // permit granted for a first call
	cRetry                    // permit granted for a retry
	nCounters
)

type counts [nCounters]int

type bucket struct {
	slot int64 // time slot (unix nanos / width) the counts belong to
	n    counts
}

// window counts events over a sliding window of time, in fixed buckets
// aligned on the clock, so it needs no timers: time passing is only looked
// at when the window is read or written. Not safe for concurrent use; the
// dependency's mutex guards it.
type window struct {
	width   time.Duration
	buckets [windowBuckets]bucket
}

func newWindow(size time.Duration) *window {
	w := &window{width: size / windowBuckets}
	for i := range w.buckets {
		w.buckets[i].slot = -1
	}
	return w
}

func (w *window) slot(t time.Time) int64 { return t.UnixNano() / int64(w.width) }

func (w *window) add(now time.Time, c counter) {
	s := w.slot(now)
	b := &w.buckets[mod(s, windowBuckets)]
	if b.slot != s {
		*b = bucket{slot: s}
	}
	b.n[c]++
}

// live reports whether a bucket still belongs to the window ending at slot cur.
func (w *window) live(b *bucket, cur int64) bool {
	return b.slot > cur-windowBuckets && b.slot <= cur
}

func (w *window) sum(now time.Time) counts {
	var total counts
	cur := w.slot(now)
	for i := range w.buckets {
		b := &w.buckets[i]
		if !w.live(b, cur) {
			continue
		}
		for c := range total {
			total[c] += b.n[c]
		}
	}
	return total
}

// firstTrue returns the earliest time, from now on, at which ok holds of the
// window's counts assuming nothing new is added: now itself, the moment one
// of the live buckets slides out, or, if ok never holds, the end of the
// window.
func (w *window) firstTrue(now time.Time, ok func(counts) bool) time.Time {
	cur := w.slot(now)
	total := w.sum(now)
	if ok(total) {
		return now
	}
	// Drop buckets oldest first; slots are distinct, so walk them in order.
	for s := cur - windowBuckets + 1; s <= cur; s++ {
		b := &w.buckets[mod(s, windowBuckets)]
		if b.slot != s {
			continue
		}
		for c := range total {
			total[c] -= b.n[c]
		}
		if ok(total) {
			return time.Unix(0, (s+windowBuckets)*int64(w.width)).In(now.Location())
		}
	}
	return time.Unix(0, (cur+windowBuckets)*int64(w.width)).In(now.Location())
}

func mod(a, n int64) int64 {
	m := a % n
	if m < 0 {
		m += n
	}
	return m
}
