package skiplocked_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestTxWorkerCompletesUnderRepeatableReadDefault: on a connection whose
// default isolation is REPEATABLE READ, a TxHandler still running when the
// Worker renews its claim completes its job. The handler's transaction took
// the session's default: the renewal updated the job's row after its
// snapshot, the completion failed with 40001 on every attempt, and the job
// went dead although every attempt's handler returned nil.
func TestTxWorkerCompletesUnderRepeatableReadDefault(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	cfg.MaxConns = 6
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ids, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "rr", MaxAttempts: 2})
	if err != nil {
		t.Fatal(err)
	}
	w, err := skiplocked.NewTxWorker(pool, "rr", func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		var iso string
		if err := tx.QueryRow(ctx, "SHOW transaction_isolation").Scan(&iso); err != nil { // the snapshot is taken here
			return err
		}
		if iso != "read committed" {
			return skiplocked.Permanent(errors.New("the handler's transaction is " + iso))
		}
		// Return once the Worker has renewed the claim (its row updated
		// after this transaction's first statement).
		for {
			var renewed bool
			if err := admin.QueryRow(ctx, "SELECT claim_expires_at > $2 FROM pgfence.jobs WHERE id = $1",
				j.ID, j.ClaimExpiresAt).Scan(&renewed); err != nil {
				return err
			}
			if renewed {
				return nil
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
	}, &skiplocked.Config{Concurrency: 1, ClaimTTL: 2 * time.Second, RenewInterval: 100 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, Backoff: func(int) time.Duration { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	sum, err := w.Drain(dctx)
	j := mustJob(t, admin, ids[0])
	if err != nil || j.State != skiplocked.StateCompleted || sum.Completed != 1 {
		t.Fatalf("job %s (last error %q), summary %+v, drain %v; want completed", j.State, j.LastError, sum, err)
	}
}

// TestCompleteTxOnlyOwnClaims: CompleteTx and FailTx change only a job this
// transaction's ClaimTx claimed. A wrong id (a due job of another queue, an
// outbox delivery, that nobody claimed) was completed or failed; a claim
// made in a rolled-back savepoint is gone with it; a setting left by another
// transaction claims nothing.
func TestCompleteTxOnlyOwnClaims(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	other := enqueueN(t, pool, "outbox:payments", 1, 5)[0]
	mine := enqueueN(t, pool, "mine", 1, 5)[0]
	later := enqueueN(t, pool, "later", 1, 5)[0]

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	js, err := skiplocked.ClaimTx(ctx, tx, "mine", 1)
	if err != nil || len(js) != 1 || js[0].ID != mine {
		t.Fatalf("ClaimTx = %v, %v", js, err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, other); !errors.Is(err, pgfence.ErrNotFound) {
		t.Errorf("CompleteTx(a job this transaction did not claim) = %v; want ErrNotFound", err)
	}
	if _, err := skiplocked.FailTx(ctx, tx, other, skiplocked.FailParams{GiveUp: true}); !errors.Is(err, pgfence.ErrNotFound) {
		t.Errorf("FailTx(a job this transaction did not claim) = %v; want ErrNotFound", err)
	}
	// A claim in a savepoint rolled back is no claim.
	sp, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if js, err := skiplocked.ClaimTx(ctx, sp, "later", 1); err != nil || len(js) != 1 {
		t.Fatalf("ClaimTx in a savepoint = %v, %v", js, err)
	}
	if err := sp.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, later); !errors.Is(err, pgfence.ErrNotFound) {
		t.Errorf("CompleteTx(a claim rolled back with its savepoint) = %v; want ErrNotFound", err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, mine); err != nil {
		t.Fatalf("CompleteTx(its own claim) = %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if st := mustJob(t, pool, other).State; st != skiplocked.StateAvailable {
		t.Errorf("the job of another queue is %s; want available", st)
	}
	if st := mustJob(t, pool, later).State; st != skiplocked.StateAvailable {
		t.Errorf("the job claimed in the rolled-back savepoint is %s; want available", st)
	}
	if st := mustJob(t, pool, mine).State; st != skiplocked.StateCompleted {
		t.Errorf("the claimed job is %s; want completed", st)
	}

	// A session-level value, as a transaction of its own claim wrote it,
	// names another transaction: it claims nothing in the next one.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT set_config('pgfence.job_tx_claims', pg_current_xact_id()::text || ':,' || $1::bigint::text || ',', false)", other); err != nil {
		t.Fatal(err)
	}
	var done bool
	if err := conn.QueryRow(ctx, "SELECT pgfence.job_complete_tx($1)", other).Scan(&done); err != nil || done {
		t.Errorf("job_complete_tx with another transaction's setting = %v, %v; want false", done, err)
	}
	if _, err := conn.Exec(ctx, "RESET pgfence.job_tx_claims"); err != nil {
		t.Fatal(err)
	}
}

// TestClaimAndRenewCountFromStatement: Claim and Renew run inside a
// transaction begun earlier count the claim's expiry from their statement,
// not from the transaction's start: a claim committed that way had already
// run out (another worker took the job at once while the first believed it
// held it), and Renew reported an expiry still in the past.
func TestClaimAndRenewCountFromStatement(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "oldtx", 1, 5)
	const ttl, aged = time.Minute, 1200 * time.Millisecond
	for _, op := range []string{"claim", "renew"} {
		var held skiplocked.Job
		if op == "renew" {
			held = claimOne(t, ctx, pool, "oldtx", "A", time.Second)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var txStart time.Time
		if err := tx.QueryRow(ctx, "SELECT now()").Scan(&txStart); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT pg_sleep($1::float8)", aged.Seconds()); err != nil { // the transaction ages
			t.Fatal(err)
		}
		var expires time.Time
		if op == "claim" {
			expires = claimOne(t, ctx, tx, "oldtx", "A", ttl).ClaimExpiresAt
		} else {
			exp, err := skiplocked.Renew(ctx, tx, ttl, held.Ref())
			if err != nil || len(exp) != 1 {
				t.Fatalf("Renew in the aged transaction = %v, %v", exp, err)
			}
			expires = exp[0]
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got, want := expires.Sub(txStart), ttl+aged; got < want {
			t.Errorf("%s in a transaction begun %v earlier: expiry %v after the transaction's start; want at least %v", op, aged, got, want)
		}
		if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "oldtx", Holder: "B", Limit: 1, TTL: time.Minute}); err != nil || len(js) != 0 {
			t.Errorf("after the %s, another worker claimed %v, %v; want nothing", op, js, err)
		}
		if op == "claim" {
			// Expire it for the renew round.
			if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET state = 'available', claim_expires_at = NULL WHERE queue = 'oldtx'"); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestJobBatchRefusesMultiDimensionalArrays: the batch functions on claims
// refuse two-dimensional arrays with PF011 and change nothing; they read
// them flattened.
func TestJobBatchRefusesMultiDimensionalArrays(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "md", 2, 5)
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "md", Holder: "h", Limit: 2, TTL: time.Minute})
	if err != nil || len(js) != 2 {
		t.Fatalf("claim %v %v", js, err)
	}
	k := js[0].ClaimKey
	for _, fn := range []string{"job_complete", "job_release"} {
		for _, c := range []struct {
			name string
			sql  string
			args []any
		}{
			{"2x1", `SELECT count(*) FROM pgfence.` + fn + `(ARRAY[ARRAY[$1::bigint], ARRAY[$2::bigint]],
				ARRAY[ARRAY[$3::bigint], ARRAY[$4::bigint]], ARRAY[ARRAY[$5::bytea], ARRAY[$5::bytea]])`,
				[]any{js[0].ID, js[1].ID, js[0].ClaimToken, js[1].ClaimToken, k[:]}},
			{"1x1", `SELECT count(*) FROM pgfence.` + fn + `(ARRAY[ARRAY[$1::bigint]], ARRAY[ARRAY[$2::bigint]], ARRAY[ARRAY[$3::bytea]])`,
				[]any{js[0].ID, js[0].ClaimToken, k[:]}},
		} {
			var n int
			err := pool.QueryRow(ctx, c.sql, c.args...).Scan(&n)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "PF011" {
				t.Errorf("%s with %s arrays = %d rows, %v; want PF011", fn, c.name, n, err)
			}
		}
	}
	for _, j := range js {
		if st := mustJob(t, pool, j.ID).State; st != skiplocked.StateRunning {
			t.Errorf("job %d is %s; want running (unchanged)", j.ID, st)
		}
	}
}
