package advisory

import (
	"context"
	"fmt"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// The errors of this package are [*pgfence.Error]s; the helpers below build
// them. Op names the exported call ("advisory.TryAcquire", "advisory.Xact",
// ...), Name the key as pg_advisory_lock's arguments ("123", "7,-5").

// invalid is rejected input (pgfence.ErrInvalid): arg names the argument,
// the rest says what is wrong with it. Nothing was sent to the database.
func invalid(op, arg, format string, args ...any) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: arg + ": " + fmt.Sprintf(format, args...)}
}

// keyName is a key as the Name of an error: "" for the zero Key.
func keyName(key Key) string {
	if key.IsZero() {
		return ""
	}
	return key.String()
}

// dbError is a database or connection failure of op on key while doing step
// ("check backend", "commit", ...): no Kind, the driver's error as Err.
func dbError(op, step string, key Key, err error) *pgfence.Error {
	return &pgfence.Error{Op: op, Name: keyName(key), Reason: step, Err: err}
}

// lockedError says another session holds a lock on key conflicting with
// mode (pgfence.ErrLocked). cause is the server's error when lock_timeout
// ended the wait, nil for a Try variant's refusal.
func lockedError(op string, key Key, mode Mode, cause error) *pgfence.Error {
	reason := "another session holds a lock conflicting with " + mode.String()
	if cause != nil {
		reason += " (lock_timeout ended the wait)"
	}
	return &pgfence.Error{Op: op, Kind: pgfence.ErrLocked, Name: keyName(key), Reason: reason, Err: cause}
}

// lockErr translates the error of a blocking lock statement: lock_timeout
// (SQLSTATE 55P03) is pgfence.ErrLocked, anything else a database failure.
func lockErr(ctx context.Context, op string, key Key, mode Mode, err error) error {
	if pgerr.Code(err) == pgerr.LockNotAvailable {
		return lockedError(op, key, mode, err)
	}
	return dbError(op, "lock", key, ctxErr(ctx, err))
}

// poolerError says the connection does not lead to one dedicated backend
// (pgfence.ErrInvalid: the pool given cannot hold a session lock).
func poolerError(op string, key Key, startup uint32, pids []uint32, why string) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: keyName(key), Reason: fmt.Sprintf(
		"pool: a pooler in transaction or statement mode was detected (%s; startup pid %d, pg_backend_pid %v); "+
			"session advisory locks need a dedicated backend: use advisory.Xact (transaction-scoped locks work "+
			"through PgBouncer in transaction mode), connect directly to PostgreSQL, or, for a pooler in session "+
			"mode only, set SessionConfig.AllowPooler", why, startup, pids)}
}

// lostError says a session lock's connection failed or changed backend
// (pgfence.ErrLost); cause says how.
func lostError(key Key, pid uint32, cause error) *pgfence.Error {
	return &pgfence.Error{Op: "advisory.SessionLock", Kind: pgfence.ErrLost, Name: keyName(key),
		Reason: fmt.Sprintf("the connection to backend %d failed its check", pid), Err: cause}
}

// errReleased is the end of every released session lock (SessionLock.Err
// after Release, and a second Release): shared, so a release allocates
// nothing for it.
var errReleased = &pgfence.Error{Op: "advisory.SessionLock.Release", Kind: pgfence.ErrReleased}
