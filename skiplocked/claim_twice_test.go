package skiplocked_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// staleAndFresh claims one job of queue (ref a), expires the claim and
// claims it again (ref b): a is lost, b holds the job.
func staleAndFresh(t *testing.T, ctx context.Context, pool *pgxpool.Pool, queue string) (a, b skiplocked.Job) {
	t.Helper()
	enqueueN(t, pool, queue, 1, 5)
	as, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: queue, Holder: "A", Limit: 1, TTL: time.Minute})
	if err != nil || len(as) != 1 {
		t.Fatal(as, err)
	}
	if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", as[0].ID); err != nil {
		t.Fatal(err)
	}
	bs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: queue, Holder: "B", Limit: 1, TTL: time.Minute})
	if err != nil || len(bs) != 1 || bs[0].ID != as[0].ID || bs[0].ClaimToken <= as[0].ClaimToken {
		t.Fatal(bs, err)
	}
	return as[0], bs[0]
}

// TestBatchLostAndLiveClaimOfOneJob: a batch call (Renew, Complete,
// Release) given the lost claim of a job and the live claim of the same job
// reports the lost one ("a call with a refused claim is never a nil
// error"). The changed rows were matched to refs by job id only, so the live
// claim's success hid the lost claim: Renew reported it extended (with the
// live claim's expiry) and Complete and Release returned nil.
func TestBatchLostAndLiveClaimOfOneJob(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)

	t.Run("renew", func(t *testing.T) {
		a, b := staleAndFresh(t, ctx, pool, "dup-renew")
		exp, err := skiplocked.Renew(ctx, pool, time.Minute, a.Ref(), b.Ref())
		if l := lostErrors(err); len(l) != 1 || l[0].Token != a.ClaimToken || len(exp) != 2 || !exp[0].IsZero() {
			t.Errorf("Renew(lost token %d, live token %d of job %d) = expiries %v, err %v; want ErrLost for token %d and a zero expiry for it",
				a.ClaimToken, b.ClaimToken, a.ID, exp, err, a.ClaimToken)
		}
	})
	t.Run("complete", func(t *testing.T) {
		a, b := staleAndFresh(t, ctx, pool, "dup-complete")
		err := skiplocked.Complete(ctx, pool, a.Ref(), b.Ref())
		if l := lostErrors(err); len(l) != 1 || l[0].Token != a.ClaimToken {
			t.Errorf("Complete(lost token %d, live token %d of job %d) = %v; want ErrLost for token %d",
				a.ClaimToken, b.ClaimToken, a.ID, err, a.ClaimToken)
		}
	})
	t.Run("release", func(t *testing.T) {
		a, b := staleAndFresh(t, ctx, pool, "dup-release")
		err := skiplocked.Release(ctx, pool, a.Ref(), b.Ref())
		if l := lostErrors(err); len(l) != 1 || l[0].Token != a.ClaimToken {
			t.Errorf("Release(lost token %d, live token %d of job %d) = %v; want ErrLost for token %d",
				a.ClaimToken, b.ClaimToken, a.ID, err, a.ClaimToken)
		}
	})
}

