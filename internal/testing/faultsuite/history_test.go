package faultsuite

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestHistoryRandomized runs a randomized workload (lease holders on a few
// hot names with random TTLs, fenced writes and reads, outbox intents,
// renewals, inspections, job claimers) while a killer terminates random
// client backends and holders pause past their TTLs, records every
// operation, and checks the history with the lease, row and job models and
// the real-time checks. About 30 s; PGFENCE_FAULTS_LONG=1 runs 3 minutes.
func TestHistoryRandomized(t *testing.T) {
	t.Parallel()
	run := 30 * time.Second
	if long() {
		run = 3 * time.Minute
	}
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	clients := appPool(t, dsn, "faults-history", 24)
	rec := history.New()
	rec.BoundCutAcquires() // kills and pauses; no network delay
	names := []string{"hist:a", "hist:b", "hist:c"}
	const queue = "history-jobs"

	var (
		mu    sync.Mutex
		known []int64 // the jobs of the queue
	)
	enqueue := func(ctx context.Context) error {
		ids, err := skiplocked.Enqueue(ctx, admin, skiplocked.EnqueueParams{Queue: queue, MaxAttempts: 1000000})
		if err == nil {
			mu.Lock()
			known = append(known, ids[0])
			mu.Unlock()
		}
		return err
	}
	for range 4 {
		if err := enqueue(ctx); err != nil {
			t.Fatal(err)
		}
	}

	wctx, stop := context.WithTimeout(ctx, run)
	defer stop()
	kills := killer(wctx, 100*time.Millisecond, 400*time.Millisecond, func(ctx context.Context) (int, error) {
		return terminateApp1(ctx, admin, "faults-history")
	})
	var wg sync.WaitGroup
	var errs atomic.Int64
	fail := func(format string, args ...any) {
		if errs.Add(1) <= 5 {
			t.Errorf(format, args...)
		}
	}

	// Lease holders: half wait by LISTEN, half poll; a holder shares its
	// holder name with another goroutine of its Locker.
	for w := range 6 {
		locker, err := pglock.New(clients, &pglock.Config{Holder: fmt.Sprintf("hist-%d", w/2), PollOnly: w%3 == 0, PollInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { locker.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := rec.NewClient()
			rng := rand.New(rand.NewPCG(uint64(w), 35))
			n := 0
			for wctx.Err() == nil {
				name := names[rng.IntN(len(names))]
				ttl := time.Duration(150+rng.IntN(850)) * time.Millisecond
				actx, cancel := context.WithTimeout(wctx, 3*time.Second)
				lease, err := c.Acquire(actx, locker, name, ttl, rng.IntN(3) > 0)
				cancel()
				if err != nil {
					continue
				}
				for k := rng.IntN(5); k >= 0 && wctx.Err() == nil; k-- {
					n++
					switch rng.IntN(7) {
					case 0:
						_ = c.Write(wctx, clients, name, lease.Token(), fencedwrite.Strict, name, fmt.Sprintf("c%d-%d", w, n))
					case 1:
						_ = c.Write(wctx, clients, name, lease.Token(), fencedwrite.Reentrant, name, fmt.Sprintf("c%d-%d", w, n))
					case 2:
						_, _ = c.Read(wctx, clients, name, lease.Token(), name)
					case 3:
						_ = c.Enqueue(wctx, clients, lease, fmt.Sprintf("hist-%d-%d", w, n))
					case 4:
						_ = c.Renew(wctx, lease)
					case 5:
						_, _ = c.Inspect(wctx, clients, name)
					case 6:
						// A pause: sometimes past the lease's TTL, so that the
						// next write is a stale holder's.
						sleep(wctx, time.Duration(rng.Int64N(int64(ttl*3/2))))
					}
				}
				if rng.IntN(10) > 0 {
					_ = c.Release(wctx, lease)
				} // else: abandoned, it expires
			}
		}()
	}
	// An observer reads every lock row.
	wg.Add(1)
	go func() {
		defer wg.Done()
		c := rec.NewClient()
		for wctx.Err() == nil {
			for _, name := range names {
				_, _ = c.Inspect(wctx, admin, name)
			}
			sleep(wctx, 20*time.Millisecond)
		}
	}()
	// Job claimers: claim, sometimes pause past the claim, then complete or
	// fail (back to available). A completed job is replaced by a new one.
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := rec.NewClient()
			rng := rand.New(rand.NewPCG(uint64(w), 36))
			for wctx.Err() == nil {
				mu.Lock()
				ids := append([]int64(nil), known...)
				mu.Unlock()
				ttl := time.Duration(100+rng.IntN(300)) * time.Millisecond
				jobs, err := c.Claim(wctx, clients, skiplocked.ClaimParams{Queue: queue, Holder: fmt.Sprintf("claimer-%d", w), Limit: 1 + rng.IntN(2), TTL: ttl}, ids)
				if err != nil || len(jobs) == 0 {
					sleep(wctx, 10*time.Millisecond)
					continue
				}
				for _, j := range jobs {
					if rng.IntN(4) == 0 {
						sleep(wctx, time.Duration(rng.Int64N(int64(ttl*3/2))))
					}
					if rng.IntN(3) == 0 {
						if err := c.Complete(wctx, clients, j.Ref()); err == nil {
							if err := enqueue(wctx); err != nil && wctx.Err() == nil {
								fail("enqueue: %v", err)
							}
						}
					} else {
						_ = c.Fail(wctx, clients, j.Ref(), 0)
					}
				}
			}
		}()
	}
	wg.Wait()
	sum := rec.Verify(t)
	per10k := time.Duration(0)
	if sum.Ops > 0 {
		per10k = sum.Took * 10000 / time.Duration(sum.Ops)
	}
	t.Logf("outcomes: %v", sum.Outcomes)
	t.Logf("randomized history: %d ops in %v (%.0f ops/s recorded), %d backends killed, %d unknown; check %v (%v per 10,000 ops)",
		sum.Ops, run, float64(sum.Ops)/run.Seconds(), kills.Load(), sum.Unknown, sum.Took.Round(time.Millisecond), per10k.Round(time.Millisecond))
	if sum.PerModel["lease"] == 0 || sum.PerModel["row"] == 0 || sum.PerModel["job"] == 0 || kills.Load() == 0 {
		t.Errorf("the workload did not exercise every model under kills: %v, %d kills", sum, kills.Load())
	}
}

// terminateApp1 ends one backend, at random, of the current database whose
// application_name is app.
func terminateApp1(ctx context.Context, admin *pgxpool.Pool, app string) (int, error) {
	var n int
	err := admin.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM (
			SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()
			ORDER BY random() LIMIT 1) victim`, app).Scan(&n)
	return n, err
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
