package pglock

import (
	"cmp"
	"context"
	"errors"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// Coalescing. The non-waiting grants (TryAcquire, the first attempt of
// Acquire) and the releases of a Locker each go through a coalescer: while
// maxInFlight statements of the kind are out, further calls queue, and when
// one returns the queued calls (up to maxCoalesce) go out as one statement
// (pgfence.lock_grant_many, pgfence.lock_release_many), one commit for all of
// them. There is no timer: a call that finds a statement slot free takes it,
// yields the processor once (runtime.Gosched) if other calls of the Locker
// are in progress, and is sent, on its own goroutine and through the
// single-lease statement when nothing queued meanwhile; a lone caller sends
// at once, and a busy process batches by itself.
//
// The yield: when a batch statement returns, its callers wake together and
// most of them call again at once (a release after its grant, a grant after
// its release); the first to find the slot free would go out alone and the
// others queue behind it, two statements where one does. Goroutines that are
// ready to run get to queue first, and go out with it (a queued call like
// theirs from then on: on the coalescer's context, not its caller's).
// Measured with a version that yielded on every call, acquire+release cycles
// on distinct names, one Locker, 2 cores, fsync on, alternating rounds in
// one process (where other calls are nearly always in progress): 1.07 to
// 1.16 times the cycles/s at 8 clients and 1.10 to 1.24 at 32 (more of the
// calls carried by batch statements). Only a call that finds other calls of its Locker in progress
// (inCalls) yields: a Locker with one caller at a time, as each client's
// own Locker on a hot name, sends as it did before, with nothing to batch.
//
// Every call gets its own result: the many-functions answer per element, as
// the single functions would have answered one call each, in the byte order
// of the names (one lock order for every statement). A statement that fails
// (a connection lost mid-statement: the outcome is unknown) fails every call
// it carried with that error, as it would have failed each of them alone.

// maxCoalesce bounds the calls one statement carries. A statement holds the
// row locks of every name it grants or releases until it commits, and its
// calls all wait for the slowest element: the bound keeps that time (a plpgsql
// loop of maxCoalesce single-row updates, well under a millisecond) small
// next to the commit it shares. At 64 the commit is already shared by enough
// calls that a larger batch saves little more.
const maxCoalesce = 64

// maxInFlight is how many statements of one kind a Locker has out at once:
// a call that finds none out is sent at once; the others queue and go out
// together when it returns (Kafka's max.in.flight, at 1). A grant statement
// and a release statement can still be out at the same time (one coalescer
// each). One was measured against two with acquire+release cycles on
// distinct names, one Locker, 2 cores: 1.1 to 1.4 times the cycles/s at 8
// and at 32 clients with less CPU per cycle, because the calls that queue
// behind a statement share the next one instead of paying for a statement
// of their own (the server's CPU per statement, not its commit wait, bounds
// these rates). A lone caller finds no statement out and waits for nothing.
// Two variants did not pay (two alternations each, 4 s runs): a second
// statement sent as soon as 8 calls had queued (0.57 to 0.97 times the
// cycles/s at 32 and 128 clients; at 16 calls 0.66 to 1.28, no clear gain),
// and a second single-lease statement while the one out carries a lone call
// (1.3 to 1.4 times with 4 processes of 2 clients each, but 0.64 to 0.68
// times with 4 processes of 8 and 0.78 to 0.99 with one of 8).
const maxInFlight = 1

// coalesceCall is one call waiting in a coalescer.
type coalesceCall[Req, Res any] struct {
	req  Req
	done chan struct{} // closed once res, sent and err are set
	res  Res
	sent time.Time // when its statement was sent (zero if never sent)
	err  error
	// panicked holds what a panic under its statement (user code: a pool
	// hook or a tracer) was called with, re-raised in the caller's
	// goroutine as a statement of its own would have; nil if none.
	panicked any

	// Under the coalescer's mu.
	state  callState
	flight *flight // the statement it went out in
}

type callState uint8

const (
	callQueued callState = iota
	callSent
	callGone // abandoned: its context ended
)

// flight is one batch statement out, with the number of its calls still
// waiting for it: when all of them gave up, its context is cancelled, unless
// the coalescer has an orphan handler (the grants): cancelling a statement
// does not stop the server from committing it (pgx sends a cancel request
// and closes the connection, but a cancel that arrives before the statement,
// or once it is committing, changes nothing), and a grant committed so would
// stay held by nobody until its TTL. Such a statement is left to run to its end on its
// own (abandoned is closed: the slot goes on with the next calls), is
// cancelled once the longest TTL it asked for has passed after that, or once
// Close has waited for it (closeWait: the Locker's abortCtx, so that the
// pool can be closed right after Close), and the grants of the calls that
// gave up are released when it returns. A grant it commits after that
// cancel anyway (the server may commit a statement whose cancel it never
// saw, or saw too late) stays held by nobody until its TTL; Close logs it.
type flight struct {
	waiting   int
	cancel    context.CancelFunc
	abandoned chan struct{} // closed when waiting reaches 0 (orphan coalescers only)
	bound     time.Duration // the longest bound of its calls
	timer     *time.Timer   // cancels it bound after it was abandoned (under the coalescer's mu)
}

// coalescer sends the calls of one kind. one runs a single call (the
// single-lease statement, on the caller's context); many runs a batch of at
// least two, sorted by name, and returns one result per call, in order.
type coalescer[Req, Res any] struct {
	l    *Locker
	name func(Req) string
	one  func(ctx context.Context, conn *pgxpool.Conn, r Req) (Res, error)
	many func(ctx context.Context, conn *pgxpool.Conn, rs []Req) ([]Res, error)
	// orphan, when set, is given the result of each call whose statement
	// succeeded after its caller had given up (its context ended while the
	// statement was out): the grant coalescer releases such a lease, which
	// nobody holds a Lease for. It runs on the sending goroutine.
	orphan func(Req, Res)
	// bound, required with orphan, bounds the statement of a batch whose
	// callers all gave up: the longest bound of its calls (a grant's TTL:
	// a grant committed later has ended already).
	bound func(Req) time.Duration

	mu       sync.Mutex
	inFlight int // statements out (at most maxInFlight)
	queue    []*coalesceCall[Req, Res]

	// statements counts the batch statements sent (tests).
	statements int
	// queuedHook, when set (tests), is called with the queue's length each
	// time a call queues.
	queuedHook func(n int)
	// orphanHook, when set (tests), is called after orphan returns.
	orphanHook func()
	// yield, when set (tests), replaces the runtime.Gosched a call that
	// finds a free slot runs before it sends.
	yield func()
	// abandon, when set, makes a queued call give up as if its context
	// ended once it is closed, with errCoalescerClosed: the grant
	// coalescer's calls give up when the Locker closes (the releases are
	// still sent).
	abandon <-chan struct{}
}

// errCoalescerClosed is a queued call's error when abandon closed.
var errCoalescerClosed = errors.New("pglock: Locker closed")

// errBatchPanic is the error send returns when a panic under its statement
// was recovered (and re-raised in the callers: answer).
var errBatchPanic = errors.New("pglock: a panic under a batch statement (a pool hook or tracer)")

// do runs r and returns its result and the send time of its statement.
func (c *coalescer[Req, Res]) do(ctx context.Context, r Req) (Res, time.Time, error) {
	// Other calls of the Locker in progress: callers a returning statement
	// woke may be about to call (see yield).
	busy := c.l.inCalls.Add(1) > 1
	defer c.l.inCalls.Add(-1)
	c.mu.Lock()
	if c.inFlight < maxInFlight {
		// A free slot means nothing is queued (a statement that returns
		// takes the queue before it frees its slot): take it, let the
		// goroutines that are ready to run go first if other calls are in
		// progress (see yield), and send.
		c.inFlight++
		c.mu.Unlock()
		if busy {
			if c.yield != nil {
				c.yield()
			} else {
				runtime.Gosched()
			}
		}
		c.mu.Lock()
		if len(c.queue) > 0 {
			// Calls queued behind the slot meanwhile: this call goes out
			// with them, first in the queue, in the slot it holds.
			call := &coalesceCall[Req, Res]{req: r, done: make(chan struct{})}
			c.queue = slices.Insert(c.queue, 0, call)
			c.mu.Unlock()
			c.next()
			return c.wait(ctx, call)
		}
		c.mu.Unlock()
		// The slot is freed however the statement ends: user code runs
		// under onLiveConn (pool hooks, tracers), and a panic recovered
		// above would otherwise hold the slot, and queue every later call
		// of the kind, for good.
		defer c.next()
		var (
			res  Res
			sent time.Time
		)
		err := c.l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
			sent = time.Now()
			res, err = c.one(ctx, conn, r)
			return err
		})
		return res, sent, err
	}
	call := &coalesceCall[Req, Res]{req: r, done: make(chan struct{})}
	c.queue = append(c.queue, call)
	hook, n := c.queuedHook, len(c.queue)
	c.mu.Unlock()
	if hook != nil {
		hook(n)
	}
	return c.wait(ctx, call)
}

