//go:build unix

package pglock

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestK1KeepAlive10k is bench K1, run by hand: one Locker keeps 10,000
// leases alive for PGFENCE_K1 minutes (e.g. PGFENCE_K1=5), and it reports
// the statements per tick, the CPU this process spent per lease per minute,
// and the smallest margin a lease had before its local deadline when a
// renewal came back. It fails if any lease is lost. Without PGFENCE_K1 it
// runs for 9 seconds with 500 leases of 6 seconds.
//
//	PGFENCE_K1=5 go test -run TestK1KeepAlive10k -v -timeout 30m ./pglock/
func TestK1KeepAlive10k(t *testing.T) {
	t.Parallel()
	n, minutes, ttl := 500, 0.15, 6*time.Second
	if v := os.Getenv("PGFENCE_K1"); v != "" {
		m, err := strconv.ParseFloat(v, 64)
		if err != nil {
			t.Fatalf("PGFENCE_K1=%q: %v", v, err)
		}
		n, minutes, ttl = 10000, m, 30*time.Second // a renewal every 10 s
	}
	ctx := testCtx(t, time.Duration(minutes*float64(time.Minute))+10*time.Minute)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	var c renewCounter
	cfg.ConnConfig.Tracer = &c
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := newLocker(t, pool, &Config{KeepAlive: true, PollOnly: true})
	leases := make([]*Lease, n)
	acquireStart := time.Now()
	for i := range leases {
		leases[i] = mustAcquire(t, l, fmt.Sprintf("k1-%05d", i), ttl)
	}
	t.Logf("acquired %d leases in %v", n, time.Since(acquireStart).Round(time.Millisecond))

	c.many.Store(0)
	cpu0 := cpuTime(t)
	start := time.Now()
	end := start.Add(time.Duration(minutes * float64(time.Minute)))
	minMargin := ttl
	for time.Now().Before(end) {
		// The smallest time left before a lease's local deadline, sampled
		// every second (a renewal moves it back to about the TTL).
		for _, s := range leases {
			if err := s.Err(); err != nil {
				t.Fatalf("lease %s lost after %v: %v", s.Name(), time.Since(start), err)
			}
			minMargin = min(minMargin, time.Until(s.Deadline()))
		}
		time.Sleep(time.Second) // sampling period; nothing to wait for
	}
	elapsed := time.Since(start)
	cpu := cpuTime(t) - cpu0
	ticks := c.many.Load()
	var held int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.locks WHERE name LIKE 'k1-%' AND holder = $1 AND expires_at > now()`,
		l.Holder()).Scan(&held); err != nil {
		t.Fatal(err)
	}
	t.Logf("K1: %d leases kept alive for %v: %d lock_renew_many statements (%.1f per renewal interval of %v), %d lock_renew; "+
		"client CPU %v = %.2f ms per lease per minute; smallest margin before a local deadline %v of %v; %d held, 0 lost",
		n, elapsed.Round(time.Second), ticks, float64(ticks)/(float64(elapsed)/float64(ttl/3)), ttl/3, c.single.Load(),
		cpu.Round(time.Millisecond), float64(cpu.Microseconds())/1000/float64(n)/elapsed.Minutes(), minMargin.Round(time.Millisecond), ttl, held)
	if held != n || c.single.Load() != 0 {
		t.Fatalf("%d of %d held, %d single renewals", held, n, c.single.Load())
	}
}

// cpuTime is the user+system CPU time of this process so far.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
