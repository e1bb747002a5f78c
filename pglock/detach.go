package pglock

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// Detached statements. A waiter's QueueGrant is not cancelled when its
// caller's context ends once it is sent: cancelling does not stop the
// server from committing it (pgx's cancel request can reach the server
// before the statement, on a slow network path, and find the backend idle,
// or after its commit), and a late statement queued the wait again after it
// had left the queue, or granted it a lease: held by nobody until its TTL.
// The caller returns its context's error at once; the statement runs on, on
// its own goroutine, for at most detachedBound more, and what it got is
// given back when it answers. A statement not sent yet when the caller
// gives up is never sent. A lone TryAcquire's GrantLock is not sent so: the
// goroutine hand-off cost a lone caller 20 to 35 us a grant (p50 of
// BenchmarkAcquireLatency, 95-134 us before, 129-151 us after, three
// alternations on the test server), more than the 5 % a lone caller may
// lose; its grant's outcome stays unknown when its context ends (package
// documentation).

// detachedBound bounds how long a statement runs on once its caller gave
// up (or its TTL, if shorter: a grant committed later has ended already).
// It keeps a pooled connection meanwhile; after it the statement is
// cancelled, and a grant it commits later anyway (a network that delays it
// longer) stays held until its TTL, as after a connection failure. Close
// waits as long for them (closeWait).
const detachedBound = 5 * time.Second

// pending is one statement of sendDetachable (a waiter's QueueGrant, its
// only user). res, sent and err are set by
// the statement's goroutine before state becomes stmtAnswered (the caller
// then reads them after done), or read by its gone function on that
// goroutine once the caller detached.
type pending struct {
	state atomic.Int32  // stmtRunning, stmtSent, then stmtAnswered or stmtDetached
	done  chan struct{} // closed on stmtAnswered
	res   dbsqlc.QueueGrantRow
	sent  time.Time
	err   error
	// stop stops the statement's bound once its caller detached (a timer,
	// and the registration on the Locker's abortCtx); stored before the
	// caller detaches, nil until then.
	stop atomic.Pointer[func()]
	// panicked holds what a panic under the statement (user code: a pool
	// hook or a tracer) was called with, re-raised in the caller's
	// goroutine as it would have been before the statement had one of its
	// own; nil if none.
	panicked any
}

const (
	stmtRunning  int32 = iota // not sent yet
	stmtSent                  // written to a connection
	stmtAnswered              // the caller takes the answer
	stmtDetached              // the caller is gone: gone handles the answer
)

// errDetached is a detached statement's error when it was never sent.
var errDetached = errors.New("pglock: the caller was gone before its statement was sent")

// errGoexit is a statement's error when runtime.Goexit ended its goroutine
// (called by a pool hook or a tracer).
var errGoexit = errors.New("pglock: runtime.Goexit under a statement (a pool hook or tracer)")

// sending is called by a statement's connection callback right before the
// statement is written: it records the send time and reports false if the
// caller is gone (the statement must then not be sent).
func (p *pending) sending() bool {
	if !p.state.CompareAndSwap(stmtRunning, stmtSent) && p.state.Load() != stmtSent {
		return false
	}
	p.sent = time.Now()
	return true
}

// sendDetachable runs stmt on a connection of l's pool on its own goroutine
// and waits for its answer, ctx's end or the Locker's Close, whichever comes
// first. stmt must call p.sending() right before it writes its statement,
// and return errDetached without sending when that is false. The
// statement's context has ctx's values, not its cancellation. When ctx ends
// first, or the Locker closes, sendDetachable returns detached true and
// ctx.Err() (errCoalescerClosed): a statement not sent yet is then never
// sent; one that is out runs on for at most min(bound, detachedBound), and
// until Close has waited for it (l.abortCtx). gone then runs on the
// statement's goroutine once it has answered, with p.err set (the
// statement's error, errDetached if it was never sent). A panic under the
// statement (user code: a pool hook or a tracer) is raised again in the
// caller's goroutine, or logged once the caller is gone; so is one in gone.
func sendDetachable(l *Locker, ctx context.Context, bound time.Duration,
	stmt func(ctx context.Context, conn *pgxpool.Conn, p *pending) error,
	gone func(p *pending)) (res dbsqlc.QueueGrantRow, sent time.Time, err error, detached bool) {
	p := &pending{done: make(chan struct{})}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	l.calls.add() // Close waits for it
	go p.run(l, sctx, cancel, stmt, gone)
	var cause error
	select {
	case <-p.done:
		return p.answer()
	case <-ctx.Done():
		cause = ctx.Err()
	case <-l.closedCh:
		cause = errCoalescerClosed // the caller is told at once; Close waits for the statement
	}
	for {
		switch s := p.state.Load(); s {
		case stmtRunning:
			if p.state.CompareAndSwap(s, stmtDetached) {
				cancel() // never sent: stop waiting for a connection
				return dbsqlc.QueueGrantRow{}, time.Time{}, cause, true
			}
		case stmtSent:
			// Out: it runs on for at most min(bound, detachedBound) from
			// here, and until Close has waited for it.
			t := time.AfterFunc(min(bound, detachedBound), cancel)
			unregister := context.AfterFunc(l.abortCtx, cancel)
			stop := func() { t.Stop(); unregister() }
			p.stop.Store(&stop)
			if !p.state.CompareAndSwap(s, stmtDetached) {
				stop() // answered meanwhile
				continue
			}
			return dbsqlc.QueueGrantRow{}, time.Time{}, cause, true
		default: // answered as ctx ended: the answer is the caller's
			<-p.done
			return p.answer()
		}
	}
}

// answer returns what the statement answered to its caller.
func (p *pending) answer() (dbsqlc.QueueGrantRow, time.Time, error, bool) {
	if p.panicked != nil {
		panic(p.panicked)
	}
	return p.res, p.sent, p.err, false
}

// run is the statement's goroutine (sendDetachable).
func (p *pending) run(l *Locker, sctx context.Context, cancel context.CancelFunc,
	stmt func(ctx context.Context, conn *pgxpool.Conn, p *pending) error,
	gone func(p *pending)) {
	defer l.calls.done()
	over := false // the statement returned or panicked (not runtime.Goexit)
	// Deferred, so that it runs after runtime.Goexit as well.
	defer func() {
		if !over {
			p.err = errGoexit
		}
		cancel()
		if p.err != nil && p.panicked == nil && l.abortCtx.Err() != nil {
			// Close waited for it, then ended it: a caller still waiting
			// learns that the Locker closed.
			p.err = errCoalescerClosed
		}
		if p.state.CompareAndSwap(stmtSent, stmtAnswered) || p.state.CompareAndSwap(stmtRunning, stmtAnswered) {
			close(p.done)
			return
		}
		// Detached: its caller stored stop before it detached.
		if s := p.stop.Load(); s != nil {
			(*s)()
		}
		if p.panicked != nil {
			l.log.Error("pglock: a panic under a statement whose caller had given up (a pool hook or tracer)", "panic", p.panicked)
		}
		defer func() {
			if r := recover(); r != nil {
				l.log.Error("pglock: a panic while giving back what a statement whose caller had given up got (a pool hook or tracer)", "panic", r)
			}
		}()
		gone(p)
	}()
	defer func() {
		if r := recover(); r != nil {
			p.panicked, p.err, over = r, fmt.Errorf("pglock: panic under a statement: %v", r), true
		}
	}()
	p.err = l.onLiveConn(sctx, func(conn *pgxpool.Conn) error { return stmt(sctx, conn, p) })
	over = true
}
