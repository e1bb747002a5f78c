package fencedwrite

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/pgtext"
)

// maxLockExprBytes bounds GuardOptions.LockNameExpression (pgfence.guard
// enforces the same limit).
const maxLockExprBytes = 4096

// GuardOptions configure [Guard]. Exactly one of LockName, LockNameColumn
// and LockNameExpression must be set.
type GuardOptions struct {
	// LockName is the pgfence.locks row that governs every row of the table.
	LockName string
	// LockNameColumn is a column of the table whose value (cast to text) is
	// the name of the lock that governs that row: a plain or a generated
	// column (re-attach the guard if a generation expression changes).
	LockNameColumn string
	// LockNameExpression is an SQL expression over the table's columns
	// giving the lock name of a row, e.g. 'store:' || store_id. It is
	// compiled into the trigger as written: never from user input. Up to
	// 4096 bytes.
	LockNameExpression string
	// FenceColumn defaults to "fence".
	FenceColumn string
	// Mode defaults to [Strict]: every UPDATE must raise the fence. With
	// [Reentrant] an UPDATE that assigns the fence column may keep it equal
	// (needed for fenced reads and re-entrant writes).
	Mode Mode
}

// Guard attaches the pgfence guard trigger to table by calling
// pgfence.guard(). From then on every change to the table needs the latest
// token of the row's lock, or it fails with [pgfence.ErrGuard] (the guard's
// reason, message and detail in the error's Reason):
//   - an UPDATE must raise the fence to it (in strict mode; with [Reentrant]
//     an UPDATE that assigns the fence may keep it equal), so a writer
//     without a token or with a stale one is refused;
//   - an INSERT must carry it in the fence column ([Table.Upsert] and the
//     generated FencedUpsert do);
//   - a DELETE must name it with pgfence.use_token(token) earlier in its
//     transaction or statement ([Table.Delete] and the generated
//     FencedDelete do).
//
// A token above the lock's latest is refused as [pgfence.ErrInvalid]
// (Reason "token not issued ..."); one below it, a superseded holder's, as
// [pgfence.ErrStaleToken]. Attaching again replaces the previous guard.
//
// The table and columns are validated first ([pgfence.ErrInvalid] naming
// the argument: an invalid name, an unknown table or column). The caller must own the table and have
// CREATE on schema pgfence; Guard takes a SHARE ROW EXCLUSIVE lock on the
// table while it creates the trigger, and an ACCESS EXCLUSIVE one, to the
// end of the transaction, when it replaces an attached guard.
func Guard(ctx context.Context, db pgfence.DBTX, table string, opts GuardOptions) (err error) {
	defer func() { withOp(&err, "fencedwrite.Guard", table) }() // table: as resolved, once looked up
	if nilcheck.IsNil(db) {
		return errNilDB()
	}
	if opts.FenceColumn == "" {
		opts.FenceColumn = defaultFenceColumn
	}
	if !opts.Mode.valid() {
		return invalid("GuardOptions.Mode", "unknown mode %v", opts.Mode)
	}
	set := 0
	for _, s := range []string{opts.LockName, opts.LockNameColumn, opts.LockNameExpression} {
		if s != "" {
			set++
		}
	}
	if set != 1 {
		return invalid("GuardOptions", "set exactly one of LockName, LockNameColumn and LockNameExpression")
	}
	if len(opts.LockNameExpression) > maxLockExprBytes {
		return invalid("GuardOptions.LockNameExpression", "%d bytes, the limit is %d",
			len(opts.LockNameExpression), maxLockExprBytes)
	}
	if len(opts.LockName) > maxKeyBytes {
		return invalid("GuardOptions.LockName", "%d bytes, the limit is %d", len(opts.LockName), maxKeyBytes)
	}
	if p := pgtext.Problem(opts.LockName); p != "" {
		return invalid("GuardOptions.LockName", "%s", p)
	}
	if p := pgtext.Problem(opts.LockNameExpression); p != "" {
		return invalid("GuardOptions.LockNameExpression", "%s", p)
	}
	if err := checkIdent("fence column", opts.FenceColumn); err != nil {
		return err
	}
	if opts.LockNameColumn != "" {
		if err := checkIdent("lock name column", opts.LockNameColumn); err != nil {
			return err
		}
	}
	ti, err := lookup(ctx, db, table)
	if err != nil {
		return err
	}
	table = ti.Schema + "." + ti.Name
	if err := checkFenceColumn(ti, opts.FenceColumn); err != nil {
		return err
	}
	var lockName, lockCol, lockExpr *string
	switch {
	case opts.LockName != "":
		lockName = &opts.LockName
	case opts.LockNameExpression != "":
		lockExpr = &opts.LockNameExpression
	default:
		if err := checkColumns(ti, "lock name column", []string{opts.LockNameColumn}); err != nil {
			return err
		}
		lockCol = &opts.LockNameColumn
	}
	_, err = db.Exec(ctx, `SELECT pgfence.guard($1::pg_catalog.regclass, lock_name => $2, lock_name_column => $3,
		fence_column => $4, mode => $5, lock_name_expression => $6)`,
		ti.Qualified(), lockName, lockCol, opts.FenceColumn, opts.Mode.String(), lockExpr)
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == pgerr.InvalidParameterValue {
		e := invalid("GuardOptions", "%s", pgErr.Message)
		e.Err = err
		return e
	}
	return translateErr(err)
}

