package advisory_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// incrementInTx is a read-then-write increment: it loses updates unless
// something serialises the callers.
func incrementInTx(ctx context.Context, tx pgx.Tx) error {
	var n int
	if err := tx.QueryRow(ctx, "SELECT n FROM counter WHERE id = 1").Scan(&n); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, "UPDATE counter SET n = $1 WHERE id = 1", n+1)
	return err
}

// TestXactMutualExclusion: two goroutines, 1,000 read-then-write increments
// in total, each inside Xact on one name; none may be lost, and no two
// callbacks may overlap.
func TestXactMutualExclusion(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	newCounter(t, pool)
	key := advisory.MustName("counter:1")
	const workers, rounds = 2, 500
	var inside atomic.Int32
	var overlaps atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				err := advisory.Xact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
					if inside.Add(1) != 1 {
						overlaps.Add(1)
					}
					defer inside.Add(-1)
					return incrementInTx(ctx, tx)
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := counterValue(t, pool); got != workers*rounds {
		t.Fatalf("counter = %d, want %d: increments were lost", got, workers*rounds)
	}
	if overlaps.Load() != 0 {
		t.Fatalf("%d callbacks overlapped", overlaps.Load())
	}
	requireNoLocks(t, pool)
}

func TestXactReleased(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("released")
	errBoom := errors.New("boom")

	t.Run("commit", func(t *testing.T) {
		ran := false
		err := advisory.Xact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
			ran = true
			requireLocked(t, pool, key)
			_, err := tx.Exec(ctx, "CREATE TABLE committed (x int)")
			return err
		})
		if err != nil || !ran {
			t.Fatalf("Xact: %v (ran %v)", err, ran)
		}
		requireFree(t, pool, key)
		requireNoLocks(t, pool)
		if _, err := pool.Exec(ctx, "SELECT * FROM committed"); err != nil {
			t.Fatalf("the transaction's write did not commit: %v", err)
		}
	})
	t.Run("rollback", func(t *testing.T) {
		err := advisory.Xact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
			requireLocked(t, pool, key)
			if _, err := tx.Exec(ctx, "CREATE TABLE rolled_back (x int)"); err != nil {
				return err
			}
			return errBoom
		})
		if !errors.Is(err, errBoom) {
			t.Fatalf("Xact error = %v, want fn's error", err)
		}
		requireFree(t, pool, key)
		requireNoLocks(t, pool)
		var exists bool
		if err := pool.QueryRow(ctx, "SELECT to_regclass('rolled_back') IS NOT NULL").Scan(&exists); err != nil || exists {
			t.Fatalf("the transaction's write survived a rollback (exists %v, %v)", exists, err)
		}
	})
	t.Run("panic", func(t *testing.T) {
		type marker struct{}
		var recovered any
		func() {
			defer func() { recovered = recover() }()
			_ = advisory.Xact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
				requireLocked(t, pool, key)
				panic(marker{})
			})
		}()
		if _, ok := recovered.(marker); !ok {
			t.Fatalf("recovered %v, want the callback's panic value re-raised", recovered)
		}
		requireFree(t, pool, key)
		requireNoLocks(t, pool)
		if s := pool.Stat(); s.AcquiredConns() != 0 {
			t.Fatalf("%d connections still acquired after the panic", s.AcquiredConns())
		}
	})
}

