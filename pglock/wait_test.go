package pglock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// waitSignal makes l report on the returned channel each time a waiter
// starts sleeping.
func waitSignal(l *Locker) <-chan string {
	ch := make(chan string, 64)
	l.waitHook = func(name string) {
		select {
		case ch <- name:
		default:
		}
	}
	return ch
}

// drainSignals drops the signals already sent on ch (by a wait that has
// returned), so that the next receive is a later wait's.
func drainSignals(ch <-chan string) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

type acquired struct {
	lease *Lease
	err   error
	at    time.Time
}

func acquireAsync(ctx context.Context, l *Locker, name string, ttl time.Duration) <-chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		s, err := l.Acquire(ctx, name, ttl)
		ch <- acquired{s, err, time.Now()}
	}()
	return ch
}

func listenBackends(t testing.TB, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND query ILIKE 'LISTEN%'`).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A release wakes the waiter through LISTEN/NOTIFY, long before the holder's
// TTL; one Locker uses one LISTEN connection for all its waiters.
func TestWaiterWokenByRelease(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	waiting := waitSignal(b)

	names := []string{"w1", "w2", "w3", "w4"}
	held := map[string]*Lease{}
	results := map[string]<-chan acquired{}
	for _, n := range names {
		held[n] = mustAcquire(t, a, n, time.Minute)
		results[n] = acquireAsync(ctx, b, n, time.Minute)
	}
	for range names {
		select {
		case <-waiting:
		case <-ctx.Done():
			t.Fatal("waiters never started waiting")
		}
	}
	// Wait until the listener is up, then check that it is a single one.
	for !b.lis.isUp() {
		time.Sleep(time.Millisecond)
	}
	if n := listenBackends(t, pool); n != 1 {
		t.Errorf("%d LISTEN connections for %d waiters, want 1", n, len(names))
	}
	for _, n := range names {
		start := time.Now()
		if err := held[n].Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-results[n]
		if r.err != nil {
			t.Fatalf("waiter %s: %v", n, r.err)
		}
		lat := r.at.Sub(start)
		if lat > 2*time.Second {
			t.Errorf("handoff of %s took %v; the holder's TTL was 1m, so the release did not wake it", n, lat)
		}
		if r.lease.Token() != held[n].Token()+1 {
			t.Errorf("waiter token %d, want %d", r.lease.Token(), held[n].Token()+1)
		}
		t.Logf("%s: release → grant %v", n, lat)
	}
}

// A holder that crashed (never releases) is replaced shortly after its expiry
// on the database clock.
func TestWaiterOnCrashedHolder(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a, err := New(pool, &Config{Holder: "crashing"})
	if err != nil {
		t.Fatal(err)
	}
	b := newLocker(t, pool, &Config{Holder: "b"})
	const ttl = 500 * time.Millisecond
	la := mustAcquire(t, a, "crash", ttl)
	_ = a.Close() // "crash": no release, no renewal
	if !errors.Is(la.Err(), pgfence.ErrClosed) {
		t.Errorf("lease after Close: %v", la.Err())
	}
	// The waiter sleeps on a timer until the expiry: on a busy machine
	// timers fire late, so the bound adds the worst overrun of a 10 ms
	// timer measured meanwhile (0 on an idle machine).
	overrun := make(chan time.Duration, 1)
	stop := make(chan struct{})
	go func() {
		var worst time.Duration
		for {
			t0 := time.Now()
			select {
			case <-stop:
				overrun <- worst
				return
			case <-time.After(10 * time.Millisecond):
			}
			worst = max(worst, time.Since(t0)-10*time.Millisecond)
		}
	}()
	r := <-acquireAsync(ctx, b, "crash", time.Minute)
	close(stop)
	worst := <-overrun
	if r.err != nil {
		t.Fatal(r.err)
	}
	grantDBTime := r.lease.ExpiresAt().Add(-time.Minute)
	if grantDBTime.Before(la.ExpiresAt()) {
		t.Errorf("granted at %v (db), before the crashed holder's expiry %v", grantDBTime, la.ExpiresAt())
	}
	late := grantDBTime.Sub(la.ExpiresAt())
	if late > 500*time.Millisecond+worst {
		t.Errorf("granted %v after the crashed holder's expiry; want shortly after (500ms + %v of timer overrun)", late, worst)
	}
	t.Logf("granted %v after expiry (db clock); worst timer overrun %v", late, worst)
}

// With the LISTEN connection killed, a release is still not missed: the
// listener reconnects, wakes every waiter and they re-try.
func TestListenerReconnectNoLostWakeup(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	waiting := waitSignal(b)
	held := mustAcquire(t, a, "rc", time.Minute)
	res := acquireAsync(ctx, b, "rc", time.Minute)
	<-waiting
	for !b.lis.isUp() {
		time.Sleep(time.Millisecond)
	}
	var killed int
	if err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND query ILIKE 'LISTEN%'`).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminated %d listeners: %v", killed, err)
	}
	// Release right away: the notification may well be lost with the
	// connection; the reconnect must make the waiter re-check.
	start := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if lat := r.at.Sub(start); lat > 10*time.Second {
		t.Errorf("waiter took %v after the release", lat)
	} else {
		t.Logf("release → grant across a listener reconnect: %v", lat)
	}
}

