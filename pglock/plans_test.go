package pglock

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// planCounter counts the planner runs of every session of a pool: with
// debug_print_plan on and client_min_messages at log, PostgreSQL sends a
// "plan:" LOG message to the client for every plan it makes, nested
// statements (trigger functions) included.
type planCounter struct {
	mu    sync.Mutex
	n     int
	flags int      // plans whose text shows their JIT flags
	jit   int      // plans that would be JIT-compiled (jitFlags not 0)
	plans []string // the first lines of the plans counted since the last reset
}

func (c *planCounter) onNotice(_ *pgconn.PgConn, n *pgconn.Notice) {
	if n.Severity != "LOG" || n.Message != "plan:" {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n++
	if m := jitFlags.FindStringSubmatch(n.Detail); m != nil {
		c.flags++
		if m[1] != "0" {
			c.jit++
		}
	}
	if len(c.plans) < 5 {
		d := n.Detail
		if len(d) > 2000 {
			d = d[:2000]
		}
		c.plans = append(c.plans, d)
	}
}

// jitFlags finds a plan's JIT flags in its debug_print_plan text: not 0
// means the plan's cost passed jit_above_cost and its expressions would be
// compiled (tens to hundreds of milliseconds per statement).
var jitFlags = regexp.MustCompile(`:jitFlags (\d+)`)

func (c *planCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n, c.flags, c.jit, c.plans = 0, 0, 0, nil
}

// jitted returns how many plans were counted since the last reset, how many
// of them show their JIT flags, and how many would be JIT-compiled.
func (c *planCounter) jitted() (n, flags, jit int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n, c.flags, c.jit
}

func (c *planCounter) get() (int, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n, strings.Join(c.plans, "\n---\n")
}

func planCountingPool(t *testing.T, ctx context.Context, dsn string, maxConns int32) (*pgxpool.Pool, *planCounter) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	c := &planCounter{}
	cfg.ConnConfig.OnNotice = c.onNotice
	cfg.ConnConfig.RuntimeParams["debug_print_plan"] = "on"
	cfg.ConnConfig.RuntimeParams["client_min_messages"] = "log"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, c
}

