package pglock

import (
	"context"
	"errors"
	"fmt"
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

// gatedPool is a pool whose new connections can be refused and whose
// backends can be terminated, to simulate a network partition of one client.
type gatedPool struct {
	*pgxpool.Pool
	app    string
	closed atomic.Bool
}

var gateSeq atomic.Int64

func newGatedPool(t testing.TB, dsn string) *gatedPool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedPool{app: fmt.Sprintf("pglock_gate_%d", gateSeq.Add(1))}
	cfg.ConnConfig.RuntimeParams["application_name"] = g.app
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		if g.closed.Load() {
			return errors.New("test: partitioned")
		}
		return nil
	}
	g.Pool, err = pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Pool.Close)
	return g
}

// partition refuses new connections and terminates the existing ones
// (through admin), except the Locker's LISTEN connection when keepListen.
func (g *gatedPool) partition(t testing.TB, admin pgfence.DBTX) {
	t.Helper()
	g.closed.Store(true)
	if _, err := admin.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = $1 AND pid <> pg_backend_pid()`, g.app); err != nil {
		t.Fatal(err)
	}
}

func (g *gatedPool) heal() { g.closed.Store(false) }

func TestKeepAliveRenews(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{KeepAlive: true})
	// 1 s: a renewal is due every third of it, and a 300 ms lease ended on
	// its local deadline once when the machine's load average was 20.
	const ttl = time.Second
	s := mustAcquire(t, l, "ka", ttl)
	first := s.Deadline()
	time.Sleep(4 * ttl)
	if err := s.Err(); err != nil {
		t.Fatalf("kept-alive lease ended: %v", err)
	}
	if !s.Deadline().After(first.Add(2 * ttl)) {
		t.Errorf("deadline did not move: %v → %v", first, s.Deadline())
	}
	info := inspect(t, pool, "ka")
	if !info.Held || info.Token != s.Token() || info.Holder != l.Holder() {
		t.Errorf("row %+v", info)
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A renewal the database refuses ends the lease at once, well before its
// local deadline.
func TestKeepAliveRefusedEndsAtOnce(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{KeepAlive: true})
	const ttl = 900 * time.Millisecond
	s := mustAcquire(t, l, "steal", ttl)
	// Someone takes the row over behind the lease's back (an operator, or an
	// expiry the client did not see).
	if _, err := pool.Exec(context.Background(), `UPDATE pgfence.locks
		SET token = token + 1, holder = 'thief', expires_at = now() + interval '1 minute' WHERE name = 'steal'`); err != nil {
		t.Fatal(err)
	}
	deadline := s.Deadline()
	select {
	case <-s.Done():
	case <-time.After(2 * ttl):
		t.Fatal("lease not ended after a refused renewal")
	}
	var lost *pgfence.Error
	if err := s.Err(); !errors.As(err, &lost) || lost.Kind != pgfence.ErrLost || lost.Err != nil {
		t.Fatalf("Err = %v, want a refused ErrLost", err)
	}
	if !time.Now().Before(deadline) {
		t.Errorf("ended only at the local deadline")
	}
}

// Renewals that fail on the connection are retried until the local deadline,
// then the lease ends with pgfence.ErrLost wrapping context.DeadlineExceeded.
// The local deadline is never later than the database's expiry.
func TestKeepAliveTransientErrorsUntilDeadline(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	g := newGatedPool(t, dsn)
	l := newLocker(t, g.Pool, &Config{KeepAlive: true})
	const ttl = 600 * time.Millisecond
	s := mustAcquire(t, l, "part", ttl)
	time.Sleep(ttl / 2) // at least one renewal
	g.partition(t, admin)
	select {
	case <-s.Done():
	case <-time.After(3 * ttl):
		t.Fatal("lease did not end at its deadline while partitioned")
	}
	err := s.Err()
	if !errors.Is(err, pgfence.ErrLost) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Err = %v", err)
	}
	// Same host, same clock: the local deadline (send time + ttl) is not
	// after the database's expiry (statement start + ttl).
	if d, e := s.Deadline().Round(0), s.ExpiresAt(); d.After(e) {
		t.Errorf("local deadline %v after database expiry %v", d, e)
	}
	g.heal()
}

func TestCloseEndsLeasesAndWaiters(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, 30*time.Second)
	a := newLocker(t, pool, nil)
	b, err := New(pool, &Config{KeepAlive: true})
	if err != nil {
		t.Fatal(err)
	}
	held := mustAcquire(t, a, "c1", time.Minute)
	mine := mustAcquire(t, b, "c2", time.Minute)
	waiting := waitSignal(b)
	res := acquireAsync(ctx, b, "c1", time.Minute)
	<-waiting
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if r := <-res; !errors.Is(r.err, pgfence.ErrClosed) {
		t.Errorf("waiting Acquire after Close = %v", r.err)
	}
	if !errors.Is(mine.Err(), pgfence.ErrClosed) || !errors.Is(context.Cause(mine.Context()), pgfence.ErrClosed) {
		t.Errorf("lease after Close: %v", mine.Err())
	}
	if _, err := b.TryAcquire(ctx, "c3", time.Minute); !errors.Is(err, pgfence.ErrClosed) {
		t.Errorf("TryAcquire after Close = %v", err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
	// Close does no SQL: the row is still held until released or expired;
	// Release still works through the pool.
	if info := inspect(t, pool, "c2"); !info.Held {
		t.Errorf("c2 not held after Close: %+v", info)
	}
	if err := mine.Release(ctx); err != nil {
		t.Errorf("Release after Close: %v", err)
	}
	_ = held.Release(ctx)
}

// Renewals run in one round trip even on a connection that never ran one
// (no prepared statement, so no prepare round trip to eat into the lease on
// a slow network): after renewals, the pool's only connection has the grant
// prepared but not the renewal.
func TestRenewalIsNotPrepared(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := newLocker(t, pool, &Config{Holder: "one-trip", PollOnly: true})
	s := mustAcquire(t, l, "one-trip", time.Minute)
	for range 3 {
		if err := s.Renew(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var grants, renewals int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE statement LIKE '%name: GrantLock%' OR statement LIKE '%name: InsertLock%'),
		count(*) FILTER (WHERE statement LIKE '%name: RenewLock%') FROM pg_prepared_statements
		WHERE statement NOT LIKE '%pg_prepared_statements%'`).Scan(&grants, &renewals); err != nil {
		t.Fatal(err)
	}
	if grants == 0 || renewals != 0 {
		t.Errorf("prepared on the connection: %d grant statements, %d renewal statements; want the grant prepared (cache) and the renewal not", grants, renewals)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// renewCounter counts the renewal statements a pool sends.
type renewCounter struct{ many, single atomic.Int64 }

func (c *renewCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "pgfence.lock_renew_many("):
		c.many.Add(1)
	case strings.Contains(d.SQL, "pgfence.lock_renew("):
		c.single.Add(1)
	}
	return ctx
}

