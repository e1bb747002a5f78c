package fencedwrite

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// Why a fenced write changed no row. Exactly one of these is returned when the
// statement ran but the row was not written; the answer comes from the write's
// own round trip, or for [Table.Update] from a read of the row right after the
// refusal.
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

	// ErrGuardRejected: the table's pgfence guard trigger refused an INSERT,
	// UPDATE or DELETE (SQLSTATE PF001, PF002 or PF008). The error is a
	// *[GuardError].
	ErrGuardRejected = errors.New("fencedwrite: rejected by the pgfence guard")
)

// Problems with a table description ([Spec], [GuardOptions], the options of
// `pgfence gen fenced`). They are detected before any write runs.
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
	// ErrNilDB: a nil pool, connection or transaction was passed.
	ErrNilDB = errors.New("fencedwrite: nil database handle")
)

// StaleTokenError is returned when a newer grant already wrote the row: the
// row's Fence is higher than the caller's Token. errors.Is(err,
// [ErrStaleToken]) reports true for it.
type StaleTokenError struct {
	Token int64 // the token the caller sent
	Fence int64 // the row's fence: the highest token it accepted
	// Table and Key name the row when the refusal came from a generated
	// statement (through [TranslateError]); empty otherwise.
	Table, Key string
	// Err is the server's error when the refusal came from a generated
	// statement; nil otherwise.
	Err *pgconn.PgError
}

// Error describes the refusal with both numbers.
func (e *StaleTokenError) Error() string {
	msg := fmt.Sprintf("fencedwrite: stale token %d: the row's fence is %d (a newer grant wrote it)", e.Token, e.Fence)
	if e.Table != "" {
		msg += " (table " + e.Table + ", key " + e.Key + ")"
	}
	return msg
}

// Is reports whether target is [ErrStaleToken].
func (e *StaleTokenError) Is(target error) bool { return target == ErrStaleToken }

// Unwrap returns the server's error, if any.
func (e *StaleTokenError) Unwrap() error {
	if e.Err == nil {
		return nil
	}
	return e.Err
}

// RefusedError is a refusal raised by a statement that `pgfence gen fenced`
// generated (SQLSTATE PF004..PF007), as returned by [TranslateError].
// errors.Is(err, Reason) reports true: Reason is [ErrAlreadyApplied], [ErrNotFound],
// [ErrConcurrentChange] or [ErrInvalidToken]. A stale token is a
// *[StaleTokenError] instead.
type RefusedError struct {
	Reason error
	Table  string // the table, as the statement names it
	Key    string // the key, as a JSON object of the key columns
	Token  int64  // the token the caller sent
	Fence  int64  // the row's fence as the statement saw it (0 if there was no row)
	Err    *pgconn.PgError
}

// Error names the reason, table, key, token and fence.
func (e *RefusedError) Error() string {
	return fmt.Sprintf("%v (table %s, key %s, token %d, fence %d)", e.Reason, e.Table, e.Key, e.Token, e.Fence)
}

// Is reports whether target is the Reason.
func (e *RefusedError) Is(target error) bool { return target == e.Reason }

// Unwrap returns the server's error.
func (e *RefusedError) Unwrap() error {
	if e.Err == nil {
		return nil
	}
	return e.Err
}

// GuardReason says which rule of the guard trigger refused a change.
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
	// GuardTokenSuperseded (SQLSTATE PF008): the token is lower than the
	// latest token of the row's lock: a newer grant exists, so the writer is
	// a superseded holder. errors.Is(err, [ErrStaleToken]) also reports true.
	GuardTokenSuperseded
)

