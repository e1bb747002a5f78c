package pglock

import (
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestLeasePastDeadlineNotKept: a grant that answers after its own TTL
// makes a lease whose local deadline has passed. Its deadline timer was
// started before the lease was registered, so when it fired first the
// lease ended, was taken out of the Locker, and was then put in for good
// (the Locker kept every such lease, and its keep-alive renewed nothing for
// it, until Close). It now ends and is forgotten. The race needs the timer's
// goroutine to run before newLease's next statement, and did not show in
// 600 rounds on the code before the fix: this test checks the invariant
// (an ended lease leaves nothing behind), not that race.
func TestLeasePastDeadlineNotKept(t *testing.T) {
	t.Parallel()
	l := newLocker(t, pgtest.Pool(t), &Config{KeepAlive: true})
	const n = 200
	for i := range n {
		s := l.newLease("past", int64(i+1), time.Millisecond, time.Now(), time.Now().Add(-time.Second))
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("lease %d with a past deadline did not end", i)
		}
		if err := s.Err(); !errors.Is(err, pgfence.ErrLost) {
			t.Fatalf("lease %d: Err() = %v; want ErrLost", i, err)
		}
	}
	// end takes a lease out after cancelling its context: wait for the last.
	deadline := time.Now().Add(10 * time.Second)
	for {
		l.mu.Lock()
		kept := len(l.leases)
		l.mu.Unlock()
		l.keeper.mu.Lock()
		due := len(l.keeper.kept)
		l.keeper.mu.Unlock()
		if kept == 0 && due == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("of %d ended leases the Locker still keeps %d, its keep-alive %d", n, kept, due)
		}
		time.Sleep(time.Millisecond)
	}
}
