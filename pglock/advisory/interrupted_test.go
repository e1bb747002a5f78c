package advisory_test

// Tests of locks whose caller is interrupted: a context cancelled while fn
// runs, and a session lock's backend terminated while it is released.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// xactRunners are Xact and TryXact, by name.
var xactRunners = map[string]func(context.Context, advisory.Beginner, advisory.Key, advisory.Mode, func(pgx.Tx) error) error{
	"Xact": advisory.Xact, "TryXact": advisory.TryXact,
}

// TestXactContextCancelledInFn: fn writes, then cancels the caller's
// context, and its next statement on that context fails. On a pool, Xact
// and TryXact return an error matching context.Canceled, roll fn's write
// back although the context has ended, and leave no lock held and no
// connection out of the pool. In a caller's transaction, only fn's
// savepoint is rolled back: the outer transaction stays usable with its own
// write, and keeps the lock until it ends.
func TestXactContextCancelledInFn(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	key := advisory.Int64(-42)
	for name, run := range xactRunners {
		t.Run(name+"/pool", func(t *testing.T) {
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			err := run(ctx, pool, key, advisory.Shared, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "CREATE TABLE undone (x int)"); err != nil {
					return err
				}
				cancel()
				_, err := tx.Exec(ctx, "SELECT 1")
				return err
			})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%s with ctx cancelled in fn = %v, want context.Canceled", name, err)
			}
			requireNoLocks(t, pool)
			requireFree(t, pool, key)
			var exists bool
			if err := pool.QueryRow(testCtx(t), "SELECT to_regclass('undone') IS NOT NULL").Scan(&exists); err != nil || exists {
				t.Fatalf("fn's write survived (exists %v, %v), want it rolled back", exists, err)
			}
			if n := pool.Stat().AcquiredConns(); n != 0 {
				t.Fatalf("%d connections still acquired", n)
			}
		})
		t.Run(name+"/nested", func(t *testing.T) {
			outer, err := pool.Begin(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			// Before the pool's cleanup, which waits for the connection.
			t.Cleanup(func() { _ = outer.Rollback(context.Background()) })
			if _, err := outer.Exec(testCtx(t), "CREATE TABLE kept (x int)"); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			err = run(ctx, outer, key, advisory.Exclusive, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "CREATE TABLE undone (x int)"); err != nil {
					return err
				}
				cancel()
				_, err := tx.Exec(ctx, "SELECT 1")
				return err
			})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%s in a tx with ctx cancelled in fn = %v, want context.Canceled", name, err)
			}
			var ok bool
			if err := outer.QueryRow(testCtx(t), "SELECT to_regclass('kept') IS NOT NULL AND to_regclass('undone') IS NULL").Scan(&ok); err != nil || !ok {
				t.Fatalf("outer transaction after fn's cancelled statement: ok %v, %v; want usable with only its own write", ok, err)
			}
			requireLocked(t, pool, key)
			if err := outer.Rollback(testCtx(t)); err != nil {
				t.Fatal(err)
			}
			requireFree(t, pool, key)
			requireNoLocks(t, pool)
		})
	}
}

// TestXactStatementCancelledInFn: the caller's context is cancelled while
// fn's statement runs on the server. Xact and TryXact return an error
// matching context.Canceled (pgx cancels the statement and closes the
// connection), fn's earlier write is not committed, the lock is freed and
// no connection stays out of the pool.
func TestXactStatementCancelledInFn(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	key := advisory.MustName("cancel-in-statement")
	for name, run := range xactRunners {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			err := run(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "CREATE TABLE undone (x int)"); err != nil {
					return err
				}
				pid := tx.Conn().PgConn().PID()
				go func() {
					defer cancel()
					waitSleeping(t, pool, pid)
				}()
				_, err := tx.Exec(ctx, "SELECT pg_sleep(60)")
				return err
			})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%s with ctx cancelled during fn's statement = %v, want context.Canceled", name, err)
			}
			// pgx closes the connection in the background (it sends a
			// cancel request and Terminate first), and the pool counts it
			// acquired until then; the server ends its backend on its own.
			waitNoneAcquired(t, pool)
			waitLocks(t, pool, "no locks once fn's backend is gone", func(l []advisory.LockInfo) bool { return len(l) == 0 })
			requireFree(t, pool, key)
			var exists bool
			if err := pool.QueryRow(testCtx(t), "SELECT to_regclass('undone') IS NOT NULL").Scan(&exists); err != nil || exists {
				t.Fatalf("fn's write was committed (exists %v, %v)", exists, err)
			}
		})
	}
}

