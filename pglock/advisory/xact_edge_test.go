package advisory_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// TestXactNestedContextEndedKeepsNoWrites: in a caller's transaction, an Xact
// whose context ends after fn's last statement (fn returns nil) reports an
// error, and fn's writes are rolled back with its savepoint. pgx refused the
// RELEASE SAVEPOINT without sending it and marked the savepoint closed: it
// stayed open, with fn's writes, and the caller, told of an error, committed
// them with its transaction.
func TestXactNestedContextEndedKeepsNoWrites(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	bg := testCtx(t)
	if _, err := pool.Exec(bg, "CREATE TABLE payouts (id int)"); err != nil {
		t.Fatal(err)
	}
	outer, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Rollback(bg)
	ctx, cancel := context.WithCancelCause(bg)
	errShutdown := errors.New("shutting down")
	err = advisory.Xact(ctx, outer, advisory.Int64(7), advisory.Exclusive, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO payouts VALUES (1)"); err != nil {
			return err
		}
		cancel(errShutdown) // the context ends right after fn's last statement
		return nil
	})
	if !errors.Is(err, context.Canceled) || !errors.Is(err, errShutdown) {
		t.Fatalf("Xact = %v; want an error matching context.Canceled and the context's cause", err)
	}
	// The outer transaction goes on, without fn's write.
	if _, err := outer.Exec(bg, "INSERT INTO payouts VALUES (2)"); err != nil {
		t.Fatalf("the outer transaction after the Xact: %v", err)
	}
	if err := outer.Commit(bg); err != nil {
		t.Fatalf("outer commit: %v", err)
	}
	var ids []int
	rows, _ := pool.Query(bg, "SELECT id FROM payouts ORDER BY id")
	ids, err = pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil || len(ids) != 1 || ids[0] != 2 {
		t.Fatalf("payouts after the outer commit: %v, %v; want [2] (fn's write rolled back)", ids, err)
	}
}

// TestXactFnErrorUnchangedWhenRollbackFails: fn's error comes back as it is
// (err == errMine) also when the rollback after it fails because fn's
// connection is gone; it came back joined with the rollback's error.
func TestXactFnErrorUnchangedWhenRollbackFails(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	errMine := errors.New("mine")
	err := advisory.Xact(ctx, pool, advisory.Int64(8), advisory.Exclusive, func(tx pgx.Tx) error {
		_, _ = tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
		return errMine
	})
	if err != errMine { //nolint:errorlint // unchanged is the contract
		t.Fatalf("Xact = %T %v; want fn's error unchanged", err, err)
	}
}

// TestSessionReleaseNilContext: Release(nil) releases the lock, as Release
// does whatever its context says, and a second Release says it is released.
// It panicked after marking the lock released and stopping its pinger: a
// recovered panic left the key locked and the connection out of the pool
// for the life of the process.
func TestSessionReleaseNilContext(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t)
	key := advisory.Int64(9)
	l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatal(err)
	}
	var nilCtx context.Context
	if err := l.Release(nilCtx); err != nil {
		t.Fatalf("Release(nil) = %v; want nil (released)", err)
	}
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrReleased) {
		t.Fatalf("Release(ctx) after Release(nil) = %v; want ErrReleased", err)
	}
	select {
	case <-l.Done():
	default:
		t.Error("Done is not closed after Release")
	}
	if err := advisory.TryXact(ctx, pool, key, advisory.Exclusive, func(pgx.Tx) error { return nil }); err != nil {
		t.Errorf("TryXact of the released key = %v", err)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired after Release", n)
	}
}
