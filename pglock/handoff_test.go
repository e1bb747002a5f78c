package pglock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// queueLen counts the live, ungranted waiters of name.
func queueLen(t testing.TB, db DBTX, name string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(),
		"SELECT count(*) FROM pgfence.lock_queue WHERE name = $1 AND granted_token IS NULL AND alive_until > now()", name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A release hands the lease to the waiters in the order they queued, one
// waiter woken per release, each grant the next token.
func TestHandoffFIFO(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "handoff-fifo"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	first := mustAcquire(t, owner, name, time.Minute)

	const n = 4
	results := make([]<-chan acquired, n)
	for i := range n {
		w := newLocker(t, pool, &Config{Holder: fmt.Sprintf("w%d", i)})
		queued := waitSignal(w)
		results[i] = acquireAsync(ctx, w, name, time.Minute)
		<-queued // w is in the queue before the next one arrives
		if got := queueLen(t, pool, name); got != i+1 {
			t.Fatalf("after waiter %d queued: %d waiters in the queue", i, got)
		}
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	token := first.Token()
	for i := range n {
		r := <-results[i]
		if r.err != nil {
			t.Fatalf("waiter %d: %v", i, r.err)
		}
		if r.lease.Token() != token+1 {
			t.Fatalf("waiter %d got token %d, want %d (handed over in queue order)", i, r.lease.Token(), token+1)
		}
		token = r.lease.Token()
		// Nobody else got it: the later waiters are still waiting.
		for j := i + 1; j < n; j++ {
			select {
			case r := <-results[j]:
				t.Fatalf("waiter %d got a lease (%v) while waiter %d held it", j, r.err, i)
			default:
			}
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := queueLen(t, pool, name); got != 0 {
		t.Errorf("%d waiters left in the queue", got)
	}
}

// A queued waiter that has gone away is skipped once its alive_until has
// passed, and one that went away recently holds the lease at most its own
// TTL: then the next waiter gets it, with the next token.
func TestHandoffDeadWaiters(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "handoff-dead"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	s := mustAcquire(t, owner, name, time.Minute)
	// A waiter gone for longer than its TTL, then one gone just now (its TTL
	// 300 ms still running), both queued before a live waiter.
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.lock_queue (wkey, name, holder, ttl_us, alive_until) VALUES
		(-1, $1, 'gone-long-ago', 300000, now() - interval '1 second'),
		(-2, $1, 'gone-just-now', 300000, now() + interval '300 milliseconds')`, name); err != nil {
		t.Fatal(err)
	}
	live := newLocker(t, pool, &Config{Holder: "live"})
	queued := waitSignal(live)
	res := acquireAsync(ctx, live, name, time.Minute)
	<-queued
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := Inspect(ctx, pool, name)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Held || info.Holder != "gone-just-now" || info.Token != s.Token()+1 {
		t.Fatalf("after the release: %+v, want the recent waiter holding token %d", info, s.Token()+1)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != s.Token()+2 {
		t.Errorf("live waiter got token %d, want %d", r.lease.Token(), s.Token()+2)
	}
	var grantedAt time.Time
	if err := pool.QueryRow(ctx, "SELECT acquired_at FROM pgfence.locks WHERE name = $1", name).Scan(&grantedAt); err != nil {
		t.Fatal(err)
	}
	if !grantedAt.After(info.ExpiresAt) && !grantedAt.Equal(info.ExpiresAt) {
		t.Errorf("live waiter granted at %v, before the dead waiter's lease ended at %v", grantedAt, info.ExpiresAt)
	}
	var stale int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.lock_queue WHERE wkey = -1").Scan(&stale); err != nil || stale != 0 {
		t.Errorf("the long-gone waiter's row is still there (%d, %v)", stale, err)
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A waiter that gives up leaves the queue, and gives back a lease a release
// handed to it meanwhile: the next waiter gets it.
func TestHandoffLeave(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "handoff-leave"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	s := mustAcquire(t, owner, name, time.Minute)

	// Giving up removes the queue row.
	quitter := newLocker(t, pool, &Config{Holder: "quitter"})
	queued := waitSignal(quitter)
	qctx, cancel := context.WithCancel(ctx)
	res := acquireAsync(qctx, quitter, name, time.Minute)
	<-queued
	cancel()
	// Cancelled in its sleep it returns a *LockedError, during a round trip
	// (a wake-up, such as the listener's first connection, may have started
	// one) a *DBError; both match the context's error.
	if r := <-res; !errors.Is(r.err, context.Canceled) || r.lease != nil {
		t.Fatalf("cancelled waiter: %v, %v", r.lease, r.err)
	}
	if got := queueLen(t, pool, name); got != 0 {
		t.Fatalf("the waiter that gave up is still queued (%d)", got)
	}

	// A lease handed to a waiter that leaves is given back and handed on.
	const wkey = 4242
	if _, locked, _, err := quitter.grant(ctx, name, time.Minute, attemptWait, wkey); err != nil || locked == nil {
		t.Fatalf("queueing: %v %v", locked, err)
	}
	next := newLocker(t, pool, &Config{Holder: "next"})
	queued = waitSignal(next)
	res = acquireAsync(ctx, next, name, time.Minute)
	<-queued
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := Inspect(ctx, pool, name); err != nil || info.Holder != "quitter" || info.Token != s.Token()+1 {
		t.Fatalf("after the release: %+v %v, want the lease handed to quitter", info, err)
	}
	quitter.leaveQueue(name, wkey)
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != s.Token()+2 {
		t.Errorf("next waiter got token %d, want %d", r.lease.Token(), s.Token()+2)
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// Clients looping acquire/release on one name get grants in turn: while a
// client waits, at most a few rounds of grants go to others (at most 2 ×
// clients), and nobody starves. Every grant's token is the previous one + 1 and no two leases
// overlap.
func TestHandoffFairness(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := testCtx(t, 2*time.Minute)
	const (
		clients = 4
		grants  = 200
		name    = "handoff-fair"
	)
	var (
		mu        sync.Mutex
		order     []int // client of each grant, in token order
		last      int64
		holding   = -1
		failed    error
		maxBypass int64 // grants to others while one client was queued
		// Counting starts once every client has had a grant: a client whose
		// first Acquire is slow (a new pool, a cold connection on a busy
		// machine) would skew the counts of a short run.
		warm    = make([]bool, clients)
		nWarm   int
		counted []int // client of each grant counted
	)
	fail := func(err error) {
		mu.Lock()
		if failed == nil {
			failed = err
		}
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for c := range clients {
		pool := pgtest.PoolFor(t, dsn)
		l := newLocker(t, pool, &Config{Holder: fmt.Sprintf("c%d", c)})
		// queuedAt is the latest token granted when this client's current
		// Acquire first went to sleep in the queue (-1: not queued yet).
		queuedAt := int64(-1)
		l.waitHook = func(string) {
			mu.Lock()
			if queuedAt < 0 {
				queuedAt = last
			}
			mu.Unlock()
		}
		wg.Add(1)
		go func(c int, l *Locker, pool *pgxpool.Pool) {
			defer wg.Done()
			for {
				mu.Lock()
				done := len(counted) >= grants || failed != nil
				mu.Unlock()
				if done {
					return
				}
				s, err := l.Acquire(ctx, name, time.Minute)
				if err != nil {
					fail(err)
					return
				}
				mu.Lock()
				switch {
				case holding != -1:
					failed = fmt.Errorf("client %d granted token %d while client %d holds the lock", c, s.Token(), holding)
				case last != 0 && s.Token() != last+1:
					failed = fmt.Errorf("client %d granted token %d after %d", c, s.Token(), last)
				}
				if queuedAt >= 0 && nWarm == clients {
					maxBypass = max(maxBypass, s.Token()-queuedAt-1)
				}
				queuedAt = -1
				holding, last = c, s.Token()
				order = append(order, c)
				if nWarm == clients {
					counted = append(counted, c)
				} else if !warm[c] {
					warm[c] = true
					nWarm++
				}
				mu.Unlock()
				mu.Lock()
				holding = -1
				mu.Unlock()
				if err := s.Release(ctx); err != nil {
					fail(err)
					return
				}
			}
		}(c, l, pool)
	}
	wg.Wait()
	if failed != nil {
		t.Fatal(failed)
	}
	counts := make([]int, clients)
	for _, c := range counted {
		counts[c]++
	}
	sum, sq := 0.0, 0.0
	for _, n := range counts {
		sum += float64(n)
		sq += float64(n) * float64(n)
	}
	jain := sum * sum / (clients * sq)
	t.Logf("%d grants to %d clients (after %d while they started): per client %v, Jain's fairness index %.3f, at most %d grants to others while one client was queued",
		len(counted), clients, len(order)-len(counted), counts, jain, maxBypass)
	// Served in queue order, a queued client waits for those queued before
	// it: at most clients-1 grants. A release that ran while a client was
	// queueing cannot see it and frees the lock instead (the client is woken
	// and tries again), which lets at most a few grants more through.
	if limit := int64(2 * clients); maxBypass > limit {
		t.Errorf("a queued client waited through %d grants to others (want at most %d)", maxBypass, limit)
	}
	// Nobody starves. The fairness index itself is logged, not asserted:
	// grant counts also follow how often each client asks, and on a loaded
	// machine one client's goroutine or backend can get little CPU for part
	// of a short run (seen beside two CPU-bound processes: per client
	// [65 63 10 65], index 0.823, while no queued client waited through more
	// than 3 grants to others). The bound above is what the queue controls;
	// B2 of the bench reports the index over a timed run.
	for c, n := range counts {
		if n == 0 {
			t.Errorf("client %d got no grant among %d (index %.3f)", c, len(counted), jain)
		}
	}
}

// Only grants wait for the flush: a handoff (a release that grants) and a
// QueueGrant that grants turn synchronous_commit on; a QueueGrant that only
// queues turns it off, and a plain release keeps the session's setting. The
// setting is read back inside a transaction that ran the statement.
func TestHandoffCommitModes(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	ctx := testCtx(t, 30*time.Second)
	conn, err := pgx.Connect(ctx, dsn) // session default: on
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	q := dbsqlc.New()
	const name = "handoff-commit-modes"
	inTx := func(what string, want string, f func(tx pgx.Tx) error) {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := f(tx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		var v string
		if err := tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&v); err != nil {
			t.Fatal(err)
		}
		if v != want {
			t.Errorf("%s: synchronous_commit = %q, want %q", what, v, want)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	params := func(holder string, wkey int64) dbsqlc.QueueGrantParams {
		return dbsqlc.QueueGrantParams{Name: name, Holder: holder, TtlUs: 60e6, Wkey: wkey}
	}
	var first dbsqlc.QueueGrantRow
	inTx("QueueGrant that grants", "on", func(tx pgx.Tx) (err error) {
		first, err = q.QueueGrant(ctx, tx, params("a", 1001))
		if err == nil && !first.Granted {
			err = errors.New("not granted")
		}
		return err
	})
	inTx("QueueGrant that queues", "off", func(tx pgx.Tx) error {
		r, err := q.QueueGrant(ctx, tx, params("b", 1002))
		if err == nil && r.Granted {
			err = errors.New("granted a held lock")
		}
		return err
	})
	inTx("release that hands off", "on", func(tx pgx.Tx) error {
		r, err := q.ReleaseLock(ctx, tx, dbsqlc.ReleaseLockParams{Name: name, Holder: "a", Token: first.Token})
		if err == nil && !r.HandedOff {
			err = errors.New("no handoff")
		}
		return err
	})
	inTx("plain release", "off", func(tx pgx.Tx) error {
		r, err := q.ReleaseLock(ctx, tx, dbsqlc.ReleaseLockParams{Name: name, Holder: "b", Token: first.Token + 1})
		if err == nil && r.HandedOff {
			err = errors.New("handed off with nobody queued")
		}
		return err
	})
}

// The handoff notification carries the token and expiry; the waiter trusts
// only a well-formed one addressed to its own key. A malformed one, or one for
// another key, is no lease: the waiter reads the queue (nothing was handed),
// keeps waiting, and gets the real handoff with the next token.
func TestHandoffPayloadChecked(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "handoff-payload"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	s := mustAcquire(t, owner, name, time.Minute)
	w := newLocker(t, pool, &Config{Holder: "w", PollInterval: 30 * time.Second})
	queued := waitSignal(w)
	res := acquireAsync(ctx, w, name, time.Minute)
	<-queued
	var wkey int64
	if err := pool.QueryRow(ctx, "SELECT wkey FROM pgfence.lock_queue WHERE name = $1", name).Scan(&wkey); err != nil {
		t.Fatal(err)
	}
	// Each one wakes the waiter (its poll interval is 30s: a new sleep within
	// 10s comes from the notification); it looks, finds nothing handed and
	// sleeps again, still queued.
	for _, p := range []string{
		fmt.Sprint(wkey),                   // no token nor expiry: read, nothing handed
		fmt.Sprintf("%d x 1", wkey),        // token not a number
		fmt.Sprintf("%d 0 1", wkey),        // token 0
		fmt.Sprintf("%d -5 1", wkey),       // negative token
		fmt.Sprintf("%d 99 1 extra", wkey), // four fields
		fmt.Sprintf("%d 99 1e9", wkey),     // expiry not an integer
	} {
		if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", HandoffChannel, p); err != nil {
			t.Fatal(err)
		}
		select {
		case <-queued:
		case r := <-res:
			t.Fatalf("payload %q: waiter returned (%v, %v)", p, r.lease, r.err)
		case <-time.After(10 * time.Second):
			t.Fatalf("payload %q did not wake the waiter", p)
		}
	}
	select {
	case r := <-res:
		t.Fatalf("waiter returned (%v, %v) on a notification that is no handoff", r.lease, r.err)
	default:
	}
	if n := queueLen(t, pool, name); n != 1 {
		t.Fatalf("%d waiters queued, want 1", n)
	}
	if info := inspect(t, pool, name); info.Holder != "owner" || info.Token != s.Token() {
		t.Fatalf("lock changed: %+v", info)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.lease.Token() != s.Token()+1 {
		t.Errorf("handed token %d, want %d", r.lease.Token(), s.Token()+1)
	}
	info := inspect(t, pool, name)
	if !info.Held || info.Holder != "w" || info.Token != r.lease.Token() || !info.ExpiresAt.Equal(r.lease.ExpiresAt()) {
		t.Errorf("row %+v, lease token %d expiry %v", info, r.lease.Token(), r.lease.ExpiresAt())
	}
	if left := time.Until(r.lease.Deadline()); left > time.Minute || left < 50*time.Second {
		t.Errorf("handed lease's local deadline in %v, want within the TTL (1m) and counted from the wait's start", left)
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// Lockers of one pool share one LISTEN connection; it stays while one of them
// is open and goes with the last.
func TestListenerSharedPerPool(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	a, err := New(pool, &Config{Holder: "a"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(pool, &Config{Holder: "b"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	c := newLocker(t, pool, &Config{Holder: "c"})
	hold := mustAcquire(t, c, "shared-a", time.Minute)
	hold2 := mustAcquire(t, c, "shared-b", time.Minute)
	ra := acquireAsync(ctx, a, "shared-a", time.Minute)
	rb := acquireAsync(ctx, b, "shared-b", time.Minute)
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for end := time.Now().Add(20 * time.Second); !ok(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitFor("both waiters queued", func() bool { return queueLen(t, pool, "shared-a") == 1 && queueLen(t, pool, "shared-b") == 1 })
	waitFor("the listener", func() bool { return a.lis.isUp() && b.lis.isUp() })
	if n := listenBackends(t, pool); n != 1 {
		t.Fatalf("%d LISTEN connections for three Lockers of one pool, want 1", n)
	}
	if err := hold.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-ra; r.err != nil {
		t.Fatal(r.err)
	} else if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	// b and c still use it: b's waiter is woken through it.
	if err := hold2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-rb:
		if r.err != nil {
			t.Fatal(r.err)
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second): // far below the 1s poll fallback × 5: the wake-up came by NOTIFY
		t.Fatal("b's waiter not woken after a closed")
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor("no LISTEN connection after the last Locker closed", func() bool { return listenBackends(t, pool) == 0 })
	shared.mu.Lock()
	_, left := shared.m[pool]
	shared.mu.Unlock()
	if left {
		t.Error("the pool's shared listener is still registered")
	}
}