// smallPool is a pool of maxConns connections on a fresh migrated database.
func smallPool(t *testing.T, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestWorkerOwnReclaimCancelsLostHandler: a Worker whose claim of a job ran
// out under a running handler (a pause, renewals failing) and whose own
// fetcher then claims the job again holds two claims of it: the lost one
// and the new one. Its renewals send both in one call; the new claim's row
// was counted as the lost claim's renewal too, so the first handler was
// never cancelled and two handlers of one job ran side by side, both
// believing they held it. The first handler's context now ends with
// ErrLost, and only the new claim's completion counts.
func TestWorkerOwnReclaimCancelsLostHandler(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := smallPool(t, 4)
	x := enqueueN(t, pool, "own-reclaim", 1, 5)[0]

	type start struct {
		token int64
		ctx   context.Context
	}
	starts := make(chan start, 2)
	releaseX := make(chan struct{})
	var lostHook atomic.Int64
	w := newWorker(t, pool, "own-reclaim", func(ctx context.Context, j skiplocked.Job) error {
		starts <- start{j.ClaimToken, ctx}
		select {
		case <-releaseX:
		case <-ctx.Done():
		}
		return nil
	}, &skiplocked.Config{
		Concurrency: 2, BatchSize: 1, PollOnly: true, PollInterval: 20 * time.Millisecond,
		ClaimTTL: 3 * time.Second, RenewInterval: time.Second,
		OnClaimLost: func(context.Context, skiplocked.Job, *pgfence.Error) { lostHook.Add(1) },
	})
	stop := runWorker(t, w)

	first := <-starts
	// A pause past the claim: expire it, and let this worker's own fetcher
	// (every 20 ms) claim the job again before a renewal (every second)
	// extends it; a renewal that wins extends it, and the claim is expired
	// again.
	var second start
	for deadline := time.Now().Add(time.Minute); second.ctx == nil; {
		if time.Now().After(deadline) {
			t.Fatal("the worker never claimed its own expired job again")
		}
		if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1 AND claim_token = $2",
			x, first.token); err != nil {
			t.Fatal(err)
		}
		select {
		case second = <-starts:
		case <-time.After(500 * time.Millisecond):
		}
	}
	if second.token <= first.token {
		t.Fatalf("second claim token %d, first %d", second.token, first.token)
	}
	// The next renewals tell the first handler its claim is lost.
	select {
	case <-first.ctx.Done():
		if c := context.Cause(first.ctx); !errors.Is(c, pgfence.ErrLost) {
			t.Errorf("first handler cancelled with %v, want ErrLost", c)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("job %d: the handler of lost claim %d still runs 30 s later, beside the handler of claim %d (same worker)",
			x, first.token, second.token)
	}
	close(releaseX)
	waitFor(t, "both outcomes", func() bool { s := w.Summary(); return s.Completed+s.ClaimsLost+s.Failed+s.Unknown >= 2 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	sum := w.Summary()
	if j := mustJob(t, pool, x); j.State != skiplocked.StateCompleted || j.ClaimToken != second.token {
		t.Fatalf("job %+v; want completed under claim %d", j, second.token)
	}
	if sum.Completed != 1 || sum.ClaimsLost != 1 || lostHook.Load() != 1 {
		t.Errorf("summary %+v, OnClaimLost calls %d; want Completed 1 (claim %d), ClaimsLost 1 and one OnClaimLost (claim %d)",
			sum, lostHook.Load(), second.token, first.token)
	}
}

// TestTxWorkerFailureStaysRenewed: a TxHandler's attempt whose COMMIT
// fails (a deferred constraint of its effect) stays renewed until the
// outcome writer records the failure, as a Handler's does. The renewals
// skipped it from the completion on (the row is locked by the handler's
// transaction while it completes) and never again: when the writer was
// busy longer than the claim's TTL (modelled by another job's failure
// whose Backoff blocks the only writer), the claim ran out, another worker
// took the job while this one still had it in flight, and the failure was
// refused and reported as a lost claim, its error and backoff not recorded.
func TestTxWorkerFailureStaysRenewed(t *testing.T) {
	t.Parallel()
	for _, txMode := range []bool{false, true} {
		name := "handler"
		if txMode {
			name = "txhandler"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			pool := smallPool(t, 5) // one outcome writer in both modes
			queue := "failrenew-" + name
			if _, err := pool.Exec(ctx, `CREATE TABLE parent (id int PRIMARY KEY);
				CREATE TABLE child (p int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`); err != nil {
				t.Fatal(err)
			}
			ids := enqueueN(t, pool, queue, 2, 5)
			x, y := ids[0], ids[1]
			inBackoff := make(chan struct{})
			gate := make(chan struct{})
			var once sync.Once
			xReturned := make(chan struct{})
			var lostHook atomic.Int64
			cfg := &skiplocked.Config{
				Concurrency: 2, BatchSize: 1, PollOnly: true, PollInterval: time.Hour,
				ClaimTTL: 2 * time.Second, RenewInterval: 200 * time.Millisecond,
				Backoff: func(int) time.Duration {
					once.Do(func() { close(inBackoff); <-gate }) // the first failure written is Y's
					return time.Minute
				},
				OnClaimLost: func(context.Context, skiplocked.Job, *pgfence.Error) { lostHook.Add(1) },
			}
			var w *skiplocked.Worker
			var err error
			if txMode {
				w, err = skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
					if j.ID == y {
						return errors.New("y fails")
					}
					<-inBackoff // the writer is busy with Y's failure
					defer close(xReturned)
					_, err := tx.Exec(ctx, "INSERT INTO child VALUES (42)") // fails at COMMIT
					return err
				}, cfg)
			} else {
				w, err = skiplocked.NewWorker(pool, queue, func(ctx context.Context, j skiplocked.Job) error {
					if j.ID == y {
						return errors.New("y fails")
					}
					<-inBackoff
					defer close(xReturned)
					return errors.New("x fails")
				}, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			stop := runWorker(t, w)
			<-xReturned
			time.Sleep(3 * time.Second) // the scenario: longer than ClaimTTL, only renewals keep X's claim
			b, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: queue, Holder: "B", Limit: 2, TTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			close(gate)
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			sum := w.Summary()
			for _, j := range b {
				if j.ID == x {
					t.Errorf("another worker claimed job %d (attempt %d) while this worker still had its failed attempt in flight: "+
						"the claim was not renewed; summary %+v, OnClaimLost calls %d, last_error now %q",
						x, j.Attempts, sum, lostHook.Load(), mustJob(t, pool, x).LastError)
				}
			}
			if len(b) == 0 {
				if jx := mustJob(t, pool, x); jx.State != skiplocked.StateAvailable || jx.Attempts != 1 || sum.ClaimsLost != 0 {
					t.Errorf("job X %+v, summary %+v: want X's failure recorded", jx, sum)
				}
			}
		})
	}
}

// TestTxHandlerCompletesThroughTx: a TxHandler that completes its own job
// through tx (skiplocked.Complete(ctx, tx, j.Ref())) has it completed with
// its effect, as Config.Metrics says ("of a job the handler completed
// itself, is a completion"). The Worker read the claim through the pool,
// another session, which did not see the transaction's own completion: the
// effect was rolled back, the claim reported lost, and the job stayed
// running under this worker's claim until it expired.
func TestTxHandlerCompletesThroughTx(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := smallPool(t, 6)
	queue := "selftx"
	if _, err := pool.Exec(ctx, "CREATE TABLE effects (job_id bigint PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, pool, queue, 1, 5)
	var lostHook atomic.Int64
	w, err := skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		if _, err := tx.Exec(ctx, "INSERT INTO effects VALUES ($1)", j.ID); err != nil {
			return err
		}
		return skiplocked.Complete(ctx, tx, j.Ref())
	}, &skiplocked.Config{Concurrency: 1, PollInterval: 20 * time.Millisecond, ClaimTTL: time.Minute,
		OnClaimLost: func(context.Context, skiplocked.Job, *pgfence.Error) { lostHook.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	waitFor(t, "an outcome", func() bool { s := w.Summary(); return s.Completed+s.ClaimsLost+s.Failed+s.Unknown > 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	sum := w.Summary()
	var effects int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM effects").Scan(&effects); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, ids[0])
	if sum.Completed != 1 || sum.ClaimsLost != 0 || lostHook.Load() != 0 || effects != 1 || j.State != skiplocked.StateCompleted {
		t.Errorf("summary %+v, OnClaimLost calls %d, effects %d, job state %s (claim expires %v); want completed with its effect, no loss",
			sum, lostHook.Load(), effects, j.State, j.ClaimExpiresAt)
	}
}

// TestWorkerBackoffPanic: a Config.Backoff that panics does not crash the
// process (it ran unrecovered on an outcome writer's goroutine): the failure
// is recorded with DefaultBackoff's delay, and the Worker goes on.
func TestWorkerBackoffPanic(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := smallPool(t, 4)
	id := enqueueN(t, pool, "backoff-panic", 1, 5)[0]
	w := newWorker(t, pool, "backoff-panic", func(context.Context, skiplocked.Job) error {
		return errors.New("fails")
	}, &skiplocked.Config{Concurrency: 1, PollInterval: 20 * time.Millisecond,
		Backoff: func(int) time.Duration { panic("backoff bug") }})
	stop := runWorker(t, w)
	waitFor(t, "the failure", func() bool { return w.Summary().Failed > 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, id)
	var delay time.Duration
	if err := pool.QueryRow(ctx, "SELECT (extract(epoch FROM run_at - updated_at) * 1e6)::bigint * 1000 FROM pgfence.jobs WHERE id = $1", id).Scan(&delay); err != nil {
		t.Fatal(err)
	}
	if want := skiplocked.DefaultBackoff(1); j.State != skiplocked.StateAvailable || j.Attempts != 1 || delay != want.Truncate(time.Microsecond) {
		t.Errorf("job %s, attempt %d, retry in %v; want available, 1, %v (DefaultBackoff)", j.State, j.Attempts, delay, want)
	}
}

// TestTxHandlerCommitRefused: a TxHandler's transaction that the server
// refuses at COMMIT (here a deferred foreign key) rolled back, and the
// attempt is a failure recorded with the COMMIT's error, whether the Worker
// completed the job in the transaction or the handler did itself. When the
// handler had completed it, the refusal was taken for an unknown outcome:
// no failure recorded, last_error empty, the job running under a claim
// nobody renewed until ClaimTTL.
func TestTxHandlerCommitRefused(t *testing.T) {
	t.Parallel()
	for _, self := range []bool{false, true} {
		name := "worker completes"
		if self {
			name = "handler completes"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			pool := smallPool(t, 6)
			if _, err := pool.Exec(ctx, `CREATE TABLE parent (id int PRIMARY KEY);
				CREATE TABLE child (pid int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`); err != nil {
				t.Fatal(err)
			}
			id := enqueueN(t, pool, "commit-refused", 1, 5)[0]
			w, err := skiplocked.NewTxWorker(pool, "commit-refused", func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
				if _, err := tx.Exec(ctx, "INSERT INTO child VALUES (42)"); err != nil {
					return err
				}
				if self {
					return skiplocked.Complete(ctx, tx, j.Ref())
				}
				return nil
			}, &skiplocked.Config{Concurrency: 1, PollInterval: 20 * time.Millisecond, ClaimTTL: time.Minute,
				Backoff: func(int) time.Duration { return time.Hour }})
			if err != nil {
				t.Fatal(err)
			}
			stop := runWorker(t, w)
			waitFor(t, "an outcome", func() bool { s := w.Summary(); return s.Completed+s.ClaimsLost+s.Failed+s.Unknown > 0 })
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			sum := w.Summary()
			j := mustJob(t, pool, id)
			var children int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM child").Scan(&children); err != nil {
				t.Fatal(err)
			}
			if sum.Failed != 1 || sum.Unknown != 0 || sum.Completed != 0 || j.State != skiplocked.StateAvailable ||
				!strings.Contains(j.LastError, "23503") || children != 0 {
				t.Errorf("summary %+v, job %s (attempt %d, last_error %q), %d effects; want the attempt failed with the COMMIT's 23503, the job available, no effect",
					sum, j.State, j.Attempts, j.LastError, children)
			}
		})
	}
}
