package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock"
)

// k1TTL is the TTL of K1's leases: with the default KeepAliveFraction (1/3)
// a lease is renewed every 10 s, as in pglock's TestK1KeepAlive10k.
const k1TTL = 30 * time.Second

// k1Acquirers is how many goroutines acquire K1's leases (through the one
// Locker, so the grants coalesce) before the window starts.
const k1Acquirers = 64

// renewCounter counts the renewal statements a pool sends (a pgx tracer).
type renewCounter struct{ many, single atomic.Int64 }

func (c *renewCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "pgfence.lock_renew_many("):
		c.many.Add(1)
	case strings.Contains(d.SQL, "pgfence.lock_renew("):
		c.single.Add(1)
	}
	return ctx
}

func (c *renewCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// processCPU is the user+system CPU time of this process so far.
func processCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}

// runK1 keeps k1Leases leases alive with one Locker (Config.KeepAlive,
// PollOnly as in pglock's test) for the window, once: the renewal statements
// it sends per renewal interval, the CPU this process spends per lease per
// minute, the smallest margin a lease had before its local deadline (sampled
// every second) and the leases lost.
func (b *bench) runK1(ctx context.Context) {
	const scen = "K1 keep-alive, one Locker"
	n, window := b.cfg.k1Leases, b.cfg.k1Window
	variantName := fmt.Sprintf("%d leases, TTL %s, one run of %s", n, k1TTL, window)
	b.k1Goal.name = fmt.Sprintf("K1 %d leases kept alive by one Locker for %s", n, window)
	fail := func(err error) {
		b.progress("K1: ERROR %v", err)
		b.add(notMeasured(scen, variantName, 0, "lock_renew_many statements per renewal interval", "error: "+err.Error()))
	}
	cfg, err := pgxpool.ParseConfig(b.pg.benchDSN)
	if err != nil {
		fail(err)
		return
	}
	var counter renewCounter
	cfg.ConnConfig.Tracer = &counter
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fail(err)
		return
	}
	defer pool.Close()
	holder := fmt.Sprintf("bench-k1-%d", time.Now().UnixNano())
	l, err := pglock.New(pool, &pglock.Config{Holder: holder, KeepAlive: true, PollOnly: true})
	if err != nil {
		fail(err)
		return
	}
	defer l.Close()

	leases := make([]*pglock.Lease, n)
	defer func() {
		var wg sync.WaitGroup
		var next atomic.Int64
		for range k1Acquirers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
					if leases[i] != nil {
						_ = leases[i].Release(context.WithoutCancel(ctx))
					}
				}
			}()
		}
		wg.Wait()
	}()
	acqStart := time.Now()
	var (
		wg      sync.WaitGroup
		next    atomic.Int64
		errOnce sync.Once
		acqErr  error
	)
	for range k1Acquirers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				lease, err := l.Acquire(ctx, fmt.Sprintf("bench-k1-%05d", i), k1TTL)
				if err != nil {
					errOnce.Do(func() { acqErr = err })
					return
				}
				leases[i] = lease
			}
		}()
	}
	wg.Wait()
	if acqErr != nil {
		fail(fmt.Errorf("acquire: %w", acqErr))
		return
	}
	acquired := time.Since(acqStart)
	b.progress("K1: %d leases acquired in %s by %d goroutines; keeping them alive for %s", n, acquired.Round(time.Millisecond), k1Acquirers, window)

	counter.many.Store(0)
	counter.single.Store(0)
	cpu0, cpuOK := processCPU()
	start := time.Now()
	end := start.Add(window)
	minMargin := k1TTL
	lost := 0
	seen := make([]bool, n)
	for {
		// The smallest time left before a lease's local deadline, sampled
		// every second (a renewal moves it back to about the TTL).
		for i, s := range leases {
			if s.Err() != nil {
				if !seen[i] {
					seen[i] = true
					lost++
				}
				continue
			}
			minMargin = min(minMargin, time.Until(s.Deadline()))
		}
		if !time.Now().Before(end) || ctx.Err() != nil {
			break
		}
		select {
		case <-time.After(min(time.Second, time.Until(end))):
		case <-ctx.Done():
		}
	}
	if err := ctx.Err(); err != nil {
		fail(err)
		return
	}
	elapsed := time.Since(start)
	cpu1, cpuOK1 := processCPU()
	many, single := counter.many.Load(), counter.single.Load()
	var held int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.locks WHERE holder = $1 AND expires_at > now()`, holder).Scan(&held); err != nil {
		fail(err)
		return
	}
	interval := time.Duration(float64(k1TTL) / 3)
	perTick := float64(many) / (float64(elapsed) / float64(interval))
	b.progress("K1: %d lock_renew_many statements in %s (%.2f per %s), %d lock_renew; smallest margin %s; %d held, %d lost",
		many, elapsed.Round(time.Second), perTick, interval, single, minMargin.Round(time.Millisecond), held, lost)

	one := func(metric string, v float64) Row { return newRow(scen, variantName, 0, metric, []float64{v}) }
	lostRow := one("leases lost (lease ended, or not held in the table at the end)", float64(max(lost, n-held)))
	lostRow = lostRow.withGoal("0", lostRow.Median == 0)
	b.k1Goal.addValue(fmt.Sprintf("%d leases, %s", n, window), fmt.Sprintf("%d lost", int(lostRow.Median)), lostRow.Median == 0)
	b.add(
		one(fmt.Sprintf("lock_renew_many statements per renewal interval (%s)", interval), perTick),
		one("lock_renew_many statements in the window", float64(many)),
		one("single-lease lock_renew statements in the window", float64(single)),
	)
	if cpuOK && cpuOK1 {
		b.add(one("client CPU ms per lease per minute (whole bench process)",
			float64(cpu1-cpu0)/float64(time.Millisecond)/float64(n)/elapsed.Minutes()))
	} else {
		b.add(notMeasured(scen, variantName, 0, "client CPU ms per lease per minute", "getrusage failed"))
	}
	b.add(one("smallest margin before a lease's local deadline s (sampled every second)", minMargin.Seconds()),
		lostRow,
		one(fmt.Sprintf("acquire of the %d leases s (%d goroutines, one Locker)", n, k1Acquirers), acquired.Seconds()))
}
