package pglock

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
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
	// held receives a signal each time an extended-protocol request (a
	// Parse or Bind message first: a statement, not a ping) is held.
	held chan struct{}
}

func newHoldProxy(t *testing.T, target string) *holdProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &holdProxy{ln: ln, target: target, heldTo: -1, gate: make(chan struct{}), held: make(chan struct{}, 1)}
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
				if buf[0] == 'P' || buf[0] == 'B' {
					select {
					case p.held <- struct{}{}:
					default:
					}
				}
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

// resume lets the held bytes through; safe to call more than once.
func (p *holdProxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.gate:
	default:
		close(p.gate)
	}
}

// proxiedPool returns a pool of at most 2 connections to dsn's server
// through a holdProxy, counting its door statements in c when c is not nil;
// the pool is closed when the test ends.
func proxiedPool(t *testing.T, ctx context.Context, dsn string, c *doorCounter) (*pgxpool.Pool, *holdProxy) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newHoldProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.ConnConfig.Fallbacks = nil
	cfg.MaxConns = 2
	if c != nil {
		cfg.ConnConfig.Tracer = c
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, proxy
}

// heldWait is a waiting Acquire of a name by the Locker w (holder "w",
// through a holdProxy) whose next queueing statement is held on the
// network: an owner holds the name, the wait has queued, and its next
// QueueGrant is out (newHeldWait).
type heldWait struct {
	admin  *pgxpool.Pool // a pool straight to the server
	held   *Lease        // the owner's lease on the name
	w      *Locker
	pool   *pgxpool.Pool // w's pool, through proxy
	proxy  *holdProxy
	left   chan string     // w's detachedHook: a detached wait left the queue
	res    <-chan acquired // the Acquire's result
	cancel func()          // ends the Acquire's context
}

// newHeldWait sets up a heldWait on name, the Acquire asking for ttl, with
// w's door statements counted in door if it is not nil. When the test
// ends, the proxy lets the held bytes through, then w and the owner's lease
// are closed and released.
func newHeldWait(t *testing.T, ctx context.Context, name string, ttl time.Duration, door *doorCounter) *heldWait {
	t.Helper()
	dsn := pgtest.DSN(t)
	h := &heldWait{admin: pgtest.PoolFor(t, dsn), left: make(chan string, 1)}
	owner := newLocker(t, h.admin, &Config{Holder: "owner"})
	h.held = mustAcquire(t, owner, name, time.Minute)
	h.pool, h.proxy = proxiedPool(t, ctx, dsn, door)
	w, err := New(h.pool, &Config{Holder: "w", PollInterval: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h.w = w
	t.Cleanup(func() {
		h.proxy.resume()
		_ = w.Close()
		_ = h.held.Release(context.Background())
	})
	w.detachedHook = func(name string) {
		select {
		case h.left <- name:
		default:
		}
	}
	if err := w.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	sig := waitSignal(w)
	actx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	h.cancel = cancel
	h.res = acquireAsync(actx, w, name, ttl)
	<-sig // queued, asleep for the poll interval
	// Its next queueing statement is held on the way.
	h.proxy.hold()
	<-h.proxy.held
	return h
}

// waitLeft waits until the detached wait has left the queue.
func (h *heldWait) waitLeft(t *testing.T, ctx context.Context) {
	t.Helper()
	select {
	case <-h.left:
	case <-ctx.Done():
		t.Fatal("the detached wait never left the queue")
	}
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
			ctx := testCtx(t, time.Minute)
			name := "detached-wait-" + strconv.FormatBool(tc.freeFirst)
			var door doorCounter
			h := newHeldWait(t, ctx, name, 30*time.Second, &door)
			h.cancel() // its context ends while the statement is out
			r := <-h.res
			if r.err == nil {
				t.Fatal("Acquire returned a lease although its queueing statement never reached the server")
			}
			if tc.freeFirst {
				if err := h.held.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			door.reset()
			h.proxy.resume() // the statement reaches the server now
			h.waitLeft(t, ctx)
			// The handed lease is given back once: before, leaving the
			// queue released it a second time (a statement that matched
			// nothing).
			if n, want := door.release.Load()+door.releaseMany.Load(), map[bool]int64{false: 0, true: 1}[tc.freeFirst]; n != want {
				t.Errorf("the detached wait sent %d release statements, want %d", n, want)
			}
			if !tc.freeFirst {
				if err := h.held.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if info := inspect(t, h.admin, name); info.Held {
				t.Errorf("the waiter gave up (%v), yet the name is held by %q with token %d for %v more, and nobody has its Lease",
					r.err, info.Holder, info.Token, info.ExpiresAt.Sub(info.DBNow))
			}
			var rows int
			if err := h.admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.lock_queue WHERE name = $1 AND granted_token IS NULL", name).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if rows != 0 {
				t.Errorf("%d waits of %q still queued after the waiter gave up", rows, name)
			}
		})
	}
}

