package advisory_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// TestSessionMutualExclusion: two goroutines, 1,000 read-then-write
// increments in total, each between Acquire and Unlock of one session lock.
// The reads and writes go through other pool connections (autocommit), as an
// efficiency lock is normally used among cooperating workers.
func TestSessionMutualExclusion(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	newCounter(t, pool)
	key := advisory.MustName("counter:session")
	const workers, rounds = 2, 500
	var inside, overlaps atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				if err := sessionIncrement(ctx, pool, key, &inside, &overlaps); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := counterValue(t, pool); got != workers*rounds {
		t.Fatalf("counter = %d, want %d: increments were lost", got, workers*rounds)
	}
	if overlaps.Load() != 0 {
		t.Fatalf("%d critical sections overlapped", overlaps.Load())
	}
	requireNoLocks(t, pool)
}

func sessionIncrement(ctx context.Context, pool *pgxpool.Pool, key advisory.Key, inside, overlaps *atomic.Int32) error {
	// The shortest ping interval, so that checks race with Unlock under -race.
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: advisory.MinPingInterval})
	if err != nil {
		return err
	}
	if inside.Add(1) != 1 {
		overlaps.Add(1)
	}
	var n int
	err = pool.QueryRow(ctx, "SELECT n FROM counter WHERE id = 1").Scan(&n)
	if err == nil {
		_, err = pool.Exec(ctx, "UPDATE counter SET n = $1 WHERE id = 1", n+1)
	}
	inside.Add(-1)
	return errors.Join(err, l.Release(ctx))
}

func TestSessionUnlockReturnsCleanConnection(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("clean")
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if l.Key() != key || l.Mode() != advisory.Exclusive || l.PID() == 0 || l.Err() != nil {
		t.Fatalf("lock state: key %v mode %v pid %d err %v", l.Key(), l.Mode(), l.PID(), l.Err())
	}
	locks := advisoryLocks(t, pool)
	if len(locks) != 1 || locks[0].Key != key || locks[0].PID != int32(l.PID()) || !locks[0].Granted ||
		locks[0].Mode != advisory.Exclusive || locks[0].BackendStart.IsZero() || locks[0].User == "" {
		t.Fatalf("List = %+v, want one granted exclusive lock on %v held by pid %d", locks, key, l.PID())
	}
	requireLocked(t, pool, key)
	// Several pings pass without firing Done.
	select {
	case <-l.Done():
		t.Fatalf("Done fired while the lock was held: %v", l.Err())
	case <-time.After(150 * time.Millisecond):
	}
	if got := pool.Stat().AcquiredConns(); got != 1 {
		t.Fatalf("AcquiredConns = %d while locked, want 1", got)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed after Unlock")
	}
	if !errors.Is(l.Err(), pgfence.ErrReleased) {
		t.Fatalf("Err after Unlock = %v", l.Err())
	}
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrReleased) {
		t.Fatalf("second Unlock = %v, want ErrReleased", err)
	}
	requireNoLocks(t, pool)
	requireFree(t, pool, key)
	// The connection went back to the pool (not destroyed) and holds nothing.
	s := pool.Stat()
	if s.AcquiredConns() != 0 || s.TotalConns() == 0 {
		t.Fatalf("pool after Unlock: acquired %d total %d", s.AcquiredConns(), s.TotalConns())
	}
	var back bool
	conns := pool.AcquireAllIdle(ctx)
	for _, c := range conns {
		if c.Conn().PgConn().PID() == l.PID() {
			back = true
		}
		var n int
		if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&n); err != nil || n != 0 {
			t.Errorf("idle connection holds %d advisory locks (%v)", n, err)
		}
		c.Release()
	}
	if !back {
		t.Fatal("the lock's connection was not returned to the pool")
	}
}

// TestSessionTerminateFiresDone: pg_terminate_backend on the lock's backend
// closes Done within the ping interval, and the lock is free for others.
func TestSessionTerminateFiresDone(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("terminate")
	const interval = 200 * time.Millisecond
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: interval})
	if err != nil {
		t.Fatal(err)
	}
	var ok bool
	if err := pool.QueryRow(ctx, "SELECT pg_terminate_backend($1)", int32(l.PID())).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend: %v %v", ok, err)
	}
	start := time.Now()
	select {
	case <-l.Done():
	case <-time.After(10 * interval):
		t.Fatalf("Done not closed %v after the backend was terminated", 10*interval)
	}
	// The first ping after the termination fails: one interval, plus slack
	// for a loaded CI machine running -race.
	if el := time.Since(start); el > interval+time.Second {
		t.Errorf("Done closed %v after termination, want within the ping interval %v", el, interval)
	}
	if err := l.Err(); !errors.Is(err, pgfence.ErrLost) || pfError(err).Name != key.String() || pfError(err).Err == nil ||
		!strings.Contains(pfError(err).Reason, fmt.Sprintf("backend %d ", l.PID())) {
		t.Fatalf("Err = %v, want ErrLost for key %v on pid %d with its cause", err, key, l.PID())
	}
	// Another session can now take the lock (Acquire waits for the dying
	// backend to finish releasing it).
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	l2, err := advisory.Acquire(actx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatalf("lock not free after the holder died: %v", err)
	}
	if err := l2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Unlock of the lost lock reports the loss once, then ErrReleased.
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("Unlock after loss = %v, want ErrLost", err)
	}
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrReleased) {
		t.Fatalf("second Unlock after loss = %v, want ErrReleased", err)
	}
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d after loss and unlock", got)
	}
}

