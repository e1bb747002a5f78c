package fencedwrite

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// The errors of this package are [*pgfence.Error]s; the helpers below build
// them. Op names the exported call ("fencedwrite.Update",
// "fencedwrite.UpdateValue", ...), Name the table ("schema.name") or the
// value's key, Token the token refused. The helpers leave Op (and Name) empty
// and the exported call fills them in (withOp).

// invalid is rejected input (pgfence.ErrInvalid): arg names the argument,
// the rest says what is wrong with it.
func invalid(arg, format string, args ...any) *pgfence.Error {
	return &pgfence.Error{Kind: pgfence.ErrInvalid, Reason: arg + ": " + fmt.Sprintf(format, args...)}
}

// errNilDB is the error for a nil database handle.
func errNilDB() *pgfence.Error {
	return invalid("db", "nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
}

// staleError says a newer grant wrote (or read) the row: its fence is above
// token (pgfence.ErrStaleToken).
func staleError(token, fence int64) *pgfence.Error {
	return &pgfence.Error{Kind: pgfence.ErrStaleToken, Token: token,
		Reason: fmt.Sprintf("row fence %d > token %d", fence, token)}
}

// appliedError says token already wrote the row (strict mode,
// pgfence.ErrAlreadyApplied).
func appliedError(token int64) *pgfence.Error {
	return &pgfence.Error{Kind: pgfence.ErrAlreadyApplied, Token: token,
		Reason: fmt.Sprintf("row fence %d = token %d", token, token)}
}

// notFoundError says no row has the key (pgfence.ErrNotFound).
func notFoundError(token int64) *pgfence.Error {
	return &pgfence.Error{Kind: pgfence.ErrNotFound, Token: token, Reason: "no row with that key"}
}

// concurrentReason is the Reason of a refused write whose row changed (or
// was deleted and re-created) between the statement's snapshot and a second
// look, so the reason is unknown: rare, only under READ COMMITTED with
// concurrent writers on the row. It has no Kind: the write was not applied,
// and sending it again with the same token gets a definite answer
// (pgfence.IsRetryable is true).
const concurrentReason = "refused, but the row changed concurrently so the reason is unknown; the write was not applied: send it again"

// concurrentError is a refusal whose reason is unknown (see concurrentReason).
func concurrentError(token int64) *pgfence.Error {
	return &pgfence.Error{Token: token, Reason: concurrentReason, Err: pgerr.ErrConcurrentChange}
}

// dbError is a database or connection failure (no Kind; Err is the cause).
func dbError(err error) *pgfence.Error { return &pgfence.Error{Err: err} }

// withOp fills in the Op and, if empty, the Name of the *pgfence.Error in
// *err that a helper of this package built (one whose Op is empty).
func withOp(err *error, op, name string) {
	var pe *pgfence.Error
	if *err == nil || !errors.As(*err, &pe) || pe.Op != "" {
		return
	}
	pe.Op = op
	if pe.Name == "" {
		pe.Name = name
	}
}

// TranslateError turns errors from the database into [*pgfence.Error]s:
// a guard refusal is [pgfence.ErrGuard] (SQLSTATE PF001, "fence not
// raised"), [pgfence.ErrInvalid] (PF002, "token not issued": the lock never
// issued it) or [pgfence.ErrStaleToken] (PF008, a superseded holder), with
// the guard's reason, the server's message and detail in Reason; a refusal raised by a statement `pgfence gen
// fenced` generated is [pgfence.ErrStaleToken] (PF003),
// [pgfence.ErrAlreadyApplied] (PF004), [pgfence.ErrNotFound] (PF005), a
// refusal without Kind whose reason is unknown (PF006, the row changed
// concurrently; pgfence.IsRetryable is true) or [pgfence.ErrInvalid] (PF007, a token <= 0), with Name the
// table, Token the token and the row's fence and key in Reason; anything
// else (a context's error too) is a database failure without Kind whose Err
// is the cause. nil stays nil, and a *pgfence.Error is returned as it is. So
// errors.Is(TranslateError(err), pgfence.ErrStaleToken) holds for the error
// a generated sqlc method returns. The helpers of this package already
// call it.
func TranslateError(err error) error {
	if err == nil {
		return nil
	}
	if e := translate(err); e != nil {
		e.Op = "fencedwrite.TranslateError"
		return e
	}
	return err
}

// translateErr is TranslateError for this package's calls: the Op is left
// to the exported call.
func translateErr(err error) error {
	if err == nil {
		return nil
	}
	if e := translate(err); e != nil {
		return e
	}
	return err
}

// translate is TranslateError without the Op; it returns nil only when err
// is already a *pgfence.Error (which TranslateError returns as it is).
func translate(err error) *pgfence.Error {
	var pe *pgfence.Error
	if errors.As(err, &pe) {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		name := pgErr.TableName
		if pgErr.SchemaName != "" && name != "" {
			name = pgErr.SchemaName + "." + name
		}
		c, ok := pgerr.Classify(err)
		if !ok {
			return dbError(err)
		}
		switch c.Code {
		case pgerr.FenceNotRaised, pgerr.TokenNotIssued, pgerr.TokenSuperseded:
			// The guard's refusals: its reason, then the server's words.
			r := guardReasons[c.Code] + ": " + pgErr.Message
			if pgErr.Detail != "" {
				r += " (" + pgErr.Detail + ")"
			}
			return &pgfence.Error{Kind: c.Kind, Name: name, Token: pgerr.ParseGuardToken(pgErr.Message), Reason: r, Err: err}
		case pgerr.StaleToken, pgerr.AlreadyApplied, pgerr.NotFound, pgerr.ConcurrentChange, pgerr.InvalidToken:
			// The refusals of generated statements (pgfence.fence_refused).
			token, fence, table, key := pgerr.ParseRefusal(pgErr.Detail)
			// The table as the statement names it, quoted ("s"."t"); pgfence's
			// identifier rule keeps quotes out of the names themselves.
			table = strings.ReplaceAll(table, `"`, "")
			e := &pgfence.Error{Kind: c.Kind, Name: table, Token: token, Err: err}
			switch c.Code {
			case pgerr.StaleToken:
				e.Reason = fmt.Sprintf("row fence %d > token %d", fence, token)
			case pgerr.AlreadyApplied:
				e.Reason = fmt.Sprintf("row fence %d = token %d", fence, token)
			case pgerr.NotFound:
				e.Reason = "no row with that key"
			case pgerr.ConcurrentChange:
				e.Reason = concurrentReason
			case pgerr.InvalidToken:
				e.Reason = "token: must be > 0"
			}
			if key != "" {
				e.Reason += " (key " + key + ")"
			}
			return e
		}
		return &pgfence.Error{Kind: c.Kind, Name: name, Reason: c.Meaning, Err: err}
	}
	return dbError(err)
}

// guardReasons start the Reason of the guard's refusals.
var guardReasons = map[string]string{
	pgerr.FenceNotRaised:  "fence not raised",
	pgerr.TokenNotIssued:  "token not issued",
	pgerr.TokenSuperseded: "refused by the fence guard: token superseded",
}