// waitNoneAcquired polls until no connection of pool is acquired, or fails
// after 20s (pgx's close of a broken connection, which the pool waits for
// before it forgets it, sends no signal).
func waitNoneAcquired(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for pool.Stat().AcquiredConns() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still acquired after 20s", pool.Stat().AcquiredConns())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitSleeping returns once backend pid runs pg_sleep (fn's statement is on
// the server; no client-side signal exists for that), or after 10s.
func waitSleeping(t *testing.T, pool *pgxpool.Pool, pid uint32) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var sleeping bool
		err := pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep')",
			int32(pid)).Scan(&sleeping)
		if err != nil {
			t.Errorf("pg_stat_activity: %v", err)
			return
		}
		if sleeping {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Errorf("backend %d never ran pg_sleep", pid)
}

// TestSessionReleaseRacesTermination: a session lock's backend is
// terminated (pg_terminate_backend) while Release runs, at varying offsets.
// Release returns nil (it unlocked first), an error matching
// pgfence.ErrLost (the pinger or the unlock saw the loss), or a database
// failure without Kind (the unlock statement failed), never anything else;
// it is final either way, as documented: when it returns, Done is closed,
// the connection is back in the pool or closed, and a second Release
// returns ErrReleased. Afterwards no advisory lock remains.
func TestSessionReleaseRacesTermination(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	admin := pgtest.PoolFor(t, dsn)
	ctx := testCtx(t)
	outcomes := map[string]int{}
	for i := range 20 {
		key := advisory.Pair(int32(i), -1)
		l, err := advisory.Acquire(ctx, pool, key, advisory.Shared, &advisory.SessionConfig{PingInterval: advisory.MinPingInterval})
		if err != nil {
			t.Fatalf("round %d: Acquire: %v", i, err)
		}
		// Before the pool's cleanup, which waits for the lock's connection.
		t.Cleanup(func() { _ = l.Release(context.Background()) })
		locks := advisoryLocks(t, admin)
		if len(locks) != 1 || locks[0].Key != key || locks[0].Mode != advisory.Shared {
			t.Fatalf("round %d: List = %+v, want the one shared lock on %v", i, locks, key)
		}
		start := make(chan struct{})
		terminated := make(chan error, 1)
		go func() {
			<-start
			_, err := admin.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(l.PID()))
			terminated <- err
		}()
		close(start)
		// Not a synchronisation: spreads Release over the termination's
		// window, from before the signal to after the pinger (every 10ms)
		// saw it.
		time.Sleep(time.Duration(i) * time.Millisecond)
		err = l.Release(ctx)
		var pe *pgfence.Error
		switch {
		case err == nil:
			outcomes["released"]++
		case errors.Is(err, pgfence.ErrLost):
			outcomes["lost"]++
		case errors.As(err, &pe) && pe.Kind == nil && pe.Err != nil:
			outcomes["unlock failed"]++
		default:
			t.Fatalf("round %d: Release = %v, want nil, ErrLost or a database failure", i, err)
		}
		select {
		case <-l.Done():
		default:
			t.Fatalf("round %d: Done not closed when Release (%v) returned", i, err)
		}
		// The connection is back, or closed: pgx closes a broken one in
		// the background, and the pool counts it until then.
		waitNoneAcquired(t, pool)
		if err := l.Release(ctx); !errors.Is(err, pgfence.ErrReleased) {
			t.Fatalf("round %d: second Release = %v, want ErrReleased", i, err)
		}
		if err := <-terminated; err != nil {
			t.Fatalf("round %d: pg_terminate_backend: %v", i, err)
		}
		// The server frees a terminated backend's locks on its own.
		waitLocks(t, admin, "no locks after Release", func(l []advisory.LockInfo) bool { return len(l) == 0 })
		// A connection the unlock gave back may be the one terminated since:
		// start the next round on fresh ones.
		pool.Reset()
	}
	t.Logf("Release outcomes: %v", outcomes)
}