// A waiter that polls (PollOnly + PollInterval) also gets the lock.
func TestPollingWaiter(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, nil)
	b := newLocker(t, pool, &Config{PollOnly: true, PollInterval: 50 * time.Millisecond})
	held := mustAcquire(t, a, "poll", time.Minute)
	waiting := waitSignal(b)
	res := acquireAsync(ctx, b, "poll", time.Minute)
	<-waiting
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-res; r.err != nil {
		t.Fatal(r.err)
	}
	if b.lis != nil {
		t.Error("PollOnly Locker has a listener")
	}
}

// Two callers take overlapping sets in opposite order many times; both
// finish (sorted acquisition cannot deadlock) and the sets never overlap in
// time.
func TestAcquireManyOppositeOrder(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 40*time.Second)
	sets := [][]string{{"a", "b", "c"}, {"c", "b", "x"}}
	lockers := []*Locker{newLocker(t, pool, &Config{Holder: "p"}), newLocker(t, pool, &Config{Holder: "q"})}
	var (
		mu    sync.Mutex
		inUse = map[string]bool{}
		wg    sync.WaitGroup
		errs  = make(chan error, 2)
	)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 30 {
				leases, err := lockers[i].AcquireMany(ctx, sets[i], 10*time.Second)
				if err != nil {
					errs <- err
					return
				}
				for j, s := range leases {
					if s.Name() != sets[i][j] {
						errs <- errors.New("leases not in the order of names")
					}
				}
				mu.Lock()
				for _, n := range sets[i] {
					if inUse[n] {
						errs <- errors.New("overlap on " + n)
					}
					inUse[n] = true
				}
				mu.Unlock()
				time.Sleep(time.Millisecond)
				mu.Lock()
				for _, n := range sets[i] {
					inUse[n] = false
				}
				mu.Unlock()
				for _, s := range leases {
					if err := s.Release(ctx); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// All or nothing: when one name cannot be had, the ones already taken are
// released.
func TestAcquireManyAllOrNothing(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	x := newLocker(t, pool, &Config{Holder: "x"})
	y := newLocker(t, pool, &Config{Holder: "y"})
	mustAcquire(t, x, "m2", time.Minute)
	sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	leases, err := y.AcquireMany(sctx, []string{"m3", "m2", "m1"}, time.Minute)
	// Usually pgfence.ErrLocked (the context ended while waiting for m2); on a slow
	// machine the context may end during a round trip instead.
	if !errors.Is(err, context.DeadlineExceeded) || leases != nil {
		t.Fatalf("AcquireMany = %v, %v; want the context's deadline", leases, err)
	}
	if info := inspect(t, pool, "m1"); info.Held || info.Token != 1 {
		t.Errorf("m1 after failed AcquireMany: %+v; want released (token 1)", info)
	}
	if info := inspect(t, pool, "m3"); info.Held || info.Token != 0 {
		t.Errorf("m3 after failed AcquireMany: %+v; want never taken (sorted order stops at m2)", info)
	}
}

// Six Lockers (as six processes would) each take one hot lock 25 times,
// holding it briefly. Every waiter is woken by releases through its own
// LISTEN connection and, after losing races, backs off: each must still
// finish (no lost wake-up, no waiter left sleeping until the one-minute
// TTL), never two at once, and tokens strictly increase.
func TestHotLockManyWaiters(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 60*time.Second)
	const lockers, rounds = 6, 25
	var inside atomic.Int32
	var mu sync.Mutex
	var last int64
	errs := make(chan error, lockers)
	for i := range lockers {
		l := newLocker(t, pool, &Config{Holder: fmt.Sprintf("hot-%d", i)})
		go func() {
			for range rounds {
				s, err := l.Acquire(ctx, "hot", time.Minute)
				if err != nil {
					errs <- err
					return
				}
				if n := inside.Add(1); n != 1 {
					errs <- fmt.Errorf("%d holders at once", n)
					return
				}
				mu.Lock()
				if s.Token() <= last {
					mu.Unlock()
					errs <- fmt.Errorf("token %d after %d", s.Token(), last)
					return
				}
				last = s.Token()
				mu.Unlock()
				time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond) // the critical section
				inside.Add(-1)
				if err := s.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range lockers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if last < lockers*rounds {
		t.Errorf("last token %d, want at least %d grants", last, lockers*rounds)
	}
}

// The wait mark's windows: a mark under 30 s old is not written again (a
// hot lock costs one mark write per 30 s), an older one is refreshed by the
// next waiter, and a release notifies only while the mark is under 100 s
// old.
func TestWaitMarkWindows(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, &Config{Holder: "a"})
	b := newLocker(t, pool, &Config{Holder: "b"})
	waiting := waitSignal(b)
	setMark := func(age string) {
		t.Helper()
		if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET waiting_since = now() - $1::interval WHERE name = 'win'", age); err != nil {
			t.Fatal(err)
		}
	}
	markAge := func() time.Duration {
		t.Helper()
		var us int64
		if err := pool.QueryRow(ctx, "SELECT (extract(epoch FROM now() - waiting_since) * 1e6)::bigint FROM pgfence.locks WHERE name = 'win'").Scan(&us); err != nil {
			t.Fatal(err)
		}
		return time.Duration(us) * time.Microsecond
	}

	// A stale mark (over 100 s): the release sends nothing.
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{notifyChannel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	s := mustAcquire(t, a, "win", time.Minute)
	setMark("101 seconds")
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	n, err := conn.WaitForNotification(short)
	cancel()
	if err == nil {
		t.Fatalf("release under a 101 s old mark sent %q", n.Payload)
	}

	for _, c := range []struct {
		age       string
		refreshed bool
	}{{"40 seconds", true}, {"10 seconds", false}} {
		s := mustAcquire(t, a, "win", time.Minute)
		setMark(c.age)
		drainSignals(waiting) // the last round's wait may have signalled twice
		res := acquireAsync(ctx, b, "win", time.Minute)
		<-waiting
		age := markAge()
		if refreshed := age < 5*time.Second; refreshed != c.refreshed {
			t.Errorf("mark %s old before a waiter came: now %v old, want refreshed = %v", c.age, age, c.refreshed)
		}
		start := time.Now()
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-res
		if r.err != nil {
			t.Fatal(r.err)
		}
		if lat := r.at.Sub(start); lat > 5*time.Second {
			t.Errorf("mark %s old: the waiter got the lock %v after the release (TTL 1m): not notified", c.age, lat)
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// handOver queues waiter for name (LISTEN mode), releases holding once the
// waiter sleeps, and returns the lease the release handed to the waiter,
// failing unless it is the next token.
func handOver(t testing.TB, ctx context.Context, holding *Lease, waiter *Locker, name string, ttl time.Duration) *Lease {
	t.Helper()
	queued := waitSignal(waiter)
	res := acquireAsync(ctx, waiter, name, ttl)
	select {
	case <-queued:
	case r := <-res:
		t.Fatalf("the waiter did not wait: lease %v, %v", r.lease, r.err)
	}
	if err := holding.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != holding.Token()+1 {
		t.Fatalf("waiter got token %d, want %d", r.lease.Token(), holding.Token()+1)
	}
	return r.lease
}

// Listen opens the pool's LISTEN connection before any wait and returns once
// it listens: a release notified right after it is seen by a waiter at
// once. With PollOnly there is no connection; a closed Locker refuses; a
// context that ends first is reported as a *pgfence.Error matching it.
func TestLockerListen(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)

	poll := newLocker(t, pool, &Config{Holder: "poll", PollOnly: true})
	if err := poll.Listen(ctx); err != nil {
		t.Fatalf("PollOnly Listen: %v", err)
	}
	if n := listenBackends(t, pool); n != 0 {
		t.Fatalf("%d LISTEN connections after a PollOnly Listen, want 0", n)
	}

	l := newLocker(t, pool, &Config{Holder: "l"})
	if l.lis.isUp() {
		t.Fatal("the LISTEN connection is up before any wait or Listen")
	}
	if err := l.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	if !l.lis.isUp() {
		t.Fatal("Listen returned before the connection was up")
	}
	if n := listenBackends(t, pool); n != 1 {
		t.Fatalf("%d LISTEN connections after Listen, want 1", n)
	}
	if err := l.Listen(ctx); err != nil { // already listening: at once
		t.Fatal(err)
	}

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	other := newLocker(t, pgtest.PoolFor(t, pgtest.DSN(t)), &Config{Holder: "other"})
	if err := other.Listen(cancelled); !errors.Is(err, context.Canceled) || !errors.As(err, new(*pgfence.Error)) {
		t.Fatalf("Listen with a cancelled context: %v, want a *pgfence.Error matching context.Canceled", err)
	}

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Listen(ctx); !errors.Is(err, pgfence.ErrClosed) {
		t.Fatalf("Listen on a closed Locker: %v, want pgfence.ErrClosed", err)
	}
}

// Listen on a pool whose LISTEN connection cannot be made returns the
// connection attempt's error, as a *pgfence.Error, without waiting for its
// context to end: a readiness check at start-up says what is wrong.
func TestLockerListenFailedConnection(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := testCtx(t, time.Minute)

	// poolOf opens a pool on the test server's settings changed by edit.
	poolOf := func(edit func(*pgconn.Config)) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		edit(&cfg.ConnConfig.Config)
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}

	// A database that does not exist: the server answers 3D000.
	pool := poolOf(func(c *pgconn.Config) { c.Database = "pgfence_listen_no_such_db" })
	l := newLocker(t, pool, &Config{Holder: "nodb"})
	err := l.Listen(ctx)
	var dbErr *pgfence.Error
	var pgErr *pgconn.PgError
	switch {
	case !errors.As(err, &dbErr) || dbErr.Op != "pglock.Listen" || dbErr.Kind != nil:
		t.Fatalf("Listen on a missing database: %v, want a *pgfence.Error of op pglock.Listen", err)
	case errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil:
		t.Fatalf("Listen on a missing database returned only when its context ended: %v", err)
	case !errors.As(err, &pgErr) || pgErr.Code != "3D000":
		t.Fatalf("Listen on a missing database: %v, want the server's 3D000 inside", err)
	}
	if l.lis.isUp() {
		t.Fatal("the LISTEN connection is up on a missing database")
	}
	// Called again, it waits for the next attempt, which fails the same way.
	if err := l.Listen(ctx); !errors.As(err, &pgErr) || pgErr.Code != "3D000" {
		t.Fatalf("second Listen on a missing database: %v, want 3D000", err)
	}

	// Nothing listens on the port: the attempt is refused.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	pool2 := poolOf(func(c *pgconn.Config) {
		c.Host, c.Port, c.Fallbacks = "127.0.0.1", uint16(port), nil
	})
	l2 := newLocker(t, pool2, &Config{Holder: "noserver"})
	if err := l2.Listen(ctx); !errors.As(err, &dbErr) || ctx.Err() != nil || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("Listen with no server on the port: %v, want a *pgfence.Error matching ECONNREFUSED before the context ends", err)
	}
}