// wait waits for a queued call's answer.
func (c *coalescer[Req, Res]) wait(ctx context.Context, call *coalesceCall[Req, Res]) (Res, time.Time, error) {
	gone := error(nil)
	select {
	case <-call.done:
		return call.answer()
	case <-ctx.Done():
		gone = ctx.Err()
	case <-c.abandon:
		gone = errCoalescerClosed
	}
	c.mu.Lock()
	select {
	case <-call.done:
		c.mu.Unlock()
		return call.answer()
	default:
	}
	switch call.state {
	case callQueued:
		// Never sent: nothing happened.
	case callSent:
		// Its statement is out: the outcome is unknown, as when a single
		// statement's context ends. The statement goes on for the others;
		// if none waits any more, it is cancelled (a grant statement is left
		// to finish by itself instead: see flight).
		f := call.flight
		if f.waiting--; f.waiting == 0 {
			if f.abandoned == nil {
				f.cancel()
			} else {
				close(f.abandoned)
				f.timer = time.AfterFunc(f.bound, f.cancel)
			}
		}
	}
	call.state = callGone
	c.mu.Unlock()
	// call's fields are the sender's from here on.
	var zero Res
	return zero, time.Time{}, gone
}

// answer returns a call's answer once done is closed, or re-raises the
// panic of its statement.
func (call *coalesceCall[Req, Res]) answer() (Res, time.Time, error) {
	if call.panicked != nil {
		panic(call.panicked)
	}
	return call.res, call.sent, call.err
}

