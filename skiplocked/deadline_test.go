package skiplocked_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
// handler's error then fails the attempt, and the next claim completes the
// job.
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
	// Failed (or lost to this Worker's own next claim, the claim having
	// expired meanwhile), claimed again and completed.
	deadline := time.Now().Add(30 * time.Second)
	for countState(t, pool, queue, skiplocked.StateCompleted) != len(ids) || w.Summary().Completed != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("job not completed after the cut attempt (summary %+v)", w.Summary())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("handler ran %d times; want 2 (the cut attempt, then the completing one)", n)
	}
}

// TestWorkerDeadlineCutsCountAttempts: a handler cut at its claim's local
// deadline that returns an error has its attempt failed, counted: a job
// whose every attempt starves the renewals (its handler holds the pool's
// connections) ends dead after MaxAttempts. Released instead (a review of
// the first version), the attempt was given back each time and the job ran
// again and again.
func TestWorkerDeadlineCutsCountAttempts(t *testing.T) {
	t.Parallel()
	pool := smallPool(t, 3)
	queue := "deadline-cuts-count"
	ids := enqueueN(t, pool, queue, 1, 2)
	const ttl = 500 * time.Millisecond
	var runs, cut atomic.Int32
	w := newWorker(t, pool, queue, func(jctx context.Context, j skiplocked.Job) error {
		runs.Add(1)
		var held []*pgxpool.Conn
		for range pool.Config().MaxConns {
			c, err := pool.Acquire(jctx)
			if err != nil {
				break
			}
			held = append(held, c)
		}
		defer func() {
			for _, c := range held {
				c.Release()
			}
		}()
		<-jctx.Done()
		if errors.Is(context.Cause(jctx), pgfence.ErrLost) {
			cut.Add(1)
		}
		return jctx.Err()
	}, &skiplocked.Config{Concurrency: 1, ClaimTTL: ttl, RenewInterval: 100 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 0 }})
	stop := runWorker(t, w)
	defer func() { _ = stop() }()
	deadline := time.Now().Add(60 * time.Second)
	for mustJob(t, pool, ids[0]).State != skiplocked.StateDead {
		if time.Now().After(deadline) {
			t.Fatalf("job not dead after 60s: %d runs, %d cut, %+v", runs.Load(), cut.Load(), w.Summary())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n, c := runs.Load(), cut.Load(); n > 2 || c < 1 {
		t.Errorf("handler ran %d times (cut %d) before the job went dead; want at most MaxAttempts (2), cut at least once", n, c)
	}
}

// TestTxWorkerOwnCompletionNotCut: a TxHandler that completes its own
// claim in its transaction (runTx commits it) and then works on holds the
// job's row lock, so the renewals, answered, skip the row and do not
// extend the claim; nobody else can claim a locked row. It is not cut at
// the local deadline (a review of the first version found it cut, its
// completion rolled back and the job run again for ever).
func TestTxWorkerOwnCompletionNotCut(t *testing.T) {
	t.Parallel()
	pool := smallPool(t, 6)
	queue := "deadline-own-completion"
	ids := enqueueN(t, pool, queue, 1, 3)
	const ttl = 2 * time.Second
	var runs, cut atomic.Int32
	w, err := skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		runs.Add(1)
		if err := skiplocked.Complete(ctx, tx, j.Ref()); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			cut.Add(1)
			return ctx.Err()
		case <-time.After(2 * ttl):
			return nil
		}
	}, &skiplocked.Config{Concurrency: 1, ClaimTTL: ttl, RenewInterval: 100 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	defer func() { _ = stop() }()
	deadline := time.Now().Add(60 * time.Second)
	for mustJob(t, pool, ids[0]).State != skiplocked.StateCompleted {
		if time.Now().After(deadline) {
			t.Fatalf("job not completed after 60s: %d runs, %d cut, %+v", runs.Load(), cut.Load(), w.Summary())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n, c := runs.Load(), cut.Load(); n != 1 || c != 0 {
		t.Errorf("handler ran %d times, cut %d; want once, never cut", n, c)
	}
}
