package skiplocked_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get a migrated database of their own.
func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }

// isInvalid reports whether err is a *pgfence.Error of kind ErrInvalid whose
// reason names the argument arg.
func isInvalid(err error, arg string) bool {
	var pe *pgfence.Error
	return errors.Is(err, pgfence.ErrInvalid) && errors.As(err, &pe) && strings.HasPrefix(pe.Reason, arg+": ")
}

// isLost reports whether err is exactly one lost claim, of token, whose
// reason is reason.
func isLost(err error, token int64, reason string) bool {
	l := lostErrors(err)
	return errors.Is(err, pgfence.ErrLost) && len(l) == 1 && l[0].Token == token && l[0].Reason == reason
}

// lostErrors returns the *pgfence.Errors of kind ErrLost in err: err itself,
// or the errors it joins, in order.
func lostErrors(err error) []*pgfence.Error {
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else if err != nil {
		errs = []error{err}
	}
	var lost []*pgfence.Error
	for _, e := range errs {
		var pe *pgfence.Error
		if errors.As(e, &pe) && errors.Is(pe, pgfence.ErrLost) {
			lost = append(lost, pe)
		}
	}
	return lost
}

func ctxT(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// enqueueN inserts n jobs on queue with payload {"n": i}.
func enqueueN(t testing.TB, pool *pgxpool.Pool, queue string, n int, maxAttempts int) []int64 {
	t.Helper()
	ctx := context.Background()
	var ids []int64
	for start := 0; start < n; start += 10000 {
		ps := make([]skiplocked.EnqueueParams, 0, min(10000, n-start))
		for i := start; i < min(start+10000, n); i++ {
			ps = append(ps, skiplocked.EnqueueParams{Queue: queue, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i)), MaxAttempts: maxAttempts})
		}
		got, err := skiplocked.Enqueue(ctx, pool, ps...)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, got...)
	}
	return ids
}

// noWaitPool opens a pool on dsn whose sessions fail any lock wait longer
// than 2 s (lock_timeout), for tests that SKIP LOCKED claimers never wait.
// 2 s, not less: on a loaded machine a relation extension lock can be
// waited for a few hundred ms, and lock_timeout counts that too.
func noWaitPool(t testing.TB, ctx context.Context, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "2s"
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// holdRows starts a transaction on pool that locks the n rows selected by
// query (SELECT 1 ... LIMIT $1 FOR UPDATE) until the returned function
// rolls it back (also done when t ends).
func holdRows(t testing.TB, ctx context.Context, pool *pgxpool.Pool, query string, n int) (release func()) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	release = func() { _ = tx.Rollback(context.Background()) }
	t.Cleanup(release)
	if tag, err := tx.Exec(ctx, query, n); err != nil || tag.RowsAffected() != int64(n) {
		t.Fatalf("blocker locked %v rows: %v", tag, err)
	}
	return release
}

func mustJob(t testing.TB, pool *pgxpool.Pool, id int64) skiplocked.Job {
	t.Helper()
	j, err := skiplocked.GetJob(context.Background(), pool, id)
	if err != nil {
		t.Fatal(err)
	}
	return j
}

func countState(t testing.TB, pool *pgxpool.Pool, queue string, state skiplocked.State) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pgfence.jobs WHERE queue = $1 AND state = $2", queue, string(state)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// depthOf counts the jobs of one queue.
func depthOf(t testing.TB, ctx context.Context, db pgfence.DBTX, queue string) skiplocked.Depth {
	t.Helper()
	ds, err := skiplocked.QueueDepths(ctx, db, queue)
	if err != nil {
		t.Fatal(err)
	}
	return ds[0]
}

// enqueueOne enqueues one job and returns it as stored.
func enqueueOne(t testing.TB, pool *pgxpool.Pool, p skiplocked.EnqueueParams) skiplocked.Job {
	t.Helper()
	ids, err := skiplocked.Enqueue(context.Background(), pool, p)
	if err != nil {
		t.Fatal(err)
	}
	return mustJob(t, pool, ids[0])
}