func TestSessionTryAndShared(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := must(advisory.Namespaced(42, "readers"))
	r1, err := advisory.TryAcquire(ctx, pool, key, advisory.Shared, nil)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := advisory.TryAcquire(ctx, pool, key, advisory.Shared, nil)
	if err != nil {
		t.Fatalf("second shared TryAcquire: %v", err)
	}
	w, err := advisory.TryAcquire(ctx, pool, key, advisory.Exclusive, nil)
	if w != nil || !isLocked(err, key, advisory.Exclusive) {
		t.Fatalf("exclusive TryAcquire under shared locks: %v %v", w, err)
	}
	if got := pool.Stat().AcquiredConns(); got != 2 {
		t.Fatalf("AcquiredConns = %d, want 2 (the refused try returned its connection)", got)
	}
	locks := advisoryLocks(t, pool)
	if len(locks) != 2 || locks[0].Mode != advisory.Shared || locks[1].Mode != advisory.Shared || locks[0].Key != key {
		t.Fatalf("List = %+v, want two shared locks on %v", locks, key)
	}
	for _, l := range []*advisory.SessionLock{r1, r2} {
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	w, err = advisory.TryAcquire(ctx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatalf("exclusive TryAcquire after the readers left: %v", err)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}

// TestSessionAcquireCancelled: a waiting Acquire gives up with ctx, holds
// nothing afterwards and does not keep the connection.
func TestSessionAcquireCancelled(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.Int64(-1)
	holder, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Runs before the pool's cleanup closes it (which waits for the holder's
	// connection) even when the test fails half way.
	t.Cleanup(func() { _ = holder.Release(context.Background()) })
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	l, err := advisory.Acquire(wctx, pool, key, advisory.Exclusive, nil)
	if l != nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting Acquire: %v %v, want DeadlineExceeded", l, err)
	}
	if got := pool.Stat().AcquiredConns(); got != 1 {
		t.Fatalf("AcquiredConns = %d, want 1 (the holder's)", got)
	}
	waitLocks(t, pool, "want only the holder's lock", func(l []advisory.LockInfo) bool {
		return len(l) == 1 && l[0].Granted && l[0].PID == int32(holder.PID())
	})
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}

// TestSessionUnlockFailureDestroysConnection: when the unlock statement
// fails, the connection is destroyed rather than returned with a lock.
func TestSessionUnlockFailureDestroysConnection(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("unlock-fails")
	// A long interval: the pinger must not notice the termination first.
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(l.PID())); err != nil {
		t.Fatal(err)
	}
	err = l.Release(ctx)
	if pe := pfError(err); pe == nil || pe.Kind != nil || pe.Err == nil || pe.Name != key.String() {
		t.Fatalf("Unlock on a terminated backend = %v, want a database failure", err)
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed after a failed unlock")
	}
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d", got)
	}
	for _, c := range pool.AcquireAllIdle(ctx) {
		if c.Conn().PgConn().PID() == l.PID() {
			t.Error("the failed connection went back to the pool")
		}
		c.Release()
	}
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrReleased) {
		t.Fatalf("Unlock after failed Unlock = %v", err)
	}
}

