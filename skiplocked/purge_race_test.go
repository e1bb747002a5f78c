package skiplocked_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestDeleteFinishedSparesRevived: a dead job made available again (the
// documented retry, an UPDATE by the owner) while DeleteFinished waits for
// its row is not deleted. The purge chose its ids first and deleted them
// without looking at the row again (before migration 00018), so the revived
// job was lost.
func TestDeleteFinishedSparesRevived(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "revive", MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	w, err := skiplocked.NewWorker(pool, "revive", func(context.Context, skiplocked.Job) error {
		return errors.New("fails")
	}, &skiplocked.Config{PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	tag, err := tx.Exec(ctx, `UPDATE pgfence.jobs SET state = 'available', attempts = 0, run_at = now(), finished_at = NULL
		WHERE id = $1 AND state = 'dead'`, ids[0])
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("revive: %v, %v", tag, err)
	}
	type res struct {
		n   int64
		err error
	}
	done := make(chan res, 1)
	go func() {
		n, err := skiplocked.DeleteFinished(ctx, pool, time.Now().Add(time.Hour), 100)
		done <- res{n, err}
	}()
	// No signal exists for another backend's lock wait: it is looked up.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%job_purge%' AND pid <> pg_backend_pid()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		select {
		case r := <-done:
			t.Fatalf("DeleteFinished returned (%d, %v) without waiting for the revived row", r.n, r.err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("DeleteFinished never waited for the revived row")
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	var state string
	if err := pool.QueryRow(ctx, "SELECT state FROM pgfence.jobs WHERE id = $1", ids[0]).Scan(&state); err != nil || state != "available" {
		t.Fatalf("the revived job after the purge: state %q, %v (deleted %d); want it available", state, err, r.n)
	}
}
