package skiplocked_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// lossyDB runs every statement for real and then reports the connection
// lost, as when the reply of a committed statement never reaches the client.
type lossyDB struct{ pgfence.DBTX }

func (d lossyDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	rows, err := d.DBTX.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	rows.Close() // reads the whole reply: the statement committed
	if rows.Err() != nil {
		return nil, rows.Err()
	}
	return nil, fmt.Errorf("reading the reply: %w", io.ErrUnexpectedEOF)
}

func (d lossyDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return lossyRow{d.DBTX.QueryRow(ctx, sql, args...)}
}

type lossyRow struct{ pgx.Row }

func (r lossyRow) Scan(dest ...any) error {
	if err := r.Row.Scan(dest...); err != nil {
		return err
	}
	return fmt.Errorf("reading the reply: %w", io.ErrUnexpectedEOF)
}

// counting is an observe.Metrics that counts by name.
type counting struct {
	mu sync.Mutex
	m  map[string]float64
}

func (c *counting) Add(_ context.Context, name string, delta float64, _ ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]float64{}
	}
	c.m[name] += delta
}
func (c *counting) Observe(context.Context, string, float64, ...string) {}
func (c *counting) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int(c.m[name])
}

// lockedBuffer collects a logger's output from many goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func claimOne(t *testing.T, ctx context.Context, db pgfence.DBTX, queue, worker string, ttl time.Duration) skiplocked.Job {
	t.Helper()
	js, err := skiplocked.Claim(ctx, db, skiplocked.ClaimParams{Queue: queue, Holder: worker, Limit: 1, TTL: ttl})
	if err != nil || len(js) != 1 {
		t.Fatalf("%s: claim = %v, %v", worker, js, err)
	}
	return js[0]
}