// Unguard detaches the guard from table (pgfence.unguard()). It reports
// whether a guard was attached; detaching an unguarded table is not an error.
func Unguard(ctx context.Context, db pgfence.DBTX, table string) (_ bool, err error) {
	defer withOp(&err, "fencedwrite.Unguard", table)
	ti, err := lookup(ctx, db, table)
	if err != nil {
		return false, err
	}
	var removed bool
	if err := db.QueryRow(ctx, "SELECT pgfence.unguard($1::pg_catalog.regclass)", ti.Qualified()).Scan(&removed); err != nil {
		return false, translateErr(err)
	}
	return removed, nil
}

// GuardedTable is a row of pgfence.guarded_tables.
type GuardedTable struct {
	Table           string    // as regclass prints it: schema-qualified unless on search_path
	FenceColumn     string    // the bigint column the guard checks
	LockName        string    // set when one lock governs the table
	LockNameColumn  string    // set when a column names each row's lock
	LockNameExpr    string    // set when an expression over the row names its lock
	Mode            Mode      // Strict or Reentrant
	TriggerFunction string    // pgfence.<name>() generated by pgfence.guard
	GuardedAt       time.Time // database time of the Guard call
	GuardedBy       string    // the role that called Guard
	TableExists     bool      // false when the table was dropped while guarded
}

// ListGuarded lists the guarded tables, by name.
func ListGuarded(ctx context.Context, db pgfence.DBTX) (_ []GuardedTable, err error) {
	defer withOp(&err, "fencedwrite.ListGuarded", "")
	if nilcheck.IsNil(db) {
		return nil, errNilDB()
	}
	rows, err := queries.ListGuardedTables(ctx, db)
	if err != nil {
		return nil, translateErr(err)
	}
	out := make([]GuardedTable, 0, len(rows))
	for _, r := range rows {
		g := GuardedTable{Table: r.TableName, FenceColumn: r.FenceColumn, TriggerFunction: r.TriggerFunction,
			GuardedAt: r.GuardedAt, GuardedBy: r.GuardedBy, TableExists: r.TableExists}
		if r.LockName != nil {
			g.LockName = *r.LockName
		}
		if r.LockNameColumn != nil {
			g.LockNameColumn = *r.LockNameColumn
		}
		if r.LockNameExpression != nil {
			g.LockNameExpr = *r.LockNameExpression
		}
		if r.Mode == "reentrant" {
			g.Mode = Reentrant
		}
		out = append(out, g)
	}
	return out, nil
}
