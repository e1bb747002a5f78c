package skiplocked_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// pipelinePool is a pool on a fresh migrated database with room for a
// worker's parallel claims and outcome writers (MaxConns 12).
func pipelinePool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestWorkerStaleCompletionRefused: a handler whose claim was taken over
// while it ran (no renewal in between to notice) returns nil; its batched
// completion is refused by the token, the new claim is untouched, the loss
// is counted and reported, and the other jobs of the worker complete.
func TestWorkerStaleCompletionRefused(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pipelinePool(t)
	ids := enqueueN(t, pool, "stalecomplete", 20, 5)
	stale := ids[0]
	started := make(chan skiplocked.Job, 1)
	takenOver := make(chan struct{})
	hook := make(chan *pgfence.Error, 2)
	m := &countCompleted{want: int64(len(ids) - 1), done: make(chan struct{})}
	w := newWorker(t, pool, "stalecomplete", func(_ context.Context, j skiplocked.Job) error {
		if j.ID == stale {
			started <- j
			<-takenOver // a pause past the claim
		}
		return nil
	}, &skiplocked.Config{
		// Polling: reclaimAs's claim locks an available job for a moment
		// too, and a claim of the Worker's then skips it; with only
		// notifications (one per enqueue) it was never claimed again.
		Concurrency: 4, BatchSize: 4, ClaimTTL: time.Hour, PollInterval: 100 * time.Millisecond, Metrics: m,
		OnClaimLost: func(_ context.Context, _ skiplocked.Job, err *pgfence.Error) { hook <- err },
	})
	stop := runWorker(t, w)
	a := <-started
	b := reclaimAs(t, ctx, pool, "stalecomplete", stale, "B")
	close(takenOver)
	select {
	case e := <-hook:
		if e == nil || !errors.Is(e, pgfence.ErrLost) || e.Token != a.ClaimToken || e.Holder != "B" ||
			!strings.HasPrefix(e.Reason, fmt.Sprintf("job %d: reclaimed by token %d,", a.ID, b.ClaimToken)) {
			t.Fatalf("OnClaimLost got %+v, want the loss of claim %d to B's claim %d", e, a.ClaimToken, b.ClaimToken)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("OnClaimLost not called for the stale completion")
	}
	select {
	case <-m.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("only %d of %d other jobs completed", m.n.Load(), len(ids)-1)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, stale)
	if j.State != skiplocked.StateRunning || j.ClaimToken != b.ClaimToken || j.Holder != "B" {
		t.Fatalf("stale completion changed the job: %+v", j)
	}
	if s := w.Summary(); s.ClaimsLost != 1 || s.Completed != int64(len(ids)-1) {
		t.Fatalf("summary %+v, want 1 claim lost and %d completed", s, len(ids)-1)
	}
	if got := countState(t, pool, "stalecomplete", skiplocked.StateCompleted); got != len(ids)-1 {
		t.Fatalf("%d jobs completed, want %d", got, len(ids)-1)
	}
}

// TestWorkerCompletionNotHeldForBatch: the completion delay is bounded by
// the outcome statements in flight, not by a batch filling up: a job whose
// handler returns is completed in the database while the other jobs of its
// claim batch are still being handled.
func TestWorkerCompletionNotHeldForBatch(t *testing.T) {
	t.Parallel()
	pool := pipelinePool(t)
	ids := enqueueN(t, pool, "nohold", 8, 5)
	release := make(chan struct{})
	var blocked sync.WaitGroup
	blocked.Add(len(ids) - 1)
	first := &countCompleted{want: 1, done: make(chan struct{})}
	w := newWorker(t, pool, "nohold", func(ctx context.Context, j skiplocked.Job) error {
		var p struct{ N int }
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return err
		}
		if p.N == 0 {
			return nil
		}
		blocked.Done()
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}, &skiplocked.Config{Concurrency: 8, BatchSize: 8, ClaimTTL: time.Hour, PollInterval: time.Hour, Metrics: first})
	stop := runWorker(t, w)
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before runWorker's stop (cleanups run last-in first)
	select {
	case <-first.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the first job's completion was not written while the rest of its batch ran")
	}
	blocked.Wait() // the seven others are in their handlers, their claims held
	if j := mustJob(t, pool, ids[0]); j.State != skiplocked.StateCompleted {
		t.Fatalf("job 0 is %s after its completion was recorded", j.State)
	}
	if got := countState(t, pool, "nohold", skiplocked.StateRunning); got != len(ids)-1 {
		t.Fatalf("%d jobs running, want the %d blocked ones", got, len(ids)-1)
	}
	unblock()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// TestWorkerParallelClaimsStayWithinBound: with several claims in flight a
// worker still holds at most Concurrency + 2*BatchSize claims whose handler
// has not returned, and drains the queue exactly once.
func TestWorkerParallelClaimsStayWithinBound(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pipelinePool(t)
	const conc, batch, n = 2, 3, 300
	enqueueN(t, pool, "bound", n, 5)
	var (
		returned, maxHeld, dup atomic.Int64
		seen                   sync.Map
	)
	claimed := &countClaimed{}
	w := newWorker(t, pool, "bound", func(ctx context.Context, j skiplocked.Job) error {
		if _, loaded := seen.LoadOrStore(j.ID, true); loaded {
			dup.Add(1)
		}
		// Claims counted once their statement returned, minus handlers that
		// returned: claims held whose handler has not returned (or more).
		held := claimed.n.Load() - returned.Load()
		for {
			old := maxHeld.Load()
			if held <= old || maxHeld.CompareAndSwap(old, held) {
				break
			}
		}
		time.Sleep(time.Millisecond) // some work, so that claims pile up if unbounded
		returned.Add(1)
		return nil
	}, &skiplocked.Config{Concurrency: conc, BatchSize: batch, ClaimTTL: time.Hour, Metrics: claimed})
	sum, err := w.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Completed != n || dup.Load() != 0 {
		t.Fatalf("summary %+v, %d jobs handled twice; want %d completed once", sum, dup.Load(), n)
	}
	if got := maxHeld.Load(); got > conc+2*batch || got < conc {
		t.Fatalf("held up to %d claims whose handler had not returned, bound %d", got, conc+2*batch)
	}
}

// countClaimed is an observe.Metrics that counts claimed rows.
type countClaimed struct{ n atomic.Int64 }

func (c *countClaimed) Add(_ context.Context, name string, delta float64, _ ...string) {
	if name == metricdefs.RowsClaimedTotal {
		c.n.Add(int64(delta))
	}
}

func (c *countClaimed) Observe(context.Context, string, float64, ...string) {}
