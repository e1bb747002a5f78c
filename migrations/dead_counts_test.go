package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/migrations"
)

// deadCountsVersion is migration 00021_pgfence_dead_counts_no_wait.sql.
const deadCountsVersion = 21

// TestDeadCountsNoWait: counting a dead job waits for no other transaction.
// At version 20 the queue's counter row stayed locked until the transaction
// that sent a job to dead ended: a second transaction sending a job of the
// same queue to dead waited for it, and two transactions doing so for two
// queues in opposite orders deadlocked. At 21 neither waits, and each queue's
// counted total (the sum over its rows) is its number of dead jobs at both
// versions and across the Down.
func TestDeadCountsNoWait(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, deadCountsVersion)
	enqueue := func(queue string) (id int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT id FROM pgfence.job_enqueue(ARRAY[$1], ARRAY['{}'::jsonb], ARRAY[0::smallint], ARRAY[NULL]::timestamptz[], ARRAY[5])", queue).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// kill sends job id to dead (job_fail_tx with give_up) in tx.
	kill := func(tx pgx.Tx, id int64) error {
		var state string
		err := tx.QueryRow(ctx, "SELECT state FROM pgfence.job_fail_tx($1, 'gave up', 0, true)", id).Scan(&state)
		if err == nil && state != "dead" {
			err = fmt.Errorf("job %d is %s after job_fail_tx, want dead", id, state)
		}
		return err
	}
	begin := func() pgx.Tx {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx
	}
	// counted checks that each queue's counted total is its number of
	// dead jobs.
	counted := func(version int) {
		t.Helper()
		rows, err := pool.Query(ctx, `
			SELECT j.queue, j.n, coalesce(c.dead, 0)
			FROM (SELECT queue, count(*) AS n FROM pgfence.jobs WHERE state = 'dead' GROUP BY queue) j
			FULL JOIN (SELECT queue, sum(dead)::bigint AS dead FROM pgfence.job_dead_counts GROUP BY queue) c USING (queue)
			WHERE j.n IS DISTINCT FROM c.dead`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var q string
			var n, dead *int64
			if err := rows.Scan(&q, &n, &dead); err != nil {
				t.Fatal(err)
			}
			t.Errorf("version %d: queue %s has %v dead jobs, counted %v", version, q, n, dead)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
	}
	// play returns whether a second transaction sending a job of the same
	// queue to dead waited for the first, and what two transactions
	// sending jobs of two queues to dead in opposite orders got.
	play := func(version int) (waited bool, deadlocks int) {
		t.Helper()
		qa, qb := fmt.Sprintf("dead-a-%d", version), fmt.Sprintf("dead-b-%d", version)
		// Each queue has a counter row before the test's transactions.
		for _, q := range []string{qa, qb} {
			id := enqueue(q)
			tx := begin()
			if err := kill(tx, id); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}

		// Jobs are enqueued before the transactions that fail them begin:
		// job_fail_tx changes only a job due at its transaction's start.
		first, second := enqueue(qa), enqueue(qa)
		a := begin()
		if err := kill(a, first); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			tx, err := pool.Begin(ctx)
			if err == nil {
				if err = kill(tx, second); err == nil {
					err = tx.Commit(ctx)
				} else {
					_ = tx.Rollback(ctx)
				}
			}
			done <- err
		}()
		waited = awaitLockWait(t, ctx, pool, "job_fail_tx", done)
		if err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}

		// Opposite orders: A kills in qa then qb, B in qb then qa.
		a1, a2, b1, b2 := enqueue(qa), enqueue(qb), enqueue(qb), enqueue(qa)
		a, b := begin(), begin()
		if err := kill(a, a1); err != nil {
			t.Fatal(err)
		}
		if err := kill(b, b1); err != nil {
			t.Fatal(err)
		}
		aDone := make(chan error, 1)
		go func() {
			err := kill(a, a2)
			if err == nil {
				err = a.Commit(ctx)
			}
			aDone <- err
		}()
		// At 20 A now waits for B's qb row; at 21 it has returned.
		awaitLockWait(t, ctx, pool, "job_fail_tx", aDone)
		errB := kill(b, b2)
		if errB == nil {
			errB = b.Commit(ctx)
		}
		errA := <-aDone
		for _, err := range []error{errA, errB} {
			switch {
			case err == nil:
			case sqlState(err) == "40P01":
				deadlocks++
			default:
				t.Fatalf("version %d: %v", version, err)
			}
		}
		return waited, deadlocks
	}

	v := deadCountsVersion - 1
	if waited, deadlocks := play(v); !waited || deadlocks != 1 {
		t.Errorf("version %d: second transaction waited %v, deadlocks %d; want true, 1 (the old behaviour)", v, waited, deadlocks)
	}
	counted(v)
	if _, err := p.UpTo(ctx, deadCountsVersion); err != nil {
		t.Fatal(err)
	}
	v = deadCountsVersion
	if waited, deadlocks := play(v); waited || deadlocks != 0 {
		t.Errorf("version %d: second transaction waited %v, deadlocks %d; want false, 0", v, waited, deadlocks)
	}
	counted(v)

	// Transactions counting at once leave a queue several rows; the Down
	// folds them into one per queue, totals kept.
	f1, f2 := enqueue("dead-fold"), enqueue("dead-fold")
	a, b := begin(), begin()
	for i, tx := range []pgx.Tx{a, b} {
		if err := kill(tx, []int64{f1, f2}[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, tx := range []pgx.Tx{a, b} {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var rowsBefore int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.job_dead_counts WHERE queue = 'dead-fold'").Scan(&rowsBefore); err != nil {
		t.Fatal(err)
	}
	if rowsBefore != 2 {
		t.Errorf("queue dead-fold has %d counter rows after two open transactions counted, want 2", rowsBefore)
	}
	counted(v)
	if _, err := p.DownTo(ctx, deadCountsVersion-1); err != nil {
		t.Fatal(err)
	}
	var dupes int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM (SELECT queue FROM pgfence.job_dead_counts GROUP BY queue HAVING count(*) > 1) d").Scan(&dupes); err != nil {
		t.Fatal(err)
	}
	if dupes != 0 {
		t.Errorf("after the Down %d queues have more than one counter row", dupes)
	}
	counted(deadCountsVersion - 1)
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	counted(deadCountsVersion)
}
