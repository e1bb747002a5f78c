package faultsuite

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// manyCounter counts the batch statements (lock_grant_many,
// lock_release_many) a pool sends.
type manyCounter struct{ grants, releases atomic.Int64 }

func (c *manyCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "pgfence.lock_grant_many("):
		c.grants.Add(1)
	case strings.Contains(d.SQL, "pgfence.lock_release_many("):
		c.releases.Add(1)
	}
	return ctx
}

func (c *manyCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestHistoryCoalesced: many goroutines share each Locker, so that their
// grants and releases go out in batches (pglock's coalescing: a name asked
// twice in one batch, batches cut by a killed backend), on a few hot names
// and names of their own, with fenced writes, renewals and inspections,
// while a killer terminates random client backends; the history is checked
// with the lease and row models and the real-time checks. About 20 s;
// PGFENCE_FAULTS_LONG=1 runs 2 minutes.
func TestHistoryCoalesced(t *testing.T) {
	t.Parallel()
	run := 20 * time.Second
	if long() {
		run = 2 * time.Minute
	}
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var counter manyCounter
	cfg.ConnConfig.Tracer = &counter
	clients := openPool(t, cfg, "faults-coalesce", 8)
	rec := history.New()
	rec.BoundCutAcquires()
	hot := []string{"co:a", "co:b", "co:c"}

	wctx, stop := context.WithTimeout(ctx, run)
	defer stop()
	kills := killer(wctx, 100*time.Millisecond, 400*time.Millisecond, func(ctx context.Context) (int, error) {
		return terminateApp1(ctx, admin, "faults-coalesce")
	})
	var wg sync.WaitGroup
	for lk := range 2 {
		locker, err := pglock.New(clients, &pglock.Config{Holder: fmt.Sprintf("co-%d", lk), PollOnly: lk == 1, PollInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { locker.Close() })
		for w := range 10 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := rec.NewClient()
				rng := rand.New(rand.NewPCG(uint64(lk*100+w), 41))
				own := fmt.Sprintf("co:own-%d-%d", lk, w)
				n := 0
				for wctx.Err() == nil {
					name := own
					if rng.IntN(2) == 0 {
						name = hot[rng.IntN(len(hot))]
					}
					ttl := time.Duration(150+rng.IntN(850)) * time.Millisecond
					actx, cancel := context.WithTimeout(wctx, 2*time.Second)
					lease, err := c.Acquire(actx, locker, name, ttl, rng.IntN(4) == 0)
					cancel()
					if err != nil {
						continue
					}
					for k := rng.IntN(3); k >= 0 && wctx.Err() == nil; k-- {
						n++
						switch rng.IntN(4) {
						case 0:
							_ = c.Write(wctx, clients, name, lease.Token(), fencedwrite.Strict, name, fmt.Sprintf("c%d-%d-%d", lk, w, n))
						case 1:
							_ = c.Renew(wctx, lease)
						case 2:
							_, _ = c.Inspect(wctx, clients, name)
						case 3:
							sleep(wctx, time.Duration(rng.Int64N(int64(ttl/4))))
						}
					}
					if rng.IntN(10) > 0 {
						_ = c.Release(wctx, lease)
					}
				}
			}()
		}
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		c := rec.NewClient()
		for wctx.Err() == nil {
			for _, name := range hot {
				_, _ = c.Inspect(wctx, admin, name)
			}
			sleep(wctx, 20*time.Millisecond)
		}
	}()
	wg.Wait()
	sum := rec.Verify(t)
	t.Logf("outcomes: %v", sum.Outcomes)
	t.Logf("coalesced history: %d ops in %v, %d backends killed, %d unknown, %d lock_grant_many and %d lock_release_many statements; check %v",
		sum.Ops, run, kills.Load(), sum.Unknown, counter.grants.Load(), counter.releases.Load(), sum.Took.Round(time.Millisecond))
	if sum.PerModel["lease"] == 0 || kills.Load() == 0 || counter.grants.Load() == 0 || counter.releases.Load() == 0 {
		t.Errorf("the workload did not exercise batched grants and releases under kills: %v, %d kills, %d grant and %d release batches",
			sum, kills.Load(), counter.grants.Load(), counter.releases.Load())
	}
}
