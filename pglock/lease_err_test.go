package pglock

import (
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestLeaseErrPastDeadline: Err reports a lease lost once its local
// deadline has passed even if the deadline's timer has not fired (a busy
// machine can run it late), and ends the lease there: Done is closed when
// Err returns. Before, Err (and Done) said "live" until the timer ran. The
// test moves the deadline into the past while the timer waits for the
// lease's real deadline, a minute away.
func TestLeaseErrPastDeadline(t *testing.T) {
	t.Parallel()
	l := newLocker(t, pgtest.Pool(t), nil)
	s := mustAcquire(t, l, "err-past-deadline", time.Minute)
	if err := s.Err(); err != nil {
		t.Fatalf("Err of a fresh lease = %v", err)
	}
	s.mu.Lock()
	s.deadline = time.Now().Add(-time.Millisecond)
	s.mu.Unlock()
	err := s.Err()
	if !errors.Is(err, pgfence.ErrLost) || !errors.Is(err, errDeadline) {
		t.Fatalf("Err past the deadline, its timer pending = %v; want ErrLost (the deadline passed)", err)
	}
	select {
	case <-s.Done():
	default:
		t.Fatal("Done not closed when Err reported the deadline passed")
	}
	if again := s.Err(); again != err {
		t.Errorf("Err again = %v; want the same error %v", again, err)
	}
}
