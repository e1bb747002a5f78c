package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// jobBatchesVersion is migration 00019_pgfence_job_batches.sql.
const jobBatchesVersion = 19

// TestJobBatches plays each fix of migration 00019 at version 18 (the old
// answer) and at 19:
//   - a job_complete batch waiting for the row of its first id holds no row
//     of its second id at 18 (rows locked in the order of the arrays, half
//     of a deadlock with a batch in the other order) and holds it at 19
//     (rows locked in id order);
//   - job_renew called in a transaction that began before the claim moved
//     the claim's expiry earlier (into the past) at 18, not at 19;
//   - job_enqueue accepted run_at 'infinity' at 18; 19 refuses it (23514).
func TestJobBatches(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, jobBatchesVersion)
	const key = `\x000102030405060708090a0b0c0d0e0f`
	// Enough running jobs that the plan looks each id of a batch up in
	// the order of its array.
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.jobs (queue, state, holder, claim_token, claim_expires_at, claim_key_hash)
		SELECT 'batch', 'running', 'w', g, now() + interval '1 hour', sha256('`+key+`'::bytea)
		FROM generate_series(1, 20000) AS g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE pgfence.jobs"); err != nil {
		t.Fatal(err)
	}
	var first, second int64 // second < first: the batch names first, then second
	if err := pool.QueryRow(ctx, "SELECT max(id), max(id) - 1 FROM pgfence.jobs").Scan(&first, &second); err != nil {
		t.Fatal(err)
	}

	// batchProbe runs job_complete(ARRAY[first, second]) while another
	// transaction holds first's row, and returns the SQLSTATE a NOWAIT
	// lock of second's row gets meanwhile.
	batchProbe := func(version int) string {
		t.Helper()
		first, second := first-int64(2*(version-jobBatchesVersion+1)), second-int64(2*(version-jobBatchesVersion+1))
		hold, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = hold.Rollback(ctx) }()
		if _, err := hold.Exec(ctx, "SELECT 1 FROM pgfence.jobs WHERE id = $1 FOR UPDATE", first); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := pool.Exec(ctx, `SELECT * FROM pgfence.job_complete($1, $2, ARRAY['`+key+`', '`+key+`']::bytea[])`,
				[]int64{first, second}, []int64{first, second})
			done <- err
		}()
		if !awaitLockWait(t, ctx, pool, "job_complete", done) {
			t.Fatalf("version %d: the batch returned without waiting for the held row: %v", version, <-done)
		}
		pr, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, perr := pr.Exec(ctx, "SELECT 1 FROM pgfence.jobs WHERE id = $1 FOR UPDATE NOWAIT", second)
		_ = pr.Rollback(ctx)
		if err := hold.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("version %d: job_complete: %v", version, err)
		}
		return sqlState(perr)
	}

	// renewShortens claims a job, then renews it in a transaction that
	// began before the claim, and reports whether the expiry moved earlier.
	renewShortens := func(version int) bool {
		t.Helper()
		queue := fmt.Sprintf("renew-%d", version)
		old, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = old.Rollback(ctx) }()
		if _, err := old.Exec(ctx, "SELECT now()"); err != nil { // fixes the transaction's now()
			t.Fatal(err)
		}
		var id, token int64
		var claimed time.Time
		if _, err := pool.Exec(ctx, "SELECT pgfence.job_enqueue(ARRAY[$1], ARRAY['{}'::jsonb], ARRAY[0::smallint], ARRAY[NULL::timestamptz], ARRAY[3])", queue); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, `SELECT id, claim_token, claim_expires_at FROM pgfence.job_claim($1, 'w', 60000, 1, '`+key+`')`, queue).Scan(&id, &token, &claimed); err != nil {
			t.Fatal(err)
		}
		var renewed time.Time
		if err := old.QueryRow(ctx, `SELECT claim_expires_at FROM pgfence.job_renew(ARRAY[$1::bigint], ARRAY[$2::bigint], ARRAY['`+key+`'::bytea], 100)`, id, token).Scan(&renewed); err != nil {
			t.Fatalf("version %d: job_renew: %v", version, err)
		}
		return renewed.Before(claimed)
	}

	infinity := func() string {
		_, err := pool.Exec(ctx, "SELECT pgfence.job_enqueue(ARRAY['inf'], ARRAY['{}'::jsonb], ARRAY[0::smallint], ARRAY['infinity'::timestamptz], ARRAY[3])")
		return sqlState(err)
	}

	v := jobBatchesVersion - 1
	if got := batchProbe(v); got != "" {
		t.Errorf("version %d: the waiting batch held its second row (probe %q); the scenario does not show the array order", v, got)
	}
	if !renewShortens(v) {
		t.Errorf("version %d: job_renew in an older transaction did not shorten the claim; the scenario does not show the old answer", v)
	}
	if got := infinity(); got != "" {
		t.Errorf("version %d: run_at infinity: %q, want accepted (the old answer)", v, got)
	}
	if _, err := pool.Exec(ctx, "DELETE FROM pgfence.jobs WHERE queue = 'inf'"); err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, jobBatchesVersion); err != nil {
		t.Fatal(err)
	}
	v = jobBatchesVersion
	if got := batchProbe(v); got != "55P03" {
		t.Errorf("version %d: a batch waiting for one row does not hold its lower id (probe %q, want 55P03): not locked in id order", v, got)
	}
	if renewShortens(v) {
		t.Errorf("version %d: job_renew in an older transaction moved the claim's expiry earlier", v)
	}
	if got := infinity(); got != "23514" {
		t.Errorf("version %d: run_at infinity: %q, want 23514 (jobs_run_at_finite)", v, got)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