// reclaimAs expires job id's claim and claims it again as worker, in one
// transaction (a pause past the claim, without waiting for it).
func reclaimAs(t *testing.T, ctx context.Context, pool *pgxpool.Pool, queue string, id int64, worker string) skiplocked.Job {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
	j := claimOne(t, ctx, tx, queue, worker, time.Hour)
	if j.ID != id {
		t.Fatalf("re-claimed job %d, want %d", j.ID, id)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return j
}

// TestIdempotentOutcomes: Complete, Fail and Release under a token whose
// claim already ended with that very outcome succeed (a retry after a lost
// reply); every other refusal is still an ErrLost naming the job's current
// token, state, holder and outcome.
func TestIdempotentOutcomes(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	const q = "idem"
	enqueueN(t, pool, q, 4, 5)
	a := claimOne(t, ctx, pool, q, "w1", time.Minute)
	b := claimOne(t, ctx, pool, q, "w1", time.Minute)
	c := claimOne(t, ctx, pool, q, "w1", time.Minute)
	d := claimOne(t, ctx, pool, q, "w1", time.Minute)

	// Complete twice, and as a batch.
	for i := range 2 {
		if err := skiplocked.Complete(ctx, pool, a.Ref()); err != nil {
			t.Fatalf("complete #%d: %v", i+1, err)
		}
	}
	if err := skiplocked.Complete(ctx, pool, a.Ref(), a.Ref()); err != nil {
		t.Fatalf("batch completion of a completed claim: %v", err)
	}

	// The reply of the first completion is lost: the caller sees a
	// connection error, retries, and gets nil, not "claim lost".
	err := skiplocked.Complete(ctx, lossyDB{pool}, b.Ref())
	if !pgfence.IsRetryable(err) || errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("complete with a lost reply: %v, want a retryable connection error", err)
	}
	if got := mustJob(t, pool, b.ID); got.State != skiplocked.StateCompleted {
		t.Fatalf("the first completion did not land: %+v", got)
	}
	if err := skiplocked.Complete(ctx, pool, b.Ref()); err != nil {
		t.Fatalf("retried completion: %v, want nil", err)
	}

	// Release twice; then a completion of the released claim is refused.
	for i := range 2 {
		if err := skiplocked.Release(ctx, pool, c.Ref()); err != nil {
			t.Fatalf("release #%d: %v", i+1, err)
		}
	}
	ended := func(j skiplocked.Job, outcome string, state skiplocked.State) string {
		return fmt.Sprintf("job %d: claim already ended (%s), state %s", j.ID, outcome, state)
	}
	if err := skiplocked.Complete(ctx, pool, c.Ref()); !isLost(err, c.ClaimToken, ended(c, "released", skiplocked.StateAvailable)) {
		t.Fatalf("complete after release: %v", err)
	}

	// Fail twice: the second returns the job as the first left it.
	first, err := skiplocked.Fail(ctx, lossyDB{pool}, d.Ref(), skiplocked.FailParams{Error: "first", RetryIn: time.Hour})
	if !pgfence.IsRetryable(err) {
		t.Fatalf("fail with a lost reply: %v %+v", err, first)
	}
	again, err := skiplocked.Fail(ctx, pool, d.Ref(), skiplocked.FailParams{Error: "second"})
	if err != nil || again.State != skiplocked.StateAvailable || again.LastError != "first" || again.ID != d.ID {
		t.Fatalf("retried fail = %+v, %v; want the job failed once with the first error", again, err)
	}
	if err := skiplocked.Complete(ctx, pool, d.Ref()); !isLost(err, d.ClaimToken, ended(d, "failed", skiplocked.StateAvailable)) {
		t.Fatalf("complete after fail: %v", err)
	}
	// A claim that ended cannot be renewed, even by its own worker.
	if _, err := skiplocked.Renew(ctx, pool, time.Minute, a.Ref()); !isLost(err, a.ClaimToken, ended(a, "completed", skiplocked.StateCompleted)) {
		t.Fatalf("heartbeat of a completed claim: %v", err)
	}

	// A stale token after another worker re-claimed and completed: refused,
	// single and batch, with the new holder's token.
	enqueueN(t, pool, q+"2", 1, 5)
	e1 := claimOne(t, ctx, pool, q+"2", "w1", time.Hour)
	e2 := reclaimAs(t, ctx, pool, q+"2", e1.ID, "w2")
	if err := skiplocked.Complete(ctx, pool, e2.Ref()); err != nil {
		t.Fatal(err)
	}
	reclaimed := fmt.Sprintf("job %d: reclaimed by token %d, state completed", e1.ID, e2.ClaimToken)
	if err := skiplocked.Complete(ctx, pool, e1.Ref()); !isLost(err, e1.ClaimToken, reclaimed) || lostErrors(err)[0].Holder != "w2" {
		t.Fatalf("stale completion: %v", err)
	}
	err = skiplocked.Complete(ctx, pool, e1.Ref(), e2.Ref())
	if !isLost(err, e1.ClaimToken, reclaimed) || lostErrors(err)[0].Holder != "w2" {
		t.Fatalf("Complete(stale, retried) = %v, want only the stale claim lost", err)
	}
	if err := skiplocked.Release(ctx, pool, e1.Ref()); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("stale release: %v", err)
	}

	// A claim that expired on the last attempt and was sent to dead by the
	// next claim: a late Fail is refused (the job did not fail by it).
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: q + "3", MaxAttempts: 1}); err != nil {
		t.Fatal(err)
	}
	f := claimOne(t, ctx, pool, q+"3", "w1", time.Hour)
	if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", f.ID); err != nil {
		t.Fatal(err)
	}
	if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: q + "3", Holder: "w2", Limit: 1, TTL: time.Minute}); err != nil || len(js) != 0 {
		t.Fatalf("claim of an expired last attempt = %v, %v (want it dead, not returned)", js, err)
	}
	if _, err := skiplocked.Fail(ctx, pool, f.Ref(), skiplocked.FailParams{Error: "late"}); !isLost(err, f.ClaimToken, ended(f, "expired", skiplocked.StateDead)) {
		t.Fatalf("fail after the claim expired into dead: %v", err)
	}
}

