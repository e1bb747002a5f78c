package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// runResult is what one timed run produced.
type runResult struct {
	ops     int64
	elapsed time.Duration
	mallocs uint64 // heap allocations during the run, all goroutines
	bytes   uint64 // heap bytes allocated during the run
	// elsewhere: the work ran in other processes (B1's 4 processes), so
	// this process's allocation counters say nothing about it.
	elsewhere bool
}

func (r runResult) rate() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.ops) / r.elapsed.Seconds()
}

func (r runResult) allocsPerOp() float64 {
	if r.ops == 0 {
		return 0
	}
	return float64(r.mallocs) / float64(r.ops)
}

func (r runResult) bytesPerOp() float64 {
	if r.ops == 0 {
		return 0
	}
	return float64(r.bytes) / float64(r.ops)
}

// opFunc performs one operation for worker w; i counts that worker's calls.
type opFunc func(ctx context.Context, w, i int) error

// closedLoop runs op from clients goroutines, each issuing the next operation
// as soon as the previous one returned, until dur has passed. Operations that
// end after the deadline still count, and the elapsed time runs until the last
// one ended. The first error stops every worker and is returned.
func closedLoop(ctx context.Context, clients int, dur time.Duration, op opFunc) (runResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		ops      atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
		startCh  = make(chan struct{})
	)
	for w := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-startCh
			deadline := time.Now().Add(dur)
			for i := 0; time.Now().Before(deadline); i++ {
				if err := op(ctx, w, i); err != nil {
					if ctx.Err() == nil || !errors.Is(err, context.Canceled) {
						errOnce.Do(func() { firstErr = fmt.Errorf("worker %d: %w", w, err); cancel() })
					}
					return
				}
				ops.Add(1)
			}
		}()
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()
	close(startCh)
	wg.Wait()
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	if firstErr != nil {
		return runResult{}, firstErr
	}
	return runResult{
		ops:     ops.Load(),
		elapsed: elapsed,
		mallocs: after.Mallocs - before.Mallocs,
		bytes:   after.TotalAlloc - before.TotalAlloc,
	}, nil
}

func memStats() runtime.MemStats {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}
