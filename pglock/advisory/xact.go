package advisory

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/nilcheck"
)

// Beginner starts a transaction. *pgxpool.Pool and *pgx.Conn satisfy it; so
// does pgx.Tx, in which case fn runs in a savepoint and the lock is taken in
// the outer transaction and held until it ends (see [Xact]).
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
// should use the caller's ctx for its statements.
//
// When db is a pgx.Tx, the lock is taken in that outer transaction and lasts
// until it ends, whatever fn returns; fn runs in a savepoint, which is
// released when fn returns nil and rolled back (undoing only fn's writes)
// when fn returns an error or panics, or when ctx has ended by the time fn
// returns nil (the error then matches ctx.Err(): fn's writes are not in the
// outer transaction). Once begun, a savepoint's release is bounded by 10
// seconds rather than by ctx, so that ctx ending cannot leave it half done.
// The wait for the lock runs in a
// savepoint of its own: if it fails (lock_timeout, for example) nothing is
// held and the outer transaction stays usable. Holding the lock past fn is
// what keeps fn's writes protected until they commit with the outer
// transaction.
//
// The error is fn's own error (unchanged, so errors.Is works on it), or an
// error from beginning, locking or committing. fn must not commit or roll
// back tx itself: the lock would end there, and Xact's own commit then fails
// with pgx.ErrTxClosed although fn's work committed (do not retry on it).
func Xact(ctx context.Context, db Beginner, key Key, mode Mode, fn func(tx pgx.Tx) error) error {
	return runXact(ctx, "advisory.Xact", db, key, mode, false, fn)
}

// TryXact is like [Xact] but does not wait: when another session holds a
// conflicting lock on key it rolls back at once and returns an error matching
// [pgfence.ErrLocked] without calling fn. It uses
// pg_try_advisory_xact_lock or pg_try_advisory_xact_lock_shared. When db is
// a pgx.Tx, the try runs in the outer transaction, which a refusal leaves
// unchanged and usable; a lock taken lasts until the outer transaction ends.
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
	// In a caller's transaction, lock in that transaction before the
	// savepoint of fn: rolling back a savepoint frees the locks taken in it.
	outer, nested := db.(pgx.Tx)
	if nested {
		if err := lockOuter(ctx, op, outer, key, mode, try); err != nil {
			return err
		}
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return dbError(op, "begin transaction", key, ctxErr(ctx, err))
	}
	done, fnFailed := false, false
	defer func() {
		if done {
			return
		}
		// Error or panic: roll back on a context that survives the caller's.
		rbErr := rollback(ctx, tx)
		if p := recover(); p != nil {
			panic(p)
		}
		// fn's own error is returned unchanged (a failed rollback means a
		// broken connection, which pgx has closed: nothing commits).
		if rbErr != nil && !fnFailed {
			err = errors.Join(err, dbError(op, "roll back", key, rbErr))
		}
	}()

	if !nested {
		if try {
			err = tryLockTx(ctx, op, tx, key, mode)
		} else {
			err = lockTx(ctx, op, tx, key, mode)
		}
		if err != nil {
			return err
		}
	}

	if err := fn(tx); err != nil {
		fnFailed = true
		return err
	}
	if nested {
		return releaseSavepoint(ctx, op, tx, key, &done)
	}
	done = true
	if err := tx.Commit(ctx); err != nil {
		return dbError(op, "commit", key, ctxErr(ctx, err))
	}
	return nil
}

// releaseSavepoint releases sp, a savepoint of a caller's transaction, so
// that what ran in it stays in that transaction; it sets *done when the
// savepoint is no longer to be rolled back. A release pgx refuses without
// sending it (ctx already ended) marks sp closed and leaves it open, with
// its writes, in a transaction that goes on: the caller, told of an error,
// would then commit them. So when ctx has ended, sp is rolled back (the
// caller's deferred rollback: *done stays false) and the error says so; else
// it is released on a context that survives ctx: one ending during the
// release can no longer leave it half done (an error then comes from a
// broken connection or an aborted transaction, which the caller cannot
// commit).
func releaseSavepoint(ctx context.Context, op string, sp pgx.Tx, key Key, done *bool) error {
	if ctx.Err() != nil {
		return dbError(op, "release savepoint (rolled back: the context ended)", key, ctxErr(ctx, context.Cause(ctx)))
	}
	*done = true
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	if err := sp.Commit(rctx); err != nil {
		return dbError(op, "release savepoint", key, err)
	}
	return nil
}

// lockOuter takes the lock in outer, a caller's transaction, so that it lasts
// until outer ends. A try needs no savepoint: a refusal is a result, not an
// error. A wait runs in a savepoint released once the lock is granted (its
// locks pass to outer), so that a wait ended by lock_timeout leaves outer
// usable.
func lockOuter(ctx context.Context, op string, outer pgx.Tx, key Key, mode Mode, try bool) error {
	if try {
		return tryLockTx(ctx, op, outer, key, mode)
	}
	sp, err := outer.Begin(ctx)
	if err != nil {
		return dbError(op, "begin savepoint", key, ctxErr(ctx, err))
	}
	if err := lockTx(ctx, op, sp, key, mode); err != nil {
		if rbErr := rollback(ctx, sp); rbErr != nil {
			err = errors.Join(err, dbError(op, "roll back", key, rbErr))
		}
		return err
	}
	done := false
	err = releaseSavepoint(ctx, op, sp, key, &done)
	if !done {
		if rbErr := rollback(ctx, sp); rbErr != nil {
			err = errors.Join(err, dbError(op, "roll back", key, rbErr))
		}
	}
	return err
}

// rollback rolls tx back on a context that survives the caller's, bounded by
// rollbackTimeout. A transaction already closed is not an error.
func rollback(ctx context.Context, tx pgx.Tx) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	if err := tx.Rollback(rctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

// LockTx takes the transaction-scoped advisory lock on key in mode inside a
// transaction the caller already has, waiting as long as ctx allows. The lock
// is released when tx ends; there is no unlock. When tx is a savepoint (a
// pgx.Tx begun from another), rolling it back frees the lock and committing
// it passes the lock to the enclosing transaction. As with [Xact], only
// writes made through tx are protected.
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