// String returns a short description of the reason.
func (r GuardReason) String() string {
	switch r {
	case GuardFenceNotRaised:
		return "fence not raised"
	case GuardTokenNotIssued:
		return "token not issued"
	case GuardTokenSuperseded:
		return "token superseded"
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
	msg := "fencedwrite: guard rejected the change (" + e.Reason.String() + "): " + e.Message
	if e.Detail != "" {
		msg += " (" + e.Detail + ")"
	}
	return msg
}

// Is reports whether target is [ErrGuardRejected], or [ErrStaleToken] for a
// superseded holder ([GuardTokenSuperseded]).
func (e *GuardError) Is(target error) bool {
	return target == ErrGuardRejected || (target == ErrStaleToken && e.Reason == GuardTokenSuperseded)
}

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
// a guard refusal (SQLSTATE PF001/PF002/PF008) becomes a *[GuardError]; a
// refusal raised by a statement `pgfence gen fenced` generated becomes a
// *[StaleTokenError] (PF003) or a *[RefusedError] (PF004..PF007), so
// errors.Is(TranslateError(err), [ErrStaleToken]) and the like hold for the
// error a generated sqlc method returns; context errors are returned as they
// are; anything else becomes a *[DBError]. The helpers of this
// package already call it.
func TranslateError(err error) error {
	if err == nil {
		return nil
	}
	var (
		ge *GuardError
		se *StaleTokenError
		re *RefusedError
	)
	if errors.As(err, &ge) || errors.As(err, &se) || errors.As(err, &re) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if r, ok := guardReasons[pgErr.Code]; ok {
			return &GuardError{Reason: r, Schema: pgErr.SchemaName, Table: pgErr.TableName,
				Message: pgErr.Message, Detail: pgErr.Detail, Err: pgErr}
		}
		if pgErr.Code == pgerr.StaleToken {
			token, fence, table, key := parseRefusal(pgErr.Detail)
			return &StaleTokenError{Token: token, Fence: fence, Table: table, Key: key, Err: pgErr}
		}
		if reason, ok := refusalReasons[pgErr.Code]; ok {
			token, fence, table, key := parseRefusal(pgErr.Detail)
			return &RefusedError{Reason: reason, Table: table, Key: key, Token: token, Fence: fence, Err: pgErr}
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return &DBError{Err: err}
}

// DBError is a database or connection error that is not a refusal: the
// statement failed for another reason (a lost connection, a constraint, a
// missing table). Unwrap returns the pgx or PostgreSQL error. On a database
// without pgfence's schema, its text says to run "pgfence migrate up" as the
// schema owner.
type DBError struct {
	Op  string // the call that failed; "" when translated by [TranslateError]
	Err error
}

func (e *DBError) Error() string {
	if e.Op == "" {
		return "fencedwrite: " + pgerr.Describe(e.Err)
	}
	return "fencedwrite: " + e.Op + ": " + pgerr.Describe(e.Err)
}

// Unwrap returns the pgx or PostgreSQL error.
func (e *DBError) Unwrap() error { return e.Err }

// Transient reports whether the same statement may succeed when sent again
// (connection failures, server shutting down, serialization failures). A
// fenced write retried with the same token is safe: it is applied once.
func (e *DBError) Transient() bool { return pgerr.IsTransient(e.Err) }

var (
	guardReasons = map[string]GuardReason{
		pgerr.FenceNotRaised:  GuardFenceNotRaised,
		pgerr.TokenNotIssued:  GuardTokenNotIssued,
		pgerr.TokenSuperseded: GuardTokenSuperseded,
	}
	refusalReasons = map[string]error{
		pgerr.AlreadyApplied:   ErrAlreadyApplied,
		pgerr.NotFound:         ErrNotFound,
		pgerr.ConcurrentChange: ErrConcurrentChange,
		pgerr.InvalidToken:     ErrInvalidToken,
	}
)

// parseRefusal reads the DETAIL of pgfence.fence_refused: "token N, fence N,
// table T, key K" (fence may be NULL when there was no row).
func parseRefusal(detail string) (token, fence int64, table, key string) {
	rest, ok := strings.CutPrefix(detail, "token ")
	if !ok {
		return 0, 0, "", ""
	}
	tok, rest, _ := strings.Cut(rest, ", fence ")
	fen, rest, _ := strings.Cut(rest, ", table ")
	table, key, _ = strings.Cut(rest, ", key ")
	token, _ = strconv.ParseInt(tok, 10, 64)
	fence, _ = strconv.ParseInt(fen, 10, 64)
	return token, fence, table, key
}

// errNilDB is the error for a nil database handle.
var errNilDB = fmt.Errorf("%w: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx", ErrNilDB)
