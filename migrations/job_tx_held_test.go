package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// jobTxHeldVersion is migration 00020_pgfence_job_tx_held.sql.
const jobTxHeldVersion = 20

// TestJobTxHeld: job_complete_tx and job_fail_tx change only a job the
// calling transaction can hold. At version 19 a job scheduled for later was
// completed (and another sent to dead) without any claim, and a job another
// transaction held through job_claim_tx, whose worker recorded a failed
// attempt, was completed by a second caller once the first committed. At 20
// each of those calls answers "no such available job" and changes nothing,
// and the claiming transaction's own calls still work.
func TestJobTxHeld(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, jobTxHeldVersion)
	enqueue := func(queue string, later bool) (id int64) {
		t.Helper()
		runAt := "NULL"
		if later {
			runAt = "now() + interval '1 hour'"
		}
		if err := pool.QueryRow(ctx, "SELECT id FROM pgfence.job_enqueue(ARRAY[$1], ARRAY['{}'::jsonb], ARRAY[0::smallint], ARRAY["+runAt+"]::timestamptz[], ARRAY[5])", queue).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	state := func(id int64) (s string) {
		t.Helper()
		var attempts int
		if err := pool.QueryRow(ctx, "SELECT state, attempts FROM pgfence.jobs WHERE id = $1", id).Scan(&s, &attempts); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%s/%d", s, attempts)
	}
	// play returns what the unclaimed and the foreign calls did: the
	// scheduled job's state after job_complete_tx, the other scheduled
	// job's after job_fail_tx(give_up), and the held job's after a second
	// caller's job_complete_tx once its holder committed a failed attempt.
	play := func(version int) (scheduled, gaveUp, held string) {
		t.Helper()
		q := fmt.Sprintf("tx-held-%d", version)
		s1, s2 := enqueue(q+"-later", true), enqueue(q+"-later", true)
		if _, err := pool.Exec(ctx, "SELECT pgfence.job_complete_tx($1)", s1); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, "SELECT * FROM pgfence.job_fail_tx($1, 'x', 0, true)", s2); err != nil {
			t.Fatal(err)
		}
		h := enqueue(q, false)
		a, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = a.Rollback(ctx) }()
		var claimed int64
		if err := a.QueryRow(ctx, "SELECT id FROM pgfence.job_claim_tx($1, 1)", q).Scan(&claimed); err != nil || claimed != h {
			t.Fatalf("version %d: job_claim_tx: %d, %v; want %d", version, claimed, err, h)
		}
		if _, err := a.Exec(ctx, "SELECT * FROM pgfence.job_fail_tx($1, 'upstream down', 600000, false)", h); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := pool.Exec(ctx, "SELECT pgfence.job_complete_tx($1)", h)
			done <- err
		}()
		// At 19 the second caller waits for the row; at 20 it skips it and
		// returns at once. Either way A commits only once the call waits
		// or has returned.
		awaitLockWait(t, ctx, pool, "job_complete_tx", done)
		if err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		return state(s1), state(s2), state(h)
	}

	v := jobTxHeldVersion - 1
	if s, g, h := play(v); s != "completed/0" || g != "dead/1" || h != "completed/1" {
		t.Errorf("version %d: scheduled %s, gave up %s, held %s; want completed/0, dead/1, completed/1 (the old answers)", v, s, g, h)
	}
	if _, err := p.UpTo(ctx, jobTxHeldVersion); err != nil {
		t.Fatal(err)
	}
	v = jobTxHeldVersion
	if s, g, h := play(v); s != "available/0" || g != "available/0" || h != "available/1" {
		t.Errorf("version %d: scheduled %s, gave up %s, held %s; want available/0, available/0, available/1", v, s, g, h)
	}
	// The claiming transaction's own calls still work.
	id := enqueue("tx-held-own", false)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var done bool
	if _, err := tx.Exec(ctx, "SELECT * FROM pgfence.job_claim_tx('tx-held-own', 1)"); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, "SELECT pgfence.job_complete_tx($1)", id).Scan(&done); err != nil || !done {
		t.Fatalf("the claiming transaction's job_complete_tx: %v, %v", done, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if s := state(id); s != "completed/0" {
		t.Fatalf("own claim after commit: %s", s)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