func TestSessionValidation(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("v")
	cases := []struct {
		name string
		pool *pgxpool.Pool
		key  advisory.Key
		mode advisory.Mode
		cfg  *advisory.SessionConfig
		want string // the argument named
	}{
		{"nil pool", nil, key, advisory.Exclusive, nil, "pool"},
		{"zero key", pool, advisory.Key{}, advisory.Exclusive, nil, "key"},
		{"bad mode", pool, key, advisory.Mode(2), nil, "mode"},
		{"negative interval", pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: -time.Second}, "SessionConfig.PingInterval"},
		{"tiny interval", pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: time.Millisecond}, "SessionConfig.PingInterval"},
		{"negative timeout", pool, key, advisory.Exclusive, &advisory.SessionConfig{PingTimeout: -1}, "SessionConfig.PingTimeout"},
		{"tiny timeout", pool, key, advisory.Exclusive, &advisory.SessionConfig{PingTimeout: time.Microsecond}, "SessionConfig.PingTimeout"},
	}
	for _, c := range cases {
		for _, acquire := range []func(context.Context, *pgxpool.Pool, advisory.Key, advisory.Mode, *advisory.SessionConfig) (*advisory.SessionLock, error){
			advisory.Acquire, advisory.TryAcquire,
		} {
			l, err := acquire(ctx, c.pool, c.key, c.mode, c.cfg)
			if l != nil || !isInvalid(err, c.want) {
				t.Errorf("%s: got %v, %v; want %v", c.name, l, err, c.want)
			}
		}
	}
	requireNoLocks(t, pool)
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d after refused calls", got)
	}
	var nilLock *advisory.SessionLock
	if err := nilLock.Release(ctx); !isInvalid(err, "lock") {
		t.Error("Unlock on a nil *SessionLock returned nil")
	}
	if _, err := advisory.List(ctx, nil); !isInvalid(err, "db") {
		t.Errorf("List(nil) = %v", err)
	}
}

// TestSessionUnlockContextDone: Release with an ended context is final, as
// defer lock.Release(ctx) in a job whose ctx was cancelled needs: the lock is
// freed, Done is closed, and the connection goes back to the pool clean.
func TestSessionUnlockContextDone(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("unlock-ctx")
	jobCtx, cancel := context.WithCancel(ctx)
	l, err := advisory.Acquire(jobCtx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// Runs before the pool's cleanup, which waits for the lock's connection:
	// without it a Release that kept the lock would hang the test instead of
	// failing it.
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	cancel() // the job ends with its ctx cancelled; its deferred Release runs
	if err := l.Release(jobCtx); err != nil {
		t.Fatalf("Release(ended ctx) = %v, want nil (released)", err)
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed after Release(ended ctx): the pinger still runs")
	}
	if !errors.Is(l.Err(), pgfence.ErrReleased) {
		t.Fatalf("Err after Release(ended ctx) = %v, want ErrReleased", l.Err())
	}
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d after Release(ended ctx), want 0", got)
	}
	requireFree(t, pool, key)
	requireNoLocks(t, pool)
	// The unlock ran (the connection was not merely closed): it is back in
	// the pool.
	back := false
	for _, c := range pool.AcquireAllIdle(ctx) {
		back = back || c.Conn().PgConn().PID() == l.PID()
		c.Release()
	}
	if !back {
		t.Error("the lock's connection was not returned to the pool")
	}
	if err := l.Release(jobCtx); !errors.Is(err, pgfence.ErrReleased) {
		t.Fatalf("second Release = %v, want ErrReleased", err)
	}
}

// TestSessionUnlockNotHeld: when pg_advisory_unlock finds the lock not held
// (here the lock's own session dropped it behind the package's back),
// Release reports ErrLost with no cause and a Reason that says so, destroys
// the connection, and Err says ErrReleased, as documented.
func TestSessionUnlockNotHeld(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	var last atomic.Pointer[pgx.Conn] // the connection handed out last
	cfg.PrepareConn = func(_ context.Context, c *pgx.Conn) (bool, error) { last.Store(c); return true, nil }
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	key := advisory.MustName("unlock-not-held")
	// No check runs: the test uses the lock's connection while it is idle.
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, &advisory.SessionConfig{PingInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	c := last.Load()
	if c == nil || c.PgConn().PID() != l.PID() {
		t.Fatal("did not capture the lock's connection")
	}
	if _, err := c.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
	err = l.Release(ctx)
	pe := pfError(err)
	if !errors.Is(err, pgfence.ErrLost) || pe.Err != nil || pe.Name != key.String() ||
		!strings.Contains(pe.Reason, "pg_advisory_unlock returned false") ||
		!strings.Contains(pe.Reason, fmt.Sprintf("backend %d ", l.PID())) {
		t.Fatalf("Release of a lock not held = %v, want ErrLost naming pg_advisory_unlock and the backend, no cause", err)
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("Done not closed")
	}
	if !errors.Is(l.Err(), pgfence.ErrReleased) {
		t.Fatalf("Err = %v, want ErrReleased", l.Err())
	}
	if got := pool.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d", got)
	}
	for _, c := range pool.AcquireAllIdle(ctx) {
		if c.Conn().PgConn().PID() == l.PID() {
			t.Error("the connection went back to the pool")
		}
		c.Release()
	}
}
