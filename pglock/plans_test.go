package pglock

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// planCounter counts the planner runs of every session of a pool: with
// debug_print_plan on and client_min_messages at log, PostgreSQL sends a
// "plan:" LOG message to the client for every plan it makes, nested
// statements (trigger functions) included.
type planCounter struct {
	mu    sync.Mutex
	n     int
	plans []string // the first lines of the plans counted since the last reset
}

func (c *planCounter) onNotice(_ *pgconn.PgConn, n *pgconn.Notice) {
	if n.Severity != "LOG" || n.Message != "plan:" {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n++
	if len(c.plans) < 5 {
		d := n.Detail
		if len(d) > 2000 {
			d = d[:2000]
		}
		c.plans = append(c.plans, d)
	}
}

func (c *planCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n, c.plans = 0, nil
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
}
