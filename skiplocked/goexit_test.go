package skiplocked_test

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

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

// goexitWorker is a Worker of handle (a TxHandler when tx) with cfg, its
// Logger writing to logs.
func goexitWorker(t *testing.T, pool *pgxpool.Pool, queue string, tx bool, handle func(context.Context, skiplocked.Job) error,
	cfg *skiplocked.Config, logs *lockedBuffer) *skiplocked.Worker {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var w *skiplocked.Worker
	var err error
	if tx {
		w, err = skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, _ pgx.Tx, j skiplocked.Job) error { return handle(ctx, j) }, cfg)
	} else {
		w, err = skiplocked.NewWorker(pool, queue, handle, cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// eventually polls cond until it holds or 60s pass (a correct Worker takes
// milliseconds, a stuck one forever: the margin is for a loaded machine),
// and tells whether it held.
func eventually(cond func() bool) bool {
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// A Config.Backoff that calls runtime.Goexit (t.FailNow or a require
// assertion in a test) ended the outcome writer that called it, mid-batch:
// the failure was never written (the job stayed running, its claim renewed
// for as long as Run lived), and with one writer nobody wrote any later
// outcome, the handlers blocked handing theirs over, and Run never
// returned. Now the failure is written with DefaultBackoff's delay, as
// after a panic, and the Worker goes on.
func TestWorkerBackoffGoexit(t *testing.T) {
	for _, tx := range []bool{false, true} {
		name := map[bool]string{false: "Handler", true: "TxHandler"}[tx]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := smallPool(t, 4) // one outcome writer
			queue := "goexit-backoff-" + strings.ToLower(name)
			bad := enqueueN(t, pool, queue, 1, 2)[0]
			called := make(chan struct{}, 2)
			var logs lockedBuffer
			w := goexitWorker(t, pool, queue, tx, func(_ context.Context, j skiplocked.Job) error {
				if j.ID == bad {
					return errors.New("fails")
				}
				return nil
			}, &skiplocked.Config{Concurrency: 1, PollInterval: 20 * time.Millisecond,
				Backoff: func(int) time.Duration {
					select {
					case called <- struct{}{}:
					default: // more calls than expected: the logs tell
					}
					runtime.Goexit()
					return 0
				}}, &logs)
			stop := runWorker(t, w)
			select {
			case <-called:
			case <-time.After(60 * time.Second):
				t.Fatal("Backoff not called after the job failed")
			}
			good := enqueueN(t, pool, queue, 10, 5)
			// The bad job is retried after DefaultBackoff(1), 1s, and
			// fails its last attempt: dead.
			if !eventually(func() bool {
				return countState(t, pool, queue, skiplocked.StateCompleted) == len(good) &&
					countState(t, pool, queue, skiplocked.StateDead) == 1
			}) {
				t.Errorf("after 60s: %d of %d later jobs completed, the failing job %s (summary %+v)",
					countState(t, pool, queue, skiplocked.StateCompleted), len(good), mustJob(t, pool, bad).State, w.Summary())
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if j := mustJob(t, pool, bad); j.State != skiplocked.StateDead || j.Attempts != 2 || j.LastError != "fails" {
				t.Errorf("the failing job: %s, attempt %d, last error %q; want dead after 2 attempts, \"fails\"", j.State, j.Attempts, j.LastError)
			}
			sum := w.Summary()
			if sum.Failed != 1 || sum.Dead != 1 || sum.Completed != int64(len(good)) || sum.ClaimsLost != 0 || sum.Unknown != 0 {
				t.Errorf("summary %+v; want 1 failed, 1 dead, %d completed, nothing lost or unknown", sum, len(good))
			}
			if n := strings.Count(logs.String(), "Backoff called runtime.Goexit; DefaultBackoff used"); n != 2 {
				t.Errorf("the Backoff's runtime.Goexit logged %d times, want 2; logs:\n%s", n, logs.String())
			}
			if strings.Contains(logs.String(), "claim lost") {
				t.Errorf("a claim reported lost; logs:\n%s", logs.String())
			}
		})
	}
}

// A Config.OnClaimLost that calls runtime.Goexit ended the outcome writer
// that called it, before it removed its batch's claims from those renewed:
// with one writer nobody wrote any later outcome, the handlers blocked
// handing theirs over, and Run never returned. Now the hook's goroutine
// ends alone, and the Worker goes on.
func TestWorkerClaimLostHookGoexit(t *testing.T) {
	for _, tx := range []bool{false, true} {
		name := map[bool]string{false: "Handler", true: "TxHandler"}[tx]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			pool := smallPool(t, 4) // one outcome writer
			queue := "goexit-lost-hook-" + strings.ToLower(name)
			victim := enqueueN(t, pool, queue, 1, 5)[0]
			started := make(chan struct{}, 1)
			hooked := make(chan int64, 10)
			var logs lockedBuffer
			w := goexitWorker(t, pool, queue, tx, func(ctx context.Context, j skiplocked.Job) error {
				if j.ID == victim {
					started <- struct{}{}
					<-ctx.Done()
				}
				return nil
			}, &skiplocked.Config{Concurrency: 2, RenewInterval: 50 * time.Millisecond, // the renewals find the loss
				PollInterval: 20 * time.Millisecond, ShutdownTimeout: 500 * time.Millisecond,
				OnClaimLost: func(_ context.Context, j skiplocked.Job, _ *pgfence.Error) {
					hooked <- j.ID
					runtime.Goexit()
				}}, &logs)
			stop := runWorker(t, w)
			select {
			case <-started:
			case <-time.After(60 * time.Second):
				t.Fatal("the job's handler not started")
			}
			// Another holder takes the claim over (expired and claimed
			// again in one transaction, so that no renewal slips in).
			btx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := btx.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", victim); err != nil {
				t.Fatal(err)
			}
			b, err := skiplocked.Claim(ctx, btx, skiplocked.ClaimParams{Queue: queue, Holder: "B", Limit: 1, TTL: time.Hour})
			if err != nil || len(b) != 1 {
				t.Fatal(b, err)
			}
			if err := btx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case id := <-hooked:
				if id != victim {
					t.Errorf("OnClaimLost called for job %d, want %d", id, victim)
				}
			case <-time.After(60 * time.Second):
				t.Fatal("OnClaimLost not called after the claim was lost")
			}
			good := enqueueN(t, pool, queue, 10, 5)
			if !eventually(func() bool { return countState(t, pool, queue, skiplocked.StateCompleted) == len(good) }) {
				t.Errorf("after 60s: %d of %d later jobs completed (summary %+v)",
					countState(t, pool, queue, skiplocked.StateCompleted), len(good), w.Summary())
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if j := mustJob(t, pool, victim); j.State != skiplocked.StateRunning || j.Holder != "B" || j.ClaimToken != b[0].ClaimToken {
				t.Errorf("the lost job: %s, holder %q, token %d; want B's claim (token %d) untouched", j.State, j.Holder, j.ClaimToken, b[0].ClaimToken)
			}
			sum := w.Summary()
			if sum.ClaimsLost != 1 || sum.Completed != int64(len(good)) || sum.Failed != 0 || sum.Unknown != 0 || len(hooked) != 0 {
				t.Errorf("summary %+v, %d more OnClaimLost calls; want 1 lost, %d completed, no failure, nothing unknown, no more calls",
					sum, len(hooked), len(good))
			}
			if n := strings.Count(logs.String(), "claim lost"); n != 1 {
				t.Errorf("%d claims logged lost, want 1; logs:\n%s", n, logs.String())
			}
			if !strings.Contains(logs.String(), "OnClaimLost called runtime.Goexit") {
				t.Errorf("the hook's runtime.Goexit not logged; logs:\n%s", logs.String())
			}
		})
	}
}
