package pglock

import (
	"context"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestWaitKeyTakenRetakes: when another key queues under a waiter's wkey
// (its row gone meanwhile, the wkey read from a handoff payload), the
// waiter's next lock_wait is refused with PF013 and the Acquire waits under
// a new random wkey: it is queued again (before migration 00017 its calls
// changed nothing and it was queued nowhere), and the release hands it the
// lease. The taken wkey is not kept for the next wait.
func TestWaitKeyTakenRetakes(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, time.Minute)
	a := newLocker(t, pool, &Config{Holder: "a"})
	lease, err := a.TryAcquire(ctx, "wk:name", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.TryAcquire(ctx, "wk:other", time.Minute); err != nil {
		t.Fatal(err)
	}
	v := newLocker(t, pool, &Config{Holder: "victim", PollInterval: 50 * time.Millisecond})
	waits := waitSignal(v)
	got := acquireAsync(ctx, v, "wk:name", 10*time.Second)
	<-waits
	queued := func() (wkey int64, n int) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT coalesce(max(wkey), 0), count(*) FROM pgfence.lock_queue
			WHERE name = 'wk:name' AND holder = 'victim' AND granted_token IS NULL`).Scan(&wkey, &n); err != nil {
			t.Fatal(err)
		}
		return wkey, n
	}
	wkey, n := queued()
	if n != 1 {
		t.Fatalf("the victim is queued %d times, want once", n)
	}
	// Its row goes (as a row past its alive_until is deleted), and another
	// key queues under its wkey on another name.
	// One transaction: the victim's next attempt (every 50 ms) cannot queue
	// it again between the two (the squat then failed with PF013).
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM pgfence.lock_queue WHERE wkey = $1`, wkey); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT pgfence.lock_wait('wk:other', 'squatter', 60000000,
		'\x100102030405060708090a0b0c0d0e0f', $1, 1)`, wkey); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Two more sleeps: at least one lock_wait was sent after the squat.
	drainSignals(waits)
	for range 2 {
		select {
		case <-waits:
		case r := <-got:
			t.Fatalf("the victim's Acquire returned while the lock is held: %v, %v", r.lease, r.err)
		}
	}
	nw, n := queued()
	if n != 1 || nw == wkey {
		t.Fatalf("after the squat the victim is queued %d times (wkey %d, squatted %d); want once, under a new wkey", n, nw, wkey)
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		t.Fatalf("victim's Acquire: %v", r.err)
	}
	if r.lease.Token() != lease.Token()+1 {
		t.Fatalf("victim token %d, want %d", r.lease.Token(), lease.Token()+1)
	}
	v.hotMu.Lock()
	slots := append([]int64(nil), v.slots["wk:name"]...)
	v.hotMu.Unlock()
	for _, s := range slots {
		if s == wkey {
			t.Fatalf("the squatted wkey %d is kept for the next wait: %v", wkey, slots)
		}
	}
	_ = r.lease.Release(context.Background())
}
