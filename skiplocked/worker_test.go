package skiplocked_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// runWorker starts w.Run and returns a stop function that cancels it and
// returns Run's error.
func runWorker(t *testing.T, w *skiplocked.Worker) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("Run did not return within 30s")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func newWorker(t *testing.T, pool *pgxpool.Pool, queue string, h skiplocked.Handler, cfg *skiplocked.Config) *skiplocked.Worker {
	t.Helper()
	w, err := skiplocked.NewWorker(pool, queue, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// waitFor polls cond (a database condition the test cannot be signalled
// about) until it holds or 10s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWorkersDrainExactlyOnce: 8 workers drain 5,000 jobs (20,000 with
// PGFENCE_TEST_LARGE=1; the 20,000-row drains of the claim API itself run
// always); every job is handled exactly once and ends completed.
func TestWorkersDrainExactlyOnce(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	const workers = 8
	rows := 5000
	if os.Getenv("PGFENCE_TEST_LARGE") != "" {
		rows = 20000
	}
	enqueueN(t, pool, "drainw", rows, 5)

	var seen sync.Map
	var handled, dups atomic.Int64
	allDone := make(chan struct{})
	h := func(_ context.Context, j skiplocked.Job) error {
		if _, dup := seen.LoadOrStore(j.ID, j.Holder); dup {
			dups.Add(1)
		}
		if handled.Add(1) == int64(rows) {
			close(allDone)
		}
		return nil
	}
	var stops []func() error
	for i := range workers {
		w := newWorker(t, pool, "drainw", h, &skiplocked.Config{
			Holder: fmt.Sprintf("w%d", i), Concurrency: 4, BatchSize: 50, PollInterval: 50 * time.Millisecond,
		})
		stops = append(stops, runWorker(t, w))
	}
	select {
	case <-allDone:
	case <-time.After(45 * time.Second):
		t.Fatalf("handled %d of %d", handled.Load(), rows)
	}
	for _, stop := range stops {
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
	if dups.Load() != 0 || handled.Load() != int64(rows) {
		t.Fatalf("handled %d, duplicates %d", handled.Load(), dups.Load())
	}
	if n := countState(t, pool, "drainw", skiplocked.StateCompleted); n != rows {
		t.Fatalf("%d completed, want %d", n, rows)
	}
	var mismatch int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pgfence.jobs WHERE queue = 'drainw' AND attempts <> 1`).Scan(&mismatch); err != nil || mismatch != 0 {
		t.Fatalf("%d jobs with attempts <> 1 (%v)", mismatch, err)
	}
	rs, err := pool.Query(context.Background(), "SELECT id, holder FROM pgfence.jobs WHERE queue = 'drainw'")
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	for rs.Next() {
		var id int64
		var by string
		if err := rs.Scan(&id, &by); err != nil {
			t.Fatal(err)
		}
		if v, ok := seen.Load(id); !ok || v.(string) != by {
			t.Fatalf("job %d handled by %v but holder %s", id, v, by)
		}
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
}

func listenerCount(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN "pgfence_jobs"'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// With polling effectively off, only NOTIFY can wake the worker.
func TestWorkerWakesOnNotify(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	got := make(chan int64, 1)
	w := newWorker(t, pool, "notify", func(_ context.Context, j skiplocked.Job) error { got <- j.ID; return nil },
		&skiplocked.Config{PollInterval: time.Hour})
	stop := runWorker(t, w)
	waitFor(t, "the listener connection", func() bool { return listenerCount(t, pool) == 1 })
	j := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "notify"})
	select {
	case id := <-got:
		if id != j.ID {
			t.Fatalf("handled %d, want %d", id, j.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("worker not woken by NOTIFY")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the listener to close", func() bool { return listenerCount(t, pool) == 0 })
}

func TestWorkerPollOnly(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	got := make(chan int64, 1)
	w := newWorker(t, pool, "poll", func(_ context.Context, j skiplocked.Job) error { got <- j.ID; return nil },
		&skiplocked.Config{PollOnly: true, PollInterval: 20 * time.Millisecond})
	stop := runWorker(t, w)
	if _, err := skiplocked.Enqueue(context.Background(), pool, skiplocked.EnqueueParams{Queue: "poll"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("poll-only worker did not pick the job up")
	}
	if n := listenerCount(t, pool); n != 0 {
		t.Fatalf("poll-only worker LISTENs (%d connections)", n)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// Shutdown: claimed jobs not started are released at once; jobs in flight
// finish and are completed.
func TestWorkerShutdownFinishesInFlightReleasesRest(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "shut", 6, 5)
	started := make(chan int64, 6)
	proceed := make(chan struct{})
	w := newWorker(t, pool, "shut", func(_ context.Context, j skiplocked.Job) error {
		started <- j.ID
		<-proceed
		return nil
	}, &skiplocked.Config{Concurrency: 2, BatchSize: 4, PollInterval: time.Hour})
	stop := runWorker(t, w)
	// The worker claims a batch of 4 at start, then the other 2 (it may hold
	// Concurrency + 2*BatchSize = 10 claims): 2 run, 4 wait for a handler.
	inFlight := map[int64]bool{<-started: true, <-started: true}
	waitFor(t, "all 6 claimed", func() bool { return countState(t, pool, "shut", skiplocked.StateRunning) == 6 })

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	// The 4 claimed-but-not-started jobs come back while the 2 still run.
	waitFor(t, "release of unstarted claims", func() bool { return countState(t, pool, "shut", skiplocked.StateAvailable) == 4 })
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) while handlers were running", err)
	default:
	}
	close(proceed)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		j := mustJob(t, pool, id)
		switch {
		case inFlight[id] && (j.State != skiplocked.StateCompleted || j.Attempts != 1):
			t.Errorf("in-flight job %d = %s attempts %d, want completed", id, j.State, j.Attempts)
		case !inFlight[id] && (j.State != skiplocked.StateAvailable || j.Attempts != 0):
			t.Errorf("unstarted job %d = %s attempts %d, want available with attempt given back", id, j.State, j.Attempts)
		}
	}
}

// After ShutdownTimeout the handlers' contexts are cancelled with
// a cause matching pgfence.ErrClosed; a handler that then returns an error has its claim released.
func TestWorkerShutdownTimeoutReleases(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "shut2", 1, 5)
	started := make(chan struct{})
	cause := make(chan error, 1)
	w := newWorker(t, pool, "shut2", func(ctx context.Context, _ skiplocked.Job) error {
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}, &skiplocked.Config{ShutdownTimeout: 200 * time.Millisecond, PollInterval: time.Hour})
	stop := runWorker(t, w)
	<-started
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if c := <-cause; !errors.Is(c, pgfence.ErrClosed) {
		t.Fatalf("handler ctx cause = %v, want ErrClosed", c)
	}
	if j := mustJob(t, pool, ids[0]); j.State != skiplocked.StateAvailable || j.Attempts != 0 || j.LastError != "" {
		t.Fatalf("job after shutdown = %+v, want released", j)
	}
}

func TestWorkerRetriesThenDead(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "retry", 1, 3)
	permID := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "retry", Payload: []byte(`{"perm":true}`)})
	panicID := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "retry", Payload: []byte(`{"panic":true}`), MaxAttempts: 1})
	permNilID := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "retry", Payload: []byte(`{"permnil":true}`)})
	var calls sync.Map
	var backoffs []int
	var mu sync.Mutex
	w := newWorker(t, pool, "retry", func(_ context.Context, j skiplocked.Job) error {
		n, _ := calls.LoadOrStore(j.ID, new(atomic.Int32))
		k := n.(*atomic.Int32).Add(1)
		switch {
		case j.ID == permID.ID:
			return skiplocked.Permanent(errors.New("bad payload"))
		case j.ID == panicID.ID:
			panic("kaboom")
		case j.ID == permNilID.ID:
			return skiplocked.Permanent(nil)
		}
		return fmt.Errorf("attempt %d failed", k)
	}, &skiplocked.Config{
		PollInterval: 20 * time.Millisecond,
		Backoff: func(attempt int) time.Duration {
			mu.Lock()
			backoffs = append(backoffs, attempt)
			mu.Unlock()
			return 0
		},
	})
	stop := runWorker(t, w)
	waitFor(t, "all jobs dead", func() bool { return countState(t, pool, "retry", skiplocked.StateDead) == 4 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, ids[0])
	if j.Attempts != 3 || j.LastError != "attempt 3 failed" {
		t.Fatalf("retried job = %+v", j)
	}
	if j := mustJob(t, pool, permID.ID); j.Attempts != 1 || j.LastError != "permanent: bad payload" {
		t.Fatalf("permanent job = %+v", j)
	}
	if j := mustJob(t, pool, panicID.ID); j.Attempts != 1 || j.LastError != "panic: kaboom" {
		t.Fatalf("panicking job = %+v", j)
	}
	// Permanent(nil) is a permanent failure too, not a panic of the worker.
	if j := mustJob(t, pool, permNilID.ID); j.Attempts != 1 || j.LastError != "permanent failure" {
		t.Fatalf("Permanent(nil) job = %+v", j)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(backoffs) < 3 {
		t.Fatalf("backoff called %v", backoffs)
	}
}

// Heartbeats keep a claim alive past its TTL; when a renewal finds the
// claim lost (another worker re-claimed it), the handler's ctx is cancelled
// with ErrLost and the stale worker writes nothing.
func TestWorkerHeartbeatAndLostClaim(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "hbw", 1, 5)
	started := make(chan skiplocked.Job, 1)
	cause := make(chan error, 1)
	w := newWorker(t, pool, "hbw", func(ctx context.Context, j skiplocked.Job) error {
		started <- j
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return nil // even "success" must not land
	}, &skiplocked.Config{ClaimTTL: 300 * time.Millisecond, RenewInterval: 50 * time.Millisecond, PollInterval: time.Hour})
	stop := runWorker(t, w)
	a := <-started
	time.Sleep(600 * time.Millisecond) // two TTLs: only heartbeats keep the claim
	if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "hbw", Holder: "B", Limit: 1, TTL: time.Minute}); err != nil || len(js) != 0 {
		t.Fatalf("B claimed %v (%v) while renewals run", js, err)
	}
	// Simulate a pause longer than the TTL: expire the claim and re-claim as B
	// in one transaction, so no heartbeat slips in between.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE pgfence.jobs SET claim_expires_at = now() - interval '1 second' WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	b, err := skiplocked.Claim(ctx, tx, skiplocked.ClaimParams{Queue: "hbw", Holder: "B", Limit: 1, TTL: time.Minute})
	if err != nil || len(b) != 1 {
		t.Fatal(b, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-cause:
		if !errors.Is(c, pgfence.ErrLost) {
			t.Fatalf("cause = %v, want ErrLost", c)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("handler not cancelled after its claim was lost")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, ids[0])
	if j.State != skiplocked.StateRunning || j.ClaimToken != b[0].ClaimToken || j.Holder != "B" || j.ClaimToken <= a.ClaimToken {
		t.Fatalf("job after stale worker = %+v", j)
	}
	if err := skiplocked.Complete(ctx, pool, b[0].Ref()); err != nil {
		t.Fatal(err)
	}
}

func TestWorkerConfigValidation(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	h := func(context.Context, skiplocked.Job) error { return nil }
	var nilPool *pgxpool.Pool
	if _, err := skiplocked.NewWorker(nilPool, "q", h, nil); !isInvalid(err, "db") {
		t.Errorf("nil pool: %v", err)
	}
	if _, err := skiplocked.NewWorker(pool, "", h, nil); !isInvalid(err, "queue") {
		t.Errorf("empty queue: %v", err)
	}
	if _, err := skiplocked.NewWorker(pool, "q", nil, nil); !isInvalid(err, "h") {
		t.Errorf("nil handler: %v", err)
	}
	bad := map[string]struct {
		cfg skiplocked.Config
		arg string // the field ErrInvalid names
	}{
		"negative concurrency": {skiplocked.Config{Concurrency: -1}, "Config.Concurrency"},
		"huge concurrency":     {skiplocked.Config{Concurrency: 5000}, "Config.Concurrency"},
		"negative batch":       {skiplocked.Config{BatchSize: -1}, "Config.BatchSize"},
		"huge batch":           {skiplocked.Config{BatchSize: 10001}, "Config.BatchSize"},
		"tiny TTL":             {skiplocked.Config{ClaimTTL: time.Millisecond}, "Config.ClaimTTL"},
		"huge TTL":             {skiplocked.Config{ClaimTTL: 48 * time.Hour}, "Config.ClaimTTL"},
		"heartbeat >= TTL":     {skiplocked.Config{ClaimTTL: time.Second, RenewInterval: time.Second}, "Config.RenewInterval"},
		"negative heartbeat":   {skiplocked.Config{RenewInterval: -time.Second}, "Config.RenewInterval"},
		"tiny heartbeat":       {skiplocked.Config{RenewInterval: time.Nanosecond}, "Config.RenewInterval"},
		"tiny poll":            {skiplocked.Config{PollInterval: time.Millisecond}, "Config.PollInterval"},
		"negative shutdown":    {skiplocked.Config{ShutdownTimeout: -time.Second}, "Config.ShutdownTimeout"},
		"control in worker id": {skiplocked.Config{Holder: "a\nb"}, "Config.Holder"},
	}
	for name, c := range bad {
		if _, err := skiplocked.NewWorker(pool, "q", h, &c.cfg); !isInvalid(err, c.arg) {
			t.Errorf("%s: err = %v, want ErrInvalid naming %s", name, err, c.arg)
		}
	}
	if _, err := skiplocked.NewWorker(pool, "q", h, &skiplocked.Config{BatchSize: 0}); err != nil {
		t.Errorf("defaults refused: %v", err)
	}
	w, err := skiplocked.NewWorker(pool, "q", h, nil)
	if err != nil || w.Holder() == "" {
		t.Fatalf("nil config: %v, id %q", err, w.Holder())
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Run(ctx); err != nil {
		t.Fatalf("Run on a cancelled ctx: %v", err)
	}
	if err := w.Run(ctx); !errors.Is(err, pgfence.ErrInvalid) {
		t.Fatalf("second Run: %v", err)
	}
}

// TestWorkerCompletesAfterTerminatedConnections: the worker's backends are
// terminated while a handler runs; when the handler returns, the completion
// meets a dead pooled connection and is sent again on a new one, so the job
// is completed at once (not re-run after its claim expires) and was handled
// exactly once.
func TestWorkerCompletesAfterTerminatedConnections(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	const app = "skiplocked-terminated"
	cfg.MaxConns = 3
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ids := enqueueN(t, admin, "term", 1, 5)
	started, finish := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	w := newWorker(t, pool, "term", func(ctx context.Context, j skiplocked.Job) error {
		if calls.Add(1) == 1 {
			close(started)
		}
		<-finish
		return nil
	}, &skiplocked.Config{ClaimTTL: time.Minute, PollInterval: time.Hour, Concurrency: 1})
	stop := runWorker(t, w)
	<-started
	// End every backend of the worker's pool (and its LISTEN connection),
	// and wait until they are gone.
	if n := pgtest.TerminateBackends(t, ctx, admin, app); n == 0 {
		t.Fatal("no backend of the worker to terminate")
	}
	close(finish)
	waitFor(t, "the job to be completed", func() bool {
		return mustJob(t, admin, ids[0]).State == skiplocked.StateCompleted
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if c := calls.Load(); c != 1 {
		t.Errorf("handler ran %d times, want 1", c)
	}
}

// A claim statement out when Run stops is let answer, and its jobs are
// released at once like every claimed job whose handler has not started.
// Cut instead, it still committed on the server (the client only dropped
// its connection): the job stayed claimed by a worker that had stopped,
// its attempt counted, until the claim expired (its last attempt would
// then have sent it to dead without running it).
func TestWorkerShutdownDuringClaim(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "cutclaim", 1, 1)
	// The claim waits for an advisory lock the test holds.
	if _, err := pool.Exec(ctx, `
CREATE FUNCTION pgfence.test_claim_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state = 'available' AND NEW.state = 'running' THEN
        PERFORM pg_advisory_xact_lock(424242);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_claim_gate BEFORE UPDATE ON pgfence.jobs FOR EACH ROW EXECUTE FUNCTION pgfence.test_claim_gate();`); err != nil {
		t.Fatal(err)
	}
	gate, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer gate.Release()
	if _, err := gate.Exec(ctx, `SELECT pg_advisory_lock(424242)`); err != nil {
		t.Fatal(err)
	}
	ran := make(chan int64, 1)
	w := newWorker(t, pool, "cutclaim", func(_ context.Context, j skiplocked.Job) error {
		ran <- j.ID
		return nil
	}, &skiplocked.Config{Concurrency: 1, PollOnly: true, PollInterval: time.Hour})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(runCtx) }()
	waitFor(t, "the claim to wait for the gate", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory' AND query LIKE '%job_claim%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	cancel() // before the claim can answer
	if _, err := gate.Exec(ctx, `SELECT pg_advisory_unlock(424242)`); err != nil {
		t.Fatal(err)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	// A handler that took the job before the worker saw the stop ran it to
	// completion; otherwise the claim was given back. Never left claimed.
	j := mustJob(t, pool, ids[0])
	sum := w.Summary()
	select {
	case <-ran:
		if j.State != skiplocked.StateCompleted || sum.Completed != 1 {
			t.Fatalf("the job ran during the stop: job %s, summary completed %d; want completed, 1", j.State, sum.Completed)
		}
	default:
		if j.State != skiplocked.StateAvailable || j.Attempts != 0 || sum.Claimed != 1 || sum.Released != 1 {
			t.Fatalf("after a stop during the claim: job %s, attempts %d, summary claimed %d released %d; want available, 0, 1, 1",
				j.State, j.Attempts, sum.Claimed, sum.Released)
		}
	}
}
