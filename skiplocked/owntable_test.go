package skiplocked_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// importsTable creates an application table like a batch importer's and
// fills it with n rows, spread over 4 stores.
func importsTable(t testing.TB, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE import_rows (
			id           bigint PRIMARY KEY,
			store_id     int NOT NULL,
			status       text NOT NULL DEFAULT 'pending',
			processed_by text,
			times        int NOT NULL DEFAULT 0,
			imported_at  timestamptz
		);
		CREATE INDEX ON import_rows (store_id, id) WHERE status = 'pending';`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO import_rows (id, store_id) SELECT g, g % 4 FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
}

// claimPending is the in-transaction claim on an application table that
// docs/claims.md shows: one SELECT ... FOR UPDATE SKIP LOCKED in tx.
func claimPending(ctx context.Context, tx pgx.Tx, limit int) ([]int64, error) {
	rows, err := tx.Query(ctx, `SELECT id FROM import_rows WHERE status = 'pending'
		ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// TestTxClaimsDrainConcurrently: 8 workers drain 20,000 rows of an
// application table with in-transaction claims; every row is processed
// exactly once (times = 1, and by the worker the test recorded) and no worker
// ever waits for a lock: lock_timeout would fail it, and a blocker
// transaction holds 100 rows locked until every worker has finished.
func TestTxClaimsDrainConcurrently(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := noWaitPool(t, ctx, dsn, 9)
	const rows, workers, blocked = 20000, 8, 100
	importsTable(t, pool, rows)
	unblock := holdRows(t, ctx, pool, "SELECT 1 FROM import_rows ORDER BY id LIMIT $1 FOR UPDATE", blocked)

	var mu sync.Mutex
	seen := make(map[int64]string, rows)
	var wg sync.WaitGroup
	errs := make(chan error, workers+1)
	drain := func(name string) {
		for {
			var ids []int64
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var err error
				ids, err = claimPending(ctx, tx, 100)
				if err != nil || len(ids) == 0 {
					return err
				}
				_, err = tx.Exec(ctx, `UPDATE import_rows SET status = 'done', processed_by = $1, times = times + 1,
						imported_at = now() WHERE id = ANY($2)`, name, ids)
				return err
			})
			if err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
				return
			}
			if len(ids) == 0 {
				return
			}
			mu.Lock()
			for _, id := range ids {
				if prev, dup := seen[id]; dup {
					errs <- fmt.Errorf("row %d claimed by %s and %s", id, prev, name)
				}
				seen[id] = name
			}
			mu.Unlock()
		}
	}
	for w := range workers {
		name := fmt.Sprintf("w%d", w)
		wg.Go(func() { drain(name) })
	}
	wg.Wait()
	// The workers skipped the blocked rows and stopped; free them and drain
	// the rest with one more worker.
	if len(seen) != rows-blocked {
		t.Errorf("claimed %d rows while %d were locked, want %d", len(seen), blocked, rows-blocked)
	}
	unblock()
	drain("wz")
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != rows {
		t.Fatalf("claimed %d distinct rows, want %d", len(seen), rows)
	}
	var notOnce, mismatched int
	rs, err := pool.Query(ctx, "SELECT id, processed_by, times FROM import_rows")
	if err != nil {
		t.Fatal(err)
	}
	for rs.Next() {
		var id int64
		var by *string
		var times int
		if err := rs.Scan(&id, &by, &times); err != nil {
			t.Fatal(err)
		}
		if times != 1 {
			notOnce++
		}
		if by == nil || *by != seen[id] {
			mismatched++
		}
	}
	if rs.Err() != nil || notOnce != 0 || mismatched != 0 {
		t.Fatalf("rows not processed exactly once: %d, processed_by mismatches: %d, err %v", notOnce, mismatched, rs.Err())
	}
}

// A worker killed mid-transaction (pg_terminate_backend) releases its claimed
// application rows at once; a worker that rolls back releases them too.
func TestTxClaimsReleasedOnKillAndRollback(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	importsTable(t, pool, 20)
	claimAll := func() []int64 {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		ids, err := claimPending(ctx, tx, 100)
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}

	victim, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close(context.Background())
	tx, err := victim.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held, err := claimPending(ctx, tx, 10)
	if err != nil || len(held) != 10 || held[0] != 1 {
		t.Fatalf("victim claimed %v, %v", held, err)
	}
	if got := claimAll(); len(got) != 10 || got[0] != 11 {
		t.Fatalf("others claimed %v while victim holds 1..10", got)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", victim.PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(claimAll()) != 20 {
		if time.Now().After(deadline) {
			t.Fatal("rows of the killed worker not released")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := claimPending(ctx, tx, 10); !pgfence.IsRetryable(err) {
		t.Fatalf("claim on the killed connection: %v, want a connection error", err)
	}

	// Rollback releases at once as well.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := claimPending(ctx, tx2, 10); err != nil || len(ids) != 10 {
		t.Fatal(ids, err)
	}
	if got := claimAll(); len(got) != 10 {
		t.Fatalf("others claimed %d, want 10", len(got))
	}
	if err := tx2.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := claimAll(); len(got) != 20 {
		t.Fatalf("after rollback others claimed %d, want 20", len(got))
	}
}
