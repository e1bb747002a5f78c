package pglock

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// doorCounter counts the grant and release statements a pool sends, and
// the names each lock_grant_many carries.
type doorCounter struct {
	grant, grantMany, release, releaseMany atomic.Int64

	mu        sync.Mutex
	manySizes []int
}

func (c *doorCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "pgfence.lock_grant_many("):
		c.grantMany.Add(1)
		if len(d.Args) > 0 {
			if names, ok := d.Args[0].([]string); ok {
				c.mu.Lock()
				c.manySizes = append(c.manySizes, len(names))
				c.mu.Unlock()
			}
		}
	case strings.Contains(d.SQL, "pgfence.lock_grant("):
		c.grant.Add(1)
	case strings.Contains(d.SQL, "pgfence.lock_release_many("):
		c.releaseMany.Add(1)
	case strings.Contains(d.SQL, "pgfence.lock_release("):
		c.release.Add(1)
	}
	return ctx
}

func (c *doorCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *doorCounter) reset() {
	c.grant.Store(0)
	c.grantMany.Store(0)
	c.release.Store(0)
	c.releaseMany.Store(0)
	c.mu.Lock()
	c.manySizes = nil
	c.mu.Unlock()
}

func countingPool(t testing.TB, dsn string, c *doorCounter) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = c
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// blocker holds the row lock of a lock row in an open transaction, so that a
// grant or release of that name waits in the database until unblock.
type blocker struct {
	tx pgx.Tx
}

