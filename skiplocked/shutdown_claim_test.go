package skiplocked_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestShutdownTimeoutCountsFromStop: Config.ShutdownTimeout counts from the
// moment Run's context ends. It used to start only once every claim
// statement out had answered, and a claim may take up to ClaimTTL to answer
// (here it waits for a table lock): handlers in flight ran that much longer
// than the Worker promised.
func TestShutdownTimeoutCountsFromStop(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := smallPool(t, 8)
	const queue = "shutdown-claim"
	enqueueN(t, pool, queue, 1, 5)
	started := make(chan struct{})
	cause := make(chan error, 1)
	w := newWorker(t, pool, queue, func(jctx context.Context, _ skiplocked.Job) error {
		close(started)
		<-jctx.Done()
		cause <- context.Cause(jctx)
		return jctx.Err()
	}, &skiplocked.Config{Concurrency: 2, BatchSize: 1, PollOnly: true, PollInterval: 20 * time.Millisecond,
		ClaimTTL: time.Minute, ShutdownTimeout: 100 * time.Millisecond})
	stop := runWorker(t, w)
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the handler never started")
	}

	// Hold every claim statement at the table until the test is done.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "LOCK TABLE pgfence.jobs IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a claim statement waiting for the table", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_catalog.pg_stat_activity
			WHERE datname = pg_catalog.current_database() AND wait_event_type = 'Lock' AND query LIKE '%job_claim(%'`).Scan(&n)
		return err == nil && n > 0
	})

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case c := <-cause:
		if !errors.Is(c, pgfence.ErrClosed) {
			t.Errorf("handler's context ended with %v, want a cause matching pgfence.ErrClosed", c)
		}
	case <-time.After(20 * time.Second): // 200 x ShutdownTimeout; the claim would answer after ClaimTTL (1 min)
		t.Error("the handler was not cancelled 20s after Run stopped (ShutdownTimeout 100ms) while a claim statement was out")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}
