package pglock

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// listener is the single LISTEN connection of a Locker. It multiplexes every
// waiter: a notification on NotifyChannel wakes the waiters of the lock name
// in its payload, and each (re)connection wakes every waiter so that a
// release missed while the connection was down is re-checked.
type listener struct {
	l *Locker

	mu      sync.Mutex
	waiters map[string]map[*waiter]struct{}
	started bool
	up      bool
	cancel  context.CancelFunc
	done    chan struct{}
}

type waiter struct {
	name string
	ch   chan struct{} // buffered 1: a wake-up is never lost, never blocks
}

func newListener(l *Locker) *listener {
	return &listener{l: l, waiters: make(map[string]map[*waiter]struct{})}
}

func (w *waiter) wake() {
	select {
	case w.ch <- struct{}{}:
	default:
	}
}

// register adds a waiter for name and starts the connection on first use.
func (ls *listener) register(name string) *waiter {
	w := &waiter{name: name, ch: make(chan struct{}, 1)}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	set := ls.waiters[name]
	if set == nil {
		set = make(map[*waiter]struct{})
		ls.waiters[name] = set
	}
	set[w] = struct{}{}
	if !ls.started && !ls.l.isClosed() {
		ls.started = true
		ctx, cancel := context.WithCancel(context.Background())
		ls.cancel = cancel
		ls.done = make(chan struct{})
		go ls.run(ctx)
	}
	return w
}

func (ls *listener) unregister(w *waiter) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if set := ls.waiters[w.name]; set != nil {
		delete(set, w)
		if len(set) == 0 {
			delete(ls.waiters, w.name)
		}
	}
}

func (ls *listener) stop() {
	ls.mu.Lock()
	started, cancel, done := ls.started, ls.cancel, ls.done
	ls.started = true // no start after stop
	ls.mu.Unlock()
	if started && cancel != nil {
		cancel()
		<-done
	}
}

func (ls *listener) isUp() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.up
}

func (ls *listener) wakeName(name string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for w := range ls.waiters[name] {
		w.wake()
	}
}

func (ls *listener) setUp(up bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.up = up
	if up {
		for _, set := range ls.waiters {
			for w := range set {
				w.wake()
			}
		}
	}
}

// run keeps one LISTEN connection open until ctx ends, reconnecting with a
// capped exponential backoff.
func (ls *listener) run(ctx context.Context) {
	defer close(ls.done)
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		err := ls.session(ctx, func() { backoff = 50 * time.Millisecond })
		ls.setUp(false)
		if ctx.Err() != nil {
			return
		}
		ls.l.log.Warn("pglock: LISTEN connection lost; waiters fall back to expiry timers until it is back",
			"channel", NotifyChannel, "retry_in", backoff, "err", err)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

// session connects, LISTENs, wakes every waiter (they retry their grant) and
// then dispatches notifications until the connection fails or ctx ends.
func (ls *listener) session(ctx context.Context, connected func()) error {
	cfg := ls.l.pool.Config().ConnConfig.Copy()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := pgx.ConnectConfig(cctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Close(cctx)
		cancel()
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return err
	}
	connected()
	ls.setUp(true)
	ls.l.log.Debug("pglock: listening", "channel", NotifyChannel)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		ls.wakeName(n.Payload)
	}
}
