package skiplocked_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestWorkerClaimDeadlineCancelsHandler: a handler whose claim gets no
// renewal answered before its local deadline (here: the handler holds
// every connection of the Worker's pool, so no renewal can be sent) has its
// context cancelled then, with a cause matching pgfence.ErrLost: the claim
// may have expired and the job may be claimed again. Before, only a
// renewal that found the claim lost cancelled it, so a Worker cut off from
// the database let its handler run on beside the job's next claimer. The
// handler's error then releases the claim, which the next claim takes.
func TestWorkerClaimDeadlineCancelsHandler(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := smallPool(t, 3)
	queue := "claim-deadline"
	ids := enqueueN(t, pool, queue, 1, 5)
	const ttl = time.Second
	type end struct {
		cause   error
		elapsed time.Duration
	}
	ended := make(chan end, 1)
	var runs atomic.Int32
	w := newWorker(t, pool, queue, func(jctx context.Context, j skiplocked.Job) error {
		if runs.Add(1) > 1 {
			return nil // claimed again after the release: completes
		}
		start := time.Now()
		// Take every connection of the pool: the Worker's renewals wait.
		var held []*pgxpool.Conn
		for range pool.Config().MaxConns {
			c, err := pool.Acquire(jctx)
			if err != nil {
				break // cancelled while taking them
			}
			held = append(held, c)
		}
		<-jctx.Done()
		ended <- end{context.Cause(jctx), time.Since(start)}
		for _, c := range held {
			c.Release()
		}
		return jctx.Err()
	}, &skiplocked.Config{Concurrency: 1, ClaimTTL: ttl, RenewInterval: 100 * time.Millisecond, PollInterval: 50 * time.Millisecond})
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run = %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("Run did not return within 30s of its context's end")
		}
	}()

	select {
	case e := <-ended:
		if !errors.Is(e.cause, pgfence.ErrLost) {
			t.Fatalf("handler's context cause = %v; want one matching pgfence.ErrLost", e.cause)
		}
		// The local deadline counts from before the claim was sent: the
		// handler cannot have run longer than the TTL before it passed.
		if e.elapsed > ttl+5*time.Second {
			t.Errorf("handler cancelled %v after it started; want about the claim TTL %v", e.elapsed, ttl)
		}
	case <-ctx.Done():
		t.Fatalf("the handler's context was not cancelled although no renewal could be sent (claim TTL %v)", ttl)
	}
	// Released, claimed again and completed.
	deadline := time.Now().Add(30 * time.Second)
	for countState(t, pool, queue, skiplocked.StateCompleted) != len(ids) {
		if time.Now().After(deadline) {
			t.Fatalf("job not completed after the release (summary %+v)", w.Summary())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if s := w.Summary(); s.Failed != 0 || s.Completed != 1 {
		t.Errorf("summary %+v; want the cut attempt released, not failed, and one completion", s)
	}
}
