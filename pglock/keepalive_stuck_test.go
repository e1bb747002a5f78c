package pglock

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestKeepAliveStuckStatement: one keep-alive statement that does not answer
// (here it waits for a row lock; a connection black-holed after a failover
// does the same) must not stop the keep-alive of the Locker's other leases.
// Before, the keeper was one goroutine that waited for each statement, for
// up to the latest local deadline among its leases: a 2 s lease acquired
// while a 30 s lease's renewal hung was never renewed and was lost at 2 s,
// although the database answered every other connection.
func TestKeepAliveStuckStatement(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	l := newLocker(t, pgtest.PoolFor(t, dsn), &Config{PollOnly: true, KeepAlive: true, KeepAliveFraction: 0.1})

	const longTTL, shortTTL = 30 * time.Second, 2 * time.Second
	long := mustAcquire(t, l, "ka-stuck-long", longTTL) // renewed every ~3 s
	longDeadline := long.Deadline()
	b := blockRows(t, admin, "ka-stuck-long")
	waitLockWait(t, admin, "lock_renew_many", 1) // the keep-alive's statement for it is out and waits

	short := mustAcquire(t, l, "ka-stuck-short", shortTTL) // renewed every ~200 ms
	shortDeadline := short.Deadline()
	// 2.5 TTLs of the short lease: not renewed, it ends within one. Less than
	// half of the long lease's remaining time, which is what the stuck
	// statement is given before it is cut and retried.
	window := 5 * shortTTL / 2
	select {
	case <-short.Done():
		t.Fatalf("the short lease was lost while the database answered: %v (%v after its grant)",
			short.Err(), time.Since(shortDeadline.Add(-shortTTL)).Round(time.Millisecond))
	case <-time.After(window): // the time that passes is what is measured
	}
	if d := short.Deadline(); !d.After(shortDeadline.Add(window - shortTTL)) {
		t.Errorf("the short lease's deadline moved from %v to %v in %v: not renewed", shortDeadline, d, window)
	}
	if long.Err() != nil {
		t.Fatalf("the long lease ended while its renewal waited: %v", long.Err())
	}

	// The row is free again: the long lease's renewal (the stuck statement,
	// or its retry) is answered.
	b.unblock(t)
	deadline := time.Now().Add(longTTL / 2)
	for !long.Deadline().After(longDeadline) {
		if time.Now().After(deadline) || long.Err() != nil {
			t.Fatalf("the long lease was not renewed after its row was freed: %v", long.Err())
		}
		time.Sleep(10 * time.Millisecond) // no signal for a renewal: poll its deadline
	}
	if err := short.Release(ctx); err != nil {
		t.Errorf("release the short lease: %v", err)
	}
	if err := long.Release(ctx); err != nil {
		t.Errorf("release the long lease: %v", err)
	}
}