// TestHeartbeatSkipsLockedRows: a renewal never waits for a row lock (a
// completion in progress holds one until it commits): the locked claim is
// neither extended nor reported lost, the others of the batch are extended.
func TestHeartbeatSkipsLockedRows(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "hbskip", 2, 5)
	a := claimOne(t, ctx, pool, "hbskip", "w", time.Minute)
	b := claimOne(t, ctx, pool, "hbskip", "w", time.Minute)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := skiplocked.Complete(ctx, tx, a.Ref()); err != nil { // a completion in progress
		t.Fatal(err)
	}
	hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	exp, err := skiplocked.Renew(hctx, pool, time.Hour, a.Ref(), b.Ref())
	if !errors.Is(err, pgfence.ErrLocked) || errors.Is(err, pgfence.ErrLost) || len(exp) != 2 || !exp[0].IsZero() || exp[1].IsZero() {
		t.Fatalf("heartbeat with a locked row = %v, %v; want only b extended, nothing lost, a non-loss error, no wait", exp, err)
	}
	if _, err := skiplocked.Renew(hctx, pool, time.Hour, a.Ref()); !errors.Is(err, pgfence.ErrLocked) || errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("heartbeat of the locked row: %v, want a non-loss error", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := skiplocked.Renew(ctx, pool, time.Hour, a.Ref()); !isLost(err, a.ClaimToken,
		fmt.Sprintf("job %d: claim already ended (completed), state completed", a.ID)) {
		t.Fatalf("heartbeat after the completion committed: %v", err)
	}
}

// pauseScenario runs one job through a worker whose handler does its effect
// and then "pauses" (waits) while the test re-claims the job as worker B, and
// B does the effect and completes. When the paused handler resumes and
// returns nil, its completion is refused. It returns the effects that
// committed and the loss reported to OnClaimLost.
func pauseScenario(t *testing.T, txMode bool) (effects []string, reported *pgfence.Error, sum skiplocked.Summary) {
	t.Helper()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	queue := fmt.Sprintf("pause-%v", txMode)
	if _, err := pool.Exec(ctx, "CREATE TABLE effects (job_id bigint NOT NULL, token bigint NOT NULL, worker text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, pool, queue, 1, 5)
	paused, resume := make(chan skiplocked.Job, 1), make(chan struct{})
	effect := func(ctx context.Context, db pgfence.DBTX, j skiplocked.Job, worker string) error {
		_, err := db.Exec(ctx, "INSERT INTO effects VALUES ($1, $2, $3)", j.ID, j.ClaimToken, worker)
		return err
	}
	var mu sync.Mutex
	var calls int
	cfg := &skiplocked.Config{
		Holder: "A", ClaimTTL: time.Hour, RenewInterval: 50 * time.Minute, PollInterval: 20 * time.Millisecond,
		OnClaimLost: func(_ context.Context, j skiplocked.Job, err *pgfence.Error) {
			mu.Lock()
			defer mu.Unlock()
			calls++
			reported = err
		},
	}
	var w *skiplocked.Worker
	var err error
	if txMode {
		w, err = skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
			if err := effect(ctx, tx, j, "A"); err != nil {
				return err
			}
			paused <- j
			<-resume
			return nil
		}, cfg)
	} else {
		w, err = skiplocked.NewWorker(pool, queue, func(ctx context.Context, j skiplocked.Job) error {
			if err := effect(ctx, pool, j, "A"); err != nil {
				return err
			}
			paused <- j
			<-resume
			return nil
		}, cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		var err error
		sum, err = w.Drain(ctx)
		done <- err
	}()
	a := <-paused
	b := reclaimAs(t, ctx, pool, queue, ids[0], "B")
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := effect(ctx, tx, b, "B"); err != nil {
			return err
		}
		return skiplocked.Complete(ctx, tx, b.Ref())
	}); err != nil {
		t.Fatal(err)
	}
	close(resume)
	if err := <-done; err != nil {
		t.Fatalf("drain: %v", err)
	}
	rows, err := pool.Query(ctx, "SELECT worker || ':' || token FROM effects ORDER BY worker")
	if err != nil {
		t.Fatal(err)
	}
	if effects, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 || reported == nil || !errors.Is(reported, pgfence.ErrLost) || reported.Token != a.ClaimToken ||
		reported.Reason != fmt.Sprintf("job %d: reclaimed by token %d, state completed", a.ID, b.ClaimToken) ||
		reported.Holder != "B" || reported.Name != queue {
		t.Fatalf("OnClaimLost called %d times, last with %+v; want once, naming B's token %d", calls, reported, b.ClaimToken)
	}
	return effects, reported, sum
}

