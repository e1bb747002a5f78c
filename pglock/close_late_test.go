package pglock

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// warnSignal returns a Logger of warnings and a channel closed once one of
// them contains msg.
func warnSignal(msg string) (*slog.Logger, <-chan struct{}) {
	ch := make(chan struct{})
	var once sync.Once
	return slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		if strings.Contains(string(p), msg) {
			once.Do(func() { close(ch) })
		}
		return len(p), nil
	}), &slog.HandlerOptions{Level: slog.LevelWarn})), ch
}

// poolClosesSoon fails t unless pool.Close returns within limit: nothing of
// a closed Locker keeps a connection. It returns once the pool is closed
// (unblock, if any, runs first when it is late, to let it end).
func poolClosesSoon(t *testing.T, pool *pgxpool.Pool, limit time.Duration, unblock func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { pool.Close(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(limit):
		t.Errorf("pool.Close still blocked %v after Locker.Close returned: a statement of the closed Locker keeps its connection", limit)
	}
	if unblock != nil {
		unblock()
	}
	<-done
}

// waitNoLockWait returns once no backend other than admin's waits for a row
// lock in a statement containing sql (looked up, as in waitLockWait).
func waitNoLockWait(t *testing.T, admin *pgxpool.Pool, sql string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := admin.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'
			  AND pid <> pg_backend_pid()`, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a statement with %q still waits for a lock after 30s", sql)
		}
		time.Sleep(2 * time.Millisecond) // no signal exists for another backend's lock wait
	}
}

// TestCloseEndsBackgroundQueueGrant: an Acquire on context.Background() (a
// context that never ends) whose queueing statement is out when the
// Locker closes returns ErrClosed at once, as Close documents, and Close
// ends the statement after its wait, so that the pool closes right after
// it. The statement ran on the caller's goroutine, not detached: Acquire
// returned only when the statement answered (here: never, while a row lock
// blocks it), Close waited its 5 seconds for nothing, pool.Close blocked
// on the statement, and the wait, left queued once the statement
// committed, got the lease at the holder's release, held by nobody.
func TestCloseEndsBackgroundQueueGrant(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	const name = "close-bg-queue"
	holder := newLocker(t, admin, &Config{Holder: "holder"})
	h := mustAcquire(t, holder, name, time.Minute)

	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(pool, &Config{Holder: "w"})
	if err != nil {
		t.Fatal(err)
	}
	b := blockRows(t, admin, name) // lock_wait's wait mark (an UPDATE of the row) waits
	unblocked := false
	unblock := func() {
		if !unblocked {
			unblocked = true
			b.unblock(t)
		}
	}
	defer unblock()
	res := make(chan error, 1)
	go func() {
		s, err := l.Acquire(context.Background(), name, time.Minute)
		if s != nil {
			t.Errorf("Acquire returned a lease (token %d) while the name was held", s.Token())
		}
		res <- err
	}()
	waitLockWait(t, admin, "lock_wait", 1) // its queueing statement is out
	start := time.Now()
	closed := make(chan struct{})
	go func() { _ = l.Close(); close(closed) }()
	select {
	case err := <-res:
		var pe *pgfence.Error
		if !errors.Is(err, pgfence.ErrClosed) || !errors.As(err, &pe) {
			t.Errorf("Acquire at Close: %v; want a *pgfence.Error matching ErrClosed", err)
		}
		t.Logf("Acquire returned %v after Close began: %v", time.Since(start).Round(time.Millisecond), err)
	case <-closed:
		t.Errorf("Acquire(context.Background()) with its queueing statement out did not return before Close returned (%v)",
			time.Since(start).Round(time.Millisecond))
		unblock()
		<-res
	}
	<-closed
	t.Logf("Locker.Close took %v", time.Since(start).Round(time.Millisecond))
	poolClosesSoon(t, pool, 10*time.Second, unblock)
	// Closing its connection cancelled the statement in the server (pgx
	// sends a cancel request): it is not waiting any more.
	waitNoLockWait(t, admin, "lock_wait")
	unblock()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if info := inspect(t, admin, name); info.Held {
		t.Errorf("after the holder released, %s is held by %q (token %d) for %v: handed to the closed Locker's wait",
			name, info.Holder, info.Token, info.ExpiresAt.Sub(info.DBNow).Round(time.Second))
	}
}

// TestCloseEndsAbandonedGrantBatch: a grant batch out when the Locker
// closes (its callers return ErrClosed) is ended once Close has waited for
// it, so that the pool closes right after Close. The batch's context came
// from context.Background() and was cancelled only after the longest TTL
// it asked for: pool.Close blocked until the batch answered.
func TestCloseEndsAbandonedGrantBatch(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	log, warned := warnSignal("Close ended a grant statement")
	l, err := New(pool, &Config{PollOnly: true, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	bx, calls := batchOut(t, ctx, l, admin, "close-batch-abort", time.Minute,
		func() (context.Context, context.CancelFunc) { return ctx, func() {} })
	var unblockOnce sync.Once
	unblock := func() { unblockOnce.Do(func() { bx.unblock(t) }) }
	defer unblock()
	start := time.Now()
	_ = l.Close()
	t.Logf("Locker.Close took %v", time.Since(start).Round(time.Millisecond))
	for range 2 {
		if c := <-calls; !errors.Is(c.err, pgfence.ErrClosed) {
			t.Errorf("batched TryAcquire at Close: %v, want ErrClosed", c.err)
		}
	}
	poolClosesSoon(t, pool, 10*time.Second, unblock)
	if !t.Failed() {
		waitClosed(t, warned, "the warning that Close ended the grant batch")
	}
}

// gateTracer holds the next statement containing match, once armed, before
// it is written (after pglock read its send time): entered is closed then,
// and the statement goes on when resume is closed.
type gateTracer struct {
	match   string
	armed   atomic.Bool
	entered chan struct{}
	resume  chan struct{}
}

func (g *gateTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, q pgx.TraceQueryStartData) context.Context {
	if strings.Contains(q.SQL, g.match) && g.armed.CompareAndSwap(true, false) {
		close(g.entered)
		<-g.resume
	}
	return ctx
}

func (g *gateTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestQueueGrantEndedHandedLeaseGivenBack: a waiter's queueing statement is
// delayed on its way (sent, not yet written), a release hands the lease to
// the wait meanwhile, and the statement reaches the server once less of the
// lease is left than the statement has taken. Acquire returned that lease
// with a nil error although its local deadline (send time + what was left)
// had passed, and nobody gave the grant back. It now gives it back and
// returns ErrSlowGrant, as for a fresh grant answered after its TTL.
func TestQueueGrantEndedHandedLeaseGivenBack(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	const name = "queue-grant-ended-handed"
	holder := newLocker(t, admin, &Config{Holder: "holder"})
	h := mustAcquire(t, holder, name, 10*time.Second)

	g := &gateTracer{match: "lock_wait", entered: make(chan struct{}), resume: make(chan struct{})}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = g
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	w := newLocker(t, pool, &Config{Holder: "w"})
	sig := waitSignal(w)
	const ttl = 2 * time.Second
	res := acquireAsync(ctx, w, name, ttl)
	<-sig // queued, asleep until its next queueing statement (ttl/2 at most)
	g.armed.Store(true)
	// That statement was sent, and is held on its way; the holder's release
	// hands the lease to the wait's queue row meanwhile.
	<-g.entered
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The statement reaches the server once less than half the lease is
	// left: less than the statement will have taken.
	time.Sleep(ttl/2 + 50*time.Millisecond)
	close(g.resume)
	r := <-res
	if r.err == nil {
		defer r.lease.Release(ctx)
		if !r.at.Before(r.lease.Deadline()) {
			t.Fatalf("Acquire returned a nil error with a lease (token %d) whose local deadline had passed %v before it returned",
				r.lease.Token(), r.at.Sub(r.lease.Deadline()).Round(time.Millisecond))
		}
		// Only if the statement reached the server after the handed lease
		// had expired (a machine too busy for the test): a fresh grant.
		t.Logf("Acquire returned a lease (token %d) with %v left: a fresh grant, the handed lease had expired",
			r.lease.Token(), r.lease.Deadline().Sub(r.at).Round(time.Millisecond))
		return
	}
	var pe *pgfence.Error
	if !errors.Is(r.err, pgfence.ErrSlowGrant) || !errors.As(r.err, &pe) || pe.Token == 0 {
		t.Fatalf("Acquire: %v; want a *pgfence.Error matching ErrSlowGrant, with the token", r.err)
	}
	if !strings.Contains(pe.Reason, "it was released") {
		t.Errorf("ErrSlowGrant's reason %q does not say the grant was released", pe.Reason)
	}
	t.Logf("Acquire: %v", r.err)
	if info := inspect(t, admin, name); info.Held {
		t.Errorf("after ErrSlowGrant the name is held by %q (token %d) for %v more: not given back",
			info.Holder, info.Token, info.ExpiresAt.Sub(info.DBNow).Round(time.Millisecond))
	}
}

// cancelTracer delays the next lock_grant before it is written and cancels
// the caller's context once its answer is read.
type cancelTracer struct {
	armed  atomic.Bool
	delay  time.Duration
	cancel atomic.Pointer[context.CancelFunc]
}

func (c *cancelTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, q pgx.TraceQueryStartData) context.Context {
	if strings.Contains(q.SQL, "lock_grant(") && c.armed.Load() {
		time.Sleep(c.delay) // the fault: a slow network path
		return context.WithValue(ctx, c, true)
	}
	return ctx
}

func (c *cancelTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(c) != nil && c.armed.CompareAndSwap(true, false) {
		(*c.cancel.Load())()
	}
}

// TestSlowGrantGivenBackWhenCtxEnded: a grant answered after its TTL
// (ErrSlowGrant) is given back also when the caller's context ended as the
// answer came. It was released only on the caller's context, if that was
// still live, while the error always said it was released: the name stayed
// held by nobody until its TTL.
func TestSlowGrantGivenBackWhenCtxEnded(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	const ttl = 200 * time.Millisecond
	tr := &cancelTracer{delay: ttl + 100*time.Millisecond}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := newLocker(t, pool, &Config{PollOnly: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tr.cancel.Store(&cancel)
	tr.armed.Store(true)
	s, err := l.TryAcquire(ctx, "slow-ctx-ended", ttl)
	if s != nil {
		t.Fatalf("TryAcquire returned a lease (token %d) answered after its TTL", s.Token())
	}
	var pe *pgfence.Error
	if !errors.Is(err, pgfence.ErrSlowGrant) || !errors.As(err, &pe) || pe.Token == 0 {
		t.Fatalf("TryAcquire: %v; want a *pgfence.Error matching ErrSlowGrant, with the token", err)
	}
	if ctx.Err() == nil {
		t.Fatal("the caller's context did not end as the answer came")
	}
	t.Logf("TryAcquire: %v", err)
	if info := inspect(t, admin, "slow-ctx-ended"); info.Held {
		t.Errorf("after ErrSlowGrant the name is held by %q (token %d) for %v more: not given back",
			info.Holder, info.Token, info.ExpiresAt.Sub(info.DBNow).Round(time.Millisecond))
	} else if !strings.Contains(pe.Reason, "it was released") {
		t.Errorf("ErrSlowGrant's reason %q does not say the grant was released", pe.Reason)
	}
}