// next sends the queued calls in the slot of the statement that just
// returned, or frees the slot.
func (c *coalescer[Req, Res]) next() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.queue) == 0 {
		c.inFlight--
		return
	}
	c.l.calls.add()
	go func() {
		defer c.l.calls.done()
		finished := false
		defer func() {
			if !finished {
				// runtime.Goexit under a statement (user code; send ended
				// its calls): the slot goes on with the queue.
				c.next()
			}
		}()
		c.loop()
		finished = true
	}()
}

// loop sends the queued calls, a batch per statement, in one slot until
// none is left.
func (c *coalescer[Req, Res]) loop() {
	for {
		c.mu.Lock()
		var batch []*coalesceCall[Req, Res]
		n := 0
		for _, call := range c.queue {
			if call.state == callGone {
				n++
				continue
			}
			if len(batch) == maxCoalesce {
				break
			}
			batch = append(batch, call)
			n++
		}
		c.queue = slices.Delete(c.queue, 0, n)
		if len(batch) == 0 {
			c.queue = nil
			c.inFlight--
			c.mu.Unlock()
			return
		}
		parent := context.Background()
		if c.orphan != nil {
			// Ended when Close has waited for it (see flight).
			parent = c.l.abortCtx
		}
		ctx, cancel := context.WithCancel(parent)
		f := &flight{waiting: len(batch), cancel: cancel}
		if c.orphan != nil {
			f.abandoned = make(chan struct{})
			for _, call := range batch {
				f.bound = max(f.bound, c.bound(call.req))
			}
		}
		for _, call := range batch {
			call.state, call.flight = callSent, f
		}
		if len(batch) > 1 {
			c.statements++
		}
		c.mu.Unlock()
		if f.abandoned == nil {
			c.send(ctx, batch)
			cancel()
			continue
		}
		// A grant statement whose callers all give up goes on by itself:
		// the slot serves the next calls meanwhile.
		done := make(chan struct{})
		c.l.calls.add()
		go func() {
			defer c.l.calls.done()
			defer close(done)
			// Also after a runtime.Goexit under the statement.
			defer func() {
				c.mu.Lock()
				if f.timer != nil {
					f.timer.Stop()
				}
				c.mu.Unlock()
				cancel()
			}()
			if err := c.send(ctx, batch); err != nil && c.l.abortCtx.Err() != nil &&
				err != errGoexit && err != errBatchPanic {
				// Close has waited for it, then ended it: its callers had
				// gone (ErrClosed), and what it granted is unknown.
				names := make([]string, len(batch))
				for i, call := range batch {
					names[i] = c.name(call.req)
				}
				c.l.log.Warn("pglock: Close ended a grant statement it had waited for; "+
					"a lease it granted anyway stays held until its TTL", "names", names, "err", err)
			}
		}()
		select {
		case <-done:
		case <-f.abandoned:
		}
	}
}