// TestTxWorkerRefusedCompletionRollsBackEffect: the exactly-once mode. A
// worker paused between its effect and its completion, while another worker
// re-claims and completes the job, commits nothing: its completion in the
// handler's transaction is refused, the transaction rolls back, the effect
// is gone. The same pause with the effect committed on its own (a Handler)
// leaves a duplicate effect: the mode matters.
func TestTxWorkerRefusedCompletionRollsBackEffect(t *testing.T) {
	t.Parallel()
	t.Run("tx", func(t *testing.T) {
		t.Parallel()
		effects, _, sum := pauseScenario(t, true)
		if len(effects) != 1 || !strings.HasPrefix(effects[0], "B:") {
			t.Fatalf("effects = %v, want only B's", effects)
		}
		if sum.ClaimsLost != 1 || sum.Completed != 0 || !sum.Drained {
			t.Fatalf("summary %+v", sum)
		}
	})
	t.Run("autocommit", func(t *testing.T) {
		t.Parallel()
		effects, _, sum := pauseScenario(t, false)
		if len(effects) != 2 {
			t.Fatalf("effects = %v, want A's stale effect and B's", effects)
		}
		if sum.ClaimsLost != 1 || sum.Completed != 0 {
			t.Fatalf("summary %+v", sum)
		}
	})
}

// TestWorkerNoFalseClaimLost: handlers that complete their own job (effect
// and Complete in the handler's own transaction, the only exactly-once route
// of a plain Handler) are followed by the Worker's completion, which now
// finds the job completed under the same token: no loss is counted, logged
// or reported. The same with a TxHandler that completes the job itself.
func TestWorkerNoFalseClaimLost(t *testing.T) {
	t.Parallel()
	for _, txMode := range []bool{false, true} {
		t.Run(fmt.Sprintf("tx=%v", txMode), func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			pool := pgtest.Pool(t)
			const n = 300
			queue := "selfcomplete"
			enqueueN(t, pool, queue, n, 5)
			m := &counting{}
			var logs lockedBuffer
			var hook atomic.Int64
			cfg := &skiplocked.Config{
				Concurrency: 2, BatchSize: 10, PollInterval: 20 * time.Millisecond, Metrics: m,
				Logger:      slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
				OnClaimLost: func(context.Context, skiplocked.Job, *pgfence.Error) { hook.Add(1) },
			}
			var w *skiplocked.Worker
			var err error
			if _, err := pool.Exec(ctx, "CREATE TABLE effects (job_id bigint PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			effect := func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
				_, err := tx.Exec(ctx, "INSERT INTO effects VALUES ($1)", j.ID)
				return err
			}
			if txMode {
				w, err = skiplocked.NewTxWorker(pool, queue, func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
					if err := effect(ctx, tx, j); err != nil {
						return err
					}
					return skiplocked.Complete(ctx, pool, j.Ref()) // needless, but not a loss
				}, cfg)
			} else {
				w, err = skiplocked.NewWorker(pool, queue, func(ctx context.Context, j skiplocked.Job) error {
					return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						if err := effect(ctx, tx, j); err != nil {
							return err
						}
						return skiplocked.Complete(ctx, tx, j.Ref())
					})
				}, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			sum, err := w.Drain(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if sum.Completed != n || sum.ClaimsLost != 0 || hook.Load() != 0 || m.get(metricdefs.ClaimsLostTotal) != 0 ||
				m.get(metricdefs.RowsCompletedTotal) != n || logs.String() != "" {
				t.Fatalf("summary %+v, hook %d, claims lost metric %d, completed metric %d, logs %q; want %d completed, no loss",
					sum, hook.Load(), m.get(metricdefs.ClaimsLostTotal), m.get(metricdefs.RowsCompletedTotal), logs.String(), n)
			}
			var effects int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM effects").Scan(&effects); err != nil || effects != n {
				t.Fatalf("%d effects committed (%v), want %d", effects, err, n)
			}
			t.Logf("handler completes its own job (tx=%v): %d jobs, %d completed, %d effects, 0 false claim-lost reports", txMode, n, sum.Completed, effects)
		})
	}
}

