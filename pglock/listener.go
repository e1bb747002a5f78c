package pglock

import (
	mrand "math/rand/v2"
	"strconv"

	"github.com/pgfence/pgfence/internal/notify"
)

// listener is the single LISTEN connection of a Locker. It multiplexes every
// waiter: a notification on HandoffChannel wakes the one waiter whose key is
// its payload (a release handed it the lease), one on NotifyChannel wakes the
// waiters of the lock name in its payload (a release freed the lock), and
// each (re)connection wakes every waiter so that a notification missed while
// the connection was down is re-checked. The connection
// starts with the first waiter and stops with the Locker.
type listener struct {
	l *Locker
	n *notify.Listener
}

type waiter struct {
	wkey int64 // the key a release that hands the lease to this waiter notifies
	sub  *notify.Subscription
	hsub *notify.Subscription
	ch   <-chan struct{} // a release freed the lock; buffered 1: never lost, never blocks
	hch  <-chan struct{} // a release handed the lease to this waiter (or the connection came back)
}

func newListener(l *Locker) *listener {
	return &listener{l: l, n: notify.New(l.pool, notify.Config{
		Channels: []string{NotifyChannel, HandoffChannel},
		Logger:   l.log,
		DownMsg:  "pglock: LISTEN connection lost; waiters fall back to expiry timers until it is back",
		UpMsg:    "pglock: listening",
	})}
}

// register adds a waiter for name, with a fresh random queue key, and starts
// the connection on first use.
func (ls *listener) register(name string) *waiter {
	wkey := mrand.Int64()
	sub := ls.n.SubscribePayload(NotifyChannel, name)
	hsub := ls.n.SubscribePayload(HandoffChannel, strconv.FormatInt(wkey, 10))
	if !ls.l.isClosed() {
		ls.n.Start()
	}
	return &waiter{wkey: wkey, sub: sub, hsub: hsub, ch: sub.C(), hch: hsub.C()}
}

func (ls *listener) unregister(w *waiter) {
	w.sub.Close()
	w.hsub.Close()
}

func (ls *listener) stop() { ls.n.Stop() }

func (ls *listener) isUp() bool { return ls.n.Up() }
