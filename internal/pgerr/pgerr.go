// Package pgerr classifies errors from PostgreSQL and pgx once, for every
// pgfence package: the SQLSTATE codes pgfence reacts to, whether a session is
// gone, and whether retrying may help. Each public package maps these answers
// to its own typed errors.
package pgerr

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
)

// SQLSTATE codes and classes pgfence reacts to (PostgreSQL Appendix A).
const (
	NumericValueOutOfRange    = "22003"
	CheckViolation            = "23514"
	InvalidParameterValue     = "22023"
	InvalidTextRepresentation = "22P02"
	InvalidJSONText           = "22032"
	SequenceGeneratorLimit    = "2200H" // sequence_generator_limit_exceeded
	SerializationFailure      = "40001"
	DeadlockDetected          = "40P01"
	UndefinedTable            = "42P01"
	UndefinedFunction         = "42883"
	InvalidSchemaName         = "3F000" // the schema does not exist
	InsufficientPrivilege     = "42501"
	UndefinedColumn           = "42703"
	LockNotAvailable          = "55P03"
	QueryCanceled             = "57014" // statement_timeout or a cancel request
	AdminShutdown             = "57P01" // pg_terminate_backend, smart/fast shutdown
	CrashShutdown             = "57P02"
	CannotConnectNow          = "57P03"

	ClassConnectionException   = "08"
	ClassInsufficientResources = "53"
	ClassOperatorIntervention  = "57"
)

// Code returns the SQLSTATE of the first *pgconn.PgError in err's chain, or
// "" when the error did not come from the server.
func Code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// SchemaHint says what to do when the database has no pgfence schema, or an
// older one than the build expects.
const SchemaHint = `schema pgfence is missing or not migrated in this database: run "pgfence migrate up" (or migrations.Up) as the schema owner`

// SchemaMissing reports whether err says that schema pgfence, or one of its
// tables, views or functions, does not exist: SQLSTATE 3F000 naming the
// schema, 42P01 naming a pgfence relation, or 42883 naming a pgfence
// function (a schema migrated by an older build).
func SchemaMissing(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case InvalidSchemaName:
		return strings.Contains(pgErr.Message, `"pgfence"`)
	case UndefinedTable:
		return strings.Contains(pgErr.Message, `"pgfence.`)
	case UndefinedFunction:
		return strings.Contains(pgErr.Message, "function pgfence.")
	}
	return false
}

// Describe returns err's text, preceded by [SchemaHint] when
// [SchemaMissing](err) is true. The packages' error types print their
// cause with it and keep the cause itself in their chain, so errors.As
// still finds the *pgconn.PgError.
func Describe(err error) string {
	if SchemaMissing(err) {
		return SchemaHint + ": " + err.Error()
	}
	return err.Error()
}

// Constraint returns the name of the constraint the first *pgconn.PgError in
// err's chain violated, or "".
func Constraint(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.ConstraintName
	}
	return ""
}

// PayloadTooLarge reports whether err is a violation of one of the size
// limits pgfence's schema enforces on payloads (jobs_payload_size,
// outbox_payload_size): the same error as the packages' own checks.
func PayloadTooLarge(err error) bool {
	if Code(err) != CheckViolation {
		return false
	}
	switch Constraint(err) {
	case "jobs_payload_size", "outbox_payload_size":
		return true
	}
	return false
}

// PayloadNumberOutOfRange reports whether err is the server's refusal of a
// JSON number that jsonb cannot store (numeric's range: more than 131,072
// digits before the decimal point or 16,383 after): 22003 from an enqueue,
// whose only numeric input is the payload.
func PayloadNumberOutOfRange(err error) bool { return Code(err) == NumericValueOutOfRange }

// PayloadNumberReason is the Reason of the ErrInvalid returned for
// [PayloadNumberOutOfRange].
const PayloadNumberReason = "holds a number jsonb cannot store (numeric's range: at most 131,072 digits before the decimal point and 16,383 after)"

