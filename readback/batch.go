package readback

import "context"

// Batcher is implemented by adapters whose one read can answer many
// receipts: a list of everything created in a time window, read without the
// key filter, from which each receipt is decided by its own marker or
// fingerprint and its own window (issue 22). The reconciler gathers the due
// receipts of one adapter and operation and calls CheckBatch once for them
// instead of Check for each; the rules of a read's authority (SPEC §5a) hold
// per receipt, exactly as Check applies them.
type Batcher interface {
	Adapter
	// MaxBatch is the most receipts one CheckBatch is given; 0 means the
	// adapter reads per receipt only (Check).
	MaxBatch() int
	// CheckBatch reads once for rs and answers each of them, in order
	// (one Answer per receipt). Every request of the read goes through
	// read.Call; a read that fails answers its receipts with its error (a
	// refusal of Call among them). An error means nothing was read.
	CheckBatch(ctx context.Context, read SharedRead, rs []Receipt) ([]Answer, error)
}

// SharedRead is what a Batcher is given for one read that answers many
// receipts.
type SharedRead struct {
	// ID names the read; every receipt's check record points at it.
	ID string
	// Call makes one request of the read under the dependency's protection
	// (rate limit, concurrency, breaker): it runs do when admitted and
	// returns do's error, or the protection's refusal without running do.
	// nil runs do directly.
	Call func(ctx context.Context, do func() error) error
}

// Request runs do through r.Call, or directly when Call is nil.
func (r SharedRead) Request(ctx context.Context, do func() error) error {
	if r.Call == nil {
		return do()
	}
	return r.Call(ctx, do)
}

// Answer is one receipt's answer from a shared read.
type Answer struct {
	Result Result
	// Err is the receipt's own failure (a matched item whose id cannot be
	// recorded, an intent the adapter cannot render); classified like a
	// Check error.
	Err error
	// Alone is set when the shared read could not decide the receipt: its
	// window alone still needs more pages than the read may take. The
	// receipt is then checked on its own (Check), whose read may be
	// narrowed to its key.
	Alone bool
}
