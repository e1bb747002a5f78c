package skiplocked_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
