package fencedwrite

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// Why a fenced write changed no row. Exactly one of these is returned when the
// statement ran but the row was not written; the answer comes from the same
// round trip as the write.
var (
	// ErrStaleToken: a newer grant already wrote the row (its fence is higher
	// than the token). The caller lost its lock and must stop. The error is a
	// *[StaleTokenError] carrying both numbers.
	ErrStaleToken = errors.New("fencedwrite: stale token: a newer grant already wrote the row")

	// ErrAlreadyApplied: strict mode only, the row's fence equals the token,
	// so this grant already wrote the row once. A replay of the same write
	// (for example a retry after a timeout) gets this answer; treat it as
	// success if the write is idempotent, or use [Reentrant].
	ErrAlreadyApplied = errors.New("fencedwrite: already applied: this grant already wrote the row")

	// ErrNotFound: no row has the key.
	ErrNotFound = errors.New("fencedwrite: no row with that key")

	// ErrConcurrentChange: the write was refused, but the row changed (or was
	// deleted and re-created) between the statement's snapshot and a second
	// look, so the reason is unknown. The write was not applied; rare, and
	// only under READ COMMITTED with concurrent writers on the same row.
	ErrConcurrentChange = errors.New("fencedwrite: the row changed concurrently; the write was not applied")

	// ErrInvalidToken: the token is zero or negative. Tokens come from
	// pgfence.locks and start at 1. Checked before any SQL runs.
	ErrInvalidToken = errors.New("fencedwrite: invalid token: must be > 0")

	// ErrGuardRejected: the table's pgfence guard trigger refused the UPDATE
	// (SQLSTATE PF001 or PF002). The error is a *[GuardError].
	ErrGuardRejected = errors.New("fencedwrite: rejected by the pgfence guard")
)

// Problems with a table description ([Spec], [GuardOptions], fencegen
// options). They are detected before any write runs.
var (
	// ErrInvalidIdentifier: an empty, oversized (more than 63 bytes) or
	// SQL-looking table or column name. The error is an *[IdentifierError].
	ErrInvalidIdentifier = errors.New("fencedwrite: invalid identifier")

	// ErrUnknownTable: the table does not exist (or is not a table).
	ErrUnknownTable = errors.New("fencedwrite: unknown table")

	// ErrUnknownColumn: a named column does not exist. The error is a
	// *[ColumnError].
	ErrUnknownColumn = errors.New("fencedwrite: unknown column")

	// ErrNoFenceColumn: the table has no fence column, or it is not bigint.
	// The error is a *[ColumnError].
	ErrNoFenceColumn = errors.New("fencedwrite: table has no bigint fence column")

	// ErrKeyNotUnique: the key columns are not exactly the columns of a
	// primary key or unique index (without predicate or expressions), so a
	// key could match several rows and an upsert has no conflict target.
	ErrKeyNotUnique = errors.New("fencedwrite: key columns are not a primary key or unique index")

	// ErrInvalidSpec: the description is incomplete or contradictory (no key
	// columns, a column listed twice, the fence column among the set columns,
	// wrong number of values).
	ErrInvalidSpec = errors.New("fencedwrite: invalid spec")
)

// StaleTokenError is returned when a newer grant already wrote the row: the
// row's Fence is higher than the caller's Token. errors.Is(err,
// [ErrStaleToken]) reports true for it.
type StaleTokenError struct {
	Token int64 // the token the caller sent
	Fence int64 // the row's fence: the highest token it accepted
}

// Error describes the refusal with both numbers.
func (e *StaleTokenError) Error() string {
	return fmt.Sprintf("fencedwrite: stale token %d: the row's fence is %d (a newer grant wrote it)", e.Token, e.Fence)
}

// Is reports whether target is [ErrStaleToken].
func (e *StaleTokenError) Is(target error) bool { return target == ErrStaleToken }

// GuardReason says which rule of the guard trigger refused an UPDATE.
type GuardReason int