// SessionGone reports whether a SQLSTATE means the server ended the session:
// class 08, or 57P01/57P02/57P03.
func SessionGone(code string) bool {
	return strings.HasPrefix(code, ClassConnectionException) ||
		code == AdminShutdown || code == CrashShutdown || code == CannotConnectNow
}

// IsConnectionLost reports whether err means the connection failed or was
// closed, so the session and any transaction on it are gone: a SQLSTATE for
// which [SessionGone] is true, a failed connect, a network error, EOF in the
// middle of a message, a closed pgx connection or pool, or an error pgconn
// calls safe to retry. It is false for nil and for a context's cancellation
// or deadline (the caller's decision, even when pgx closed the connection to
// enforce it). A true answer does not say whether the statement took effect.
func IsConnectionLost(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if code := Code(err); code != "" {
		return SessionGone(code)
	}
	var netErr net.Error
	var connectErr *pgconn.ConnectError
	return errors.As(err, &netErr) || errors.As(err, &connectErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, puddle.ErrClosedPool) ||
		pgconn.SafeToRetry(err)
}

// IsRetryable reports whether running the whole transaction again may
// succeed: SQLSTATE 40001 or 40P01 (the server rolled it back), a PF code
// that PFCodes calls retryable (or [ErrConcurrentChange]), or
// [IsConnectionLost]. It is false for nil, a context's end, lock and
// statement timeouts (limits the caller set) and every other error.
func IsRetryable(err error) bool {
	switch Code(err) {
	case SerializationFailure, DeadlockDetected:
		return true
	}
	if c, ok := Classify(err); ok {
		return c.Retryable
	}
	if errors.Is(err, ErrConcurrentChange) {
		return true
	}
	return IsConnectionLost(err)
}

// IsTransient reports whether the same statement may succeed when sent
// again: server errors of classes 08, 53 and 57, 40001 and 40P01, and every
// error that did not come from the server (network, timeouts, a closed pool)
// except the caller's cancellation.
func IsTransient(err error) bool {
	if code := Code(err); code != "" {
		switch code[:2] {
		case ClassConnectionException, ClassOperatorIntervention, ClassInsufficientResources:
			return true
		}
		return code == SerializationFailure || code == DeadlockDetected
	}
	return err != nil && !errors.Is(err, context.Canceled)
}

// NotExecuted reports whether a statement on a connection that is now closed
// certainly did not take effect: nothing was written to the connection
// (pgconn.SafeToRetry), or the answer was the server's termination notice
// (57P01, 57P02, 57P03), which a backend ended while idle sends before it
// reads the next statement. closed says whether the connection is closed now;
// an open connection never qualifies.
func NotExecuted(closed bool, err error) bool {
	if !closed {
		return false
	}
	if pgconn.SafeToRetry(err) {
		return true
	}
	switch Code(err) {
	case AdminShutdown, CrashShutdown, CannotConnectNow:
		return true
	}
	return false
}

// ParseConfigText returns the text of an error of pgx's connection string
// parser without the connection string it quotes, and true; for any other
// error (or one whose text does not start as pgx writes it) it returns ""
// and false. pgx masks the passwords it recognises in that string, but not
// in every malformed one (a password with an escaped space, password=ab\ cd,
// kept the part after the escape). What is left says what was wrong
// ("invalid port").
func ParseConfigText(err error) (string, bool) {
	var pce *pgconn.ParseConfigError
	if !errors.As(err, &pce) {
		return "", false
	}
	// The same error with an empty message is exactly the prefix pgx
	// wrote: "cannot parse `<the string, masked>`: ".
	prefix := pgconn.NewParseConfigError(pce.ConnString, "", nil).Error()
	if rest, ok := strings.CutPrefix(err.Error(), prefix); ok {
		return rest, true
	}
	return "", false
}