func TestTryXactLockedAndShared(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("shared")

	err := advisory.Xact(ctx, pool, key, advisory.Shared, func(tx pgx.Tx) error {
		// Another shared holder may enter at the same time...
		if err := advisory.TryXact(ctx, pool, key, advisory.Shared, func(pgx.Tx) error { return nil }); err != nil {
			t.Errorf("second shared TryXact: %v", err)
		}
		// ...an exclusive one may not, and its callback must not run.
		ran := false
		err := advisory.TryXact(ctx, pool, key, advisory.Exclusive, func(pgx.Tx) error { ran = true; return nil })
		if !isLocked(err, key, advisory.Exclusive) || pfError(err).Op != "advisory.TryXact" || ran {
			t.Errorf("exclusive TryXact under a shared lock: err %v ran %v", err, ran)
		}
		locks := advisoryLocks(t, pool)
		if len(locks) != 1 || locks[0].Key != key || locks[0].Mode != advisory.Shared || !locks[0].Granted {
			t.Errorf("List = %+v, want one granted shared lock on %v", locks, key)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}

// TestKeySpacesDistinct: a bigint key and a pair with the same bits are
// different locks in PostgreSQL, and the package keeps them apart.
func TestKeySpacesDistinct(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	big, pair := advisory.Int64(5), advisory.Pair(0, 5)
	err := advisory.Xact(ctx, pool, big, advisory.Exclusive, func(pgx.Tx) error {
		requireLocked(t, pool, big)
		requireFree(t, pool, pair)
		locks := advisoryLocks(t, pool)
		if len(locks) != 1 || locks[0].Key != big {
			t.Errorf("List = %+v, want %v", locks, big)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ns := must(advisory.Namespaced(-3, "x"))
	err = advisory.Xact(ctx, pool, ns, advisory.Exclusive, func(pgx.Tx) error {
		locks := advisoryLocks(t, pool)
		if len(locks) != 1 || locks[0].Key != ns {
			t.Errorf("List = %+v, want %v", locks, ns)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestXactWaitCancelled: a caller waiting for a held lock gives up when its
// context ends, without running fn and without holding anything.
func TestXactWaitCancelled(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("wait")
	entered := make(chan struct{})
	release := make(chan struct{})
	holderErr := make(chan error, 1)
	go func() {
		holderErr <- advisory.Xact(ctx, pool, key, advisory.Exclusive, func(pgx.Tx) error {
			close(entered)
			<-release
			return nil
		})
	}()
	<-entered
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	ran := false
	err := advisory.Xact(wctx, pool, key, advisory.Exclusive, func(pgx.Tx) error { ran = true; return nil })
	if !errors.Is(err, context.DeadlineExceeded) || ran {
		t.Fatalf("waiting Xact: err %v ran %v, want DeadlineExceeded and fn not run", err, ran)
	}
	// pgx sent a cancel request and closed the connection; the server drops
	// the waiter on its own.
	waitLocks(t, pool, "want only the holder's granted lock (the waiter gone)", func(l []advisory.LockInfo) bool {
		return len(l) == 1 && l[0].Granted
	})
	close(release)
	if err := <-holderErr; err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}

func TestXactValidation(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	ok := func(pgx.Tx) error { t.Error("fn ran on bad input"); return nil }
	key := advisory.MustName("v")
	var nilPool *nilBeginner
	cases := []struct {
		name string
		err  error
		want string // the argument named
	}{
		{"nil db", advisory.Xact(ctx, nil, key, advisory.Exclusive, ok), "db"},
		{"typed nil db", advisory.Xact(ctx, nilPool, key, advisory.Exclusive, ok), "db"},
		{"nil fn", advisory.Xact(ctx, pool, key, advisory.Exclusive, nil), "fn"},
		{"zero key", advisory.Xact(ctx, pool, advisory.Key{}, advisory.Exclusive, ok), "key"},
		{"bad mode", advisory.TryXact(ctx, pool, key, advisory.Mode(7), ok), "mode"},
	}
	for _, c := range cases {
		if !isInvalid(c.err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, c.err, c.want)
		}
	}
	requireNoLocks(t, pool)
	if s := pool.Stat(); s.AcquiredConns() != 0 {
		t.Fatalf("%d connections acquired after refused calls", s.AcquiredConns())
	}
}

type nilBeginner struct{}

func (*nilBeginner) Begin(context.Context) (pgx.Tx, error) { panic("called") }

// TestXactInsideTx documents the savepoint case: with a pgx.Tx as db the lock
// lasts until the outer transaction ends.
func TestXactInsideTx(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("nested")
	outer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Rollback(ctx)
	if err := advisory.Xact(ctx, outer, key, advisory.Exclusive, func(pgx.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}
	requireLocked(t, pool, key)
	if err := outer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	requireFree(t, pool, key)
}

// TestXactInsideTxError: with a pgx.Tx as db, the lock outlives fn's
// savepoint also when fn fails (the savepoint is rolled back), until the outer
// transaction ends; the outer transaction stays usable and keeps its own
// writes.
func TestXactInsideTxError(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	errBoom := errors.New("boom")
	for name, run := range map[string]func(context.Context, advisory.Beginner, advisory.Key, advisory.Mode, func(pgx.Tx) error) error{
		"Xact": advisory.Xact, "TryXact": advisory.TryXact,
	} {
		key := advisory.MustName("nested-error:" + name)
		outer, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// Before the pool's cleanup, which waits for the connection.
		t.Cleanup(func() { _ = outer.Rollback(context.Background()) })
		if _, err := outer.Exec(ctx, "CREATE TABLE kept (x int)"); err != nil {
			t.Fatal(err)
		}
		err = run(ctx, outer, key, advisory.Exclusive, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "CREATE TABLE undone (x int)"); err != nil {
				return err
			}
			return errBoom
		})
		if !errors.Is(err, errBoom) {
			t.Fatalf("%s in a tx: %v, want fn's error", name, err)
		}
		requireLocked(t, pool, key)
		var ok bool
		if err := outer.QueryRow(ctx, "SELECT to_regclass('kept') IS NOT NULL AND to_regclass('undone') IS NULL").Scan(&ok); err != nil || !ok {
			t.Fatalf("%s in a tx: outer transaction after fn's error: ok %v err %v, want usable with only its own write", name, ok, err)
		}
		requireLocked(t, pool, key)
		if err := outer.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		requireFree(t, pool, key)
	}
	requireNoLocks(t, pool)
}

// TestXactInsideTxRefused: with a pgx.Tx as db, a refused TryXact and an
// Xact whose wait lock_timeout ends leave the outer transaction usable, hold
// nothing and do not run fn.
func TestXactInsideTxRefused(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("nested-refused")
	holder, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Release(context.Background()) })
	outer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = outer.Rollback(context.Background()) })
	if _, err := outer.Exec(ctx, "SET LOCAL lock_timeout = '50ms'"); err != nil {
		t.Fatal(err)
	}
	for name, run := range map[string]func(context.Context, advisory.Beginner, advisory.Key, advisory.Mode, func(pgx.Tx) error) error{
		"Xact": advisory.Xact, "TryXact": advisory.TryXact,
	} {
		ran := false
		err := run(ctx, outer, key, advisory.Shared, func(pgx.Tx) error { ran = true; return nil })
		if !isLocked(err, key, advisory.Shared) || ran {
			t.Fatalf("%s in a tx on a held key: err %v ran %v, want ErrLocked and fn not run", name, err, ran)
		}
		var n int
		if err := outer.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&n); err != nil || n != 0 {
			t.Fatalf("%s in a tx on a held key: outer transaction holds %d advisory locks (%v), want usable and none", name, n, err)
		}
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The key is free now: the same outer transaction takes it.
	if err := advisory.Xact(ctx, outer, key, advisory.Shared, func(pgx.Tx) error { return nil }); err != nil {
		t.Fatalf("Xact in the outer transaction after the refusals: %v", err)
	}
	requireLocked(t, pool, key)
	if err := outer.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}

// TestLockTx: the lock taken in a caller's transaction lasts exactly as long
// as that transaction.
func TestLockTx(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("locktx")
	for _, end := range []string{"commit", "rollback"} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := advisory.LockTx(ctx, tx, key, advisory.Exclusive); err != nil {
			t.Fatal(err)
		}
		requireLocked(t, pool, key)
		// A second transaction's TryLockTx is refused and its tx stays usable.
		tx2, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := advisory.TryLockTx(ctx, tx2, key, advisory.Shared); !errors.Is(err, pgfence.ErrLocked) {
			t.Fatalf("TryLockTx while held: %v", err)
		}
		if _, err := tx2.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatalf("tx unusable after a refused TryLockTx: %v", err)
		}
		if err := tx2.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if end == "commit" {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		requireFree(t, pool, key)
	}
	requireNoLocks(t, pool)
	if err := advisory.LockTx(ctx, nil, key, advisory.Exclusive); !isInvalid(err, "tx") {
		t.Errorf("LockTx(nil tx) = %v", err)
	}
	if err := advisory.TryLockTx(ctx, nil, advisory.Key{}, advisory.Exclusive); !isInvalid(err, "tx") {
		t.Errorf("TryLockTx(nil tx) = %v", err)
	}
	// A zero Key or an unknown Mode on a live transaction: refused before any
	// SQL, and the transaction stays usable (nothing was sent).
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	for _, c := range []struct {
		name string
		key  advisory.Key
		mode advisory.Mode
		arg  string
	}{
		{"zero key", advisory.Key{}, advisory.Exclusive, "key"},
		{"unknown mode", key, advisory.Mode(2), "mode"},
	} {
		if err := advisory.LockTx(ctx, tx, c.key, c.mode); !isInvalid(err, c.arg) {
			t.Errorf("LockTx(%s) = %v, want ErrInvalid (%s)", c.name, err, c.arg)
		}
		if err := advisory.TryLockTx(ctx, tx, c.key, c.mode); !isInvalid(err, c.arg) {
			t.Errorf("TryLockTx(%s) = %v, want ErrInvalid (%s)", c.name, err, c.arg)
		}
	}
	var one int
	if err := tx.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("transaction after refused calls: %v", err)
	}
	requireNoLocks(t, pool)
	fn := func(pgx.Tx) error { return nil }
	var nilPool *pgxpool.Pool
	if err := advisory.TryXact(ctx, nilPool, key, advisory.Exclusive, fn); !isInvalid(err, "db") {
		t.Errorf("TryXact(nil db) = %v, want ErrInvalid (db)", err)
	}
	if err := advisory.TryXact(ctx, pool, key, advisory.Exclusive, nil); !isInvalid(err, "fn") {
		t.Errorf("TryXact(nil fn) = %v, want ErrInvalid (fn)", err)
	}
	if err := advisory.Xact(ctx, pool, advisory.Key{}, advisory.Exclusive, fn); !isInvalid(err, "key") {
		t.Errorf("Xact(zero key) = %v, want ErrInvalid (key)", err)
	}
}

// TestLockTimeoutIsLocked: a wait ended by lock_timeout reports ErrLocked,
// with the server's error as the cause.
func TestLockTimeoutIsLocked(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.MustName("lock-timeout")
	err := advisory.Xact(ctx, pool, key, advisory.Exclusive, func(pgx.Tx) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '50ms'"); err != nil {
			return err
		}
		err = advisory.LockTx(ctx, tx, key, advisory.Shared)
		var pgErr *pgconn.PgError
		if !isLocked(err, key, advisory.Shared) || !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
			t.Errorf("LockTx under lock_timeout = %v, want ErrLocked caused by 55P03", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