func (c *renewCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestKeepAliveOneStatementPerTick: a Locker keeps all its leases alive with
// one statement per tick, however many: leases acquired one after another
// (so due at different moments) share statements, at most about two per
// renewal interval, and every lease stays held. A lease whose renewal is
// refused in a batch ends; the others go on.
func TestKeepAliveOneStatementPerTick(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var c renewCounter
	cfg.ConnConfig.Tracer = &c
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var logs strings.Builder
	var logMu sync.Mutex
	logger := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		logMu.Lock()
		defer logMu.Unlock()
		return logs.Write(p)
	}), &slog.HandlerOptions{Level: slog.LevelWarn}))
	l := newLocker(t, pool, &Config{KeepAlive: true, PollOnly: true, Logger: logger})
	defer func() {
		logMu.Lock()
		defer logMu.Unlock()
		if logs.Len() > 0 {
			t.Logf("warnings:\n%s", logs.String())
		}
	}()
	// TTL 6s, a renewal every 2s: slow enough for a busy machine, and the
	// window below is longer than a TTL, so a lease not renewed would end.
	const ttl, n = 6 * time.Second, 300
	leases := make([]*Lease, n)
	for i := range leases {
		leases[i] = mustAcquire(t, l, fmt.Sprintf("ka-batch-%03d", i), ttl)
	}
	start := time.Now()
	c.many.Store(0)
	window := ttl + ttl/2
	select {
	case <-leases[0].Done():
		t.Fatalf("a kept-alive lease ended: %v", leases[0].Err())
	case <-time.After(window): // the time that passes is what is measured
	}
	elapsed := time.Since(start)
	many, single := c.many.Load(), c.single.Load()
	interval := time.Duration(float64(ttl) / 3)
	limit := int64(2*elapsed/interval) + 2
	t.Logf("%d leases, %v: %d lock_renew_many statements (limit %d), %d lock_renew", n, elapsed.Round(time.Millisecond), many, limit, single)
	if many == 0 || many > limit || single != 0 {
		t.Fatalf("%d lock_renew_many and %d lock_renew statements in %v for %d leases; want 1 to %d and 0", many, single, elapsed, n, limit)
	}
	var held int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.locks WHERE name LIKE 'ka-batch-%' AND holder = $1 AND expires_at > now()`,
		l.Holder()).Scan(&held); err != nil {
		t.Fatal(err)
	}
	for i, s := range leases {
		if err := s.Err(); err != nil {
			t.Fatalf("lease %d ended: %v", i, err)
		}
	}
	if held != n {
		t.Fatalf("%d of %d leases held in the database", held, n)
	}

	// Another holder takes one lease over: the next batch ends it, and only it.
	if _, err := pool.Exec(ctx, `UPDATE pgfence.locks
		SET token = token + 1, holder = 'thief', expires_at = now() + interval '1 minute' WHERE name = 'ka-batch-007'`); err != nil {
		t.Fatal(err)
	}
	select {
	case <-leases[7].Done():
	case <-time.After(2 * ttl):
		t.Fatal("the lease taken over did not end at the next renewal")
	}
	if err := leases[7].Err(); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("Err = %v, want pgfence.ErrLost", err)
	}
	// The next tick after it still renews the others.
	before := leases[8].Deadline()
	deadline := time.Now().Add(2 * ttl)
	for !leases[8].Deadline().After(before) {
		if time.Now().After(deadline) {
			t.Fatal("no renewal after the lost lease")
		}
		time.Sleep(50 * time.Millisecond) // no signal for a renewal: poll its deadline
	}
	for i, s := range leases {
		if err := s.Err(); err != nil && i != 7 {
			t.Fatalf("lease %d ended: %v", i, err)
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// renewErrors counts the lock_renew_many statements that ended with an
// error, and the largest batch sent.
type renewErrors struct{ failed, most atomic.Int64 }

type renewArgsKey struct{}

func (c *renewErrors) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if !strings.Contains(d.SQL, "pgfence.lock_renew_many(") {
		return ctx
	}
	for _, a := range d.Args {
		if names, ok := a.([]string); ok {
			for n := int64(len(names)); ; {
				m := c.most.Load()
				if n <= m || c.most.CompareAndSwap(m, n) {
					break
				}
			}
		}
	}
	return context.WithValue(ctx, renewArgsKey{}, true)
}

func (c *renewErrors) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if ctx.Value(renewArgsKey{}) != nil && d.Err != nil {
		c.failed.Add(1)
	}
}

// TestKeepAliveStuckBatchRetriedApart: a renewal statement that gets no
// answer in time is cut and its leases are tried again at once, apart, on
// other connections, so a lease it shares with one whose row is locked is
// renewed long before its deadline. Before, the statement ran until the
// latest local deadline among its leases (1 minute here), and the 3 s lease
// ended while it waited for the other lease's row. (Earlier still it ran
// until the earliest deadline: a lease about to end cut the statement of
// every lease it shared, tick after tick. The cut now leaves that lease
// half of its time and the statement at least twice the measured round
// trip, and its retries go apart from the other leases.)
func TestKeepAliveStuckBatchRetriedApart(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var c renewErrors
	cfg.ConnConfig.Tracer = &c
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := newLocker(t, pool, &Config{KeepAlive: true, PollOnly: true})
	const shortTTL = 3 * time.Second
	long := mustAcquire(t, l, "kb-long", time.Minute)
	short := mustAcquire(t, l, "kb-short", shortTTL)
	exp0 := long.ExpiresAt()
	// The long lease's row is locked: the next renewal of both waits.
	b := blockRows(t, admin, "kb-long")
	l.keeper.mu.Lock()
	now := time.Now()
	l.keeper.kept[long].next, l.keeper.kept[short].next = now, now
	l.keeper.mu.Unlock()
	l.keeper.poke()
	waitLockWait(t, admin, "lock_renew_many", 1)
	shortDeadline := short.Deadline()
	// The statement is cut at about half the short lease's remaining time;
	// the short lease's retry is answered while the long lease's row is
	// still locked.
	for !short.Deadline().After(shortDeadline) {
		select {
		case <-short.Done():
			t.Fatalf("the short lease ended while the statement it shared waited for the other lease's row: %v", short.Err())
		case <-ctx.Done():
			t.Fatal("the short lease was not renewed")
		case <-time.After(10 * time.Millisecond): // no signal for a renewal: poll its deadline
		}
	}
	if !long.ExpiresAt().Equal(exp0) {
		t.Fatalf("the long lease was renewed (expiry %v, granted %v) while its row was locked", long.ExpiresAt(), exp0)
	}
	if c.failed.Load() == 0 {
		t.Errorf("no renewal statement failed: the short lease was renewed by the statement waiting for the other row?")
	}
	b.unblock(t)
	// The row is free: the long lease is renewed (by the cut statement's
	// retry; the cut one extends nothing, whatever the database did).
	deadline := time.Now().Add(30 * time.Second)
	for !long.ExpiresAt().After(exp0) {
		if time.Now().After(deadline) {
			t.Fatalf("long lease not renewed: expiry %v, as granted", long.ExpiresAt())
		}
		time.Sleep(10 * time.Millisecond) // no signal for a renewal
	}
	if c.most.Load() < 2 {
		t.Fatalf("largest renewal batch %d, want the two leases in one statement", c.most.Load())
	}
	if err := short.Err(); err != nil {
		t.Errorf("short lease: %v", err)
	}
	if err := long.Err(); err != nil {
		t.Errorf("long lease: %v", err)
	}
}

// A Release that fails (here its context had ended: nothing was sent) leaves
// the Lease live locally until its deadline, and the keep-alive no longer
// renews it: before, it was renewed again, and a caller that did not call
// Release once more kept the name held for as long as the process lived (a
// churn loop of the HA test waited for its own abandoned lease until its
// deadline). A second Release within the TTL still releases it.
func TestKeepAliveStopsAfterFailedRelease(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, time.Minute)
	l := newLocker(t, pool, &Config{Holder: "kept", KeepAlive: true})
	other := newLocker(t, pool, &Config{Holder: "other"})
	gone, cancel := context.WithCancel(ctx)
	cancel()

	t.Run("abandoned", func(t *testing.T) {
		const ttl = 3 * time.Second
		lease := mustAcquire(t, l, "failed-release-abandoned", ttl)
		if err := lease.Release(gone); err == nil || errors.Is(err, pgfence.ErrLost) {
			t.Fatalf("Release on an ended context = %v, want a connection-level error", err)
		}
		if err := lease.Err(); err != nil {
			t.Fatalf("the Lease ended at the failed Release: %v", err)
		}
		select {
		case <-lease.Done():
		case <-time.After(20 * ttl):
			t.Fatalf("the Lease is still live %v after a failed Release with a TTL of %v: the keep-alive renews it", 20*ttl, ttl)
		}
		if err := lease.Err(); !errors.Is(err, pgfence.ErrLost) {
			t.Errorf("the Lease ended with %v, want its deadline (pgfence.ErrLost)", err)
		}
		// The name expires in the database too: another holder gets it.
		s, err := other.Acquire(testCtx(t, 20*ttl), "failed-release-abandoned", time.Minute)
		if err != nil {
			t.Fatalf("another holder's Acquire after the abandoned lease's TTL: %v", err)
		}
		if s.Token() != lease.Token()+1 {
			t.Errorf("the next grant has token %d, want %d", s.Token(), lease.Token()+1)
		}
		_ = s.Release(ctx)
	})

	t.Run("released again", func(t *testing.T) {
		lease := mustAcquire(t, l, "failed-release-again", time.Minute)
		if err := lease.Release(gone); err == nil {
			t.Fatal("Release on an ended context succeeded")
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatalf("Release again: %v", err)
		}
		if !errors.Is(lease.Err(), pgfence.ErrReleased) {
			t.Errorf("after the second Release the Lease's Err is %v, want pgfence.ErrReleased", lease.Err())
		}
		if info := inspect(t, pool, "failed-release-again"); info.Held {
			t.Errorf("after the second Release the row is %+v, want released", info)
		}
	})
}
