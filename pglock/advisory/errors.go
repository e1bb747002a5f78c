package advisory

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// Sentinel errors. Every error the package returns is one of them, a
// structured error that matches one with [errors.Is] ([*KeyError],
// [*LockedError], [*PoolerError], [*LostError]), or a [*DBError] for a
// database or connection failure.
var (
	// ErrEmptyName is returned for a key name of zero length.
	ErrEmptyName = errors.New("advisory: empty lock name")
	// ErrNameTooLong is returned for a key name longer than 512 bytes.
	ErrNameTooLong = errors.New("advisory: lock name too long")
	// ErrInvalidName is returned for a key name that is not valid UTF-8 or
	// contains a NUL byte (PostgreSQL text cannot hold either, so the name could
	// not be hashed the same way in SQL).
	ErrInvalidName = errors.New("advisory: lock name is not valid UTF-8 text")
	// ErrZeroKey is returned when a [Key] was not made by one of the key
	// constructors (its zero value).
	ErrZeroKey = errors.New("advisory: zero Key (use Name, Namespaced, Int64 or Pair)")
	// ErrInvalidMode is returned for a [Mode] other than [Exclusive] or [Shared].
	ErrInvalidMode = errors.New("advisory: invalid lock mode")
	// ErrNilDB is returned when the pool, connection or transaction starter
	// passed in is nil.
	ErrNilDB = errors.New("advisory: nil database handle")
	// ErrNilFunc is returned by [Xact] and [TryXact] when fn is nil.
	ErrNilFunc = errors.New("advisory: nil function")
	// ErrInvalidConfig is returned for a [SessionConfig] field out of range.
	ErrInvalidConfig = errors.New("advisory: invalid session config")
	// ErrLocked is returned by the Try variants when another session holds a
	// conflicting lock on the key. Nothing was locked and nothing ran.
	ErrLocked = errors.New("advisory: lock is held by another session")
	// ErrPooler is returned by [Acquire] and [TryAcquire] when the connection
	// does not lead to one dedicated PostgreSQL backend (a transaction- or
	// statement-mode pooler such as PgBouncer sits in between). Session locks
	// cannot work there; use [Xact].
	ErrPooler = errors.New("advisory: connection goes through a pooler; session advisory locks need a dedicated backend")
	// ErrLost is matched by the error of a [SessionLock] whose connection died
	// or changed backend while the lock was thought held.
	ErrLost = errors.New("advisory: session lock lost")
	// ErrReleased is returned when a [SessionLock] is used after Release.
	ErrReleased = errors.New("advisory: session lock already unlocked")
	// ErrReleaseFailed is returned by [SessionLock.Release] when PostgreSQL did
	// not confirm the unlock. The connection was destroyed, which releases
	// every session lock it held.
	ErrReleaseFailed = errors.New("advisory: unlock failed")
)

// KeyError reports a key name that cannot be turned into a [Key].
type KeyError struct {
	Name string // the name as given (truncated to 64 bytes in Error)
	Err  error  // ErrEmptyName, ErrNameTooLong or ErrInvalidName
}

func (e *KeyError) Error() string {
	n := e.Name
	if len(n) > 64 {
		n = n[:64] + "..."
	}
	return fmt.Sprintf("%v: %q (%d bytes)", e.Err, n, len(e.Name))
}

// Unwrap returns the sentinel.
func (e *KeyError) Unwrap() error { return e.Err }

// LockedError reports that a Try variant found the key locked by another
// session. It matches [ErrLocked].
//
// A blocking call that gives up because of the session's lock_timeout
// (SQLSTATE 55P03) reports a LockedError too, with the server's error as
// Cause.
type LockedError struct {
	Key   Key
	Mode  Mode
	Cause error // nil for a Try variant's refusal
}

func (e *LockedError) Error() string {
	if e.Cause != nil {
		return fmt.Sprintf("%v: key %v (%v): %v", ErrLocked, e.Key, e.Mode, e.Cause)
	}
	return fmt.Sprintf("%v: key %v (%v)", ErrLocked, e.Key, e.Mode)
}

// Is reports whether target is [ErrLocked].
func (e *LockedError) Is(target error) bool { return target == ErrLocked }

// Unwrap returns the cause, if any.
func (e *LockedError) Unwrap() error { return e.Cause }

// lockErr translates the error of a blocking lock statement: lock_timeout
// becomes a *LockedError, anything else a *DBError.
func lockErr(ctx context.Context, op string, key Key, mode Mode, err error) error {
	if pgerr.Code(err) == pgerr.LockNotAvailable {
		return &LockedError{Key: key, Mode: mode, Cause: err}
	}
	return &DBError{Op: op, Key: key, Err: ctxErr(ctx, err)}
}

// PoolerError reports why a connection was judged not to lead to one dedicated
// backend. It matches [ErrPooler].
type PoolerError struct {
	// StartupPID is the process ID the server announced when the connection
	// was opened (BackendKeyData). A pooler announces its own value.
	StartupPID uint32
	// BackendPIDs are the values pg_backend_pid() returned, in order.
	BackendPIDs []uint32
	// Reason says which check failed.
	Reason string
}

func (e *PoolerError) Error() string {
	return fmt.Sprintf("%v (%s; startup pid %d, pg_backend_pid %v): use advisory.Xact (transaction-scoped locks work through "+
		"PgBouncer in transaction mode), connect directly to PostgreSQL, or, for a pooler in session mode only, set SessionConfig.AllowPooler",
		ErrPooler, e.Reason, e.StartupPID, e.BackendPIDs)
}

// Is reports whether target is [ErrPooler].
func (e *PoolerError) Is(target error) bool { return target == ErrPooler }

// LostError reports that a session lock's connection failed or changed
// backend. It matches [ErrLost] and unwraps to the cause.
type LostError struct {
	Key   Key
	PID   uint32 // backend that held the lock
	Cause error
}

func (e *LostError) Error() string {
	return fmt.Sprintf("%v: key %v on backend %d: %v", ErrLost, e.Key, e.PID, e.Cause)
}

// Is reports whether target is [ErrLost].
func (e *LostError) Is(target error) bool { return target == ErrLost }

// Unwrap returns the cause.
func (e *LostError) Unwrap() error { return e.Cause }

// DBError is a database or connection error of one of this package's calls,
// with the operation that failed and the key (zero for [List]). Unwrap
// returns the cause: the pgx or PostgreSQL error, or the context's error.
type DBError struct {
	Op  string
	Key Key
	Err error
}

func (e *DBError) Error() string {
	if e.Key.IsZero() {
		return fmt.Sprintf("advisory: %s: %v", e.Op, e.Err)
	}
	return fmt.Sprintf("advisory: %s key %v: %v", e.Op, e.Key, e.Err)
}

// Unwrap returns the cause.
func (e *DBError) Unwrap() error { return e.Err }

// Transient reports whether the same call may succeed when made again
// (connection failures, server shutting down, serialization failures).
func (e *DBError) Transient() bool { return pgerr.IsTransient(e.Err) }
