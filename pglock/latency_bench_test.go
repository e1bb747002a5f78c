package pglock

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// BenchmarkAcquireLatency: one client, Acquire then Release of a free name
// in a loop; reports the p50 and p90 of the Acquire calls alone (what
// coalescing must not delay: a lone caller is sent at once). The context
// can end, as most callers' can: its grant goes out as a statement that is
// not cancelled with it (detach.go), the path with the most work.
func BenchmarkAcquireLatency(b *testing.B) {
	pool := pgtest.Pool(b)
	l := newLocker(b, pool, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		s, err := l.Acquire(ctx, "latency", 30*time.Second)
		lat = append(lat, time.Since(start))
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1000, "µs-p50")
	b.ReportMetric(float64(lat[len(lat)*9/10].Nanoseconds())/1000, "µs-p90")
}