const (
	// GuardFenceNotRaised (SQLSTATE PF001): the UPDATE did not raise the
	// fence: a writer without a token, a stale token, or (strict guard) a
	// second write by the same grant.
	GuardFenceNotRaised GuardReason = iota + 1
	// GuardTokenNotIssued (SQLSTATE PF002): the new fence is higher than the
	// latest token pgfence.locks issued for the governing lock (a forged or
	// mistyped token), or no lock governs the row.
	GuardTokenNotIssued
)

// SQLSTATEs raised by the guard trigger (class PF).
const (
	SQLStateFenceNotRaised = "PF001"
	SQLStateTokenNotIssued = "PF002"
)

// String returns a short description of the reason.
func (r GuardReason) String() string {
	switch r {
	case GuardFenceNotRaised:
		return "fence not raised"
	case GuardTokenNotIssued:
		return "token not issued"
	}
	return fmt.Sprintf("GuardReason(%d)", int(r))
}

// GuardError is a refusal by the guard trigger that pgfence.guard attaches to
// a table. errors.Is(err, [ErrGuardRejected]) reports true for it.
type GuardError struct {
	Reason  GuardReason
	Schema  string // schema of the guarded table
	Table   string // the guarded table
	Message string // the server's message
	Detail  string // the server's detail: fences, lock name, latest token
	Err     *pgconn.PgError
}

// Error returns the reason with the server's message and detail.
func (e *GuardError) Error() string {
	msg := "fencedwrite: guard rejected the update (" + e.Reason.String() + "): " + e.Message
	if e.Detail != "" {
		msg += " (" + e.Detail + ")"
	}
	return msg
}

// Is reports whether target is [ErrGuardRejected].
func (e *GuardError) Is(target error) bool { return target == ErrGuardRejected }

// Unwrap returns the underlying *pgconn.PgError, if any.
func (e *GuardError) Unwrap() error {
	if e.Err == nil {
		return nil
	}
	return e.Err
}

// IdentifierError reports a table or column name that pgfence will not put
// into SQL. errors.Is(err, [ErrInvalidIdentifier]) reports true for it.
type IdentifierError struct {
	What   string // "table", "schema", "key column", ...
	Value  string // the rejected input, cut to 80 bytes
	Reason string
}

// Error names the input and why it was refused.
func (e *IdentifierError) Error() string {
	return fmt.Sprintf("fencedwrite: invalid %s name %q: %s", e.What, e.Value, e.Reason)
}

// Is reports whether target is [ErrInvalidIdentifier].
func (e *IdentifierError) Is(target error) bool { return target == ErrInvalidIdentifier }

// ColumnError names a column that is missing or unusable.
// errors.Is(err, Sentinel) reports true for the sentinel it carries
// ([ErrUnknownColumn] or [ErrNoFenceColumn]).
type ColumnError struct {
	Sentinel error
	Table    string
	Column   string
	Detail   string
}

// Error names the table and column.
func (e *ColumnError) Error() string {
	msg := fmt.Sprintf("%v: %s.%s", e.Sentinel, e.Table, e.Column)
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg
}

// Unwrap returns the sentinel.
func (e *ColumnError) Unwrap() error { return e.Sentinel }

// TranslateError turns errors from the database into this package's errors:
// a guard refusal (SQLSTATE PF001/PF002) becomes a *[GuardError]; context
// errors are returned as they are; anything else is wrapped with the package
// prefix. Use it on errors from sqlc code generated by fencegen; the helpers
// of this package already call it.
func TranslateError(err error) error {
	if err == nil {
		return nil
	}
	var ge *GuardError
	if errors.As(err, &ge) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case SQLStateFenceNotRaised, SQLStateTokenNotIssued:
			r := GuardFenceNotRaised
			if pgErr.Code == SQLStateTokenNotIssued {
				r = GuardTokenNotIssued
			}
			return &GuardError{Reason: r, Schema: pgErr.SchemaName, Table: pgErr.TableName,
				Message: pgErr.Message, Detail: pgErr.Detail, Err: pgErr}
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return fmt.Errorf("fencedwrite: %w", err)
}
