package pglock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// Sentinel errors. Test for them with errors.Is; the structured errors
// [*LockedError], [*LeaseLostError] and [*InvalidError] match them.
var (
	// ErrLocked: the lock is held by someone (possibly this Locker) right now.
	ErrLocked = errors.New("pglock: lock is held")
	// ErrLeaseLost: the database refused a renewal or release because the
	// lease is no longer held by this (name, holder, token) — it expired, was
	// released or was granted to someone else — or the lease ended locally
	// because its local deadline passed.
	ErrLeaseLost = errors.New("pglock: lease lost")
	// ErrReleased: the lease was released by its holder ([Lease.Err] after a
	// successful [Lease.Release]).
	ErrReleased = errors.New("pglock: lease released")
	// ErrClosed: the Locker was closed.
	ErrClosed = errors.New("pglock: locker closed")
	// ErrInvalidName: a lock name is empty, longer than 512 bytes, not
	// valid UTF-8, contains a NUL byte, or appears twice in one AcquireMany.
	ErrInvalidName = errors.New("pglock: invalid lock name")
	// ErrInvalidTTL: a lease duration is below [MinTTL] or above [MaxTTL].
	ErrInvalidTTL = errors.New("pglock: invalid lease duration")
	// ErrInvalidHolder: a holder identity is empty, longer than
	// 512 bytes, not valid UTF-8 or contains a NUL byte.
	ErrInvalidHolder = errors.New("pglock: invalid holder")
	// ErrInvalidToken: a fencing token is <= 0 (grants start at 1).
	ErrInvalidToken = errors.New("pglock: invalid token")
	// ErrNilDB: a nil pool, connection or transaction was passed.
	ErrNilDB = errors.New("pglock: nil database handle")
	// ErrInvalidConfig: a Config or ElectionConfig field is out of range.
	ErrInvalidConfig = errors.New("pglock: invalid config")
	// ErrTokenOverflow: the lock's token is already 9223372036854775807.
	// Nothing was changed; use a new lock name (and fence columns).
	ErrTokenOverflow = errors.New("pglock: fencing token overflow")
	// ErrNoLeader: [Leader] found nobody holding the election lock.
	ErrNoLeader = errors.New("pglock: no leader")
	// ErrSlowGrant: a grant's answer arrived only after its TTL had passed
	// since the statement was sent, so the lease was over before it could be
	// used. The grant was released; see [SlowGrantError].
	ErrSlowGrant = errors.New("pglock: grant arrived after its lease ended")
)

// SlowGrantError is the cause (inside a transient [*DBError]) of an
// acquisition whose grant was answered only after its TTL had passed since it
// was sent. The token was released again. Retrying is safe; if it keeps
// happening the TTL is too short for the round trips. It matches
// [ErrSlowGrant].
type SlowGrantError struct {
	Token int64         // the token that was granted and given back
	Took  time.Duration // from sending the statement to reading the answer
	TTL   time.Duration // the requested lease duration
}

func (e *SlowGrantError) Error() string {
	return fmt.Sprintf("pglock: the grant of token %d arrived %v after it was sent, not within its TTL %v; it was released, retry or use a longer TTL",
		e.Token, e.Took.Round(time.Millisecond), e.TTL)
}

// Is reports whether target is [ErrSlowGrant].
func (e *SlowGrantError) Is(target error) bool { return target == ErrSlowGrant }

// LockedError is returned by [Locker.TryAcquire] (and by [Locker.Acquire] when
// its context ends while waiting) when someone else holds the lock. Holder and
// ExpiresAt are a snapshot for diagnostics; they may be stale by the time you
// read them. It matches [ErrLocked].
type LockedError struct {
	Name      string
	Holder    string    // "" when the holder could not be read
	ExpiresAt time.Time // database clock; zero when unknown
	// Err is the context error when Acquire gave up waiting, otherwise nil.
	Err error
}

func (e *LockedError) Error() string {
	s := fmt.Sprintf("pglock: lock %q is held", e.Name)
	if e.Holder != "" {
		s += fmt.Sprintf(" by %q until %s (database clock)", e.Holder, e.ExpiresAt.UTC().Format(time.RFC3339Nano))
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is reports whether target is [ErrLocked].
func (e *LockedError) Is(target error) bool { return target == ErrLocked }

// Unwrap returns the context error that ended a wait, if any.
func (e *LockedError) Unwrap() error { return e.Err }

// LeaseLostError says a lease is no longer held by (Name, Holder, Token). It
// matches [ErrLeaseLost]; Unwrap returns the cause when there is one:
// [context.DeadlineExceeded] when the local deadline passed, or the last
// connection error when renewals kept failing until the deadline. A nil cause
// means the database refused the renewal or release.
type LeaseLostError struct {
	Name   string
	Holder string
	Token  int64
	Cause  error
}

func (e *LeaseLostError) Error() string {
	s := fmt.Sprintf("pglock: lease lost: lock %q token %d holder %q", e.Name, e.Token, e.Holder)
	switch {
	case e.Cause == errDeadline:
		s += ": local deadline passed"
	case e.Cause != nil:
		s += ": " + e.Cause.Error()
	default:
		s += ": no longer held by this holder and token (expired, released or granted to someone else)"
	}
	return s
}

// Is reports whether target is [ErrLeaseLost].
func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

// Unwrap returns the cause, if any.
func (e *LeaseLostError) Unwrap() error { return e.Cause }

// errDeadline is the cause of a lease that ended at its local deadline; it
// wraps context.DeadlineExceeded.
var errDeadline = fmt.Errorf("pglock: local lease deadline passed: %w", context.DeadlineExceeded)

// InvalidError describes rejected input. It matches the sentinel in Err
// (ErrInvalidName, ErrInvalidTTL, ...). Nothing was sent to the database.
type InvalidError struct {
	Err    error  // the sentinel
	Reason string // what is wrong
}

func (e *InvalidError) Error() string { return e.Err.Error() + ": " + e.Reason }

// Unwrap returns the sentinel.
func (e *InvalidError) Unwrap() error { return e.Err }

func invalid(sentinel error, format string, args ...any) error {
	return &InvalidError{Err: sentinel, Reason: fmt.Sprintf(format, args...)}
}

// DBError wraps an error from the database or the connection, with the
// operation that failed. Transient reports whether retrying may help
// (connection failures, serialization failures, server shutting down). On a
// database without pgfence's schema, its text says to run
// "pgfence migrate up" as the schema owner.
type DBError struct {
	Op   string // "acquire", "renew", "release", "leader", ...
	Name string
	Err  error
}

func (e *DBError) Error() string {
	return fmt.Sprintf("pglock: %s %q: %s", e.Op, e.Name, pgerr.Describe(e.Err))
}

// Unwrap returns the pgx error.
func (e *DBError) Unwrap() error { return e.Err }

// Transient reports whether the error is a connection problem or another
// condition where the same statement may succeed when retried.
func (e *DBError) Transient() bool { return pgerr.IsTransient(e.Err) }
