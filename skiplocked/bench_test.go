package skiplocked_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

const benchWorkers = 8

var benchQueue atomic.Int64

func benchPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = benchWorkers + 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// BenchmarkClaimComplete: 8 goroutines each loop Claim(batch) +
// Complete until the queue is empty; one op = one job claimed and
// completed. Reports jobs/s.
func BenchmarkClaimComplete(b *testing.B) {
	pool := benchPool(b)
	for _, batch := range []int{1, 10, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			queue := fmt.Sprintf("bench-%d", benchQueue.Add(1))
			enqueueN(b, pool, queue, b.N, 5)
			ctx := context.Background()
			var done atomic.Int64
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			for w := range benchWorkers {
				wg.Go(func() {
					for {
						js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: queue, Holder: fmt.Sprint(w), Limit: batch, TTL: time.Minute})
						if err != nil {
							b.Error(err)
							return
						}
						if len(js) == 0 {
							return
						}
						refs := make([]skiplocked.ClaimRef, len(js))
						for i, j := range js {
							refs[i] = j.Ref()
						}
						if err := skiplocked.Complete(ctx, pool, refs...); err != nil {
							b.Error(err)
							return
						}
						done.Add(int64(len(js)))
					}
				})
			}
			wg.Wait()
			b.StopTimer()
			if int(done.Load()) != b.N {
				b.Fatalf("completed %d of %d", done.Load(), b.N)
			}
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "jobs/s")
		})
	}
}

// BenchmarkWorkerLoop: one Worker with Concurrency 8 and the given batch
// size drains the queue with a no-op handler (completions are batched).
func BenchmarkWorkerLoop(b *testing.B) {
	pool := benchPool(b)
	for _, batch := range []int{1, 10, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			queue := fmt.Sprintf("benchw-%d", benchQueue.Add(1))
			enqueueN(b, pool, queue, b.N, 5)
			var handled atomic.Int64
			allDone := make(chan struct{})
			n := int64(b.N)
			w, err := skiplocked.NewWorker(pool, queue, func(context.Context, skiplocked.Job) error {
				if handled.Add(1) == n {
					close(allDone)
				}
				return nil
			}, &skiplocked.Config{Concurrency: benchWorkers, BatchSize: batch, PollInterval: 100 * time.Millisecond})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			b.ResetTimer()
			start := time.Now()
			runErr := make(chan error, 1)
			go func() { runErr <- w.Run(ctx) }()
			<-allDone
			cancel()
			if err := <-runErr; err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "jobs/s")
			if got := countState(b, pool, queue, skiplocked.StateCompleted); got != b.N {
				b.Fatalf("completed %d of %d", got, b.N)
			}
		})
	}
}

// BenchmarkWorkerSizes: one Worker with Concurrency = BatchSize = n drains
// the queue with a no-op handler, timed from Run until the last completion
// is recorded (as the bench program's B4 does). Reports jobs/s.
func BenchmarkWorkerSizes(b *testing.B) {
	for _, n := range []int{8, 100, 1000} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			pool := benchPool(b)
			queue := fmt.Sprintf("benchs-%d", benchQueue.Add(1))
			enqueueN(b, pool, queue, b.N, 5)
			if _, err := pool.Exec(context.Background(), "VACUUM ANALYZE pgfence.jobs"); err != nil {
				b.Fatal(err)
			}
			m := &countCompleted{want: int64(b.N), done: make(chan struct{})}
			w, err := skiplocked.NewWorker(pool, queue, func(context.Context, skiplocked.Job) error { return nil },
				&skiplocked.Config{Concurrency: n, BatchSize: n, ClaimTTL: time.Minute, Metrics: m})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			b.ResetTimer()
			start := time.Now()
			runErr := make(chan error, 1)
			go func() { runErr <- w.Run(ctx) }()
			<-m.done
			elapsed := time.Since(start)
			b.StopTimer()
			cancel()
			if err := <-runErr; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
			if c := m.claims.Load(); c > 0 {
				b.ReportMetric(float64(m.claimMicros.Load())/float64(c)/1000, "ms/claim")
				b.ReportMetric(float64(b.N)/float64(c), "jobs/claim")
			}
			if got := countState(b, pool, queue, skiplocked.StateCompleted); got != b.N {
				b.Fatalf("completed %d of %d", got, b.N)
			}
		})
	}
}

// countCompleted is an observe.Metrics that closes done when want rows
// have been recorded as completed.
type countCompleted struct {
	n atomic.Int64
	// claims and claimMicros count the claim statements and their time.
	claims, claimMicros atomic.Int64
	want                int64
	done                chan struct{}
	once                sync.Once
}

func (c *countCompleted) Add(_ context.Context, name string, delta float64, _ ...string) {
	if name == metricdefs.RowsCompletedTotal && c.n.Add(int64(delta)) >= c.want {
		c.once.Do(func() { close(c.done) })
	}
}

func (c *countCompleted) Observe(_ context.Context, name string, v float64, _ ...string) {
	if name == metricdefs.ClaimSeconds {
		c.claims.Add(1)
		c.claimMicros.Add(int64(v * 1e6))
	}
}

// BenchmarkClaimWithFinishedRows measures one claim+complete of 10 jobs with
// 10k and 1M finished rows in the table. The 1M case is opt-in
// (PGFENCE_BENCH_LARGE=1) because filling the table takes a while.
func BenchmarkClaimWithFinishedRows(b *testing.B) {
	sizes := []int{10000}
	if os.Getenv("PGFENCE_BENCH_LARGE") != "" {
		sizes = append(sizes, 1000000)
	}
	for _, finished := range sizes {
		b.Run(fmt.Sprintf("finished=%d", finished), func(b *testing.B) {
			pool := benchPool(b)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `INSERT INTO pgfence.jobs (queue, state, finished_at, attempts)
				SELECT 'big', 'completed', now(), 1 FROM generate_series(1, $1)`, finished); err != nil {
				b.Fatal(err)
			}
			enqueueN(b, pool, "big", b.N*10, 5)
			if _, err := pool.Exec(ctx, "VACUUM ANALYZE pgfence.jobs"); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "big", Holder: "w", Limit: 10, TTL: time.Minute})
				if err != nil || len(js) != 10 {
					b.Fatal(len(js), err)
				}
				refs := make([]skiplocked.ClaimRef, len(js))
				for i, j := range js {
					refs[i] = j.Ref()
				}
				if err := skiplocked.Complete(ctx, pool, refs...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
