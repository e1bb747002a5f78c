package pglock

import (
	"context"
	"fmt"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// The errors of this package are [*pgfence.Error]s; the helpers below build
// them. Op names the exported call ("pglock.Acquire", "pglock.Renew", ...).

// errDeadline is the cause of a lease that ended at its local deadline; it
// wraps context.DeadlineExceeded.
var errDeadline = fmt.Errorf("the local lease deadline passed: %w", context.DeadlineExceeded)

// refusedReason is the Reason of a lease the database refused to renew or
// release.
const refusedReason = "expired, released or granted to another holder"

// invalid is rejected input (pgfence.ErrInvalid): arg names the argument,
// the rest says what is wrong with it. Nothing was sent to the database.
func invalid(op, arg, format string, args ...any) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: arg + ": " + fmt.Sprintf(format, args...)}
}

// dbError is a database or connection failure of op on lock name, or a
// refusal with one of pgfence's SQLSTATEs, whose kind comes from the one
// table of them (PF011, a bad argument, is pgfence.ErrInvalid; PFHA1, the
// epoch gate, has no kind and is retryable).
func dbError(op, name string, err error) *pgfence.Error {
	e := &pgfence.Error{Op: op, Name: name, Err: err}
	if c, ok := pgerr.Classify(err); ok {
		e.Kind, e.Reason = c.Kind, c.Meaning
	}
	return e
}

// lostError says the lease (name, holder, token) is not held any more
// (pgfence.ErrLost). cause is errDeadline when the local deadline passed,
// the last connection error when renewals kept failing, nil when the
// database refused.
func lostError(op, name, holder string, token int64, cause error) *pgfence.Error {
	e := &pgfence.Error{Op: op, Kind: pgfence.ErrLost, Name: name, Holder: holder, Token: token, Err: cause}
	if cause == nil {
		e.Reason = refusedReason
	}
	return e
}

// closedError is a call on a closed Locker (pgfence.ErrClosed).
func closedError(op, name string) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrClosed, Name: name}
}

// slowGrantError is a grant (or adoption) of token answered took after it
// was sent, not within its TTL (pgfence.ErrSlowGrant); then says what
// became of the grant.
func slowGrantError(op, name string, token int64, took, ttl time.Duration, then string) *pgfence.Error {
	return slowLeaseError(op, name, token, took, ttl, ttl, then)
}

// slowLeaseError is slowGrantError for a lease that had left of its TTL
// when its statement was sent (less than ttl: a lease a release handed to
// the wait before the statement ran).
func slowLeaseError(op, name string, token int64, took, left, ttl time.Duration, then string) *pgfence.Error {
	within := fmt.Sprintf("not within its TTL %v", ttl)
	if left < ttl {
		within = fmt.Sprintf("not within the %v left of the lease a release had handed to the wait (TTL %v)",
			max(left, 0).Round(time.Millisecond), ttl)
	}
	return &pgfence.Error{Op: op, Kind: pgfence.ErrSlowGrant, Name: name, Token: token,
		Reason: fmt.Sprintf("answered %v after it was sent, %s; %s, retry or use a longer TTL",
			took.Round(time.Millisecond), within, then)}
}
