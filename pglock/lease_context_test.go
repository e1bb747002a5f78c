package pglock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// A Lease makes its context on first use. Asked for only after the lease
// ended, it is already cancelled with the lease's cause; asked for before,
// it is cancelled when the lease ends. Either way Done and Context agree.
func TestLeaseContextMadeOnFirstUse(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, time.Minute)
	l := newLocker(t, pool, &Config{Holder: "lazy"})

	late := mustAcquire(t, l, "late", time.Minute)
	if err := late.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-late.Done():
	default:
		t.Fatal("Done of a released lease, first asked after the release, is open")
	}
	if c := context.Cause(late.Context()); !errors.Is(c, pgfence.ErrReleased) {
		t.Fatalf("cause %v, want pgfence.ErrReleased", c)
	}

	early := mustAcquire(t, l, "early", time.Minute)
	lctx := early.Context()
	if lctx.Err() != nil || lctx != early.Context() {
		t.Fatal("context of a live lease is cancelled, or not the same one twice")
	}
	if err := early.Release(ctx); err != nil {
		t.Fatal(err)
	}
	<-early.Done()
	if c := context.Cause(lctx); !errors.Is(c, pgfence.ErrReleased) {
		t.Fatalf("cause %v, want pgfence.ErrReleased", c)
	}
}

// A lease that ends at its local deadline without anyone having asked for
// its context still reports the loss: Err, then Done and Context's cause.
func TestLeaseContextAfterDeadline(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{Holder: "lazy"})
	s := mustAcquire(t, l, "deadline", 50*time.Millisecond)
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case <-s.Done():
	case <-timer.C:
		t.Fatal("lease not ended 10s after a 50ms deadline")
	}
	if !errors.Is(s.Err(), pgfence.ErrLost) || !errors.Is(context.Cause(s.Context()), context.DeadlineExceeded) {
		t.Fatalf("Err %v, cause %v", s.Err(), context.Cause(s.Context()))
	}
}