// send runs batch as one statement and hands each call its result. It
// returns the statement's error. A panic under the statement (user code: a
// pool hook or a tracer) ends every call of the batch and is re-raised in
// each caller's goroutine (answer), not in the sender's; so does
// runtime.Goexit, with errGoexit, which then goes on to end the sender.
func (c *coalescer[Req, Res]) send(ctx context.Context, batch []*coalesceCall[Req, Res]) (err error) {
	// One lock order for every statement: by name, then arrival.
	slices.SortStableFunc(batch, func(a, b *coalesceCall[Req, Res]) int {
		return cmp.Compare(c.name(a.req), c.name(b.req))
	})
	var (
		sent time.Time
		res  []Res
	)
	finished := false
	defer func() {
		if finished {
			return
		}
		r := recover() // nil: runtime.Goexit
		err = errGoexit
		if r != nil {
			err = errBatchPanic
		}
		waiting := false
		c.mu.Lock()
		for _, call := range batch {
			call.err, call.panicked = err, r
			waiting = waiting || call.state != callGone
			close(call.done)
		}
		c.mu.Unlock()
		if r != nil && !waiting {
			c.l.log.Error("pglock: a panic under a batch statement whose callers had all given up (a pool hook or tracer)",
				"panic", r)
		}
	}()
	err = c.l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		sent = time.Now()
		if len(batch) == 1 {
			var r Res
			r, err = c.one(ctx, conn, batch[0].req)
			res = []Res{r}
			return err
		}
		reqs := make([]Req, len(batch))
		for i, call := range batch {
			reqs[i] = call.req
		}
		res, err = c.many(ctx, conn, reqs)
		return err
	})
	finished = true
	if err == nil && len(res) != len(batch) {
		err = errors.New("pglock: a batch statement returned the wrong number of rows")
	}
	var orphans []int
	c.mu.Lock()
	for i, call := range batch {
		call.sent, call.err = sent, err
		if err == nil {
			call.res = res[i]
			if call.state == callGone && c.orphan != nil {
				orphans = append(orphans, i)
			}
		}
		close(call.done)
	}
	c.mu.Unlock()
	if len(orphans) > 0 {
		c.giveOrphans(batch, res, orphans)
	}
	return err
}

// giveOrphans hands the orphan handler the results of the calls at orphans.
// It runs on the coalescer's goroutine: a panic under it (user code under a
// release statement) is logged, not raised there.
func (c *coalescer[Req, Res]) giveOrphans(batch []*coalesceCall[Req, Res], res []Res, orphans []int) {
	defer func() {
		if r := recover(); r != nil {
			c.l.log.Error("pglock: a panic while giving back a lease granted after its caller gave up "+
				"(a pool hook or tracer); it stays held until its TTL", "panic", r)
		}
	}()
	for _, i := range orphans {
		c.orphan(batch[i].req, res[i])
		if c.orphanHook != nil {
			c.orphanHook()
		}
	}
}

// batchStatements returns the number of batch statements sent so far.
func (c *coalescer[Req, Res]) batchStatements() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.statements
}

// grantReq is one non-waiting grant.
type grantReq struct {
	name  string
	ttlUs int64
}

// grantRes is its answer: a GrantLock row, or Exhausted (the token is at the
// bigint maximum, nothing changed).
type grantRes struct {
	fastGrantRow
	Exhausted bool
}

// releaseReq is one release.
type releaseReq struct {
	name  string
	token int64
}

func newGrantCoalescer(l *Locker) *coalescer[grantReq, grantRes] {
	return &coalescer[grantReq, grantRes]{
		l:       l,
		abandon: l.closedCh,
		name:    func(r grantReq) string { return r.name },
		orphan:  l.releaseOrphan,
		bound:   func(r grantReq) time.Duration { return time.Duration(r.ttlUs) * time.Microsecond },
		one: func(ctx context.Context, conn *pgxpool.Conn, r grantReq) (grantRes, error) {
			row, err := fastGrantLock(ctx, conn, dbsqlc.GrantLockParams{Name: r.name, Holder: l.holder, TtlUs: r.ttlUs, Key: l.key})
			return grantRes{fastGrantRow: row}, err
		},
		many: func(ctx context.Context, conn *pgxpool.Conn, rs []grantReq) ([]grantRes, error) {
			p := dbsqlc.GrantLocksParams{Holder: l.holder, Key: l.key,
				Names: make([]string, len(rs)), TtlsUs: make([]int64, len(rs))}
			for i, r := range rs {
				p.Names[i], p.TtlsUs[i] = r.name, r.ttlUs
			}
			rows, err := l.q.GrantLocks(ctx, conn, p)
			if err != nil {
				return nil, err
			}
			out := make([]grantRes, len(rs))
			seen := 0
			for _, r := range rows {
				i := int(r.I) - 1
				if i < 0 || i >= len(out) {
					return nil, errors.New("pglock: lock_grant_many returned an element out of range")
				}
				seen++
				out[i] = grantRes{fastGrantRow: fastGrantRow{
					Token: r.Token, ExpiresAt: r.ExpiresAt, HasExpiry: r.HasExpiry,
					HeldBy: r.HeldBy, HasHolder: r.HeldBy != "", DbNow: r.DbNow,
				}, Exhausted: r.Exhausted}
			}
			if seen != len(rs) {
				return nil, errors.New("pglock: lock_grant_many returned the wrong number of rows")
			}
			return out, nil
		},
	}
}

