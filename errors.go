// Package pgfence holds what pgfence's packages share: the one vocabulary of
// errors every package returns, the one retry predicate, and the database
// handle they take.
//
// Every error a pgfence package returns for a refused or invalid operation
// is a [*Error] whose Kind is one of the sentinels below; ask with
// errors.Is, whatever the package:
//
//	if errors.Is(err, pgfence.ErrStaleToken) { ... } // a newer grant wrote first
//	if errors.Is(err, pgfence.ErrLost) { ... }       // the lease or claim is not yours any more
//
// A database or connection failure is a [*Error] with no Kind whose cause
// (Err) is the driver's error, so errors.As finds a *pgconn.PgError, and
// errors.Is a context's error; [IsRetryable] says whether running the
// operation again may help.
//
// The packages: pglock (leases and fencing tokens), pglock/advisory
// (advisory locks), fencedwrite (fenced writes and the guard), skiplocked
// (job claims), outbox (intents delivered under a lease), observe (metrics),
// migrations (the schema).
package pgfence

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// The kinds of error. Each names one idea, in every package.
var (
	// ErrInvalid: an argument or setting is out of range (an empty or
	// oversized name, a TTL outside its bounds, a token <= 0, a nil
	// handle, an unknown table or column). Nothing was changed (one
	// exception, which its message states: a fencedwrite Table.Read whose
	// dest cannot hold a column, found once the row is read); the message
	// says which argument and why.
	ErrInvalid = pgerr.ErrInvalid // "invalid argument"
	// ErrLocked: the lock or lease is held by another holder right now.
	ErrLocked = pgerr.ErrLocked // "held by another holder"
	// ErrLost: a lease or claim is not held any more by this holder, token
	// and key (it expired, was released, or was granted to another), so a
	// renewal, release, completion or enqueue under it was refused; or it
	// ended locally at its deadline.
	ErrLost = pgerr.ErrLost // "not held any more"
	// ErrReleased: the lease was released by its holder.
	ErrReleased = pgerr.ErrReleased // "released"
	// ErrClosed: the Locker, Worker or Dispatcher was closed or is shutting
	// down.
	ErrClosed = pgerr.ErrClosed // "closed"
	// ErrStaleToken: a write (or read, or enqueue) carried a token older
	// than one the row or lock has already seen: a newer grant came first.
	ErrStaleToken = pgerr.ErrStaleToken // "stale token: a newer grant came first"
	// ErrAlreadyApplied: in strict mode, this token already wrote the row.
	ErrAlreadyApplied = pgerr.ErrAlreadyApplied // "already applied by this token"
	// ErrNotFound: no such row, job, lock or leader.
	ErrNotFound = pgerr.ErrNotFound // "not found"
	// ErrTokenExhausted: the next token would pass 9223372036854775807;
	// nothing changed. Use a new lock name (and fence columns).
	ErrTokenExhausted = pgerr.ErrTokenExhausted // "tokens exhausted"
	// ErrSlowGrant: a grant's answer arrived only after its TTL had passed
	// since it was sent (for a lease handed to a waiter: after what was
	// left of it), so it was not used: it was given back, unless the
	// error's Reason says otherwise. Retrying is safe.
	ErrSlowGrant = pgerr.ErrSlowGrant // "grant arrived after its lease ended"
	// ErrGuard: the guard of a fenced table refused an unfenced change.
	ErrGuard = pgerr.ErrGuard // "refused by the fence guard"
	// ErrNoSchema: the database has no pgfence schema, or an older one:
	// migrate as the schema owner ("pgfence migrate up").
	ErrNoSchema = pgerr.ErrNoSchema
)

// Error is the error of every pgfence operation that failed. Kind is one of
// the sentinels above (nil for a database or connection failure), matched
// by errors.Is; Err is the cause, if any (the driver's error, a context's
// error), matched by errors.Is and errors.As. The other fields say what the operation was
// about, where known.
type Error struct {
	Op        string    // the operation: "pglock.Acquire", "skiplocked.Complete", ...
	Kind      error     // ErrInvalid, ErrLocked, ErrLost, ...; nil for a database failure
	Name      string    // the lock name, queue, table or topic, if any
	Holder    string    // the holder the database named (ErrLocked), or whose lease was lost
	Token     int64     // the token refused or involved, 0 if none
	ExpiresAt time.Time // ErrLocked: the holder's expiry on the database clock, zero if unknown
	Reason    string    // what was wrong, in words (ErrInvalid and others)
	Err       error     // the cause, or nil
}

// Error says the operation, what it was about, the kind, the reason and the
// cause, in that order, leaving out what is empty.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.Op)
	if e.Name != "" {
		b.WriteString(" " + strconv.Quote(e.Name))
	}
	if e.Kind != nil {
		b.WriteString(": " + e.Kind.Error())
	}
	if e.Holder != "" {
		b.WriteString(" (holder " + strconv.Quote(e.Holder))
		if !e.ExpiresAt.IsZero() {
			b.WriteString(" until " + e.ExpiresAt.UTC().Format(time.RFC3339Nano))
		}
		b.WriteString(")")
	}
	if e.Token != 0 {
		b.WriteString(" token " + strconv.FormatInt(e.Token, 10))
	}
	if e.Reason != "" {
		b.WriteString(": " + e.Reason)
	}
	if e.Err != nil {
		b.WriteString(": " + pgerr.Describe(e.Err))
	}
	return b.String()
}

// Is reports whether target is e's kind. A database failure that says the
// schema is missing is [ErrNoSchema]. (errors.Is then looks at the cause.)
func (e *Error) Is(target error) bool {
	if e.Kind != nil {
		return target == e.Kind
	}
	return target == ErrNoSchema && pgerr.SchemaMissing(e.Err)
}

// Unwrap returns the cause, so errors.Is and errors.As see it (a
// *pgconn.PgError, a context's error). It allocates nothing: errors.Is on
// the hot paths is free.
func (e *Error) Unwrap() error { return e.Err }

// IsRetryable reports whether running the operation (its whole transaction)
// again may succeed: the connection was lost, the server rolled the
// transaction back (serialization failure, deadlock), the server is
// shutting down, or a grant came too late ([ErrSlowGrant]). It is false for
// nil, a context's end, and every refusal (a stale token, a lost lease, bad
// input), which the same call would meet again. Whether the lost call took
// effect is unknown: retry only what is safe to repeat (every pgfence
// operation is conditional on its token and key).
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if errors.Is(err, ErrSlowGrant) {
		return true
	}
	for _, k := range pgerr.Kinds {
		if errors.Is(err, k) {
			return false
		}
	}
	return pgerr.IsRetryable(err)
}

// DBTX is what pgfence's functions run their statements on: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. Pass a transaction to make the
// operation part of it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}
