package pglock

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// floorRingSize is the number of clients passing the lease around in the
// ring variants of BenchmarkHandoffFloor (B2's 8 clients).
const floorRingSize = 8

// floorHandoffSQL hands the lease of $2, held by ($3, $4), to holder $1 in
// one single-row UPDATE of pgfence.locks (waiting for the flush as a grant
// must) and notifies the next client ($5).
const floorHandoffSQL = `UPDATE pgfence.locks AS l
SET token = l.token + 1, holder = $1::text, acquired_at = now(), renewed_at = NULL,
    expires_at = now() + interval '1 minute'
FROM (SELECT set_config('synchronous_commit', 'on', true) AS sync) AS sc
WHERE l.name = $2::text AND l.holder = $3::text AND l.token = $4::bigint AND l.expires_at > now()
RETURNING l.token, pg_notify('pgfence_floor', $5::text || ' ' || l.token::text)`

// floorKey is the lease key of a bench client: its holder name, padded to
// the 16 bytes a key needs at least.
func floorKey(holder string) []byte { return []byte(fmt.Sprintf("%-16s", holder)) }

// floorGrant grants name to holder (with its floorKey) and returns the token;
// a refusal is an error.
func floorGrant(ctx context.Context, q *dbsqlc.Queries, db dbsqlc.DBTX, name, holder string, ttlUs int64) (int64, error) {
	r, err := q.GrantLock(ctx, db, dbsqlc.GrantLockParams{Name: name, Holder: holder, TtlUs: ttlUs, Key: floorKey(holder)})
	if err == nil && !r.Token.Valid {
		err = fmt.Errorf("grant of %s refused: held by %v", name, r.HeldBy)
	}
	return r.Token.Int64, err
}

// BenchmarkHandoffFloor measures, in SQL alone and side by side, what a
// hot lock name can do on this server, to set a target for the handoff:
//
//   - barging: one connection releases and grants again
//     (ReleaseLock + GrantLock), as a polling client that releases
//     and asks again at once does, so nobody else is ever served;
//   - ring: 8 clients pass the lease on in FIFO order, each handoff one
//     single-row UPDATE of the lock row (floorHandoffSQL) plus a
//     notification, the least a queue served in order can cost;
//   - ringrequeue: the ring, with each client queueing again (QueueGrant,
//     on a lock held by nobody in the ring) after it passed the lease on,
//     as a waiter of a queue served in order must announce every wait: the
//     least such a queue can cost, with the statement pglock queues with;
//   - releaselock: the same ring through pglock's own statements: the
//     holder's ReleaseLock hands the lease to the first queued waiter, and
//     the holder queues again with QueueGrant.
//
// Each variant makes b.N grants, in three alternating rounds so all of them
// see the same machine. Reported: grants/s of each, and each ÷ barging. A
// ring at or above barging says a FIFO handoff can outrun polling on this
// server; ringrequeue below ring is the cost of queueing every wait;
// releaselock below ringrequeue is the rest of pglock's handoff statement.
//
// Every grant waits for a WAL flush, the largest part of each step, so run
// it against a server with fsync on (the tests' own throwaway cluster runs
// with fsync off): PGFENCE_TEST_DATABASE_URL names one.
//
//	PGFENCE_TEST_DATABASE_URL=postgres://... go test -run '^$' -bench HandoffFloor -benchtime 3000x ./pglock/
func BenchmarkHandoffFloor(b *testing.B) {
	pool := benchPoolN(b, 2*floorRingSize+8)
	ctx := benchCtx(b)
	var spent [4]time.Duration
	var grants [4]int
	b.ResetTimer()
	for round := range 3 {
		n := b.N / 3
		if round == 2 {
			n = b.N - 2*(b.N/3)
		}
		if n == 0 {
			continue
		}
		for v, run := range []func(context.Context, *pgxpool.Pool, string, int) (time.Duration, error){
			floorBarging, floorRing, floorRingRequeue, floorReleaseLock,
		} {
			d, err := run(ctx, pool, fmt.Sprintf("floor-%d-%d", round, v), n)
			if err != nil {
				b.Fatal(err)
			}
			spent[v] += d
			grants[v] += n
		}
	}
	b.StopTimer()
	rate := func(v int) float64 { return float64(grants[v]) / spent[v].Seconds() }
	b.ReportMetric(rate(0), "barging-grants/s")
	b.ReportMetric(rate(1), "ring-grants/s")
	b.ReportMetric(rate(2), "ringrequeue-grants/s")
	b.ReportMetric(rate(3), "releaselock-grants/s")
	b.ReportMetric(rate(1)/rate(0), "ring/barging")
	b.ReportMetric(rate(2)/rate(0), "ringrequeue/barging")
	b.ReportMetric(rate(3)/rate(0), "releaselock/barging")
}