func blockRows(t testing.TB, admin *pgxpool.Pool, names ...string) *blocker {
	t.Helper()
	tx, err := admin.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRow(context.Background(), `SELECT count(*) FROM (SELECT 1 FROM pgfence.locks WHERE name = ANY($1) FOR UPDATE) r`, names).Scan(&n); err != nil || n != len(names) {
		t.Fatalf("lock rows %q: %d, %v", names, n, err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return &blocker{tx: tx}
}

func (b *blocker) unblock(t testing.TB) {
	t.Helper()
	if err := b.tx.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// waitLockWait returns once want backends other than admin's wait for a row
// lock in a statement containing sql (there is no signal for it: it is
// looked up).
func waitLockWait(t testing.TB, admin *pgxpool.Pool, sql string, want int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := admin.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'
			  AND pid <> pg_backend_pid()`, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no statement with %q waits for a lock after 30s", sql)
		}
		time.Sleep(2 * time.Millisecond) // no signal exists for another backend's lock wait
	}
}

// queuedSignal makes c report when n calls are queued.
func queuedSignal[Req, Res any](c *coalescer[Req, Res], n int) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	c.queuedHook = func(got int) {
		if got >= n {
			once.Do(func() { close(ch) })
		}
	}
	return ch
}

func waitClosed(t testing.TB, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(time.Minute):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// slotNames returns maxInFlight lock names, prefix-0 and on, each granted by
// l once and released: rows exist for blockRows to lock, so that a grant of
// each waits in the database and holds a statement slot of l.
func slotNames(t *testing.T, ctx context.Context, l *Locker, prefix string, ttl time.Duration) []string {
	t.Helper()
	names := make([]string, maxInFlight)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%d", prefix, i)
		if err := mustAcquire(t, l, names[i], ttl).Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return names
}

// TestCoalesceBatch: the calls that queue while a statement is out go out
// together in one lock_grant_many (one lock_release_many), and each caller
// gets its own result: distinct names are granted with their own tokens, a
// name asked twice in the batch goes to exactly one of its two callers (the
// other gets ErrLocked with this Locker as holder, as two statements would
// give), a name held by another Locker gives ErrLocked with that holder and
// its expiry, an invalid call fails alone before any SQL, and a stale
// release in a release batch gives ErrLost to its caller alone.
func TestCoalesceBatch(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	var c doorCounter
	pool := countingPool(t, dsn, &c)
	l := newLocker(t, pool, &Config{PollOnly: true})
	other := newLocker(t, admin, &Config{Holder: "other"})
	const ttl = time.Minute

	// maxInFlight grants wait on row locks: every grant after them queues.
	blockNames := slotNames(t, ctx, l, "co-block", ttl)
	held := mustAcquire(t, other, "co-held", ttl)
	// co-dup has a row and is free: the first of its two callers in the
	// batch is granted it, the second finds it held.
	if err := mustAcquire(t, l, "co-dup", ttl).Release(ctx); err != nil {
		t.Fatal(err)
	}
	dupBefore := inspect(t, admin, "co-dup").Token

	b := blockRows(t, admin, blockNames...)
	c.reset()
	const n = 40
	queued := queuedSignal(l.grants, n+3)
	type result struct {
		lease *Lease
		err   error
	}
	first := make(chan result, maxInFlight)
	for _, name := range blockNames {
		go func() {
			s, err := l.TryAcquire(ctx, name, ttl)
			first <- result{s, err}
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)

	names := make([]string, 0, n+3)
	for i := range n {
		names = append(names, fmt.Sprintf("co-%02d", i))
	}
	names = append(names, "co-dup", "co-dup", "co-held")
	results := make([]result, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := l.TryAcquire(ctx, name, ttl)
			results[i] = result{s, err}
		}()
	}
	waitClosed(t, queued, "the grants to queue")
	if _, err := l.TryAcquire(ctx, "", ttl); !isInvalid(err, "lock name") {
		t.Fatalf("TryAcquire(\"\") = %v, want ErrInvalid", err)
	}
	b.unblock(t)
	wg.Wait()
	for range maxInFlight {
		if r := <-first; r.err != nil {
			t.Fatalf("TryAcquire(co-block-*): %v", r.err)
		} else {
			defer r.lease.Release(ctx) //nolint:errcheck
		}
	}
	if got := c.grantMany.Load(); got != 1 {
		t.Errorf("%d lock_grant_many statements for %d queued grants, want 1", got, len(names))
	}
	if got := c.grant.Load(); got != maxInFlight {
		t.Errorf("%d lock_grant statements, want %d (the first ones, alone)", got, maxInFlight)
	}
	if got := l.grants.batchStatements(); got != 1 {
		t.Errorf("%d batch statements, want 1", got)
	}

	var dupGot, dupLocked int
	var leases []*Lease
	for i, name := range names {
		r := results[i]
		switch name {
		case "co-dup":
			var pe *pgfence.Error
			switch {
			case r.err == nil:
				dupGot++
				if r.lease.Name() != name || r.lease.Token() != dupBefore+1 {
					t.Errorf("co-dup: lease %q token %d, want token %d", r.lease.Name(), r.lease.Token(), dupBefore+1)
				}
				leases = append(leases, r.lease)
			case errors.As(r.err, &pe) && pe.Kind == pgfence.ErrLocked && pe.Holder == l.Holder() && !pe.ExpiresAt.IsZero():
				dupLocked++
			default:
				t.Errorf("co-dup: %v", r.err)
			}
		case "co-held":
			var pe *pgfence.Error
			if !errors.As(r.err, &pe) || pe.Kind != pgfence.ErrLocked || pe.Holder != "other" || !pe.ExpiresAt.Equal(held.ExpiresAt()) {
				t.Errorf("co-held: %v, want ErrLocked by other until %v", r.err, held.ExpiresAt())
			}
		default:
			if r.err != nil {
				t.Fatalf("%s: %v", name, r.err)
			}
			if r.lease.Name() != name || r.lease.Token() != 1 {
				t.Errorf("%s: got lease %q token %d, want its own, token 1", name, r.lease.Name(), r.lease.Token())
			}
			if info := inspect(t, admin, name); !info.Held || info.Token != r.lease.Token() || info.Holder != l.Holder() {
				t.Errorf("%s: row %+v", name, info)
			}
			leases = append(leases, r.lease)
		}
	}
	if dupGot != 1 || dupLocked != 1 {
		t.Errorf("co-dup twice in one batch: %d granted, %d ErrLocked; want 1 and 1", dupGot, dupLocked)
	}

	// Releases: maxInFlight wait on row locks, the others queue and go out
	// in one lock_release_many, with one stale token among them.
	rblocks := make([]*Lease, maxInFlight)
	rnames := make([]string, maxInFlight)
	for i := range rblocks {
		rnames[i] = fmt.Sprintf("co-rblock-%d", i)
		rblocks[i] = mustAcquire(t, l, rnames[i], ttl)
	}
	b = blockRows(t, admin, rnames...)
	c.reset()
	rqueued := queuedSignal(l.releases, len(leases)+1)
	rfirst := make(chan error, maxInFlight)
	for _, s := range rblocks {
		go func() { rfirst <- s.Release(ctx) }()
	}
	waitLockWait(t, admin, "lock_release", maxInFlight)
	errs := make([]error, len(leases))
	var staleErr error
	for i, s := range leases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.Release(ctx)
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		staleErr = l.ReleaseToken(ctx, "co-00", 99)
	}()
	waitClosed(t, rqueued, "the releases to queue")
	b.unblock(t)
	wg.Wait()
	for range maxInFlight {
		if err := <-rfirst; err != nil {
			t.Fatalf("release co-rblock-*: %v", err)
		}
	}
	for i, err := range errs {
		if err != nil {
			t.Errorf("release %s: %v", leases[i].Name(), err)
		}
		if info := inspect(t, admin, leases[i].Name()); info.Held {
			t.Errorf("%s still held after its release: %+v", leases[i].Name(), info)
		}
	}
	if !errors.Is(staleErr, pgfence.ErrLost) {
		t.Errorf("stale ReleaseToken in a batch: %v, want ErrLost", staleErr)
	}
	if got := c.releaseMany.Load(); got != 1 {
		t.Errorf("%d lock_release_many statements, want 1", got)
	}
	if got := c.release.Load(); got != maxInFlight {
		t.Errorf("%d lock_release statements, want %d (the first ones, alone)", got, maxInFlight)
	}
}

// TestCoalesceLoneCaller: a caller alone is sent at once through the
// single-lease statement: one lock_grant and one lock_release per cycle, no
// batch statement, no timer.
// TestCoalesceBatchBound: calls that queue beyond maxCoalesce while a
// statement is out go out in further statements of at most maxCoalesce
// calls each, one after another in the slot, and every caller gets its lease.
func TestCoalesceBatchBound(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	var c doorCounter
	pool := countingPool(t, dsn, &c)
	l := newLocker(t, pool, &Config{PollOnly: true})
	const ttl = time.Minute

	blockNames := slotNames(t, ctx, l, "cb-block", ttl)
	b := blockRows(t, admin, blockNames...)
	c.reset()
	const n = maxCoalesce + 10
	queued := queuedSignal(l.grants, n)
	first := make(chan error, maxInFlight)
	for _, name := range blockNames {
		go func() {
			s, err := l.TryAcquire(ctx, name, ttl)
			if err == nil {
				err = s.Release(ctx)
			}
			first <- err
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)

	leases := make([]*Lease, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			leases[i], errs[i] = l.TryAcquire(ctx, fmt.Sprintf("cb-%03d", i), ttl)
		}()
	}
	waitClosed(t, queued, "the grants to queue")
	b.unblock(t)
	wg.Wait()
	for range maxInFlight {
		if err := <-first; err != nil {
			t.Fatalf("TryAcquire(cb-block-*): %v", err)
		}
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("TryAcquire(cb-%03d): %v", i, err)
		}
		if leases[i].Token() != 1 {
			t.Errorf("cb-%03d: token %d, want 1", i, leases[i].Token())
		}
		if err := leases[i].Release(ctx); err != nil {
			t.Fatalf("Release(cb-%03d): %v", i, err)
		}
	}
	c.mu.Lock()
	sizes := slices.Clone(c.manySizes)
	c.mu.Unlock()
	// The grants: one statement of maxCoalesce names, then one of the rest
	// (the releases above go through the release coalescer).
	if len(sizes) != 2 || sizes[0] != maxCoalesce || sizes[1] != n-maxCoalesce {
		t.Errorf("lock_grant_many statements carried %v names, want [%d %d]", sizes, maxCoalesce, n-maxCoalesce)
	}
	if got := c.grant.Load(); got != maxInFlight {
		t.Errorf("%d lock_grant statements, want %d (the blocked ones)", got, maxInFlight)
	}
}

func TestCoalesceLoneCaller(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	var c doorCounter
	pool := countingPool(t, pgtest.DSN(t), &c)
	l := newLocker(t, pool, &Config{PollOnly: true})
	const cycles = 20
	for i := range cycles {
		s, err := l.TryAcquire(ctx, "lone", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if s.Token() != int64(i+1) {
			t.Fatalf("token %d, want %d", s.Token(), i+1)
		}
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if g, r, gm, rm := c.grant.Load(), c.release.Load(), c.grantMany.Load(), c.releaseMany.Load(); g != cycles || r != cycles || gm != 0 || rm != 0 {
		t.Errorf("%d cycles alone: %d lock_grant, %d lock_release, %d lock_grant_many, %d lock_release_many; want %d, %d, 0, 0",
			cycles, g, r, gm, rm, cycles, cycles)
	}
}

// TestCoalesceYieldBatches: a call that finds its slot free while another
// call of its Locker is in progress yields before it sends, and the calls
// that queue meanwhile go out with it: one lock_grant_many for all of them
// and no lock_grant, each caller with the lease of its own name. A lone
// caller does not yield.
func TestCoalesceYieldBatches(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	var c doorCounter
	pool := countingPool(t, dsn, &c)
	l := newLocker(t, pool, &Config{PollOnly: true})
	var yields atomic.Int64
	l.grants.yield = func() { yields.Add(1) }
	l.releases.yield = func() { yields.Add(1) }

	// Alone: no yield.
	for range 3 {
		if err := mustAcquire(t, l, "yield-block", time.Minute).Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n := yields.Load(); n != 0 {
		t.Fatalf("a lone caller yielded %d times", n)
	}

	// A release of the Locker waits in the database: a grant yields.
	blocked := mustAcquire(t, l, "yield-block", time.Minute)
	b := blockRows(t, admin, "yield-block")
	released := make(chan error, 1)
	go func() { released <- blocked.Release(ctx) }()
	waitLockWait(t, admin, "lock_release", 1)

	const others = 5
	inYield := yieldUntilQueued(t, l.grants, others)
	c.reset()
	type result struct {
		name  string
		lease *Lease
		err   error
	}
	results := make(chan result, others+1)
	try := func(name string) {
		s, err := l.TryAcquire(ctx, name, time.Minute)
		results <- result{name, s, err}
	}
	go try("yield-0")
	waitClosed(t, inYield, "the first grant's yield")
	for i := 1; i <= others; i++ {
		go try(fmt.Sprintf("yield-%d", i))
	}
	leases := make([]*Lease, 0, others+1)
	for range others + 1 {
		r := <-results
		if r.err != nil {
			t.Fatalf("%s: %v", r.name, r.err)
		}
		if r.lease.Name() != r.name || r.lease.Token() != 1 {
			t.Errorf("%s: got the lease of %q, token %d; want its own, token 1", r.name, r.lease.Name(), r.lease.Token())
		}
		leases = append(leases, r.lease)
	}
	c.mu.Lock()
	sizes := slices.Clone(c.manySizes)
	c.mu.Unlock()
	if g, gm := c.grant.Load(), c.grantMany.Load(); g != 0 || gm != 1 || !slices.Equal(sizes, []int{others + 1}) {
		t.Errorf("%d lock_grant, %d lock_grant_many of sizes %v; want 0 and 1 of %d", g, gm, sizes, others+1)
	}
	// Busy still, but nothing queues as it yields: sent alone.
	c.reset()
	alone, err := l.TryAcquire(ctx, "yield-alone", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	leases = append(leases, alone)
	if g, gm := c.grant.Load(), c.grantMany.Load(); g != 1 || gm != 0 {
		t.Errorf("a yield with nothing queued: %d lock_grant, %d lock_grant_many; want 1 and 0", g, gm)
	}
	b.unblock(t)
	if err := <-released; err != nil {
		t.Fatal(err)
	}
	for _, s := range leases {
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// yieldUntilQueued makes the first yield of c close the returned channel and
// wait until n calls have queued behind it; later yields return at once.
func yieldUntilQueued[Req, Res any](t *testing.T, c *coalescer[Req, Res], n int) <-chan struct{} {
	queued := queuedSignal(c, n)
	inYield := make(chan struct{})
	var once sync.Once
	c.yield = func() {
		once.Do(func() {
			close(inYield)
			select {
			case <-queued:
			case <-time.After(time.Minute):
				t.Errorf("%d calls did not queue behind the yielding one", n)
			}
		})
	}
	return inYield
}

// TestCoalesceConcurrent: many goroutines on one Locker, each cycling on its
// own names and some on shared ones, get their own results: a lease of the
// name asked, tokens rising per name, never two holders of a name at once.
func TestCoalesceConcurrent(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	var c doorCounter
	pool := countingPool(t, pgtest.DSN(t), &c)
	l := newLocker(t, pool, &Config{PollOnly: true})
	const workers, cycles, shared = 32, 30, 4
	var holding [shared]atomic.Int32
	var lastToken [shared]atomic.Int64
	var wg sync.WaitGroup
	errCh := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var last int64
			for i := range cycles {
				name := fmt.Sprintf("cc-own-%02d", w)
				sh := -1
				if i%3 == 0 {
					sh = (w + i) % shared
					name = fmt.Sprintf("cc-shared-%d", sh)
				}
				s, err := l.TryAcquire(ctx, name, time.Minute)
				if sh >= 0 && errors.Is(err, pgfence.ErrLocked) {
					continue
				}
				if err != nil {
					errCh <- fmt.Errorf("%s: %w", name, err)
					return
				}
				if s.Name() != name {
					errCh <- fmt.Errorf("asked %s, got a lease of %s", name, s.Name())
					return
				}
				if sh >= 0 {
					if holding[sh].Add(1) != 1 {
						errCh <- fmt.Errorf("%s: two holders at once", name)
						return
					}
					if prev := lastToken[sh].Swap(s.Token()); s.Token() <= prev {
						errCh <- fmt.Errorf("%s: token %d after %d", name, s.Token(), prev)
						return
					}
					holding[sh].Add(-1)
				} else {
					if s.Token() != last+1 {
						errCh <- fmt.Errorf("%s: token %d after %d", name, s.Token(), last)
						return
					}
					last = s.Token()
				}
				if err := s.Release(ctx); err != nil {
					errCh <- fmt.Errorf("release %s: %w", name, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errCh)
	for err := range errCh {
		t.Error(err)
	}
	t.Logf("%d workers × %d cycles: %d lock_grant, %d lock_grant_many, %d lock_release, %d lock_release_many",
		workers, cycles, c.grant.Load(), c.grantMany.Load(), c.release.Load(), c.releaseMany.Load())
}

// TestCoalesceTwoLockers: two Lockers (two processes' worth: their own pools,
// keys and coalescers) cycle TryAcquire and Release over the same few names,
// so that their batches share names and each grant batch locks several free
// rows that the other's batches want too. No call fails (a deadlock would be
// reported after deadlock_timeout as SQLSTATE 40P01 and fail the calls of
// its batch), a name has one holder at a time and its tokens rise. This is
// a smoke test of the two Lockers together, not a proof of the lock order:
// a grant batch holds its row locks for a moment, and the same test with
// the rows locked in random order did not deadlock in two runs either.
func TestCoalesceTwoLockers(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	var ca, cb doorCounter
	lockers := []*Locker{
		newLocker(t, countingPool(t, dsn, &ca), &Config{Holder: "a", PollOnly: true}),
		newLocker(t, countingPool(t, dsn, &cb), &Config{Holder: "b", PollOnly: true}),
	}
	const perLocker, cycles, names = 16, 100, 6
	var holding [names]atomic.Int32
	var lastToken [names]atomic.Int64
	var granted atomic.Int64
	var wg sync.WaitGroup
	errCh := make(chan error, 2*perLocker)
	for li, l := range lockers {
		for w := range perLocker {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range cycles {
					n := (li*7 + w*5 + i*3) % names
					name := fmt.Sprintf("two-%d", n)
					s, err := l.TryAcquire(ctx, name, time.Minute)
					if errors.Is(err, pgfence.ErrLocked) {
						continue
					}
					if err != nil {
						errCh <- fmt.Errorf("TryAcquire %s: %w", name, err)
						return
					}
					granted.Add(1)
					if holding[n].Add(1) != 1 {
						errCh <- fmt.Errorf("%s: two holders at once", name)
						return
					}
					if prev := lastToken[n].Swap(s.Token()); s.Token() <= prev {
						errCh <- fmt.Errorf("%s: token %d after %d", name, s.Token(), prev)
						return
					}
					holding[n].Add(-1)
					if err := s.Release(ctx); err != nil {
						errCh <- fmt.Errorf("release %s: %w", name, err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errCh)
	for err := range errCh {
		t.Error(err)
	}
	if granted.Load() == 0 {
		t.Fatal("no grant at all")
	}
	t.Logf("2 Lockers × %d goroutines × %d cycles over %d names: %d grants; lock_grant_many %d + %d, lock_release_many %d + %d",
		perLocker, cycles, names, granted.Load(), ca.grantMany.Load(), cb.grantMany.Load(), ca.releaseMany.Load(), cb.releaseMany.Load())
	if ca.grantMany.Load()+cb.grantMany.Load() == 0 {
		t.Error("no grant batch was sent: the Lockers never shared a statement")
	}
}

// TestCoalesceConnectionLost: a batch statement whose connection is lost
// mid-statement (after it changed some rows, waiting on a row lock) fails
// every call it carried with a database error (no Kind: the outcome is
// unknown), and since its transaction never committed none of its grants
// exists.
func TestCoalesceConnectionLost(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	g := newGatedPool(t, dsn)
	l := newLocker(t, g.Pool, &Config{PollOnly: true})
	const ttl = time.Minute
	blockNames := slotNames(t, ctx, l, "zz-block", ttl)
	b := blockRows(t, admin, blockNames...)
	const n = 10
	queued := queuedSignal(l.grants, n+1)
	fctx, fcancel := context.WithCancel(ctx)
	first := make(chan error, maxInFlight)
	for _, name := range blockNames {
		go func() {
			_, err := l.TryAcquire(fctx, name, ttl)
			first <- err
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)
	errs := make([]error, n+1)
	var wg sync.WaitGroup
	for i := range n + 1 {
		name := fmt.Sprintf("kl-%02d", i)
		if i == n {
			name = "zz-block-0" // sorted last: the batch grants the others, then waits
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = l.TryAcquire(ctx, name, ttl)
		}()
	}
	waitClosed(t, queued, "the grants to queue")
	// The first calls give up: the batch goes out and waits on the row lock.
	fcancel()
	for range maxInFlight {
		if err := <-first; !errors.Is(err, context.Canceled) {
			t.Fatalf("first TryAcquire: %v, want context.Canceled", err)
		}
	}
	waitLockWait(t, admin, "lock_grant_many", 1)
	g.partition(t, admin)
	wg.Wait()
	for i, err := range errs {
		var pe *pgfence.Error
		if !errors.As(err, &pe) || pe.Kind != nil || pe.Err == nil {
			t.Errorf("call %d: %v, want a database error without Kind", i, err)
		}
	}
	b.unblock(t)
	for i := range n {
		if info := inspect(t, admin, fmt.Sprintf("kl-%02d", i)); info.Held {
			t.Errorf("kl-%02d held after its batch's connection was lost: %+v", i, info)
		}
	}
	g.heal()
	s := mustAcquire(t, l, "kl-00", ttl)
	if s.Token() != 1 {
		t.Errorf("kl-00 after the lost batch: token %d, want 1", s.Token())
	}
}

// TestLockGrantMany checks the many-functions in SQL: per-element answers,
// a name twice, PF011 naming the bad element (nothing changed), the token
// at the bigint maximum reported per element.
func TestLockGrantMany(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	pool := pgtest.Pool(t)
	key := []byte("0123456789abcdef")
	if _, err := pool.Exec(ctx, `SELECT pgfence.lock_grant('gm-held', 'x', 60000000, '\x00112233445566778899aabbccddeeff'::bytea)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks (name, token) VALUES ('gm-max', 9223372036854775807)`); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT i, token, held_by, exhausted FROM pgfence.lock_grant_many(
		ARRAY['gm-b', 'gm-a', 'gm-b', 'gm-held', 'gm-max'], 'me', ARRAY[60000000, 60000000, 60000000, 60000000, 60000000]::bigint[], $1) ORDER BY i`, key)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var (
			i         int
			token     *int64
			heldBy    *string
			exhausted bool
		)
		if err := rows.Scan(&i, &token, &heldBy, &exhausted); err != nil {
			t.Fatal(err)
		}
		s := fmt.Sprint(i, ":")
		if token != nil {
			s += fmt.Sprint(" token ", *token)
		}
		if heldBy != nil {
			s += " held by " + *heldBy
		}
		if exhausted {
			s += " exhausted"
		}
		got = append(got, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := "1: token 1|2: token 1|3: held by me|4: held by x|5: exhausted"
	if g := strings.Join(got, "|"); g != want {
		t.Errorf("lock_grant_many = %s, want %s", g, want)
	}
	var synchronous string
	before := rowJSON(t, pool, "gm-c")
	_, err = pool.Exec(ctx, `SELECT * FROM pgfence.lock_grant_many(ARRAY['gm-c', ''], 'me', ARRAY[1000000, 1000000]::bigint[], $1)`, key)
	if pgerr.Code(err) != "PF011" || !strings.Contains(err.Error(), "element 2") {
		t.Errorf("an empty second name: %v, want PF011 naming element 2", err)
	}
	if after := rowJSON(t, pool, "gm-c"); after != before {
		t.Errorf("a failed call changed gm-c: %s", after)
	}
	_, err = pool.Exec(ctx, `SELECT * FROM pgfence.lock_release_many(ARRAY['gm-a', 'gm-b'], ARRAY[1, 0]::bigint[], $1)`, key)
	if pgerr.Code(err) != "PF011" || !strings.Contains(err.Error(), "element 2") {
		t.Errorf("a zero second token: %v, want PF011 naming element 2", err)
	}
	// A release batch is durable when it hands a lease over, even if a
	// later element is a plain release.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `INSERT INTO pgfence.lock_queue (name, wkey, wait_id, holder, ttl_us, key_hash, alive_until)
		VALUES ('gm-a', 7, 8, 'waiter', 60000000, sha256('\x00112233445566778899aabbccddeeff'::bytea), now() + interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	rows, err = tx.Query(ctx, `SELECT i, released, handed_off FROM pgfence.lock_release_many(ARRAY['gm-b', 'gm-a'], ARRAY[1, 1]::bigint[], $1) ORDER BY i`, key)
	if err != nil {
		t.Fatal(err)
	}
	got = got[:0]
	for rows.Next() {
		var (
			i                int
			released, handed bool
		)
		if err := rows.Scan(&i, &released, &handed); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprint(i, released, handed))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if g := strings.Join(got, "|"); g != "1 true false|2 true true" {
		t.Errorf("lock_release_many = %s, want gm-b released, gm-a handed off", g)
	}
	if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&synchronous); err != nil {
		t.Fatal(err)
	}
	if synchronous != "on" {
		t.Errorf("synchronous_commit %q after a release batch that handed a lease over, want on", synchronous)
	}
}

// TestLockManyLockOrder: a batch locks rows only in byte order of the
// names. lock_grant_many locks the free rows of its names before it grants
// any: while it waits for one ("lo-b", locked by another transaction), it
// holds no lock on a name it found held ("lo-a", before it in that order),
// whose holder can release it meanwhile; the batch then reports "lo-a" as
// changed (no token, no holder: call again) rather than locking it out of
// order, and grants "lo-b". lock_release_many answers a lease of its own,
// a lease lost (wrong token) and a name it does not hold, each as
// lock_release would.
func TestLockManyLockOrder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	pool := pgtest.Pool(t)
	other := []byte("fedcba9876543210")
	key := []byte("0123456789abcdef")
	var tokenA int64
	if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant('lo-a', 'x', 60000000, $1)`, other).Scan(&tokenA); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks (name, token) VALUES ('lo-b', 4)`); err != nil {
		t.Fatal(err)
	}
	blocker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(ctx) //nolint:errcheck
	if _, err := blocker.Exec(ctx, `SELECT 1 FROM pgfence.locks WHERE name = 'lo-b' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		rows []string
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		rows, err := pool.Query(ctx, `SELECT i, token, held_by, expires_at IS NULL, exhausted FROM pgfence.lock_grant_many(
			ARRAY['lo-b', 'lo-a'], 'me', ARRAY[60000000, 60000000]::bigint[], $1) ORDER BY i`, key)
		if err != nil {
			done <- answer{err: err}
			return
		}
		var out []string
		for rows.Next() {
			var (
				i              int
				token          *int64
				heldBy         *string
				noExpiry, exhd bool
			)
			if err := rows.Scan(&i, &token, &heldBy, &noExpiry, &exhd); err != nil {
				done <- answer{err: err}
				return
			}
			s := fmt.Sprint(i, ":")
			if token != nil {
				s += fmt.Sprint(" token ", *token)
			}
			if heldBy != nil {
				s += " held by " + *heldBy
			}
			if noExpiry {
				s += " no expiry"
			}
			if exhd {
				s += " exhausted"
			}
			out = append(out, s)
		}
		done <- answer{rows: out, err: rows.Err()}
	}()
	waitLockWait(t, pool, "lock_grant_many", 1)
	// The batch waits for lo-b: lo-a, held by x, is not locked by it.
	var released bool
	if err := pool.QueryRow(ctx, `SELECT released FROM pgfence.lock_release('lo-a', $1, $2)`, tokenA, other).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if !released {
		t.Fatal("x could not release lo-a while the batch waited")
	}
	if err := blocker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.err != nil {
		t.Fatal(a.err)
	}
	if g, want := strings.Join(a.rows, "|"), "1: token 5|2: no expiry"; g != want {
		t.Errorf("lock_grant_many = %s, want %s (lo-b granted, lo-a changed: call again)", g, want)
	}
	var holder *string
	var token int64
	if err := pool.QueryRow(ctx, `SELECT holder, token FROM pgfence.locks WHERE name = 'lo-a'`).Scan(&holder, &token); err != nil {
		t.Fatal(err)
	}
	if holder != nil || token != tokenA {
		t.Errorf("lo-a after the batch: holder %v, token %d; want free at token %d", holder, token, tokenA)
	}

	// Releases: lo-b (this key's lease), lo-a (free: not this key's), lo-b
	// again (released by the first element), lo-c (held with a wrong token).
	var tokenC int64
	if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant('lo-c', 'me', 60000000, $1)`, key).Scan(&tokenC); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT i, released, handed_off FROM pgfence.lock_release_many(
		ARRAY['lo-b', 'lo-a', 'lo-b', 'lo-c'], ARRAY[5, $2, 5, $3]::bigint[], $1) ORDER BY i`, key, tokenA, tokenC+1)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var (
			i                int
			released, handed bool
		)
		if err := rows.Scan(&i, &released, &handed); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprint(i, released, handed))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if g, want := strings.Join(got, "|"), "1 true false|2 false false|3 false false|4 false false"; g != want {
		t.Errorf("lock_release_many = %s, want %s", g, want)
	}
	if err := pool.QueryRow(ctx, `SELECT holder FROM pgfence.locks WHERE name = 'lo-c'`).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	if holder == nil || *holder != "me" {
		t.Errorf("lo-c after a release with a wrong token: holder %v, want me", holder)
	}
}

// TestLockRenewManyLockOrder: lock_renew_many locks the rows it renews in
// byte order of the names before it renews any. Asked to renew "ro-b" then
// "ro-a" while another transaction holds "ro-a"'s row, it waits for "ro-a"
// holding no lock on "ro-b" (a release batch of the same Locker, which locks
// in name order, could otherwise wait for "ro-b" while holding "ro-a"), then
// renews both.
func TestLockRenewManyLockOrder(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	pool := pgtest.Pool(t)
	key := []byte("0123456789abcdef")
	tokens := map[string]int64{}
	for _, name := range []string{"ro-a", "ro-b"} {
		var token int64
		if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'me', 60000000, $2)`, name, key).Scan(&token); err != nil {
			t.Fatal(err)
		}
		tokens[name] = token
	}
	blocker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(ctx) //nolint:errcheck
	if _, err := blocker.Exec(ctx, `SELECT 1 FROM pgfence.locks WHERE name = 'ro-a' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	renewed := make(chan int, 1)
	go func() {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.lock_renew_many(ARRAY['ro-b', 'ro-a'], ARRAY[$1, $2]::bigint[], $3, ARRAY[120000000, 120000000]::bigint[])`,
			tokens["ro-b"], tokens["ro-a"], key).Scan(&n)
		renewed <- n
		done <- err
	}()
	waitLockWait(t, pool, "lock_renew_many", 1)
	probe, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = probe.Exec(ctx, `SELECT 1 FROM pgfence.locks WHERE name = 'ro-b' FOR UPDATE NOWAIT`)
	_ = probe.Rollback(ctx)
	if err != nil {
		t.Errorf("ro-b while the renewal waits for ro-a: %v; want it not locked (rows locked in name order)", err)
	}
	if err := blocker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := <-renewed; n != 2 {
		t.Errorf("lock_renew_many renewed %d leases, want 2", n)
	}
}

