package advisory

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/nilcheck"
)

// Beginner starts a transaction. *pgxpool.Pool and *pgx.Conn satisfy it; so
// does pgx.Tx, in which case the helpers run in a savepoint and the lock is
// held until the outer transaction ends (see [Xact]).
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// rollbackTimeout bounds the rollback made after an error or a panic, which
// runs even when the caller's context has ended.
const rollbackTimeout = 10 * time.Second

// Xact runs fn in a new transaction that holds the transaction-scoped
// advisory lock on key in mode (pg_advisory_xact_lock or
// pg_advisory_xact_lock_shared), waiting for the lock as long as ctx allows.
// When fn returns nil the transaction commits; when fn returns an error or
// panics it rolls back (and the panic is re-raised). PostgreSQL releases the
// lock when the transaction ends, in every case.
//
// Only writes made through tx are protected: the lock and they commit or
// vanish together, and no fencing token is needed. Writes made elsewhere need
// a lease with fenced writes (package pglock). Xact works through poolers in
// transaction mode. Keep the transaction short: it holds a connection.
//
// If ctx ends while Xact waits for the lock, pgx closes the connection:
// nothing is held, fn is not called, and the error matches ctx.Err(). fn
// should use the caller's ctx for its statements. When db is a pgx.Tx, fn
// runs in a savepoint and the lock lasts until the outer transaction ends.
//
// The error is fn's own error (unchanged, so errors.Is works on it), or an
// error from beginning, locking or committing.
func Xact(ctx context.Context, db Beginner, key Key, mode Mode, fn func(tx pgx.Tx) error) error {
	return runXact(ctx, "advisory.Xact", db, key, mode, false, fn)
}

// TryXact is like [Xact] but does not wait: when another session holds a
// conflicting lock on key it rolls back at once and returns an error matching
// [pgfence.ErrLocked] without calling fn. It uses
// pg_try_advisory_xact_lock or pg_try_advisory_xact_lock_shared.
func TryXact(ctx context.Context, db Beginner, key Key, mode Mode, fn func(tx pgx.Tx) error) error {
	return runXact(ctx, "advisory.TryXact", db, key, mode, true, fn)
}

func runXact(ctx context.Context, op string, db Beginner, key Key, mode Mode, try bool, fn func(pgx.Tx) error) (err error) {
	if nilcheck.IsNil(db) {
		return invalid(op, "db", "nil database handle")
	}
	if fn == nil {
		return invalid(op, "fn", "nil function")
	}
	if err := key.valid(op); err != nil {
		return err
	}
	if err := mode.valid(op); err != nil {
		return err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return dbError(op, "begin transaction", key, ctxErr(ctx, err))
	}
	done := false
	defer func() {
		if done {
			return
		}
		// Error or panic: roll back on a context that survives the caller's.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		rbErr := tx.Rollback(rctx)
		cancel()
		if p := recover(); p != nil {
			panic(p)
		}
		if rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			err = errors.Join(err, dbError(op, "roll back", key, rbErr))
		}
	}()

	if try {
		err = tryLockTx(ctx, op, tx, key, mode)
	} else {
		err = lockTx(ctx, op, tx, key, mode)
	}
	if err != nil {
		return err
	}

	if err := fn(tx); err != nil {
		return err
	}
	done = true
	if err := tx.Commit(ctx); err != nil {
		return dbError(op, "commit", key, ctxErr(ctx, err))
	}
	return nil
}

// LockTx takes the transaction-scoped advisory lock on key in mode inside a
// transaction the caller already has, waiting as long as ctx allows. The lock
// is released when tx ends; there is no unlock. As with [Xact], only writes
// made through tx are protected.
//
// If ctx ends while waiting, pgx cancels the wait and closes the connection,
// so tx is unusable afterwards; the error matches ctx.Err(). If the session's
// lock_timeout ends the wait, the error matches [pgfence.ErrLocked] and tx is aborted
// (roll it back).
func LockTx(ctx context.Context, tx pgx.Tx, key Key, mode Mode) error {
	if err := checkTx("advisory.LockTx", tx, key, mode); err != nil {
		return err
	}
	return lockTx(ctx, "advisory.LockTx", tx, key, mode)
}

func lockTx(ctx context.Context, op string, tx pgx.Tx, key Key, mode Mode) error {
	sql, args := xactLockSQL(key, mode)
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		return lockErr(ctx, op, key, mode, err)
	}
	return nil
}

// TryLockTx is like [LockTx] but does not wait: when another session holds a
// conflicting lock it returns an error matching [pgfence.ErrLocked] and tx
// is unchanged and still usable.
func TryLockTx(ctx context.Context, tx pgx.Tx, key Key, mode Mode) error {
	if err := checkTx("advisory.TryLockTx", tx, key, mode); err != nil {
		return err
	}
	return tryLockTx(ctx, "advisory.TryLockTx", tx, key, mode)
}

func tryLockTx(ctx context.Context, op string, tx pgx.Tx, key Key, mode Mode) error {
	sql, args := xactTryLockSQL(key, mode)
	var ok bool
	if err := tx.QueryRow(ctx, sql, args...).Scan(&ok); err != nil {
		return dbError(op, "try lock", key, ctxErr(ctx, err))
	}
	if !ok {
		return lockedError(op, key, mode, nil)
	}
	return nil
}

func checkTx(op string, tx pgx.Tx, key Key, mode Mode) error {
	if nilcheck.IsNil(tx) {
		return invalid(op, "tx", "nil transaction")
	}
	if err := key.valid(op); err != nil {
		return err
	}
	return mode.valid(op)
}
