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

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// queueLen counts the live, ungranted waiters of name.
func queueLen(t testing.TB, db pgfence.DBTX, name string) int {
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
	// 300 ms, its queue row alive for 10 s), both queued before a live waiter.
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until) VALUES
		(-1, $1, 'gone-long-ago', sha256('gone-long-ago''s key'), 300000, now() - interval '1 second'),
		(-2, $1, 'gone-just-now', sha256('gone-just-now''s key'), 300000, now() + interval '10 seconds')`, name); err != nil {
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
	left := make(chan string, 1)
	quitter.detachedHook = func(name string) { left <- name }
	qctx, cancel := context.WithCancel(ctx)
	res := acquireAsync(qctx, quitter, name, time.Minute)
	<-queued
	cancel()
	// Cancelled in its sleep it returns ErrLocked, during a round trip
	// (a wake-up, such as the listener's first connection, may have started
	// one) a database *pgfence.Error; both match the context's error.
	if r := <-res; !errors.Is(r.err, context.Canceled) || r.lease != nil {
		t.Fatalf("cancelled waiter: %v, %v", r.lease, r.err)
	}
	if got := queueLen(t, pool, name); got != 0 {
		// Cancelled during a queueing statement, it leaves the queue once
		// that statement has answered (it is not cancelled).
		select {
		case <-left:
		case <-ctx.Done():
			t.Fatalf("the waiter that gave up is still queued (%d), and it was not detached", got)
		}
		if got := queueLen(t, pool, name); got != 0 {
			t.Fatalf("the waiter that gave up is still queued (%d)", got)
		}
	}

	// A lease handed to a waiter that leaves is given back and handed on.
	w := &waiter{wkey: 4242, waitID: 77}
	if _, locked, _, err := quitter.grant(ctx, "pglock.Acquire", name, time.Minute, attemptWait, w); err != nil || locked == nil {
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
	if !quitter.leaveQueue(name, w.wkey, w.waitID, 0) {
		t.Fatal("leaving the queue failed")
	}
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
		return dbsqlc.QueueGrantParams{Name: name, Holder: holder, TtlUs: 60e6, Key: floorKey(holder), Wkey: wkey}
	}
	var first dbsqlc.QueueGrantRow
	inTx("QueueGrant that grants", "on", func(tx pgx.Tx) (err error) {
		first, err = q.QueueGrant(ctx, tx, params("a", 1001))
		if err == nil && !first.Granted.Bool {
			err = errors.New("not granted")
		}
		return err
	})
	inTx("QueueGrant that queues", "off", func(tx pgx.Tx) error {
		r, err := q.QueueGrant(ctx, tx, params("b", 1002))
		if err == nil && r.Granted.Bool {
			err = errors.New("granted a held lock")
		}
		return err
	})
	inTx("release that hands off", "on", func(tx pgx.Tx) error {
		r, err := q.ReleaseLock(ctx, tx, dbsqlc.ReleaseLockParams{Name: name, Token: first.Token.Int64, Key: floorKey("a")})
		if err == nil && !r.HandedOff.Bool {
			err = errors.New("no handoff")
		}
		return err
	})
	inTx("plain release", "off", func(tx pgx.Tx) error {
		r, err := q.ReleaseLock(ctx, tx, dbsqlc.ReleaseLockParams{Name: name, Token: first.Token.Int64 + 1, Key: floorKey("b")})
		if err == nil && (r.HandedOff.Bool || !r.Released.Bool) {
			err = errors.New("handed off with nobody queued")
		}
		return err
	})
}

// The handoff notification carries the token and expiry; the waiter trusts
// only a well-formed one addressed to its own key and the id of its own
// wait. A malformed one, or one for another wait, is no lease: the waiter reads the queue (nothing was handed),
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
	var wkey, wait int64
	if err := pool.QueryRow(ctx, "SELECT wkey, wait_id FROM pgfence.lock_queue WHERE name = $1", name).Scan(&wkey, &wait); err != nil {
		t.Fatal(err)
	}
	// Each one wakes the waiter (its poll interval is 30s: a new sleep within
	// 10s comes from the notification); it looks, finds nothing handed and
	// sleeps again, still queued.
	for _, p := range []string{
		fmt.Sprint(wkey),                            // no wait id, token nor expiry: read, nothing handed
		fmt.Sprintf("%d %d x 1", wkey, wait),        // token not a number
		fmt.Sprintf("%d %d 0 1", wkey, wait),        // token 0
		fmt.Sprintf("%d %d -5 1", wkey, wait),       // negative token
		fmt.Sprintf("%d %d 99 1 extra", wkey, wait), // five fields
		fmt.Sprintf("%d %d 99 1e9", wkey, wait),     // expiry not an integer
		fmt.Sprintf("%d 99 1", wkey),                // no wait id (three fields)
		fmt.Sprintf("%d %d 99 1", wkey, wait+1),     // another wait of the key
		fmt.Sprintf("%d 0 99 1", wkey),              // wait id 0
	} {
		if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", handoffChannel, p); err != nil {
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

// queueRows returns wkey, ticket, granted_token (-1 for NULL) and wait_id of
// every queue row of name, in ticket order.
func queueRows(t testing.TB, db pgfence.DBTX, name string) [][4]int64 {
	t.Helper()
	rows, err := db.Query(context.Background(),
		"SELECT wkey, ticket, coalesce(granted_token, -1), wait_id FROM pgfence.lock_queue WHERE name = $1 ORDER BY ticket", name)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([4]int64, error) {
		var v [4]int64
		err := r.Scan(&v[0], &v[1], &v[2], &v[3])
		return v, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// A Locker's next wait of a name reuses the queue row of its last one (same
// key; new ticket and wait id) instead of inserting another; the lease handed to the
// earlier wait, still held, is never returned to the new one, which waits for
// its own handoff with the next token.
func TestQueueRowReused(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, time.Minute)
	const name = "queue-reuse"
	owner := newLocker(t, pool, &Config{Holder: "owner"})
	s := mustAcquire(t, owner, name, time.Minute)
	a := newLocker(t, pool, &Config{Holder: "a", PollInterval: 30 * time.Second})
	waiting := waitSignal(a)
	res := acquireAsync(ctx, a, name, time.Minute)
	<-waiting
	first := queueRows(t, pool, name)
	if len(first) != 1 || first[0][2] != -1 {
		t.Fatalf("queue rows %v, want one waiting row", first)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil || r.lease.Token() != s.Token()+1 {
		t.Fatalf("first wait: %v, %v; want token %d", r.lease, r.err, s.Token()+1)
	}
	held := r.lease
	if rows := queueRows(t, pool, name); len(rows) != 1 || rows[0] != [4]int64{first[0][0], first[0][1], held.Token(), first[0][3]} {
		t.Fatalf("after the handoff the queue rows are %v, want %v with granted_token %d", rows, first, held.Token())
	}
	// The ended wait's row is kept 10 seconds for the next wait, then a
	// release deletes it.
	var keptFor time.Duration
	if err := pool.QueryRow(ctx, "SELECT alive_until - now() FROM pgfence.lock_queue WHERE name = $1", name).Scan(&keptFor); err != nil {
		t.Fatal(err)
	}
	if keptFor <= 0 || keptFor > 10*time.Second {
		t.Fatalf("the ended wait's row is kept for %v more, want at most 10s", keptFor)
	}

	// The same Locker waits again while it still holds the handed lease:
	// its queue row is handed token held.Token(), but that is the earlier
	// wait's lease. The first wait may have signalled more than once (a
	// release wake-up beaten by its own handoff, then the handoff): drop
	// those signals, so that the next one is the second wait's.
	drainSignals(waiting)
	res = acquireAsync(ctx, a, name, time.Minute)
	<-waiting
	second := queueRows(t, pool, name)
	if len(second) != 1 || second[0][0] != first[0][0] || second[0][1] <= first[0][1] || second[0][2] != -1 || second[0][3] == first[0][3] {
		t.Fatalf("second wait: queue rows %v, want the row of key %d again, waiting, with a ticket after %d and a new wait id",
			second, first[0][0], first[0][1])
	}
	select {
	case r := <-res:
		t.Fatalf("the second wait returned (%v, %v) while the first wait's lease is held", r.lease, r.err)
	default:
	}
	// A late notification of the first handoff is no lease for the second wait.
	late := fmt.Sprintf("%d %d %d %d", first[0][0], first[0][3], held.Token(), held.ExpiresAt().UnixMicro())
	if _, err := pool.Exec(ctx, "SELECT pg_notify($1, $2)", handoffChannel, late); err != nil {
		t.Fatal(err)
	}
	select {
	case <-waiting:
	case r := <-res:
		t.Fatalf("the late notification %q ended the second wait: %v, %v", late, r.lease, r.err)
	}
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r = <-res
	if r.err != nil || r.lease.Token() != held.Token()+1 {
		t.Fatalf("second wait: %v, %v; want token %d", r.lease, r.err, held.Token()+1)
	}
	if info := inspect(t, pool, name); info.Holder != "a" || info.Token != r.lease.Token() {
		t.Fatalf("lock %+v, want a holding token %d", info, r.lease.Token())
	}
	if rows := queueRows(t, pool, name); len(rows) != 1 || rows[0][2] != r.lease.Token() {
		t.Fatalf("queue rows %v, want the one row with granted_token %d", rows, r.lease.Token())
	}
	if err := r.lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// Clients looping on one name keep one queue row each: each inserts its row
// once and reuses it for every later wait (no row is deleted), and the name
// never has more rows than clients.
func TestQueueRowsBoundedByWaiters(t *testing.T) {
	t.Parallel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	ctx := testCtx(t, 2*time.Minute)
	const (
		clients = 4
		rounds  = 30
		name    = "queue-bounded"
	)
	// Count the row inserts and deletes of pgfence.lock_queue (this test's
	// own database).
	if _, err := pool.Exec(ctx, `
		CREATE TABLE public.queue_changes (op text PRIMARY KEY, n bigint NOT NULL);
		INSERT INTO public.queue_changes VALUES ('INSERT', 0), ('DELETE', 0);
		CREATE FUNCTION public.count_queue_change() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN UPDATE public.queue_changes SET n = n + 1 WHERE op = TG_OP; RETURN NULL; END $$;
		CREATE TRIGGER count_changes AFTER INSERT OR DELETE ON pgfence.lock_queue
		FOR EACH ROW EXECUTE FUNCTION public.count_queue_change()`); err != nil {
		t.Fatal(err)
	}
	// A gate holds the lock until every client waits for it, so the run
	// contends however the clients are scheduled.
	gate := mustAcquire(t, newLocker(t, pool, &Config{Holder: "gate"}), name, time.Minute)
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	var signals []<-chan string
	for c := range clients {
		l := newLocker(t, pool, &Config{Holder: fmt.Sprintf("c%d", c)})
		signals = append(signals, waitSignal(l))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				s, err := l.Acquire(ctx, name, time.Minute)
				if err != nil {
					errs <- err
					return
				}
				if err := s.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for _, waiting := range signals {
		select {
		case <-waiting:
		case err := <-errs:
			t.Fatal(err)
		}
	}
	if err := gate.Release(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var rows, keys int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT wkey) FROM pgfence.lock_queue WHERE name = $1", name).Scan(&rows, &keys); err != nil {
		t.Fatal(err)
	}
	if rows > clients {
		t.Errorf("%d queue rows (%d keys) after %d acquires by %d clients, want at most one per client", rows, keys, clients*rounds, clients)
	}
	if n := queueLen(t, pool, name); n != 0 {
		t.Errorf("%d rows still waiting after every client finished", n)
	}
	var inserts, deletes, waited int
	if err := pool.QueryRow(ctx, `SELECT (SELECT n FROM public.queue_changes WHERE op = 'INSERT'),
		(SELECT n FROM public.queue_changes WHERE op = 'DELETE'),
		(SELECT token FROM pgfence.locks WHERE name = $1)`, name).Scan(&inserts, &deletes, &waited); err != nil {
		t.Fatal(err)
	}
	if inserts > clients || deletes != 0 {
		t.Errorf("%d queue rows inserted and %d deleted over %d grants by %d clients, want at most one insert per client and no delete",
			inserts, deletes, waited, clients)
	}
	if inserts == 0 {
		t.Errorf("no client ever waited in %d grants: the test did not contend", waited)
	}
}
