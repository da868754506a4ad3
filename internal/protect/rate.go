package protect

import (
	"time"

	"golang.org/x/time/rate"
)

// maxSlotInterval bounds the time between two booked slots, so a rate
// below one call an hour cannot push a slot past any sane horizon; the
// limiter still refuses a call that comes back early.
const maxSlotInterval = time.Hour

// bookedShare is the share of a dependency's rate that booked slots use.
// The rest is left to calls that were not deferred, chiefly the positive
// control that an absence needs before it settles: with every token booked,
// each token went to the row booked for it, the control found none, was
// deferred, and absences settled nothing (100 of 200 receipts were open
// after 2 minutes in the partial-outage test).
const bookedShare = 0.8

// book returns the slot of a call deferred for the rate until until: until,
// or one booked interval (1/(bookedShare × rate)) after the latest slot
// already booked if that is later.
func (d *dependency) book(until time.Time) time.Time {
	slot := until
	if l := d.policy.Rate.Limit; l != rate.Inf {
		interval := maxSlotInterval
		if s := float64(time.Second) / (bookedShare * float64(l)); s < float64(maxSlotInterval) {
			interval = time.Duration(s)
		}
		slot = later(slot, d.booked.Add(interval))
	}
	d.booked = later(slot, d.booked)
	return slot
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