// floorBarging times n grants of name on one connection, each after a
// release by the same client.
func floorBarging(ctx context.Context, pool *pgxpool.Pool, name string, n int) (time.Duration, error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer c.Release()
	q := dbsqlc.New()
	const holder = "barger"
	r, err := floorGrant(ctx, q, c, name, holder, time.Minute.Microseconds())
	if err != nil {
		return 0, err
	}
	token := r
	t0 := time.Now()
	for range n {
		if res, err := q.ReleaseLock(ctx, c, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: floorKey(holder)}); err != nil || !res.Released.Bool {
			return 0, fmt.Errorf("release: %v %w", res, err)
		}
		g, err := floorGrant(ctx, q, c, name, holder, time.Minute.Microseconds())
		if err != nil {
			return 0, fmt.Errorf("grant: %w", err)
		}
		token = g
	}
	return time.Since(t0), nil
}

// floorRing times n single-statement handoffs of name around a ring of
// floorRingSize clients. Every client has a live queue row that is never
// handed anything, as ReleaseLock's handoff needs.
func floorRing(ctx context.Context, pool *pgxpool.Pool, name string, n int) (time.Duration, error) {
	return floorRingWith(ctx, pool, name, n, false)
}

// floorRingRequeue is floorRing with every client queueing again after each
// pass: a QueueGrant with a new wait id on name + "-requeue", a lock held by
// a client outside the ring for the whole run, so that it queues (updates
// its row in place, as a Locker's next wait does) and never grants.
func floorRingRequeue(ctx context.Context, pool *pgxpool.Pool, name string, n int) (time.Duration, error) {
	return floorRingWith(ctx, pool, name, n, true)
}