// releaseOrphan releases a lease a batch granted to a call whose caller had
// given up (its context ended while the batch was out): the caller got an
// error and no Lease, so nobody uses its token, and without this the name
// would stay held until the lease expired. A failure is only logged: the
// lease then expires as any lease whose holder is gone.
func (l *Locker) releaseOrphan(r grantReq, res grantRes) {
	if res.Token <= 0 || res.Exhausted {
		return // not granted
	}
	l.giveBack(context.Background(), "pglock.Acquire", r.name, res.Token, "pglock: release of a lease granted after its caller gave up")
}

// giveBack releases (name, token), a grant nobody holds a Lease for, on a
// context that outlives ctx's cancellation, bounded by orphanReleaseTimeout.
// A grant a live Lease of this Locker holds, or one an Adopt is turning into
// a Lease, is left alone (claim: the Adopt gives it back if it fails). A
// failure is only logged (with msg): the lease then expires as any lease
// whose holder is gone. done reports that the grant needs nothing more
// (released, not held any more, or left to a Lease, an Adopt or another
// give-back); false after a failure.
func (l *Locker) giveBack(ctx context.Context, op, name string, token int64, msg string) (done bool) {
	if l.claim(claimGiveBack, name, token) != 0 {
		return true // adopted (Adopt), or already being given back
	}
	defer l.unclaim(name, token)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), orphanReleaseTimeout)
	defer cancel()
	if err := l.release(rctx, op, name, token); err != nil {
		l.log.Warn(msg, "name", name, "token", token, "err", err)
		return errors.Is(err, pgfence.ErrLost)
	}
	return true
}

// orphanReleaseTimeout bounds releaseOrphan: it runs in a grant slot.
const orphanReleaseTimeout = 5 * time.Second

func newReleaseCoalescer(l *Locker) *coalescer[releaseReq, fastReleaseRow] {
	return &coalescer[releaseReq, fastReleaseRow]{
		l:    l,
		name: func(r releaseReq) string { return r.name },
		one: func(ctx context.Context, conn *pgxpool.Conn, r releaseReq) (fastReleaseRow, error) {
			return fastReleaseLock(ctx, conn, dbsqlc.ReleaseLockParams{Name: r.name, Token: r.token, Key: l.key})
		},
		many: func(ctx context.Context, conn *pgxpool.Conn, rs []releaseReq) ([]fastReleaseRow, error) {
			p := dbsqlc.ReleaseLocksParams{Key: l.key, Names: make([]string, len(rs)), Tokens: make([]int64, len(rs))}
			for i, r := range rs {
				p.Names[i], p.Tokens[i] = r.name, r.token
			}
			rows, err := l.q.ReleaseLocks(ctx, conn, p)
			if err != nil {
				return nil, err
			}
			out := make([]fastReleaseRow, len(rs))
			seen := 0
			for _, r := range rows {
				i := int(r.I) - 1
				if i < 0 || i >= len(out) {
					return nil, errors.New("pglock: lock_release_many returned an element out of range")
				}
				seen++
				out[i] = fastReleaseRow{Released: r.Released, HandedOff: r.HandedOff, Notified: r.Notified}
			}
			if seen != len(rs) {
				return nil, errors.New("pglock: lock_release_many returned the wrong number of rows")
			}
			return out, nil
		},
	}
}

// errExhausted stands for the error lock_grant raises at the bigint maximum
// (lock_grant_many reports it per element instead), so that the grant's
// error is the one a single statement gives.
var errExhausted error = &pgconn.PgError{Severity: "ERROR", Code: pgerr.NumericValueOutOfRange,
	Message: "bigint out of range"}
