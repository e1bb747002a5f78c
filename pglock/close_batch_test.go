package pglock

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// batchCall is the outcome of one call of the batch batchOut sends.
type batchCall struct {
	lease *Lease
	err   error
}

// batchOut puts a lock_grant_many batch of l out, for names prefix-x and
// prefix-y, waiting in the database for the row of prefix-x, which the
// returned blocker holds: the Locker's statement slot is first held by lone
// grants that wait, the two calls queue behind them (each on the context
// callCtx returns) and go out together once those answer. The calls'
// outcomes arrive on the returned channel.
func batchOut(t *testing.T, ctx context.Context, l *Locker, admin *pgxpool.Pool, prefix string, ttl time.Duration,
	callCtx func() (context.Context, context.CancelFunc)) (*blocker, <-chan batchCall) {
	t.Helper()
	blockNames := slotNames(t, ctx, l, prefix+"-block", ttl)
	if err := mustAcquire(t, l, prefix+"-x", ttl).Release(ctx); err != nil {
		t.Fatal(err)
	}
	b := blockRows(t, admin, blockNames...)
	bx := blockRows(t, admin, prefix+"-x")
	first := make(chan *Lease, maxInFlight)
	for _, name := range blockNames {
		go func() {
			s, err := l.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Errorf("TryAcquire %s: %v", name, err)
			}
			first <- s
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)
	queued := queuedSignal(l.grants, 2)
	calls := make(chan batchCall, 2)
	for _, name := range []string{prefix + "-x", prefix + "-y"} {
		go func() {
			cctx, cancel := callCtx()
			defer cancel()
			s, err := l.TryAcquire(cctx, name, ttl)
			calls <- batchCall{s, err}
		}()
	}
	waitClosed(t, queued, "the grants to queue")
	b.unblock(t) // the lone statements answer; the batch [x, y] goes out and waits on x
	for range maxInFlight {
		if s := <-first; s != nil {
			_ = s.Release(ctx)
		}
	}
	waitLockWait(t, admin, "lock_grant_many", 1)
	return bx, calls
}

// TestCloseBatchOutReleasesGrants: a lock_grant_many batch out when the
// Locker closes (its callers return ErrClosed) runs on while Close waits
// for it, and the grants it made are released: nobody holds a Lease for
// them. The batch's context was cancelled once none of its callers waited,
// but pgx then only closes the connection: the server went on, committed
// the grants, and no release followed, so the names stayed held by the
// closed Locker until their TTL. (A batch still out when Close's wait ends
// is ended: TestCloseEndsAbandonedGrantBatch.)
func TestCloseBatchOutReleasesGrants(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	l, err := New(pgtest.PoolFor(t, dsn), &Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var orphans atomic.Int32
	orphaned := make(chan struct{})
	l.grants.orphanHook = func() {
		if orphans.Add(1) == 2 {
			close(orphaned)
		}
	}
	bx, calls := batchOut(t, ctx, l, admin, "closebatch", time.Minute,
		func() (context.Context, context.CancelFunc) { return ctx, func() {} })
	closed := make(chan error, 1)
	go func() { closed <- l.Close() }()
	for range 2 {
		c := <-calls
		if c.lease != nil {
			t.Errorf("batched TryAcquire at Close: a lease (%s)", c.lease.Name())
		}
		if !errors.Is(c.err, pgfence.ErrClosed) {
			t.Errorf("batched TryAcquire at Close: %v, want ErrClosed", c.err)
		}
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) before the batch answered: its callers took its whole wait to return", err)
	default:
	}
	bx.unblock(t) // the batch goes on, while Close waits for it
	waitClosed(t, orphaned, "the batch's grants to be given back")
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"closebatch-x", "closebatch-y"} {
		if info := inspect(t, admin, name); info.Held {
			t.Errorf("%s after Close: held by %q (token %d) though its caller got ErrClosed", name, info.Holder, info.Token)
		}
	}
}

// TestAbandonedBatchFreesGrantSlot: a lock_grant_many batch waits in the
// database (another transaction holds one of its rows) and all its callers
// give up (their contexts end). The batch goes on by itself, to give back
// what it grants, but the Locker's grant slot serves the next calls at once:
// a TryAcquire of a free name is granted. While the batch held the slot
// (bounded only by the longest TTL it asked for, up to 24 hours) every later
// TryAcquire of the Locker queued behind it and failed. Once the blocking
// transaction ends, the batch's grants are given back.
func TestAbandonedBatchFreesGrantSlot(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	l, err := New(pgtest.PoolFor(t, dsn), &Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	const ttl = time.Minute
	bx, calls := batchOut(t, ctx, l, admin, "abandoned", ttl,
		func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 2*time.Second) })
	for range 2 {
		t.Logf("batched caller gave up: %v", (<-calls).err)
	}
	orphans := make(chan struct{}, 2)
	l.grants.orphanHook = func() { orphans <- struct{}{} }
	// Nobody waits for the batch any more. A TryAcquire of a free name:
	zctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	start := time.Now()
	s, err := l.TryAcquire(zctx, "abandoned-z", ttl)
	if err != nil {
		t.Errorf("TryAcquire of a free name after the batch's callers gave up: %v after %v (the abandoned batch holds the grant slot)", err, time.Since(start).Round(time.Millisecond))
	} else {
		_ = s.Release(ctx)
	}
	bx.unblock(t)
	for range 2 {
		waitClosed(t, orphans, "the abandoned batch's grants to be given back")
	}
	for _, name := range []string{"abandoned-x", "abandoned-y"} {
		if info := inspect(t, admin, name); info.Held {
			t.Errorf("%s held by %q (token %d) after its caller gave up", name, info.Holder, info.Token)
		}
	}
}