// Once a session has run pglock's statements a few times, a grant, a release
// and a handoff plan nothing: the statements are prepared and keep a generic
// plan, and the integrity trigger of pgfence.locks evaluates its tests of a
// grant without the planner. (Its test of a grant held a subquery once; the
// plan cache re-planned that expression in every call, about 0.1 ms per
// grant.)
func TestLockPathPlansOnce(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 2*time.Minute)
	dsn := pgtest.DSN(t)

	t.Run("uncontended", func(t *testing.T) {
		pool, plans := planCountingPool(t, ctx, dsn, 1)
		l := newLocker(t, pool, &Config{Holder: "planner", PollOnly: true})
		cycle := func(n int) {
			for i := range n {
				lease := mustAcquire(t, l, fmt.Sprintf("plans-%d", i%3), time.Minute)
				if err := lease.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
		}
		cycle(30) // warm-up: the plan cache tries 5 custom plans per statement first
		plans.reset()
		cycle(30)
		if n, first := plans.get(); n != 0 {
			t.Errorf("30 acquire+release cycles on one warm session made %d plans, want 0; first:\n%s", n, first)
		}
	})

	t.Run("handoff", func(t *testing.T) {
		// Two Lockers on one pool pass one name back and forth: every grant
		// after the first is a handoff by ReleaseLock to a queued waiter.
		pool, plans := planCountingPool(t, ctx, dsn, 4)
		a := newLocker(t, pool, &Config{Holder: "planner-a"})
		b := newLocker(t, pool, &Config{Holder: "planner-b"})
		const name = "plans-handoff"
		lease := mustAcquire(t, a, name, time.Minute)
		pass := func(n int) {
			next := b
			for range n {
				lease = handOver(t, ctx, lease, next, name, time.Minute)
				if next == a {
					next = b
				} else {
					next = a
				}
			}
		}
		pass(40)
		// A waiter's path depends on timing (which pool connection serves
		// it, whether it waits once or twice), so on a loaded machine a
		// session can meet a statement for its first few times after the
		// warm-up. A statement planned on every call plans in every window;
		// one window of 20 handoffs with no plan shows the path settled.
		var n int
		var first string
		for range 5 {
			plans.reset()
			pass(20)
			if n, first = plans.get(); n == 0 {
				break
			}
		}
		if n != 0 {
			t.Errorf("5 windows of 20 handoffs on warm sessions each made plans (the last %d), want a window with none; first:\n%s", n, first)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("batches", func(t *testing.T) {
		// The many-leases functions, as a Locker sends them while a few
		// callers wait: batches of 2 to 5 names, granted, renewed and
		// released. Their array parameters made the plan cache plan every
		// statement of the function again in every call (custom plans
		// looked cheaper for small arrays) until migration 00012 pinned
		// plan_cache_mode to force_generic_plan.
		pool, plans := planCountingPool(t, ctx, dsn, 1)
		l := newLocker(t, pool, &Config{Holder: "planner-batches", PollOnly: true})
		round := func(i int) {
			n := 2 + i%4
			names, ttls := make([]string, n), make([]int64, n)
			for j := range n {
				names[j], ttls[j] = fmt.Sprintf("plans-batch-%d-%d", i%7, j), time.Minute.Microseconds()
			}
			tokens := grantBatch(t, ctx, l, pool, names, ttls)
			renewed, err := l.q.RenewLocks(ctx, pool, dbsqlc.RenewLocksParams{Names: names, Tokens: tokens, Key: l.key, TtlsUs: ttls})
			if err != nil || len(renewed) != n {
				t.Fatalf("batch %d: renewed %d of %d: %v", i, len(renewed), n, err)
			}
			released, err := l.q.ReleaseLocks(ctx, pool, dbsqlc.ReleaseLocksParams{Names: names, Tokens: tokens, Key: l.key})
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range released {
				if !r.Released {
					t.Fatalf("batch %d: element %d not released", i, r.I)
				}
			}
		}
		for i := range 20 {
			round(i) // warm-up: each statement is planned once
		}
		checkNoJIT(t, plans, "warm-up of the many-leases functions")
		plans.reset()
		for i := range 20 {
			round(i)
		}
		if n, first := plans.get(); n != 0 {
			t.Errorf("20 rounds of grant, renew and release batches on one warm session made %d plans, want 0; first:\n%s", n, first)
		}

		// A release batch that hands one of its leases to a waiter runs
		// lock_release for it, under the batch function's settings: its
		// plans are not JIT-compiled either.
		names := []string{"plans-batch-handoff-a", "plans-batch-handoff-b"}
		ttls := []int64{time.Minute.Microseconds(), time.Minute.Microseconds()}
		tokens := grantBatch(t, ctx, l, pool, names, ttls)
		w := newLocker(t, pgtest.PoolFor(t, dsn), &Config{Holder: "planner-batches-waiter"})
		queued := waitSignal(w)
		res := acquireAsync(ctx, w, names[0], time.Minute)
		select {
		case <-queued:
		case r := <-res:
			t.Fatalf("the waiter did not wait: lease %v, %v", r.lease, r.err)
		}
		plans.reset()
		released, err := l.q.ReleaseLocks(ctx, pool, dbsqlc.ReleaseLocksParams{Names: names, Tokens: tokens, Key: l.key})
		if err != nil {
			t.Fatal(err)
		}
		handed := 0
		for _, r := range released {
			if r.HandedOff {
				handed++
			}
		}
		r := <-res
		if r.err != nil || handed != 1 || r.lease.Token() != tokens[0]+1 {
			t.Fatalf("handoff by a release batch: %d handed, waiter %v, %v; want one, token %d", handed, r.lease, r.err, tokens[0]+1)
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
		checkNoJIT(t, plans, "handoff by a release batch")
	})
}

// grantBatch grants names (all free) in one lock_grant_many call and returns
// their tokens, in the order of names.
func grantBatch(t *testing.T, ctx context.Context, l *Locker, pool *pgxpool.Pool, names []string, ttls []int64) []int64 {
	t.Helper()
	granted, err := l.q.GrantLocks(ctx, pool, dbsqlc.GrantLocksParams{Names: names, Holder: l.holder, TtlsUs: ttls, Key: l.key})
	if err != nil || len(granted) != len(names) {
		t.Fatalf("grant of %v: %d rows, %v", names, len(granted), err)
	}
	tokens := make([]int64, len(names))
	for _, g := range granted {
		if g.Token <= 0 {
			t.Fatalf("grant of %v: element %d not granted: %+v", names, g.I, g)
		}
		tokens[g.I-1] = g.Token
	}
	return tokens
}

// checkNoJIT fails t unless the plans counted since the last reset (at least
// one) all show their JIT flags and none would be JIT-compiled.
func checkNoJIT(t *testing.T, plans *planCounter, phase string) {
	t.Helper()
	switch n, flags, jit := plans.jitted(); {
	case n == 0 || flags != n:
		t.Errorf("%s: %d plans, %d of them with their JIT flags: the JIT check would see nothing", phase, n, flags)
	case jit != 0:
		_, first := plans.get()
		t.Errorf("%s: %d of %d plans would be JIT-compiled; first plans:\n%s", phase, jit, n, first)
	default:
		t.Logf("%s: %d plans, none JIT-compiled", phase, n)
	}
}
