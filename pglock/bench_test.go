package pglock

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// benchPool returns a pool large enough for 8 goroutines and a table with
// one row per goroutine for the plain UPDATE baseline.
func benchPool(b *testing.B) *pgxpool.Pool { return benchPoolN(b, 16) }

// benchPoolN is benchPool with a pool of maxConns connections.
func benchPoolN(b *testing.B, maxConns int32) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	// Open every connection before the timer starts: a connection opened
	// inside the timed loop costs its first operation a connect (slow on a
	// loaded machine), which once made the first variant of
	// BenchmarkCycleBreakdown look twice as slow as the others.
	conns := make([]*pgxpool.Conn, 0, maxConns)
	for range maxConns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
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

// BenchmarkAcquireRelease: acquire + release cycles on names distinct per
// goroutine, through one shared Locker (as bench/ B1 does); op=acquire uses
// Acquire (the bench's call), op=try TryAcquire, op=sql sends the same two
// generated statements on the pool without a Lease (the floor of the
// other two). Names are built before the timer starts, so allocs/op are the
// library's alone.
//
//	go test -run '^$' -bench 'AcquireRelease' -benchmem -benchtime 3000x ./pglock/
func BenchmarkAcquireRelease(b *testing.B) {
	for _, op := range []string{"acquire", "try", "sql"} {
		for _, g := range []int{1, 8, 32} {
			b.Run(fmt.Sprintf("op=%s/goroutines=%d", op, g), func(b *testing.B) {
				pool := benchPoolN(b, int32(g)+16)
				l := newLocker(b, pool, &Config{Holder: "bench"})
				ctx := benchCtx(b)
				names := benchNames("bench", g)
				warmUp(b, l, names)
				acq := l.Acquire
				switch op {
				case "try":
					acq = l.TryAcquire
				case "sql":
					acq = func(ctx context.Context, name string, ttl time.Duration) (*Lease, error) {
						return nil, sqlCycle(ctx, l, name, ttl)
					}
				}
				b.ReportAllocs()
				b.ResetTimer()
				runN(b, g, func(id int, next func() bool) {
					name := names[id-1]
					for next() {
						s, err := acq(ctx, name, time.Minute)
						if err == nil && s != nil {
							err = s.Release(ctx)
						}
						if err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
				b.ReportMetric(float64(pool.Stat().NewConnsCount()), "conns-opened")
			})
		}
	}
}

// BenchmarkFencedCycle: the full fenced cycle of bench/ B1 on names distinct
// per goroutine: Acquire, a strict fenced UPDATE of the goroutine's own row
// through fencedwrite with the lease's token, Release (three commits). The
// key and value are passed as the bench passes them ([]any of int64).
//
//	go test -run '^$' -bench 'FencedCycle' -benchmem -benchtime 3000x ./pglock/
func BenchmarkFencedCycle(b *testing.B) {
	for _, g := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			pool := benchPoolN(b, int32(g)+16)
			ctx := benchCtx(b)
			if _, err := pool.Exec(ctx, `CREATE TABLE bench_fenced (id bigint PRIMARY KEY, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);
				INSERT INTO bench_fenced (id) SELECT 1000 + g FROM generate_series(1, 64) g`); err != nil {
				b.Fatal(err)
			}
			tbl, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "bench_fenced", Key: []string{"id"}, Set: []string{"v"}})
			if err != nil {
				b.Fatal(err)
			}
			l := newLocker(b, pool, &Config{Holder: "bench"})
			names := benchNames("fenced", g)
			warmUp(b, l, names)
			b.ReportAllocs()
			b.ResetTimer()
			runN(b, g, func(id int, next func() bool) {
				name := names[id-1]
				for i := 0; next(); i++ {
					s, err := l.Acquire(ctx, name, time.Minute)
					if err != nil {
						b.Error(err)
						return
					}
					if _, err := tbl.Update(ctx, pool, s.Token(), []any{int64(1000 + id)}, []any{int64(i)}); err != nil {
						b.Error(err)
						return
					}
					if err := s.Release(ctx); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cycles/s")
		})
	}
}

// sqlCycle sends the grant and the release that Acquire and Release send,
// through the generated methods on the pool, without a Lease.
func sqlCycle(ctx context.Context, l *Locker, name string, ttl time.Duration) error {
	r, err := l.q.GrantLock(ctx, l.pool, dbsqlc.GrantLockParams{Name: name, Holder: l.holder, TtlUs: ttl.Microseconds(), Key: l.key})
	if err != nil {
		return err
	}
	if !r.Token.Valid {
		return fmt.Errorf("grant refused: held by %v", r.HeldBy)
	}
	rr, err := l.q.ReleaseLock(ctx, l.pool, dbsqlc.ReleaseLockParams{Name: name, Token: r.Token.Int64, Key: l.key})
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	if !rr.Released.Bool {
		return errors.New("release: the lease was lost")
	}
	return nil
}

// warmUp prepares the lock statements and the plain UPDATE on every pooled
// connection (held all at once, so each gets them) and takes and releases
// every name once through l (the first grant of a name inserts its row),
// so no timed operation pays a prepare, a first insert or the listener's
// start.
func warmUp(b *testing.B, l *Locker, names []string) {
	b.Helper()
	ctx := context.Background()
	conns := make([]*pgxpool.Conn, 0, l.pool.Config().MaxConns)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range cap(conns) {
		c, err := l.pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
	}
	for i, c := range conns {
		name := fmt.Sprintf("warm:%d", i)
		_, _ = l.q.GrantLock(ctx, c, dbsqlc.GrantLockParams{Name: name, Holder: l.holder, TtlUs: 1e6, Key: l.key})
		_, _ = l.q.ReleaseLock(ctx, c, dbsqlc.ReleaseLockParams{Name: name, Token: 1, Key: l.key})
		// The fast path's own prepared statements (grant() and release()).
		_, _ = fastGrantLock(ctx, c, dbsqlc.GrantLockParams{Name: name, Holder: l.holder, TtlUs: 1e6, Key: l.key})
		_, _ = fastReleaseLock(ctx, c, dbsqlc.ReleaseLockParams{Name: name, Token: 2, Key: l.key})
		if _, err := c.Exec(ctx, "UPDATE bench_counter SET n = n + 1 WHERE id = $1", 0); err != nil {
			b.Fatal(err)
		}
	}
	for _, c := range conns {
		c.Release()
	}
	conns = conns[:0]
	for _, name := range names {
		s, err := l.Acquire(ctx, name, time.Minute)
		if err == nil {
			err = s.Release(ctx)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// benchCtx returns a cancellable context, as applications and bench/ pass:
// pgx watches such a context on every round trip (context.AfterFunc), which
// costs allocations that context.Background() would hide.
func benchCtx(b *testing.B) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	return ctx
}

// benchNames returns g distinct lock names, one per goroutine id (1..g).
func benchNames(prefix string, g int) []string {
	names := make([]string, g)
	for i := range names {
		names[i] = fmt.Sprintf("%s:%d", prefix, i+1)
	}
	return names
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

// BenchmarkCycleBreakdown separates the lock path's cost from its SQL's:
// every goroutine rotates, on its own name and rows, (lib) Acquire +
// Release, (sql) the same two generated statements sent straight on the
// pool, without a Lease, and (upd) two single-row UPDATEs of random rows,
// the "UPDATE ÷ 2" limit of the bench. Each is timed on its own; the
// ratios compare throughputs measured side by side: lib/upd is the bench's
// B1 ratio, sql/upd the statements' share of the gap, lib/sql the Go side's.
//
//	go test -run '^$' -bench 'CycleBreakdown' -benchtime 4000x ./pglock/
func BenchmarkCycleBreakdown(b *testing.B) {
	for _, g := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			pool := benchPoolN(b, int32(g)+16)
			ctx := benchCtx(b)
			if _, err := pool.Exec(ctx, `INSERT INTO bench_counter SELECT g, 0 FROM generate_series(64, 9999) g`); err != nil {
				b.Fatal(err)
			}
			l := newLocker(b, pool, &Config{Holder: "bench"})
			names := benchNames("breakdown", g)
			warmUp(b, l, names)
			var sums [3]atomic.Int64
			b.ResetTimer()
			runN(b, g, func(id int, next func() bool) {
				name := names[id-1]
				var d [3]time.Duration
				for i := 0; next(); i++ {
					for k := range 3 {
						j := (i + k) % 3
						t0 := time.Now()
						var err error
						switch j {
						case 0:
							var s *Lease
							if s, err = l.Acquire(ctx, name, time.Minute); err == nil {
								err = s.Release(ctx)
							}
						case 1:
							err = sqlCycle(ctx, l, name, time.Minute)
						case 2:
							if err = plainUpdate(ctx, pool, mrand.IntN(10000)); err == nil {
								err = plainUpdate(ctx, pool, mrand.IntN(10000))
							}
						}
						if err != nil {
							b.Error(err)
							return
						}
						d[j] += time.Since(t0)
					}
				}
				for j := range d {
					sums[j].Add(int64(d[j]))
				}
			})
			lib, sql, upd := float64(sums[0].Load()), float64(sums[1].Load()), float64(sums[2].Load())
			b.ReportMetric(upd/lib, "lib/upd")
			b.ReportMetric(upd/sql, "sql/upd")
			b.ReportMetric(sql/lib, "lib/sql")
			per := func(d float64) float64 { return d / 1e3 / float64(b.N) }
			b.ReportMetric(per(lib), "µs/lib")
			b.ReportMetric(per(sql), "µs/sql")
			b.ReportMetric(per(upd), "µs/upd")
		})
	}
}