// A detached wait whose statement never answers (a connection that went
// silent) does not hold Close, or the pool's Close after it, for the TTL:
// Close waits its 5 seconds for it, then ends it.
func TestDetachedWaitEndedByClose(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	const ttl = 90 * time.Second
	h := newHeldWait(t, ctx, "detached-wait-close", ttl, nil) // the statement never reaches the server
	w, wpool := h.w, h.pool
	h.cancel()
	if r := <-h.res; r.err == nil {
		t.Fatal("Acquire returned a lease")
	}
	start := time.Now()
	_ = w.Close()
	closed := time.Since(start)
	if closed < closeWait {
		t.Errorf("Locker.Close took %v: it did not wait for the detached statement (%v)", closed, closeWait)
	}
	// The statement Close ended gives its connection back (pgx closes it).
	for wpool.Stat().AcquiredConns() > 0 {
		if time.Since(start) > ttl/2 {
			t.Fatalf("%d connections still taken %v after Close began: the detached statement holds its connection for its TTL (%v)",
				wpool.Stat().AcquiredConns(), time.Since(start).Round(time.Millisecond), ttl)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("Locker.Close %v; its connections back %v after it began", closed.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// An Elector's campaign statement that outlives its bound (the TTL: the
// Elector lets its statements answer) is detached like any other, and the
// campaign goes on under a new wait: Run is not ended by it while its
// context is live, and the candidate leads once the holder releases.
func TestDetachedWaitElectorCampaignGoesOn(t *testing.T) {
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t, time.Minute)
	const name = "detached-wait-elector"
	owner := newLocker(t, admin, &Config{Holder: "owner"})
	held := mustAcquire(t, owner, name, time.Minute)

	epool, proxy := proxiedPool(t, ctx, dsn, nil)
	defer proxy.resume()
	failed := make(chan struct{}, 16)
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		if strings.Contains(string(p), "election campaign attempt failed") {
			select {
			case failed <- struct{}{}:
			default:
			}
		}
		return len(p), nil
	}), &slog.HandlerOptions{Level: slog.LevelWarn}))
	l, err := New(epool, &Config{Holder: "candidate", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	if err := l.Listen(ctx); err != nil {
		t.Fatal(err)
	}
	sig := waitSignal(l)
	e, err := l.NewElector(name, &ElectionConfig{LeaseDuration: time.Second, RetryPeriod: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	runErr := make(chan error, 1)
	go func() { runErr <- e.Run(rctx) }()
	<-sig // queued, asleep for RetryPeriod
	proxy.hold()
	select {
	case <-failed: // the held statement outlived its second: detached, logged
	case err := <-runErr:
		t.Fatalf("Run returned %v while its context is live", err)
	}
	proxy.resume()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	led := make(chan struct{})
	go func() {
		defer close(led)
		for e.Lease() == nil && rctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
	}()
	select {
	case <-led:
	case err := <-runErr:
		t.Fatalf("Run returned %v while its context is live", err)
	case <-ctx.Done():
		t.Fatal("the candidate never led")
	}
	stop()
	if err := <-runErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
}

// A detached statement refused with PF013 (another key queued under the
// wait's wkey while it was out) does not keep that wkey for the next wait
// of the name.
func TestDetachedWaitDropsTakenKey(t *testing.T) {
	ctx := testCtx(t, time.Minute)
	const name = "detached-wait-pf013"
	h := newHeldWait(t, ctx, name, 30*time.Second, nil)
	w, admin := h.w, h.admin
	owner := newLocker(t, admin, &Config{Holder: "owner"})
	other := mustAcquire(t, owner, name+":other", time.Minute)
	defer func() { _ = other.Release(context.Background()) }()
	var wkey int64
	if err := admin.QueryRow(ctx, `SELECT wkey FROM pgfence.lock_queue WHERE name = $1 AND holder = 'w'`, name).Scan(&wkey); err != nil {
		t.Fatal(err)
	}
	h.cancel()
	if r := <-h.res; r.err == nil {
		t.Fatal("Acquire returned a lease")
	}
	// The wait's row goes, and another key queues under its wkey.
	if _, err := admin.Exec(ctx, `DELETE FROM pgfence.lock_queue WHERE wkey = $1`, wkey); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT pgfence.lock_wait($2, 'squatter', 60000000,
		'\x100102030405060708090a0b0c0d0e0f', $1, 1)`, wkey, name+":other"); err != nil {
		t.Fatal(err)
	}
	h.proxy.resume()
	h.waitLeft(t, ctx)
	w.hotMu.Lock()
	slots := append([]int64(nil), w.slots[name]...)
	w.hotMu.Unlock()
	for _, s := range slots {
		if s == wkey {
			t.Errorf("the taken wkey %d is kept for the next wait of %q: %v", wkey, name, slots)
		}
	}
}

// Close while a waiting Acquire's statement is out (held on the network):
// Acquire returns an error matching pgfence.ErrClosed at once, not after
// Close's 5 seconds, and not the error of the statement Close ended.
func TestDetachedWaitClosed(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	h := newHeldWait(t, ctx, "detached-wait-closed", 90*time.Second, nil) // the waiter's next statement is out
	w, res := h.w, h.res
	start := time.Now()
	closed := make(chan struct{})
	go func() { defer close(closed); _ = w.Close() }()
	r := <-res
	took := time.Since(start)
	if r.err == nil || !errors.Is(r.err, pgfence.ErrClosed) {
		t.Errorf("Acquire with its statement out at Close: %v; want an error matching pgfence.ErrClosed", r.err)
	}
	if took >= closeWait {
		t.Errorf("Acquire returned %v after Close began: it waited for Close to end its statement", took.Round(time.Millisecond))
	}
	<-closed
}
