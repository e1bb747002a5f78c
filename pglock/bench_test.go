package pglock

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// benchPool returns a pool large enough for 8 goroutines and a table with
// one row per goroutine for the plain UPDATE baseline.
func benchPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	if _, err := pool.Exec(context.Background(), `CREATE TABLE bench_counter (id int PRIMARY KEY, n bigint NOT NULL);
		INSERT INTO bench_counter SELECT g, 0 FROM generate_series(0, 63) g`); err != nil {
		b.Fatal(err)
	}
	return pool
}

// runN runs body on exactly g goroutines (g = 1: the benchmark goroutine;
// else b.RunParallel, which uses a multiple of GOMAXPROCS), giving each a
// distinct id from 1.
func runN(b *testing.B, g int, body func(id int, next func() bool)) {
	if g == 1 {
		i := 0
		body(1, func() bool { i++; return i <= b.N })
		return
	}
	b.SetParallelism(max(1, g/runtime.GOMAXPROCS(0)))
	var seq atomic.Int64
	b.RunParallel(func(pb *testing.PB) { body(int(seq.Add(1)), pb.Next) })
}

func cycle(ctx context.Context, l *Locker, name string) error {
	s, err := l.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		return err
	}
	return s.Release(ctx)
}

func plainUpdate(ctx context.Context, pool *pgxpool.Pool, id int) error {
	_, err := pool.Exec(ctx, "UPDATE bench_counter SET n = n + 1 WHERE id = $1", id)
	return err
}

// BenchmarkAcquireRelease: TryAcquire + Release cycles on distinct names
// (one per goroutine); allocations are per cycle.
func BenchmarkAcquireRelease(b *testing.B) {
	for _, g := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			pool := benchPool(b)
			l := newLocker(b, pool, nil)
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			runN(b, g, func(id int, next func() bool) {
				name := fmt.Sprintf("bench:%d", id)
				for next() {
					if err := cycle(ctx, l, name); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
		})
	}
}

// BenchmarkPlainUpdate: the baseline, a single-row UPDATE per goroutine.
func BenchmarkPlainUpdate(b *testing.B) {
	for _, g := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			pool := benchPool(b)
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			runN(b, g, func(id int, next func() bool) {
				for next() {
					if err := plainUpdate(ctx, pool, id); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "updates/s")
		})
	}
}

// BenchmarkCycleVsUpdate measures both side by side on one server in one
// run: every goroutine alternates one acquire+release cycle and one plain
// UPDATE, timing each. ratio = cycles/s ÷ updates/s (target ≥ 0.45: a cycle
// is two commits).
func BenchmarkCycleVsUpdate(b *testing.B) {
	for _, g := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			pool := benchPool(b)
			l := newLocker(b, pool, nil)
			ctx := context.Background()
			var cycNs, updNs atomic.Int64
			b.ResetTimer()
			runN(b, g, func(id int, next func() bool) {
				name := fmt.Sprintf("bench:%d", id)
				var c, u time.Duration
				for next() {
					t0 := time.Now()
					if err := cycle(ctx, l, name); err != nil {
						b.Error(err)
						return
					}
					t1 := time.Now()
					if err := plainUpdate(ctx, pool, id); err != nil {
						b.Error(err)
						return
					}
					c, u = c+t1.Sub(t0), u+time.Since(t1)
				}
				cycNs.Add(int64(c))
				updNs.Add(int64(u))
			})
			// Each goroutine spends cycNs/g in cycles, so the aggregate rate
			// is b.N / (cycNs/g); likewise for updates.
			b.ReportMetric(float64(updNs.Load())/float64(cycNs.Load()), "ratio")
			b.ReportMetric(float64(b.N)*float64(g)/time.Duration(cycNs.Load()).Seconds(), "cycles/s")
			b.ReportMetric(float64(b.N)*float64(g)/time.Duration(updNs.Load()).Seconds(), "updates/s")
		})
	}
}

// BenchmarkHandoff measures the latency from the holder's Release call to
// the waiter's grant: woken by LISTEN/NOTIFY, and by polling every 100ms
// (PollOnly) for comparison.
func BenchmarkHandoff(b *testing.B) {
	for _, mode := range []struct {
		name string
		cfg  Config
	}{
		{"listen", Config{}},
		{"poll-100ms", Config{PollOnly: true, PollInterval: 100 * time.Millisecond}},
	} {
		b.Run(mode.name, func(b *testing.B) {
			pool := pgtest.Pool(b)
			holder := newLocker(b, pool, &Config{Holder: "holder"})
			cfg := mode.cfg
			cfg.Holder = "waiter"
			waiter := newLocker(b, pool, &cfg)
			waiting := waitSignal(waiter)
			ctx := context.Background()
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				s, err := holder.TryAcquire(ctx, "handoff", time.Minute)
				if err != nil {
					b.Fatal(err)
				}
				res := acquireAsync(ctx, waiter, "handoff", time.Minute)
				<-waiting
				// Let the waiter settle into its sleep (it signals just before).
				time.Sleep(time.Millisecond)
				t0 := time.Now()
				if err := s.Release(ctx); err != nil {
					b.Fatal(err)
				}
				r := <-res
				if r.err != nil {
					b.Fatal(r.err)
				}
				lat = append(lat, r.at.Sub(t0))
				if err := r.lease.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "ms-median")
			b.ReportMetric(float64(lat[len(lat)*9/10].Microseconds())/1000, "ms-p90")
		})
	}
}
