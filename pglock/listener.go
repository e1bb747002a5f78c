package pglock

import (
	"context"
	"errors"
	mrand "math/rand/v2"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/notify"
)

// listener is a Locker's handle on the LISTEN connection it shares with every
// other open Locker of the same pool (one connection per pool, however many
// Lockers: each NOTIFY signals every listening backend of the database, so
// fewer listeners make every release cheaper). The connection multiplexes
// every waiter: a notification on handoffChannel wakes the one waiter whose
// key starts its payload (a release handed it the lease), one on
// notifyChannel wakes the waiters of the lock name in its payload (a release
// freed the lock), and each (re)connection wakes every waiter so that a
// notification missed while the connection was down is re-checked. The
// connection starts with the first waiter and stops with the last Locker of
// the pool; its up/down lines go to the Logger of the Locker that opened it.
type listener struct {
	l      *Locker
	n      *notify.Listener
	pool   *pgxpool.Pool
	closed bool
}

// shared holds the LISTEN connection of each pool with open Lockers.
var shared = struct {
	mu sync.Mutex
	m  map[*pgxpool.Pool]*sharedListener
}{m: map[*pgxpool.Pool]*sharedListener{}}

type sharedListener struct {
	n    *notify.Listener
	refs int // open Lockers using it
}

type waiter struct {
	wkey   int64 // the key a release that hands the lease to this waiter notifies
	waitID int64 // random, non-zero, new for every wait: a notification must carry it too
	sub    *notify.Subscription
	hsub   *notify.Subscription
	ch     <-chan struct{} // a release freed the lock; buffered 1: never lost, never blocks
	hch    <-chan struct{} // a release handed the lease to this waiter (or the connection came back)
	// detached: its caller gave up while a QueueGrant was out; that
	// statement's goroutine leaves the queue once it answers (queueGrant).
	// Set and read by the waiting goroutine only.
	detached bool
}

// newListener returns l's handle on the LISTEN connection of its pool,
// creating it (stopped) if l is the pool's first open Locker.
func newListener(l *Locker) *listener {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	sl := shared.m[l.pool]
	if sl == nil {
		sl = &sharedListener{n: notify.New(l.pool, notify.Config{
			Channels:      []string{notifyChannel, handoffChannel},
			KeyedChannels: []string{handoffChannel},
			Logger:        l.log,
			DownMsg:       "pglock: LISTEN connection lost; waiters fall back to expiry timers until it is back",
			UpMsg:         "pglock: listening",
		})}
		shared.m[l.pool] = sl
	}
	sl.refs++
	return &listener{l: l, n: sl.n, pool: l.pool}
}

// register adds a waiter for name, with the queue key of an ended wait of
// name that its Locker kept (takeSlot) or else a fresh random one, and a
// fresh random wait id, and starts the connection on first use.
func (ls *listener) register(name string) *waiter {
	return ls.registerKey(name, ls.l.takeSlot(name))
}

// registerFresh adds a waiter for name with a fresh random queue key (the
// one it had is queued under another key).
func (ls *listener) registerFresh(name string) *waiter { return ls.registerKey(name, 0) }

// registerKey adds a waiter for name with queue key wkey, or a fresh random
// one if wkey is 0.
func (ls *listener) registerKey(name string, wkey int64) *waiter {
	if wkey == 0 {
		wkey = randNonZero()
	}
	waitID := randNonZero()
	sub := ls.n.SubscribePayload(notifyChannel, name)
	hsub := ls.n.SubscribePayload(handoffChannel, strconv.FormatInt(wkey, 10))
	if !ls.l.isClosed() {
		ls.n.Start()
	}
	return &waiter{wkey: wkey, waitID: waitID, sub: sub, hsub: hsub, ch: sub.C(), hch: hsub.C()}
}

// randNonZero returns a random positive int64 (0 means "none" for keys and
// wait ids).
func randNonZero() int64 {
	for {
		if v := mrand.Int64(); v != 0 {
			return v
		}
	}
}

func (ls *listener) unregister(w *waiter) {
	w.sub.Close()
	w.hsub.Close()
}

// stop gives up l's use of the connection; the last Locker of the pool stops
// it. Safe to call more than once.
func (ls *listener) stop() {
	shared.mu.Lock()
	if ls.closed {
		shared.mu.Unlock()
		return
	}
	ls.closed = true
	sl := shared.m[ls.pool]
	last := false
	if sl != nil && sl.n == ls.n {
		if sl.refs--; sl.refs == 0 {
			delete(shared.m, ls.pool)
			last = true
		}
	}
	shared.mu.Unlock()
	if last {
		ls.n.Stop()
	}
}

func (ls *listener) isUp() bool { return ls.n.Up() }

// listen starts the connection and waits until it is LISTENing, a
// connection attempt fails, ctx ends or closed is closed.
func (ls *listener) listen(ctx context.Context, closed <-chan struct{}) error {
	err := ls.n.WaitUp(ctx, closed, pgfence.ErrClosed)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgfence.ErrClosed):
		return closedError("pglock.Listen", "")
	}
	return dbError("pglock.Listen", "", err)
}