// TestCoalesceAbandonedGrantReleased: a caller whose context ends while its
// batch is out gets its context's error and no Lease; when the batch then
// grants its name, the Locker releases that lease at once (nobody can use
// it) instead of leaving the name held until the lease expires. The other
// calls of the batch keep their leases.
func TestCoalesceAbandonedGrantReleased(t *testing.T) {
	t.Parallel()
	testAbandonedGrant(t, false)
}

// TestCoalesceOrphanReleasePanic: a panic under the release that gives back
// an abandoned grant (a tracer) is logged on the coalescer's goroutine, not
// raised there (the test binary would die); the lease stays held until its
// TTL and the Locker goes on.
func TestCoalesceOrphanReleasePanic(t *testing.T) {
	t.Parallel()
	testAbandonedGrant(t, true)
}

func testAbandonedGrant(t *testing.T, panicking bool) {
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	tr := &batchTracer{match: "pgfence.lock_release("}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	logger, logged := warnSignal("a panic while giving back a lease")
	l := newLocker(t, pool, &Config{PollOnly: true, Logger: logger})
	const ttl = time.Minute
	blockNames := make([]string, maxInFlight)
	for i := range blockNames {
		blockNames[i] = fmt.Sprintf("zz-block-%d", i)
	}
	for _, name := range append(slices.Clone(blockNames), "ab-x") {
		if err := mustAcquire(t, l, name, ttl).Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	orphaned := make(chan struct{})
	l.grants.orphanHook = func() { close(orphaned) }
	queued := queuedSignal(l.grants, 2)
	bx := blockRows(t, admin, "ab-x")
	b := blockRows(t, admin, blockNames...)
	fctx, fcancel := context.WithCancel(ctx)
	first := make(chan error, maxInFlight)
	for _, name := range blockNames {
		go func() {
			_, err := l.TryAcquire(fctx, name, ttl)
			first <- err
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)
	xctx, xcancel := context.WithCancel(ctx)
	xerr := make(chan error, 1)
	go func() {
		_, err := l.TryAcquire(xctx, "ab-x", ttl)
		xerr <- err
	}()
	wres := make(chan *Lease, 1)
	go func() {
		s, err := l.TryAcquire(ctx, "ab-w", ttl)
		if err != nil {
			t.Errorf("TryAcquire ab-w: %v", err)
		}
		wres <- s
	}()
	waitClosed(t, queued, "the grants to queue")
	fcancel() // the slots free: the batch [ab-w, ab-x] goes out and waits on ab-x's row
	for range maxInFlight {
		if err := <-first; !errors.Is(err, context.Canceled) {
			t.Fatalf("first TryAcquire: %v, want context.Canceled", err)
		}
	}
	b.unblock(t)
	waitLockWait(t, admin, "lock_grant_many", 1)
	xcancel()
	if err := <-xerr; !errors.Is(err, context.Canceled) {
		t.Fatalf("TryAcquire ab-x after its context ended: %v, want context.Canceled", err)
	}
	tr.armed.Store(panicking)
	bx.unblock(t)
	w := <-wres
	if panicking {
		waitClosed(t, logged, "the log of the panic under the give-back")
		if info := inspect(t, admin, "ab-x"); !info.Held || info.Token != 2 {
			t.Errorf("ab-x after a give-back that panicked: %+v, want held with token 2 until its TTL", info)
		}
		if err := mustAcquire(t, l, "ab-y", ttl).Release(ctx); err != nil {
			t.Fatal(err)
		}
		return
	}
	waitClosed(t, orphaned, "the abandoned lease's release")
	if w == nil || w.Token() != 1 {
		t.Fatalf("ab-w: %v, want a lease with token 1", w)
	}
	if info := inspect(t, admin, "ab-w"); !info.Held || info.Token != 1 {
		t.Errorf("ab-w after the batch: %+v, want held with token 1", info)
	}
	if info := inspect(t, admin, "ab-x"); info.Held || info.Token != 2 {
		t.Errorf("ab-x after its abandoned grant: %+v, want granted (token 2) and released", info)
	}
	s := mustAcquire(t, l, "ab-x", ttl)
	if s.Token() != 3 {
		t.Errorf("ab-x acquired again: token %d, want 3", s.Token())
	}
}

// Close ends the wait of the grants queued behind a statement (they get
// ErrClosed, never sent), and a grant whose statement answers after Close
// is given back and its caller gets ErrClosed: before, the queued calls
// waited on (Close did not stop them) and were granted after Close
// returned, each caller getting an ended Lease with a nil error while the
// name stayed held in the database until its TTL.
func TestCoalesceClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	l, err := New(pgtest.PoolFor(t, dsn), &Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	const ttl = time.Minute
	blockNames := slotNames(t, ctx, l, "cc-block", ttl)
	queued := queuedSignal(l.grants, 2)
	b := blockRows(t, admin, blockNames...)
	first := make(chan error, maxInFlight)
	for _, name := range blockNames {
		go func() {
			s, err := l.TryAcquire(ctx, name, ttl)
			if s != nil {
				t.Errorf("TryAcquire %s granted after Close: %v (Err %v)", name, s.Token(), s.Err())
			}
			first <- err
		}()
	}
	waitLockWait(t, admin, "lock_grant", maxInFlight)
	rest := make(chan error, 2)
	for _, name := range []string{"cc-b", "cc-c"} {
		go func() {
			s, err := l.TryAcquire(ctx, name, ttl)
			if s != nil {
				t.Errorf("TryAcquire %s: a lease (token %d, Err %v) after Close", name, s.Token(), s.Err())
			}
			rest <- err
		}()
	}
	waitClosed(t, queued, "the grants to queue")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case err := <-rest:
			if !errors.Is(err, pgfence.ErrClosed) {
				t.Errorf("queued TryAcquire after Close: %v, want ErrClosed", err)
			}
		case <-ctx.Done():
			t.Fatal("queued grants still waiting after Close")
		}
	}
	b.unblock(t) // the statement out answers: granted after Close
	for range maxInFlight {
		if err := <-first; !errors.Is(err, pgfence.ErrClosed) {
			t.Errorf("TryAcquire answered after Close: %v, want ErrClosed", err)
		}
	}
	for _, name := range append(slices.Clone(blockNames), "cc-b", "cc-c") {
		if info := inspect(t, admin, name); info.Held {
			t.Errorf("%s after Close: held with token %d, want free", name, info.Token)
		}
	}
}

