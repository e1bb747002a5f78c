package advisory

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// execMode is the query mode of every statement the package sends: the
// extended protocol with an unnamed statement, in one round trip. It needs no
// server-side prepared statement, so it behaves the same on a direct
// connection and through PgBouncer in transaction mode, whatever the pool's
// default mode.
const execMode = pgx.QueryExecModeExec

// keyArgs returns the SQL argument list and the values for k.
func keyArgs(k Key) (string, []any) {
	if a, b, ok := k.Pair(); ok {
		return "$1::integer, $2::integer", []any{execMode, a, b}
	}
	v, _ := k.Int64()
	return "$1::bigint", []any{execMode, v}
}

// fnName returns the name of the advisory lock function for the given
// scope, kind and mode. The result is one of a fixed set of identifiers.
func fnName(kind string, xact bool, mode Mode) string {
	name := "pg_catalog.pg_" + kind
	if xact {
		name += "_xact"
	}
	name += "_lock"
	if kind == "advisory_unlock" {
		name = "pg_catalog.pg_advisory_unlock"
	}
	if mode == Shared {
		name += "_shared"
	}
	return name
}

// Statement builders. Their output depends only on the key's form and the
// mode, never on user text: keys are always bound parameters.

func xactLockSQL(k Key, mode Mode) (string, []any) {
	args, vals := keyArgs(k)
	return fmt.Sprintf("SELECT %s(%s)", fnName("advisory", true, mode), args), vals
}

func xactTryLockSQL(k Key, mode Mode) (string, []any) {
	args, vals := keyArgs(k)
	return fmt.Sprintf("SELECT %s(%s)", fnName("try_advisory", true, mode), args), vals
}

func sessionLockSQL(k Key, mode Mode) (string, []any) {
	args, vals := keyArgs(k)
	return fmt.Sprintf("SELECT true, pg_catalog.pg_backend_pid() FROM %s(%s) AS l", fnName("advisory", false, mode), args), vals
}

func sessionTryLockSQL(k Key, mode Mode) (string, []any) {
	args, vals := keyArgs(k)
	return fmt.Sprintf("SELECT %s(%s), pg_catalog.pg_backend_pid()", fnName("try_advisory", false, mode), args), vals
}

func unlockSQL(k Key, mode Mode) (string, []any) {
	args, vals := keyArgs(k)
	return fmt.Sprintf("SELECT %s(%s)", fnName("advisory_unlock", false, mode), args), vals
}

// heldSQL checks, in a statement of its own, which backend runs it and
// whether that backend holds the lock on k in mode.
func heldSQL(k Key, mode Mode) (string, []any) {
	pgMode := "ExclusiveLock"
	if mode == Shared {
		pgMode = "ShareLock"
	}
	var classid, objid uint32
	var objsubid int16 = 1
	if a, b, ok := k.Pair(); ok {
		classid, objid, objsubid = uint32(a), uint32(b), 2
	} else {
		v, _ := k.Int64()
		classid, objid = uint32(uint64(v)>>32), uint32(v)
	}
	return `SELECT pg_catalog.pg_backend_pid(), EXISTS (
	SELECT 1 FROM pg_catalog.pg_locks
	WHERE (locktype OPERATOR(pg_catalog.=) 'advisory') AND (pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()) AND granted
	  AND (database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database WHERE (datname OPERATOR(pg_catalog.=) pg_catalog.current_database())))
	  AND (classid OPERATOR(pg_catalog.=) $1::bigint::pg_catalog.oid) AND (objid OPERATOR(pg_catalog.=) $2::bigint::pg_catalog.oid) AND (objsubid OPERATOR(pg_catalog.=) $3::pg_catalog.int2) AND (mode OPERATOR(pg_catalog.=) $4))`,
		[]any{execMode, int64(classid), int64(objid), objsubid, pgMode}
}

const pidSQL = "SELECT pg_catalog.pg_backend_pid()"

// ctxErr returns err, joined with ctx's error when ctx ended, so that
// errors.Is(err, context.Canceled) or context.DeadlineExceeded holds after
// pgx closed the connection because of the context.
func ctxErr(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return errors.Join(err, cerr)
	}
	return err
}
