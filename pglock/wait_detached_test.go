package pglock

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// holdProxy forwards TCP connections to the server. hold delays the
// client-to-server bytes of the connections open at that moment until
// resume (a slow network path); connections opened later flow freely.
type holdProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	nextID int
	heldTo int           // connections with an id up to heldTo are held
	gate   chan struct{} // closed while not holding
}

func newHoldProxy(t *testing.T, target string) *holdProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &holdProxy{ln: ln, target: target, heldTo: -1, gate: make(chan struct{})}
	close(p.gate)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			id := p.nextID
			p.nextID++
			p.mu.Unlock()
			go p.serve(id, c)
		}
	}()
	return p
}

func (p *holdProxy) serve(id int, c net.Conn) {
	defer func() { _ = c.Close() }()
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer func() { _ = s.Close() }() // after the writes: the server reads them before the end
	go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			held, gate := id <= p.heldTo, p.gate
			p.mu.Unlock()
			if held {
				<-gate
			}
			if _, werr := s.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *holdProxy) hold() {
	p.mu.Lock()
	p.heldTo = p.nextID - 1
	p.gate = make(chan struct{})
	p.mu.Unlock()
}

func (p *holdProxy) resume() {
	p.mu.Lock()
	close(p.gate)
	p.mu.Unlock()
}

// A waiter's queueing statement is delayed on the network and its context
// ends meanwhile. Before, the statement was cancelled and the wait left the
// queue at once on another connection; the delayed statement then reached
// the server, which ran and committed it: it queued the wait again (the next
// release handed the lease to nobody) or granted the free lock to nobody.
// Either way the name stayed held by the waiter's holder, with no Lease,
// until its TTL. Now the statement runs on, and the wait leaves the queue
// (giving back what it got) once it has answered.
func TestDetachedWaitLeavesAfterItsStatement(t *testing.T) {
	for _, tc := range []struct {
		name string
		// freeFirst: the holder releases while the statement is held, so
		// the statement finds the lease handed to its wait (or, before the
		// fix, the lock free).
		freeFirst bool
	}{{"queued again", false}, {"granted", true}} {
		t.Run(tc.name, func(t *testing.T) {
			dsn := pgtest.DSN(t)
			admin := pgtest.PoolFor(t, dsn)
			ctx := testCtx(t, time.Minute)
			name := "detached-wait-" + strconv.FormatBool(tc.freeFirst)
			owner := newLocker(t, admin, &Config{Holder: "owner"})
			held := mustAcquire(t, owner, name, time.Minute)

			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			proxy := newHoldProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
			cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
			cfg.ConnConfig.Fallbacks = nil
			cfg.MaxConns = 2
			wpool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer wpool.Close()
			w, err := New(wpool, &Config{Holder: "w", PollInterval: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = w.Close() }()
			left := make(chan string, 1)
			w.detachedHook = func(name string) { left <- name }
			if err := w.Listen(ctx); err != nil {
				t.Fatal(err)
			}
			sig := waitSignal(w)
			actx, cancel := context.WithTimeout(ctx, 900*time.Millisecond)
			defer cancel()
			res := acquireAsync(actx, w, name, 30*time.Second)
			<-sig // queued, asleep for the poll interval
			// Its next queueing statement is held on the way; its context
			// ends while it is out.
			proxy.hold()
			r := <-res
			if r.err == nil {
				t.Fatal("Acquire returned a lease although its queueing statement never reached the server")
			}
			if tc.freeFirst {
				if err := held.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			proxy.resume() // the statement reaches the server now
			select {
			case <-left:
			case <-ctx.Done():
				t.Fatal("the detached wait never left the queue")
			}
			if !tc.freeFirst {
				if err := held.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if info := inspect(t, admin, name); info.Held {
				t.Errorf("the waiter gave up (%v), yet the name is held by %q with token %d for %v more, and nobody has its Lease",
					r.err, info.Holder, info.Token, info.ExpiresAt.Sub(info.DBNow))
			}
			var rows int
			if err := admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.lock_queue WHERE name = $1 AND granted_token IS NULL", name).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if rows != 0 {
				t.Errorf("%d waits of %q still queued after the waiter gave up", rows, name)
			}
		})
	}
}
