package skiplocked_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// A handler that calls runtime.Goexit (t.FailNow or a require assertion in
// a test) ends its goroutine, which no recover stops. Before, its job
// stayed claimed and renewed, the Worker lost that handler for good (with
// Concurrency 1 nothing else ran: the other jobs stayed unhandled, and Run
// returned only when stopped), and a TxHandler's transaction kept its
// connection, so that the pool never closed. Now the job fails, the
// transaction rolls back, and another goroutine takes the handler's place.
func TestWorkerHandlerGoexit(t *testing.T) {
	for _, tx := range []bool{false, true} {
		name := map[bool]string{false: "Handler", true: "TxHandler"}[tx]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := smallPool(t, 4)
			queue := "goexit-" + strings.ToLower(name)
			exit := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: queue, Payload: []byte(`{"exit":true}`), MaxAttempts: 1})
			rest := enqueueN(t, pool, queue, 3, 3)
			handle := func(j skiplocked.Job, tx pgx.Tx) error {
				if j.ID == exit.ID {
					if tx != nil {
						if _, err := tx.Exec(context.Background(), "SELECT 1"); err != nil {
							return err
						}
					}
					runtime.Goexit()
				}
				return nil
			}
			cfg := &skiplocked.Config{Concurrency: 1, PollInterval: 20 * time.Millisecond}
			var w *skiplocked.Worker
			var err error
			if tx {
				w, err = skiplocked.NewTxWorker(pool, queue, func(_ context.Context, tx pgx.Tx, j skiplocked.Job) error { return handle(j, tx) }, cfg)
			} else {
				w, err = skiplocked.NewWorker(pool, queue, func(_ context.Context, j skiplocked.Job) error { return handle(j, nil) }, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			stop := runWorker(t, w)
			waitFor(t, "every job handled", func() bool {
				return countState(t, pool, queue, skiplocked.StateCompleted) == len(rest) &&
					countState(t, pool, queue, skiplocked.StateDead) == 1
			})
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if j := mustJob(t, pool, exit.ID); !strings.Contains(j.LastError, "runtime.Goexit") {
				t.Errorf("the job whose handler called runtime.Goexit: %s, last error %q", j.State, j.LastError)
			}
			if n := pool.Stat().AcquiredConns(); n != 0 {
				t.Errorf("%d connections still taken after Run returned", n)
			}
		})
	}
}

// An OnClaimLost callback that waits on its context does not hold Run once
// it stops: its context ends ShutdownTimeout after Run's did, as the
// handlers' do. Before, it was the outcome writers' context, which ends
// only after every writer has returned, and Run never returned.
func TestWorkerClaimLostHookEndsAtShutdown(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "lost-hook", 1, 5)
	started := make(chan struct{}, 1)
	hooked := make(chan struct{}, 1)
	w := newWorker(t, pool, "lost-hook", func(ctx context.Context, j skiplocked.Job) error {
		started <- struct{}{}
		<-ctx.Done()
		return nil
	}, &skiplocked.Config{ClaimTTL: 300 * time.Millisecond, RenewInterval: 50 * time.Millisecond, PollInterval: time.Hour,
		ShutdownTimeout: 500 * time.Millisecond,
		OnClaimLost: func(ctx context.Context, _ skiplocked.Job, _ *pgfence.Error) {
			hooked <- struct{}{}
			<-ctx.Done() // a compensation that waits for as long as it may
		}})
	stop := runWorker(t, w)
	<-started
	// Another holder takes the claim over (expired and claimed again in one
	// transaction, so that no renewal slips in between).
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	if b, err := skiplocked.Claim(ctx, tx, skiplocked.ClaimParams{Queue: "lost-hook", Holder: "B", Limit: 1, TTL: time.Minute}); err != nil || len(b) != 1 {
		t.Fatal(b, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-hooked:
	case <-time.After(10 * time.Second):
		t.Fatal("OnClaimLost not called after the claim was lost")
	}
	start := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("stopping the Worker while OnClaimLost waits on its context: %v", err)
	}
	t.Logf("Run returned %v after its context ended (ShutdownTimeout 500ms)", time.Since(start).Round(time.Millisecond))
}
