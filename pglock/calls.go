package pglock

import (
	"sync"
	"time"
)

// callTracker counts the work of a Locker that may still use its pool when
// Close is called: Acquire and TryAcquire calls (which leave the wait queue
// and give back a lease granted or handed to them after Close) and the
// statements the coalescers send for them (which release a grant whose
// caller gave up). Close waits for it, so that the pool the application
// closes next is not closed under that clean-up: a lease handed to a waiter
// at Close was otherwise never given back and stayed held until its TTL.
type callTracker struct {
	mu     sync.Mutex
	n      int
	closed bool
	idle   chan struct{} // closed when n reaches 0 while Close waits
}

// enter counts a new call, unless Close has begun (false: the call must
// not start).
func (t *callTracker) enter() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.n++
	return true
}

// add counts work started on behalf of a counted call, or a release, also
// after Close began: it runs to its end.
func (t *callTracker) add() {
	t.mu.Lock()
	t.n++
	t.mu.Unlock()
}

// done ends what enter or add counted.
func (t *callTracker) done() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.n--; t.n == 0 && t.idle != nil {
		close(t.idle)
		t.idle = nil
	}
}

// refuse makes enter refuse every later call.
func (t *callTracker) refuse() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
}

// closeAndWait refuses new calls and waits until the counted work is over,
// at most limit (a statement out to an unreachable server can hang: Close
// must not hang with it). It reports whether the work was over.
func (t *callTracker) closeAndWait(limit time.Duration) bool {
	t.mu.Lock()
	t.closed = true
	if t.n == 0 {
		t.mu.Unlock()
		return true
	}
	if t.idle == nil {
		t.idle = make(chan struct{})
	}
	idle := t.idle
	t.mu.Unlock()
	timer := time.NewTimer(limit)
	defer timer.Stop()
	select {
	case <-idle:
		return true
	case <-timer.C:
		return false
	}
}

// closeWait bounds how long Close waits for the calls in flight to end: the
// longest a give-back may take (orphanReleaseTimeout), which is also more
// than a statement takes on a server that answers.
const closeWait = orphanReleaseTimeout
