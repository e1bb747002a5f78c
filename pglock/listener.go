package pglock

import (
	"github.com/pgfence/pgfence/internal/notify"
)

// listener is the single LISTEN connection of a Locker. It multiplexes every
// waiter: a notification on NotifyChannel wakes the waiters of the lock name
// in its payload, and each (re)connection wakes every waiter so that a
// release missed while the connection was down is re-checked. The connection
// starts with the first waiter and stops with the Locker.
type listener struct {
	l *Locker
	n *notify.Listener
}

type waiter struct {
	sub *notify.Subscription
	ch  <-chan struct{} // buffered 1: a wake-up is never lost, never blocks
}

func newListener(l *Locker) *listener {
	return &listener{l: l, n: notify.New(l.pool, notify.Config{
		Channels: []string{NotifyChannel},
		Logger:   l.log,
		DownMsg:  "pglock: LISTEN connection lost; waiters fall back to expiry timers until it is back",
		UpMsg:    "pglock: listening",
	})}
}

// register adds a waiter for name and starts the connection on first use.
func (ls *listener) register(name string) *waiter {
	sub := ls.n.SubscribePayload(NotifyChannel, name)
	if !ls.l.isClosed() {
		ls.n.Start()
	}
	return &waiter{sub: sub, ch: sub.C()}
}

func (ls *listener) unregister(w *waiter) { w.sub.Close() }

func (ls *listener) stop() { ls.n.Stop() }

func (ls *listener) isUp() bool { return ls.n.Up() }