func floorRingWith(ctx context.Context, pool *pgxpool.Pool, name string, n int, requeue bool) (time.Duration, error) {
	q := dbsqlc.New()
	requeueName := name + "-requeue"
	base := time.Now().UnixNano() % (1 << 40) << 8
	var seq atomic.Int64
	if requeue {
		if _, err := floorGrant(ctx, q, pool, requeueName, "outside", time.Hour.Microseconds()); err != nil {
			return 0, err
		}
	}
	holder := func(i int) string { return "ring-" + strconv.Itoa(i) }
	r, err := floorGrant(ctx, q, pool, name, holder(0), time.Minute.Microseconds())
	if err != nil {
		return 0, err
	}
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until)
		SELECT $1::bigint + g, $2::text, 'ring-' || g, sha256(convert_to(rpad('ring-' || g, 16), 'UTF8')), 60000000, now() + interval '1 hour'
		FROM generate_series(0, $3::int - 1) AS g`, base, name, floorRingSize); err != nil {
		return 0, err
	}
	return floorRun(ctx, pool, "pgfence_floor", n, r, func(payload string) (int, int64, bool) {
		f := strings.Fields(payload)
		if len(f) != 2 {
			return 0, 0, false
		}
		i, err1 := strconv.Atoi(f[0])
		t, err2 := strconv.ParseInt(f[1], 10, 64)
		return i, t, err1 == nil && err2 == nil
	}, func(ctx context.Context, i int, token int64) error {
		next := (i + 1) % floorRingSize
		var got int64
		var sent string
		err := pool.QueryRow(ctx, floorHandoffSQL, holder(next), name, holder(i), token, strconv.Itoa(next)).Scan(&got, &sent)
		if err != nil || !requeue {
			return err
		}
		// The client's requeue key: base + floorRingSize + i, next to the
		// ring's rows (base + i).
		row, err := q.QueueGrant(ctx, pool, dbsqlc.QueueGrantParams{
			Wkey: base + floorRingSize + int64(i), WaitID: seq.Add(1), Holder: holder(i),
			TtlUs: time.Minute.Microseconds(), Name: requeueName, Key: floorKey(holder(i)),
		})
		if err == nil && row.Granted.Bool {
			err = errors.New("a requeueing ring client was granted the lock held outside the ring")
		}
		return err
	})
}

// floorReleaseLock times n handoffs of name around a ring of floorRingSize
// clients through pglock's statements: ReleaseLock hands the lease to the
// first queued waiter and notifies it on handoffChannel; the releasing
// client then queues again with QueueGrant, reusing its row (its key, a new
// wait id) as a Locker does.
func floorReleaseLock(ctx context.Context, pool *pgxpool.Pool, name string, n int) (time.Duration, error) {
	q := dbsqlc.New()
	holder := func(i int) string { return "rl-" + strconv.Itoa(i) }
	base := time.Now().UnixNano() % (1 << 40) << 8
	var seq atomic.Int64
	queue := func(ctx context.Context, i int) error {
		// The key of client i is base + i.
		row, err := q.QueueGrant(ctx, pool, dbsqlc.QueueGrantParams{
			Wkey: base + int64(i), WaitID: seq.Add(1), Holder: holder(i), TtlUs: time.Minute.Microseconds(), Name: name,
			Key: floorKey(holder(i)),
		})
		if err == nil && row.Granted.Bool {
			err = errors.New("a queueing client was granted the lease")
		}
		return err
	}
	r, err := floorGrant(ctx, q, pool, name, holder(0), time.Minute.Microseconds())
	if err != nil {
		return 0, err
	}
	for i := 1; i < floorRingSize; i++ {
		if err := queue(ctx, i); err != nil {
			return 0, err
		}
	}
	return floorRun(ctx, pool, handoffChannel, n, r, func(payload string) (int, int64, bool) {
		f := strings.Fields(payload) // "wkey wait_id token expiry_us"
		if len(f) != 4 {
			return 0, 0, false
		}
		wkey, err1 := strconv.ParseInt(f[0], 10, 64)
		t, err2 := strconv.ParseInt(f[2], 10, 64)
		return int(wkey - base), t, err1 == nil && err2 == nil && wkey >= base && wkey < base+floorRingSize
	}, func(ctx context.Context, i int, token int64) error {
		res, err := q.ReleaseLock(ctx, pool, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: floorKey(holder(i))})
		if err != nil {
			return err
		}
		if !res.HandedOff.Bool {
			return errors.New("ReleaseLock handed the lease to nobody")
		}
		return queue(ctx, i)
	})
}

// floorRun runs a ring: client 0 holds token first; every client, given
// the lease (a notification on channel that parse maps to it), calls pass
// to hand it on. It returns the time from the first pass until n grants
// (handoffs) have been made.
func floorRun(ctx context.Context, pool *pgxpool.Pool, channel string, n int, first int64,
	parse func(payload string) (client int, token int64, ok bool),
	pass func(ctx context.Context, client int, token int64) error) (time.Duration, error) {
	lc, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer lc.Release()
	if _, err := lc.Exec(ctx, "LISTEN "+channel); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	turns := make([]chan int64, floorRingSize)
	for i := range turns {
		turns[i] = make(chan int64, 1)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the listener: one connection for the ring, as pglock shares one per pool
		defer wg.Done()
		for {
			nt, err := lc.Conn().WaitForNotification(ctx)
			if err != nil {
				return
			}
			if i, t, ok := parse(nt.Payload); ok {
				turns[i] <- t
			}
		}
	}()
	var made atomic.Int64
	done := make(chan struct{})
	errc := make(chan error, floorRingSize)
	turns[0] <- first
	t0 := time.Now()
	var elapsed time.Duration
	for i := range floorRingSize {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var token int64
				select {
				case token = <-turns[i]:
				case <-done:
					return
				case <-ctx.Done():
					return
				}
				if err := pass(ctx, i, token); err != nil {
					errc <- err
					return
				}
				if made.Add(1) == int64(n) {
					elapsed = time.Since(t0)
					close(done)
					return
				}
			}
		}()
	}
	select {
	case <-done:
	case err = <-errc:
	}
	cancel()
	wg.Wait()
	// The listening connection's wait was cancelled: close it (the pool
	// drops a closed connection when it is released).
	_ = lc.Conn().Close(context.Background())
	return elapsed, err
}

// BenchmarkHotNameStatements times, one after another on one connection, the
// statements a hot name costs per grant in LISTEN mode, so that their share
// can be compared: a waiter's QueueGrant that queues it (no flush), the
// holder's ReleaseLock that hands the lease to it (a grant: flushed), its
// own ReleaseLock with nobody queued (no flush), and the GrantLock that
// takes the lock back (flushed). Reported: microseconds per statement of
// each kind. Run it against a server with fsync on, as BenchmarkHandoffFloor:
//
//	PGFENCE_TEST_DATABASE_URL=postgres://... go test -run '^$' -bench HotNameStatements -benchtime 2000x ./pglock/
func BenchmarkHotNameStatements(b *testing.B) {
	pool := benchPoolN(b, 1)
	ctx := benchCtx(b)
	q := dbsqlc.New()
	name := fmt.Sprintf("hot-statements-%d", time.Now().UnixNano())
	const ttlUs = int64(60e6)
	r, err := floorGrant(ctx, q, pool, name, "holder", ttlUs)
	if err != nil {
		b.Fatal(err)
	}
	token := r
	// A key unique to this run, reused with a new wait id by every wait, as
	// a Locker does.
	wkey := time.Now().UnixNano() % (1 << 40) << 16
	var spent [4]time.Duration
	timed := func(k int, f func() error) {
		t0 := time.Now()
		if err := f(); err != nil {
			b.Fatalf("statement %d: %v", k, err)
		}
		spent[k] += time.Since(t0)
	}
	b.ResetTimer()
	for i := range b.N {
		timed(0, func() error {
			row, err := q.QueueGrant(ctx, pool, dbsqlc.QueueGrantParams{Name: name, Holder: "waiter", TtlUs: ttlUs, Key: floorKey("waiter"), Wkey: wkey, WaitID: int64(i) + 1})
			if err == nil && row.Granted.Bool {
				err = errors.New("QueueGrant granted a held lock")
			}
			return err
		})
		timed(1, func() error {
			res, err := q.ReleaseLock(ctx, pool, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: floorKey("holder")})
			if err == nil && !res.HandedOff.Bool {
				err = errors.New("ReleaseLock handed the lease to nobody")
			}
			token++
			return err
		})
		timed(2, func() error {
			res, err := q.ReleaseLock(ctx, pool, dbsqlc.ReleaseLockParams{Name: name, Token: token, Key: floorKey("waiter")})
			if err == nil && res.HandedOff.Bool {
				err = errors.New("ReleaseLock handed the lease over with nobody queued")
			}
			return err
		})
		timed(3, func() error {
			g, err := floorGrant(ctx, q, pool, name, "holder", ttlUs)
			token = g
			return err
		})
	}
	b.StopTimer()
	for k, unit := range []string{"queuegrant-us", "handoff-us", "release-us", "grant-us"} {
		b.ReportMetric(float64(spent[k].Microseconds())/float64(b.N), unit)
	}
}