// TestDrainImport5000: four TxHandler workers drain a 5,000-job import in
// which one job in 100 fails permanently (dead) and one in 7 fails its first
// attempt (retried at once). Every Drain returns nil once the queue is empty;
// the summaries add up to the queue's counts; every completed job has
// exactly one effect, written under the claim that completed it.
func TestDrainImport5000(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	pool := noWaitPool(t, ctx, dsn, 24)
	const n, workers, queue = 5000, 4, "catalogue/2024-06-01"
	if _, err := pool.Exec(ctx, "CREATE TABLE imported (job_id bigint NOT NULL, token bigint NOT NULL, n int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	enqueueN(t, pool, queue, n, 5)
	wantDead, wantFailed := 0, 0
	for i := range n {
		switch {
		case i%100 == 0:
			wantDead++
		case i%7 == 0:
			wantFailed++
		}
	}
	handler := func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		var p struct{ N int }
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return skiplocked.Permanent(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO imported VALUES ($1, $2, $3)", j.ID, j.ClaimToken, p.N); err != nil {
			return err
		}
		switch {
		case p.N%100 == 0:
			return skiplocked.Permanent(errors.New("malformed file"))
		case p.N%7 == 0 && j.Attempts == 1:
			return errors.New("store unreachable")
		}
		return nil
	}
	start := time.Now()
	sums := make([]skiplocked.Summary, workers)
	errs := make([]error, workers)
	returned := make([]time.Time, workers)
	var wg sync.WaitGroup
	for i := range workers {
		w, err := skiplocked.NewTxWorker(pool, queue, handler, &skiplocked.Config{
			Holder: fmt.Sprintf("importer-%d", i), Concurrency: 4, BatchSize: 20,
			PollInterval: 50 * time.Millisecond, Backoff: func(int) time.Duration { return 0 },
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			sums[i], errs[i] = w.Drain(ctx)
			returned[i] = time.Now()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	var total skiplocked.Summary
	for i, s := range sums {
		if errs[i] != nil || !s.Drained {
			t.Fatalf("worker %d: drain = %+v, %v", i, s, errs[i])
		}
		total.Claimed += s.Claimed
		total.Completed += s.Completed
		total.Failed += s.Failed
		total.Dead += s.Dead
		total.ClaimsLost += s.ClaimsLost
		total.Unknown += s.Unknown
		total.Released += s.Released
	}
	var lastFinish time.Time
	if err := pool.QueryRow(ctx, "SELECT max(finished_at) FROM pgfence.jobs WHERE queue = $1", queue).Scan(&lastFinish); err != nil {
		t.Fatal(err)
	}
	d := depthOf(t, ctx, pool, queue)
	if !d.Drained() || d.Completed != int64(n-wantDead) || d.Dead != int64(wantDead) {
		t.Fatalf("queue depth %+v, want %d completed and %d dead", d, n-wantDead, wantDead)
	}
	if total.Completed != d.Completed || total.Dead != d.Dead || total.Failed != int64(wantFailed) ||
		total.ClaimsLost != 0 || total.Unknown != 0 || total.Released != 0 || total.Claimed != int64(n+wantFailed) {
		t.Fatalf("summaries add up to %+v; want %d completed, %d dead, %d failed attempts, %d claims, nothing lost",
			total, d.Completed, d.Dead, wantFailed, n+wantFailed)
	}
	var effects, dupJobs, wrongToken int
	if err := pool.QueryRow(ctx, `
		SELECT count(*),
		       count(*) - count(DISTINCT i.job_id),
		       count(*) FILTER (WHERE i.token <> j.claim_token OR j.state <> 'completed')
		FROM imported i JOIN pgfence.jobs j ON j.id = i.job_id`).Scan(&effects, &dupJobs, &wrongToken); err != nil {
		t.Fatal(err)
	}
	if effects != n-wantDead || dupJobs != 0 || wrongToken != 0 {
		t.Fatalf("%d effects (%d duplicates, %d not under the completing claim), want %d", effects, dupJobs, wrongToken, n-wantDead)
	}
	var tail time.Duration
	for _, r := range returned {
		tail = max(tail, r.Sub(lastFinish))
	}
	t.Logf("drain: %d jobs by %d TxHandler workers in %v (%.0f jobs/s): %d completed, %d dead, %d failed attempts retried, "+
		"0 claims lost, 0 duplicate effects; last Drain returned %v after the last job finished",
		n, workers, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds(), total.Completed, total.Dead, total.Failed,
		tail.Round(time.Millisecond))
}

// TestDrainFailsClosed: a drain stopped before the queue is empty, and a
// drain of a queue that has no job at all, are errors, not summaries of a
// finished import.
func TestDrainFailsClosed(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	h := func(context.Context, skiplocked.Job) error { return nil }

	w := newWorker(t, pool, "no-such-queue", h, &skiplocked.Config{PollInterval: 20 * time.Millisecond})
	if sum, err := w.Drain(ctx); !errors.Is(err, pgfence.ErrNotFound) || sum.Drained {
		t.Fatalf("drain of an unknown queue: %+v, %v; want ErrNotFound", sum, err)
	}
	if d := depthOf(t, ctx, pool, "no-such-queue"); d != (skiplocked.Depth{Queue: "no-such-queue"}) || d.Total() != 0 || d.Drained() {
		t.Fatalf("depth of an unknown queue: %+v", d)
	}

	// Another worker holds the only job for an hour.
	enqueueN(t, pool, "held", 1, 5)
	claimOne(t, ctx, pool, "held", "other", time.Hour)
	w = newWorker(t, pool, "held", h, &skiplocked.Config{PollInterval: 20 * time.Millisecond})
	dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	sum, err := w.Drain(dctx)
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Kind != nil || !strings.HasPrefix(pe.Reason, "not drained") || pe.Name != "held" ||
		!errors.Is(err, context.DeadlineExceeded) || sum.Drained {
		t.Fatalf("drain stopped early: %+v, %v; want \"not drained\" and the deadline", sum, err)
	}
	d := depthOf(t, ctx, pool, "held")
	if d.Running != 1 || d.Unfinished() != 1 || d.Drained() {
		t.Fatalf("depth = %+v", d)
	}
	if _, err := w.Drain(ctx); !errors.Is(err, pgfence.ErrInvalid) {
		t.Fatalf("second drain: %v", err)
	}
}

// TestQueueDepths counts every state on the database clock.
func TestQueueDepths(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	const q = "depth"
	enqueueN(t, pool, q, 6, 1)
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: q, RunAt: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	done := claimOne(t, ctx, pool, q, "w", time.Minute)
	if err := skiplocked.Complete(ctx, pool, done.Ref()); err != nil {
		t.Fatal(err)
	}
	dead := claimOne(t, ctx, pool, q, "w", time.Minute)
	if _, err := skiplocked.Fail(ctx, pool, dead.Ref(), skiplocked.FailParams{Error: "x"}); err != nil {
		t.Fatal(err)
	}
	claimOne(t, ctx, pool, q, "w", time.Minute) // running
	exp := claimOne(t, ctx, pool, q, "w", time.Minute)
	if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", exp.ID); err != nil {
		t.Fatal(err)
	}
	want := skiplocked.Depth{Queue: q, Available: 2, Scheduled: 1, Running: 1, Expired: 1, Completed: 1, Dead: 1}
	named, err := skiplocked.QueueDepths(ctx, pool, "none", q)
	if err != nil || len(named) != 2 || named[0] != (skiplocked.Depth{Queue: "none"}) || named[1] != want {
		t.Fatalf("depths of none and %s = %+v, %v; want a zero Depth, then %+v", q, named, err, want)
	}
	if d := named[1]; d.Total() != 7 || d.Unfinished() != 5 || d.Drained() {
		t.Fatalf("depth = %+v: Total %d, Unfinished %d, Drained %v", d, d.Total(), d.Unfinished(), d.Drained())
	}
	all, err := skiplocked.QueueDepths(ctx, pool)
	if err != nil || len(all) != 1 || all[0] != want {
		t.Fatalf("depths = %+v, %v", all, err)
	}
	if _, err := skiplocked.QueueDepths(ctx, pool, q, ""); !isInvalid(err, "queue") {
		t.Fatalf("empty queue name: %v", err)
	}
}

// TestLostClaimReachesHandler: when a renewal finds the claim re-claimed,
// the handler's context cause is an ErrLost that says what Complete's error
// says (token, the new token and state, holder), and OnClaimLost is called
// once, after the handler returned.
func TestLostClaimReachesHandler(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "hblost", 1, 5)
	started := make(chan skiplocked.Job, 1)
	cause := make(chan error, 1)
	var returned atomic.Bool
	hook := make(chan *pgfence.Error, 2)
	w := newWorker(t, pool, "hblost", func(ctx context.Context, j skiplocked.Job) error {
		started <- j
		<-ctx.Done()
		cause <- context.Cause(ctx)
		returned.Store(true)
		return nil
	}, &skiplocked.Config{
		ClaimTTL: time.Hour, RenewInterval: 50 * time.Millisecond, PollInterval: time.Hour,
		OnClaimLost: func(_ context.Context, _ skiplocked.Job, err *pgfence.Error) {
			if !returned.Load() {
				err = nil // called before the handler returned
			}
			hook <- err
		},
	})
	stop := runWorker(t, w)
	a := <-started
	b := reclaimAs(t, ctx, pool, "hblost", ids[0], "B")
	var c error
	select {
	case c = <-cause:
	case <-time.After(30 * time.Second):
		t.Fatal("handler not cancelled after its claim was lost")
	}
	reclaimed := fmt.Sprintf("job %d: reclaimed by token %d, state running", a.ID, b.ClaimToken)
	var lost *pgfence.Error
	if !errors.Is(c, pgfence.ErrLost) || !errors.As(c, &lost) || lost.Token != a.ClaimToken || lost.Reason != reclaimed ||
		lost.Holder != "B" {
		t.Fatalf("cause = %v (%+v), want an ErrLost naming B's claim %d", c, lost, b.ClaimToken)
	}
	select {
	case e := <-hook:
		if e == nil || !errors.Is(e, pgfence.ErrLost) || e.Reason != reclaimed {
			t.Fatalf("OnClaimLost got %+v", e)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("OnClaimLost not called")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if len(hook) != 0 || w.Summary().ClaimsLost != 1 {
		t.Fatalf("OnClaimLost called again, or summary %+v", w.Summary())
	}
}

// TestTxHandlerMisuse: a TxHandler may not end its transaction; the attempt
// fails and nothing of it commits. A pool too small for the handlers'
// transactions is refused up front.
func TestTxHandlerMisuse(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := noWaitPool(t, ctx, dsn, 6)
	if _, err := pool.Exec(ctx, "CREATE TABLE effects (job_id bigint)"); err != nil {
		t.Fatal(err)
	}
	ids := enqueueN(t, pool, "misuse", 1, 1)
	w, err := skiplocked.NewTxWorker(pool, "misuse", func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		if _, err := tx.Exec(ctx, "INSERT INTO effects VALUES ($1)", j.ID); err != nil {
			return err
		}
		_ = tx.Commit(ctx) // refused
		return nil
	}, &skiplocked.Config{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	sum, err := w.Drain(ctx)
	if err != nil || sum.Dead != 1 {
		t.Fatalf("drain = %+v, %v", sum, err)
	}
	if j := mustJob(t, pool, ids[0]); !strings.Contains(j.LastError, "must not commit") {
		t.Fatalf("last error %q", j.LastError)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM effects").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d effects committed (%v)", n, err)
	}

	small := noWaitPool(t, ctx, dsn, 3)
	h := func(context.Context, pgx.Tx, skiplocked.Job) error { return nil }
	if _, err := skiplocked.NewTxWorker(small, "q", h, &skiplocked.Config{Concurrency: 2}); !isInvalid(err, "Config.Concurrency") {
		t.Fatalf("concurrency 2 on a pool of 3: %v", err)
	}
	if _, err := skiplocked.NewTxWorker(small, "q", h, nil); err != nil {
		t.Fatalf("default concurrency on a pool of 3: %v", err)
	}
	if _, err := skiplocked.NewTxWorker(small, "q", nil, nil); !isInvalid(err, "h") {
		t.Fatalf("nil handler: %v", err)
	}
}

// TestIsRetryable: pgfence.IsRetryable classifies errors of the caller's
// own statements and of this package's.
func TestIsRetryable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)

	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", conn.PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	_, terminated := conn.Exec(ctx, "SELECT 1")

	conn2, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, cancelled := conn2.Exec(cctx, "SELECT pg_sleep(10)")
	_, unique := admin.Exec(ctx, "CREATE TEMP TABLE u (x int PRIMARY KEY); INSERT INTO u VALUES (1), (1)")

	for _, c := range []struct {
		name      string
		err       error
		retryable bool
	}{
		{"nil", nil, false},
		{"terminated backend", terminated, true},
		{"statement cancelled by its context", cancelled, false},
		{"context.Canceled", fmt.Errorf("x: %w", context.Canceled), false},
		{"unique violation", unique, false},
		{"08006", &pgconn.PgError{Code: "08006"}, true},
		{"57P01", fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "57P01"}), true},
		{"57P03", &pgconn.PgError{Code: "57P03"}, true},
		{"40001", &pgconn.PgError{Code: "40001"}, true},
		{"40P01", &pgconn.PgError{Code: "40P01"}, true},
		{"55P03 lock timeout", &pgconn.PgError{Code: "55P03"}, false},
		{"57014 statement timeout", &pgconn.PgError{Code: "57014"}, false},
		{"io.EOF", fmt.Errorf("read: %w", io.EOF), true},
		{"net.ErrClosed", net.ErrClosed, true},
		{"a connection lost during Complete", &pgfence.Error{Op: "skiplocked.Complete", Err: io.ErrUnexpectedEOF}, true},
		{"a lost claim", &pgfence.Error{Op: "skiplocked.Complete", Kind: pgfence.ErrLost}, false},
	} {
		if got := pgfence.IsRetryable(c.err); got != c.retryable {
			t.Errorf("%s (%v): IsRetryable = %v, want %v", c.name, c.err, got, c.retryable)
		}
	}
}
