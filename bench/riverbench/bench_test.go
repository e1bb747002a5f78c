package riverbench_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

func TestMain(m *testing.M) {
	code := m.Run()
	pgtest.Shutdown()
	os.Exit(code)
}

const workers = 8

func newPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

type noopArgs struct{}

func (noopArgs) Kind() string { return "noop" }

type noopWorker struct {
	river.WorkerDefaults[noopArgs]
	done *atomic.Int64
	n    int64
	all  chan struct{}
}

func (w *noopWorker) Work(context.Context, *river.Job[noopArgs]) error {
	if w.done.Add(1) == w.n {
		close(w.all)
	}
	return nil
}

// BenchmarkRiverBurnDown: River drains b.N pre-inserted jobs with a no-op
// worker. MaxWorkers is River's concurrency and also the most jobs one fetch
// takes; FetchCooldown (River's default 100ms, minimum 1ms) is the least time
// between two fetches, which caps throughput at MaxWorkers per cooldown.
func BenchmarkRiverBurnDown(b *testing.B) {
	for _, tc := range []struct {
		maxWorkers int
		cooldown   time.Duration
	}{{workers, time.Millisecond}, {100, river.FetchCooldownDefault}, {100, time.Millisecond}} {
		maxWorkers := tc.maxWorkers
		b.Run(fmt.Sprintf("maxworkers=%d/cooldown=%s", maxWorkers, tc.cooldown), func(b *testing.B) {
			ctx := context.Background()
			pool := newPool(b)
			driver := riverpgxv5.New(pool)
			migrator, err := rivermigrate.New(driver, nil)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
				b.Fatal(err)
			}
			w := &noopWorker{done: new(atomic.Int64), n: int64(b.N), all: make(chan struct{})}
			ws := river.NewWorkers()
			river.AddWorker(ws, w)
			client, err := river.NewClient(driver, &river.Config{
				Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}},
				Workers:       ws,
				FetchCooldown: tc.cooldown,
			})
			if err != nil {
				b.Fatal(err)
			}
			for start := 0; start < b.N; start += 10000 {
				params := make([]river.InsertManyParams, min(10000, b.N-start))
				for i := range params {
					params[i] = river.InsertManyParams{Args: noopArgs{}}
				}
				if _, err := client.InsertManyFast(ctx, params); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			begin := time.Now()
			if err := client.Start(ctx); err != nil {
				b.Fatal(err)
			}
			<-w.all
			elapsed := time.Since(begin)
			b.StopTimer()
			stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if err := client.Stop(stopCtx); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
		})
	}
}

func enqueue(b *testing.B, pool *pgxpool.Pool, queue string, n int) {
	b.Helper()
	for start := 0; start < n; start += 10000 {
		ps := make([]skiplocked.EnqueueParams, min(10000, n-start))
		for i := range ps {
			ps[i] = skiplocked.EnqueueParams{Queue: queue}
		}
		if _, err := skiplocked.Enqueue(context.Background(), pool, ps...); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPgfenceWorker: one skiplocked.Worker with Concurrency 8 drains
// b.N jobs with a no-op handler, claiming BatchSize jobs per statement.
func BenchmarkPgfenceWorker(b *testing.B) {
	for _, batch := range []int{1, 10, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			pool := newPool(b)
			enqueue(b, pool, "bench", b.N)
			var done atomic.Int64
			all := make(chan struct{})
			n := int64(b.N)
			w, err := skiplocked.NewWorker(pool, "bench", func(context.Context, skiplocked.Job) error {
				if done.Add(1) == n {
					close(all)
				}
				return nil
			}, &skiplocked.Config{Concurrency: workers, BatchSize: batch})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			b.ResetTimer()
			begin := time.Now()
			errc := make(chan error, 1)
			go func() { errc <- w.Run(ctx) }()
			<-all
			elapsed := time.Since(begin)
			cancel()
			if err := <-errc; err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
		})
	}
}

// BenchmarkPgfenceClaimComplete: 8 goroutines loop skiplocked.Claim(batch)
// + Complete until the queue is empty.
func BenchmarkPgfenceClaimComplete(b *testing.B) {
	for _, batch := range []int{1, 10, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			ctx := context.Background()
			pool := newPool(b)
			enqueue(b, pool, "bench", b.N)
			var done atomic.Int64
			b.ResetTimer()
			begin := time.Now()
			var wg sync.WaitGroup
			for i := range workers {
				wg.Go(func() {
					for {
						js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "bench", Holder: fmt.Sprint(i), Limit: batch, TTL: time.Minute})
						if err != nil {
							b.Error(err)
							return
						}
						if len(js) == 0 {
							return
						}
						refs := make([]skiplocked.ClaimRef, len(js))
						for k, j := range js {
							refs[k] = j.Ref()
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
			elapsed := time.Since(begin)
			b.StopTimer()
			if done.Load() != int64(b.N) {
				b.Fatalf("completed %d of %d", done.Load(), b.N)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
		})
	}
}
