package pglock

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Detached statements. A statement that grants (a waiter's QueueGrant, a
// lone TryAcquire's GrantLock) is not cancelled when its caller's context
// ends once it is sent: cancelling does not stop the server from committing
// it (pgx's cancel request can reach the server before the statement, on a
// slow network path, and find the backend idle, or after its commit), and a
// grant committed so stays held by nobody until its TTL. The caller returns
// its context's error at once; the statement runs on, on its own goroutine,
// and what it granted is given back when it answers. A statement not sent
// yet when the caller gives up is never sent.

// pending is one statement of sendDetachable. res, sent and err are set by
// the statement's goroutine before state becomes stmtAnswered (the caller
// then reads them after done), or read by its gone function on that
// goroutine once the caller detached.
type pending[T any] struct {
	state atomic.Int32  // stmtRunning, stmtSent, then stmtAnswered or stmtDetached
	done  chan struct{} // closed on stmtAnswered
	res   T
	sent  time.Time
	err   error
	// timer ends the statement bound after its caller detached; nil until
	// then.
	timer atomic.Pointer[time.Timer]
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

// sending is called by a statement's connection callback right before the
// statement is written: it records the send time and reports false if the
// caller is gone (the statement must then not be sent).
func (p *pending[T]) sending() bool {
	if !p.state.CompareAndSwap(stmtRunning, stmtSent) && p.state.Load() != stmtSent {
		return false
	}
	p.sent = time.Now()
	return true
}

// sendDetachable runs stmt on a connection of l's pool on its own goroutine
// and waits for its answer or for ctx's end, whichever comes first. stmt
// must call p.sending() right before it writes its statement, and return
// errDetached without sending when that is false. The statement's context
// has ctx's values, not its cancellation: it ends bound after its caller
// detached (a grant committed later has ended already) or once Close has
// waited for it (l.abortCtx). When ctx ends first, or the Locker closes, sendDetachable
// returns detached true and ctx's cause (errCoalescerClosed); a statement
// not sent yet is then never sent, and gone runs on the statement's
// goroutine once it has answered (with p.err set, errDetached if it was
// never sent). after, when set, runs on that goroutine after the statement,
// before the caller takes the answer, unless the caller detached first (the
// caller then runs it). A panic under the statement (user code: a pool hook
// or a tracer) is raised again in the caller's goroutine, or logged when
// the caller is gone.
func sendDetachable[T any](l *Locker, ctx context.Context, bound time.Duration,
	stmt func(ctx context.Context, conn *pgxpool.Conn, p *pending[T]) error,
	gone func(p *pending[T]), after func()) (res T, sent time.Time, err error, detached bool) {
	p := &pending[T]{done: make(chan struct{})}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(l.abortCtx, cancel)
	l.calls.add() // Close waits for it
	go func() {
		defer l.calls.done()
		func() {
			defer func() {
				if r := recover(); r != nil {
					p.panicked, p.err = r, fmt.Errorf("pglock: panic under a statement: %v", r)
				}
			}()
			p.err = l.onLiveConn(sctx, func(conn *pgxpool.Conn) error { return stmt(sctx, conn, p) })
		}()
		if p.err != nil && p.panicked == nil && l.abortCtx.Err() != nil {
			// Close waited for it, then ended it: a caller still waiting
			// learns that the Locker closed.
			p.err = errCoalescerClosed
		}
		stop()
		cancel()
		if p.state.CompareAndSwap(stmtSent, stmtAnswered) || p.state.CompareAndSwap(stmtRunning, stmtAnswered) {
			if after != nil {
				after()
			}
			close(p.done)
			return
		}
		if t := p.timer.Load(); t != nil {
			t.Stop()
		}
		if p.panicked != nil {
			l.log.Error("pglock: a panic under a statement whose caller had given up (a pool hook or tracer)", "panic", p.panicked)
		}
		gone(p)
	}()
	var cause error
	select {
	case <-p.done:
		if p.panicked != nil {
			panic(p.panicked)
		}
		return p.res, p.sent, p.err, false
	case <-ctx.Done():
		cause = context.Cause(ctx)
	case <-l.closedCh:
		cause = errCoalescerClosed // the caller is told at once; Close waits for the statement
	}
	for {
		switch s := p.state.Load(); s {
		case stmtRunning, stmtSent:
			var t *time.Timer
			if s == stmtSent {
				// Out: it runs on for at most bound from here (a grant it
				// commits later has ended already).
				t = time.AfterFunc(bound, cancel)
				p.timer.Store(t)
			}
			if !p.state.CompareAndSwap(s, stmtDetached) {
				if t != nil {
					t.Stop() // answered (or sent) meanwhile
				}
				continue
			}
			if s == stmtRunning {
				cancel() // never sent: stop waiting for a connection
			}
			if after != nil {
				after()
			}
			var zero T
			return zero, time.Time{}, cause, true
		default: // answered as ctx ended: the answer is the caller's
			<-p.done
			if p.panicked != nil {
				panic(p.panicked)
			}
			return p.res, p.sent, p.err, false
		}
	}
}