// A panic under a lone call's statement (here a pgx tracer's; user code
// also runs in pool hooks) frees the call's statement slot and its
// connection: before, the slot stayed taken and every later TryAcquire of
// the Locker queued behind a statement that would never return.
func TestCoalescePanicFreesSlot(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	tr := &panicTracer{}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Not deferred: a connection the panic left taken would hang it.
	l, err := New(pool, &Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 { // more panics than connections: none may stay taken
		tr.panicNext.Store(true)
		func() {
			defer func() {
				if r := recover(); r == nil {
					t.Fatal("TryAcquire did not panic")
				}
			}()
			_, _ = l.TryAcquire(ctx, "ps-a", time.Minute)
		}()
	}
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	s, err := l.TryAcquire(tctx, "ps-b", time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire after recovered panics: %v", err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	_ = l.Close()
	pool.Close()
}

// panicTracer panics in the next grant statement's TraceQueryStart when
// panicNext is set.
type panicTracer struct{ panicNext atomic.Bool }

func (p *panicTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "lock_grant") && p.panicNext.CompareAndSwap(true, false) {
		panic("tracer")
	}
	return ctx
}

func (p *panicTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestCoalescePanicInBatch: a panic under a batch statement (a tracer) is
// re-raised in each of its callers' goroutines, not in the coalescer's (the
// test binary would die), nothing is granted, and the slot goes on; a
// runtime.Goexit there fails the batch's calls with an error and the slot
// goes on too.
func TestCoalescePanicInBatch(t *testing.T) {
	t.Parallel()
	for _, goexit := range []bool{false, true} {
		t.Run(fmt.Sprintf("goexit=%v", goexit), func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t, time.Minute)
			dsn := pgtest.DSN(t)
			admin := pgtest.PoolFor(t, dsn)
			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			tr := &batchTracer{match: "lock_grant_many(", goexit: goexit}
			cfg.ConnConfig.Tracer = tr
			cfg.MaxConns = 4
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			l := newLocker(t, pool, &Config{PollOnly: true})

			// A release of the Locker waits in the database: the grants
			// below yield, and the second queues behind the first.
			blocked := mustAcquire(t, l, "pb-block", time.Minute)
			b := blockRows(t, admin, "pb-block")
			released := make(chan error, 1)
			go func() { released <- blocked.Release(ctx) }()
			waitLockWait(t, admin, "lock_release", 1)

			inYield := yieldUntilQueued(t, l.grants, 1)
			tr.armed.Store(true)
			type result struct {
				panicked any
				err      error
			}
			results := make(chan result, 2)
			try := func(name string) {
				var r result
				defer func() {
					r.panicked = recover()
					results <- r
				}()
				_, r.err = l.TryAcquire(ctx, name, time.Minute)
			}
			go try("pb-0")
			waitClosed(t, inYield, "the first grant's yield")
			go try("pb-1")
			for range 2 {
				r := <-results
				switch {
				case goexit && (r.panicked != nil || r.err == nil):
					t.Errorf("Goexit under the batch: panic %v, error %v; want an error", r.panicked, r.err)
				case !goexit && r.panicked != "tracer":
					t.Errorf("panic under the batch: the caller got panic %v, error %v; want the panic", r.panicked, r.err)
				}
			}
			if tr.armed.Load() {
				t.Fatal("the tracer never saw the batch statement")
			}
			b.unblock(t)
			if err := <-released; err != nil {
				t.Fatal(err)
			}
			// Nothing was granted, and the slot goes on.
			for _, name := range []string{"pb-0", "pb-1"} {
				s, err := l.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatalf("%s after the batch: %v", name, err)
				}
				if s.Token() != 1 {
					t.Errorf("%s: token %d, want 1 (the batch granted nothing)", name, s.Token())
				}
				if err := s.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// batchTracer panics (or calls runtime.Goexit) in the TraceQueryStart of the
// next statement containing match once armed.
type batchTracer struct {
	match  string
	goexit bool
	armed  atomic.Bool
}

func (p *batchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, p.match) && p.armed.CompareAndSwap(true, false) {
		if p.goexit {
			runtime.Goexit()
		}
		panic("tracer")
	}
	return ctx
}

func (p *batchTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
