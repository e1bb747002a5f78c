package pglock

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestCloseThenPoolGivesHandedLeaseBack: a release hands the lease to a
// waiter of a Locker shut down in the documented order, Close and then the
// pool. Close returned at once, the waiting Acquire then left the queue and
// gave the handed lease back through a pool closed meanwhile: it failed, and
// the name stayed held by the waiter's holder, with no Lease, until its TTL.
// Close now waits for the call's clean-up.
func TestCloseThenPoolGivesHandedLeaseBack(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 2*time.Minute)
	const name = "close-pool-handed"
	owner := newLocker(t, admin, &Config{Holder: "owner"})
	for i := range 5 {
		held := mustAcquire(t, owner, name, time.Minute)
		wpool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		w, err := New(wpool, &Config{Holder: "w", PollInterval: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Listen(ctx); err != nil {
			t.Fatal(err)
		}
		sig := waitSignal(w)
		res := acquireAsync(ctx, w, name, 20*time.Second)
		<-sig
		if err := held.Release(ctx); err != nil { // hands the lease to w's waiter
			t.Fatal(err)
		}
		_ = w.Close()
		wpool.Close()
		r := <-res
		info := inspect(t, admin, name)
		switch {
		case r.err == nil:
			// The waiter had its lease before Close (a busy machine): a
			// live lease Close ends but does not release (documented).
			if !errors.Is(r.lease.Err(), pgfence.ErrClosed) {
				t.Fatalf("round %d: the lease returned before Close has Err %v after it; want ErrClosed", i, r.lease.Err())
			}
			if _, err := admin.Exec(ctx, "UPDATE pgfence.locks SET holder = NULL, key_hash = NULL, expires_at = NULL WHERE name = $1", name); err != nil {
				t.Fatal(err)
			}
		case !errors.Is(r.err, pgfence.ErrClosed):
			t.Fatalf("round %d: Acquire = %v; want ErrClosed", i, r.err)
		case info.Held:
			t.Fatalf("round %d: Acquire returned ErrClosed, but the lock is held by %q (token %d) until its TTL",
				i, info.Holder, info.Token)
		}
	}
}

// TestAcquireManyAllOrNothingOnEndedLease: a lease AcquireMany took first
// ended (its deadline passed) while it waited for a later name; the call
// returned every lease with a nil error, the first already free for anyone
// to take. It now releases them all and returns ErrLost.
func TestAcquireManyAllOrNothingOnEndedLease(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, time.Minute)
	other := newLocker(t, pool, &Config{Holder: "other"})
	l := newLocker(t, pool, &Config{Holder: "many"})
	sig := waitSignal(l)
	const ttl = 500 * time.Millisecond
	type result struct {
		leases []*Lease
		err    error
	}
	// A round whose handoff of the second name takes longer than the TTL
	// (a loaded machine) ends with ErrSlowGrant instead, all or nothing as
	// well, but not the case under test: it runs again, at most 3 times.
	for round := range 3 {
		a, bn := fmt.Sprintf("many-a-%d", round), fmt.Sprintf("many-b-%d", round)
		b := mustAcquire(t, other, bn, time.Minute)
		res := make(chan result, 1)
		go func() {
			leases, err := l.AcquireMany(ctx, []string{a, bn}, ttl)
			res <- result{leases, err}
		}()
		// The first name is granted before AcquireMany waits for the
		// second: its deadline is less than ttl after this signal.
		if got := <-sig; got != bn {
			t.Fatalf("waited for %q; want %s", got, bn)
		}
		time.Sleep(ttl + 50*time.Millisecond) // the first lease's deadline passes (a deadline, not a signal)
		if err := b.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-res
		for _, n := range []string{a, bn} {
			if info := inspect(t, pool, n); info.Held && info.Holder == "many" {
				t.Errorf("%s still held by the failed AcquireMany (token %d)", n, info.Token)
			}
		}
		switch {
		case r.err != nil && errors.Is(r.err, pgfence.ErrSlowGrant) && len(r.leases) == 0:
			t.Logf("round %d: %v; again", round, r.err)
			continue
		case r.err == nil || !errors.Is(r.err, pgfence.ErrLost):
			t.Fatalf("AcquireMany = %v, %v; want ErrLost", r.leases, r.err)
		}
		return
	}
	t.Fatal("every round's handoff was slower than the TTL")
}

// TestCloseThenPoolAcquireManyGivesBack: AcquireMany holds its first name and
// waits for the second when the Locker closes, then its pool. The first lease
// was given back after the counted acquire had ended, so Close did not wait
// for it and, in some rounds, the closed pool left it held until its TTL
// (found in review: 1 of 6 rounds).
func TestCloseThenPoolAcquireManyGivesBack(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 2*time.Minute)
	owner := newLocker(t, admin, &Config{Holder: "owner"})
	for i := range 10 {
		a, b := fmt.Sprintf("many-close-a-%d", i), fmt.Sprintf("many-close-b-%d", i)
		held := mustAcquire(t, owner, b, time.Minute)
		wpool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		w, err := New(wpool, &Config{Holder: "w", PollInterval: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		sig := waitSignal(w)
		res := make(chan error, 1)
		go func() {
			_, err := w.AcquireMany(ctx, []string{a, b}, time.Minute)
			res <- err
		}()
		<-sig // a is held, b waited for
		_ = w.Close()
		wpool.Close()
		if err := <-res; !errors.Is(err, pgfence.ErrClosed) {
			t.Fatalf("round %d: AcquireMany = %v; want ErrClosed", i, err)
		}
		if info := inspect(t, admin, a); info.Held {
			t.Fatalf("round %d: %s still held by %q (token %d) after AcquireMany returned ErrClosed", i, a, info.Holder, info.Token)
		}
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
