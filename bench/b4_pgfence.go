package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/skiplocked"
)

const b4Queue = "pgfence-bench"

// enqueueB4 empties pgfence.jobs and enqueues n no-op jobs.
func (b *bench) enqueueB4(ctx context.Context, n int) error {
	pool := b.pg.pool
	if _, err := pool.Exec(ctx, "TRUNCATE pgfence.jobs"); err != nil {
		return err
	}
	const chunk = 5000 // of the 100,000 one Enqueue call takes
	ps := make([]skiplocked.EnqueueParams, 0, chunk)
	for i := range n {
		ps = append(ps, skiplocked.EnqueueParams{Queue: b4Queue})
		if len(ps) == chunk || i == n-1 {
			if _, err := skiplocked.Enqueue(ctx, pool, ps...); err != nil {
				return err
			}
			ps = ps[:0]
		}
	}
	_, err := pool.Exec(ctx, "VACUUM ANALYZE pgfence.jobs")
	return err
}

// pgfenceB4Variant burns the queue down with b4Workers goroutines, each
// looping Claim (leased claims, one statement) → Complete (one
// statement, conditional on the claim tokens) with the given batch size.
func (b *bench) pgfenceB4Variant(batch, jobs int) variant {
	return variant{name: fmt.Sprintf("pgfence skiplocked, batch %d", batch), clients: b4Workers,
		run: func(ctx context.Context, dur time.Duration) (runResult, error) {
			jobs := b.burnDownJobs(jobs, dur)
			if err := b.enqueueB4(ctx, jobs); err != nil {
				return runResult{}, fmt.Errorf("enqueue: %w", err)
			}
			ctx, cancel := context.WithTimeout(ctx, b.burnDownTimeout())
			defer cancel()
			var (
				done     atomic.Int64
				wg       sync.WaitGroup
				errOnce  sync.Once
				firstErr error
			)
			before := memStats()
			start := time.Now()
			for w := range b4Workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					worker := fmt.Sprintf("bench-b4-%d", w)
					for {
						claimed, err := skiplocked.Claim(ctx, b.pg.pool, skiplocked.ClaimParams{
							Queue: b4Queue, Holder: worker, Limit: batch, TTL: 5 * time.Minute})
						if err == nil && len(claimed) == 0 {
							return // drained: what is left is claimed by others
						}
						if err == nil {
							refs := make([]skiplocked.ClaimRef, len(claimed))
							for i, j := range claimed {
								refs[i] = j.Ref()
							}
							err = skiplocked.Complete(ctx, b.pg.pool, refs...)
							lost := 0
							if errors.Is(err, pgfence.ErrLost) { // one *pgfence.Error per lost ref, joined when several
								lost = 1
								if j, ok := err.(interface{ Unwrap() []error }); ok {
									lost = len(j.Unwrap())
								}
							}
							done.Add(int64(len(refs) - lost))
						}
						if err != nil {
							errOnce.Do(func() { firstErr = err; cancel() })
							return
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			after := memStats()
			if firstErr != nil {
				if errors.Is(firstErr, context.DeadlineExceeded) {
					return runResult{}, fmt.Errorf("only %d of %d jobs completed in %s", done.Load(), jobs, b.burnDownTimeout())
				}
				return runResult{}, firstErr
			}
			if int(done.Load()) != jobs {
				return runResult{}, fmt.Errorf("completed %d jobs, enqueued %d", done.Load(), jobs)
			}
			return runResult{ops: done.Load(), elapsed: elapsed,
				mallocs: after.Mallocs - before.Mallocs, bytes: after.TotalAlloc - before.TotalAlloc}, nil
		}}
}

// pgfenceB4Variants returns pgfence's side of B4: one claim+complete
// variant per batch size, then one skiplocked.Worker variant per size.
func (b *bench) pgfenceB4Variants(jobs int) []variant {
	var vs []variant
	for _, batch := range b4Batches {
		vs = append(vs, b.pgfenceB4Variant(batch, jobs))
	}
	for _, n := range b4WorkerSizes {
		vs = append(vs, b.pgfenceWorkerSizedB4Variant(n, jobs))
	}
	return vs
}

// completions is an observe.Metrics that counts completed rows and signals
// when want is reached.
type completions struct {
	n    atomic.Int64
	want int64
	done chan struct{}
	once sync.Once
}

func (c *completions) Add(_ context.Context, name string, delta float64, _ ...string) {
	if name == metricdefs.RowsCompletedTotal && c.n.Add(int64(delta)) >= c.want {
		c.once.Do(func() { close(c.done) })
	}
}

func (c *completions) Observe(context.Context, string, float64, ...string) {}

// b4WorkerSizes are the Concurrency (= BatchSize) of the skiplocked.Worker
// variants of B4: the same concurrency as the other side, and the sizes at
// which a queue of no-op jobs is limited by the database rather than by
// the handlers.
var b4WorkerSizes = []int{b4Workers, 100, 1000}

// pgfenceWorkerB4Variant burns the queue down with skiplocked.Worker, the
// runtime that compares with River's client: b4Workers handlers, claims in
// batches of b4Workers (the default), completions batched by the worker.
// Timed from Run until the worker has recorded every completion.
func (b *bench) pgfenceWorkerB4Variant(jobs int) variant {
	return b.pgfenceWorkerSizedB4Variant(b4Workers, jobs)
}

// pgfenceWorkerSizedB4Variant is pgfenceWorkerB4Variant with n handlers and
// claims in batches of n.
func (b *bench) pgfenceWorkerSizedB4Variant(n, jobs int) variant {
	name := fmt.Sprintf("%s, %d handlers", b4WorkerPrefix, n)
	if n != b4Workers {
		name += fmt.Sprintf(", batch %d", n)
	}
	return variant{name: name, clients: n,
		run: func(ctx context.Context, dur time.Duration) (runResult, error) {
			jobs := b.burnDownJobs(jobs, dur)
			if err := b.enqueueB4(ctx, jobs); err != nil {
				return runResult{}, fmt.Errorf("enqueue: %w", err)
			}
			m := &completions{want: int64(jobs), done: make(chan struct{})}
			w, err := skiplocked.NewWorker(b.pg.pool, b4Queue, func(context.Context, skiplocked.Job) error { return nil },
				&skiplocked.Config{Concurrency: n, BatchSize: n, ClaimTTL: 5 * time.Minute, Metrics: m})
			if err != nil {
				return runResult{}, err
			}
			return b.timeBurnDown(ctx, w.Run, m, jobs, "worker", "jobs completed")
		}}
}

// timeBurnDown runs run (a Worker's or Dispatcher's Run) until m has counted
// every one of jobs, and times it from the start of run: the elapsed time,
// the count and the allocations of this process meanwhile. who and done name
// the runner and its unit in errors.
func (b *bench) timeBurnDown(ctx context.Context, run func(context.Context) error, m *completions, jobs int, who, done string) (runResult, error) {
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	before := memStats()
	start := time.Now()
	runErr := make(chan error, 1)
	go func() { runErr <- run(rctx) }()
	timeout := time.NewTimer(b.burnDownTimeout())
	defer timeout.Stop()
	select {
	case <-m.done:
	case err := <-runErr:
		return runResult{}, fmt.Errorf("%s stopped early after %d of %d: %v", who, m.n.Load(), jobs, err)
	case <-timeout.C:
		return runResult{}, fmt.Errorf("only %d of %d %s in %s", m.n.Load(), jobs, done, b.burnDownTimeout())
	}
	elapsed := time.Since(start)
	after := memStats()
	stop()
	if err := <-runErr; err != nil && !errors.Is(err, context.Canceled) {
		return runResult{}, err
	}
	return runResult{ops: m.n.Load(), elapsed: elapsed,
		mallocs: after.Mallocs - before.Mallocs, bytes: after.TotalAlloc - before.TotalAlloc}, nil
}
