package fencedwrite

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
	"github.com/pgfence/pgfence/observe"
)

// Spec describes fenced writes to one of the application's own tables.
type Spec struct {
	// Table is "name" (resolved through search_path) or "schema.name".
	Table string
	// Key lists the columns that identify one row. They must be exactly the
	// columns of the primary key or of a unique index that identifies one
	// row (see [Prepare]).
	Key []string
	// Set lists the columns a write changes. It may not contain a key column
	// or the fence column.
	Set []string
	// Read lists the columns a fenced read ([Table.Read]) returns. Defaults to Set.
	Read []string
	// FenceColumn is the bigint column holding the highest token each row
	// accepted. Defaults to "fence".
	FenceColumn string
	// Mode is the comparison of Update and Upsert. Defaults to [Strict].
	Mode Mode
	// Metrics receives pgfence_fenced_writes_total{table} and
	// pgfence_fenced_write_refused_total{table,reason} for this table's
	// writes (see package observe); table is "schema.name" as Prepare
	// resolved it, whichever form Table had. Defaults to nil: nothing is
	// recorded.
	Metrics observe.Metrics
	// Logger receives one line per refused write (Info: table, operation,
	// token, reason) and per applied write (Debug). Defaults to nil: silent.
	Logger *slog.Logger
}

// Table runs fenced statements on one table. It is built by [Prepare], holds
// no connection, and is safe for concurrent use.
type Table struct {
	spec            Spec
	name            string // quoted, schema-qualified
	label           string // schema.name as resolved, the table label of metrics
	update          string
	updateReentrant string
	upsert          string
	delete          string
	read            string
	reread          string
}

// Prepare validates spec (identifiers first, then the catalog: the table
// exists, has a bigint NOT NULL fence column, the named columns exist, the key is a
// primary key or unique index that identifies one row) and builds the fenced statements, with every
// identifier quoted by pgx.Identifier. Values are always bound parameters.
//
// A unique index counts as a key only without predicate or expressions,
// not DEFERRABLE, with each key column compared by the index as its own "="
// compares it (its own collation, or another when both are deterministic;
// its type's default btree operator class, or one with the same equality
// on a deterministically compared column), and with every key column NOT NULL
// (or the index NULLS NOT DISTINCT): otherwise one key value could match
// several rows, or none that ON CONFLICT finds.
//
// The statements write the named table's own rows: an ordinary table's
// inheritance children (CREATE TABLE ... INHERITS) are not reached (they are
// tables of their own, to prepare on their own); a partitioned table's rows
// are in its partitions, which are.
//
// Errors: [pgfence.ErrInvalid], its Reason naming the argument (an invalid
// name, an unknown table or column, no bigint NOT NULL fence column, key columns that
// are not a unique key, or whose unique index cannot identify one row (the
// Reason says why), an incomplete spec), or a database failure. Prepare
// only reads the catalog.
func Prepare(ctx context.Context, db pgfence.DBTX, spec Spec) (_ *Table, err error) {
	defer withOp(&err, "fencedwrite.Prepare", spec.Table)
	if spec.FenceColumn == "" {
		spec.FenceColumn = defaultFenceColumn
	}
	if len(spec.Read) == 0 {
		spec.Read = spec.Set
	}
	if err := checkSpec(nil, spec); err != nil {
		return nil, err
	}
	ti, err := lookup(ctx, db, spec.Table)
	if err != nil {
		return nil, err
	}
	if err := checkSpec(ti, spec); err != nil {
		return nil, err
	}
	if err := checkFenceColumn(ti, spec.FenceColumn); err != nil {
		return nil, err
	}
	if !pgident.IsUniqueKey(ti.UniqueKeys, spec.Key) {
		e := invalid("Spec.Key", "(%s) is not a primary key or unique index of %s (without predicate or expressions)",
			strings.Join(spec.Key, ", "), ti.Qualified())
		if p := ti.UnusableKeyProblem(spec.Key); p != "" {
			e = invalid("Spec.Key", "(%s) is a unique index of %s that cannot identify one row: %s",
				strings.Join(spec.Key, ", "), ti.Qualified(), p)
		}
		e.Name = ti.Schema + "." + ti.Name
		return nil, e
	}
	t := &Table{spec: spec, name: ti.Qualified(), label: ti.Schema + "." + ti.Name}
	t.build(ti)
	metricdefs.InitTable(ctx, metricdefs.OrNop(spec.Metrics), t.label)
	return t, nil
}

func checkSpec(ti *pgident.Table, s Spec) error {
	if ti == nil {
		if _, err := pgident.ParseTableName(s.Table); err != nil {
			return identError(err)
		}
		if !s.Mode.valid() {
			return invalid("Spec.Mode", "unknown mode %v", s.Mode)
		}
		if len(s.Key) == 0 {
			return invalid("Spec.Key", "no key columns")
		}
		if len(s.Set) == 0 {
			return invalid("Spec.Set", "no set columns")
		}
		if err := checkIdent("fence column", s.FenceColumn); err != nil {
			return err
		}
		seen := map[string]string{s.FenceColumn: "fence column"}
		for _, group := range []struct {
			what string
			cols []string
		}{{"key column", s.Key}, {"set column", s.Set}} {
			for _, c := range group.cols {
				if prev, dup := seen[c]; dup {
					return invalid(group.what, "column %q is both %s and %s", c, prev, group.what)
				}
				seen[c] = group.what
			}
		}
	}
	if err := checkColumns(ti, "key column", s.Key); err != nil {
		return err
	}
	if err := checkColumns(ti, "set column", s.Set); err != nil {
		return err
	}
	return checkColumns(ti, "read column", s.Read)
}

func ident(s string) string { return pgx.Identifier{s}.Sanitize() }

func param(n int) string { return "$" + strconv.Itoa(n) }

// build writes the statements. $1 is the token, then the key values, then
// the set values. Each statement returns (applied, fence, ...) from the write
// when it changed the row. When it changed nothing, the update returns no row
// (run re-reads the row to say why); the upsert, delete and read return the
// row as the statement's snapshot saw it (the UNION ALL branch gated by NOT
// EXISTS runs only when the write changed nothing).
//
// An ordinary table is named ONLY in the UPDATE, DELETE and SELECT
// statements, which would otherwise also reach the rows of its inheritance
// children: the key is unique in the table, not across its children, so one
// key could match a row the fence refuses and another it accepts. A
// partitioned table is named without ONLY: its rows are in its partitions.
//
// Every operator on the fence, on xmax and on a key column of a built-in
// type, or of a domain over one, is named OPERATOR(pg_catalog.op), so no
// operator another role creates on the caller's search_path runs (a domain's
// values are compared as its base type's). A key column of a type from
// another schema (an extension's citext, an enum) keeps the bare = of its
// own type, resolved as the application's own statements resolve it.
//
// The CTEs name their columns (pgfence_w (fence, inserted)), so that no
// column of the table, whatever its name, makes the outer SELECT ambiguous.
func (t *Table) build(ti *pgident.Table) {
	s := t.spec
	fence := ident(s.FenceColumn)
	from := t.name // the table in UPDATE, DELETE FROM and SELECT ... FROM
	if !ti.Partitioned {
		from = "ONLY " + t.name
	}
	eq := func(col string) string {
		if c, _ := ti.Column(col); c.Builtin {
			return " OPERATOR(pg_catalog.=) "
		}
		return " = "
	}
	var where, cur []string
	for i, k := range s.Key {
		where = append(where, "pgfence_t."+ident(k)+eq(k)+param(2+i))
		cur = append(cur, "pgfence_c."+ident(k)+eq(k)+param(2+i))
	}
	keyWhere := strings.Join(where, " AND ")
	curWhere := strings.Join(cur, " AND ")
	var sets []string
	for i, c := range s.Set {
		sets = append(sets, ident(c)+" = "+param(2+len(s.Key)+i))
	}
	refusedBranch := func(extra string) string {
		return "\nUNION ALL\nSELECT false, pgfence_c." + fence + extra + " FROM " + from + " AS pgfence_c WHERE " +
			curWhere + " AND NOT EXISTS (SELECT 1 FROM pgfence_w)"
	}

	// The update is the plain fenced UPDATE: an accepted write, the common
	// case, costs no more than the hand-written statement. A refusal returns
	// no row and run reads the row to say why (one more round trip, only
	// then).
	update := func(m Mode) string {
		return "UPDATE " + from + " AS pgfence_t SET " + strings.Join(sets, ", ") + ", " +
			fence + " = $1 WHERE " + keyWhere + " AND pgfence_t." + fence + " " + m.op() + " $1 RETURNING true, pgfence_t." + fence
	}
	t.update = update(s.Mode)
	t.updateReentrant = update(Reentrant)

	var cols, vals, excl []string
	for i, k := range s.Key {
		cols = append(cols, ident(k))
		vals = append(vals, param(2+i))
	}
	for i, c := range s.Set {
		cols = append(cols, ident(c))
		vals = append(vals, param(2+len(s.Key)+i))
		excl = append(excl, ident(c)+" = excluded."+ident(c))
	}
	cols = append(cols, fence)
	vals = append(vals, "$1")
	excl = append(excl, fence+" = excluded."+fence)
	var conflict []string
	for _, k := range s.Key {
		conflict = append(conflict, ident(k))
	}
	insert := "INSERT INTO " + t.name + " AS pgfence_t (" + strings.Join(cols, ", ") + ") VALUES (" +
		strings.Join(vals, ", ") + ") ON CONFLICT (" + strings.Join(conflict, ", ") + ")"
	if !ti.Partitioned {
		// xmax is 0 in a row the INSERT inserted, and the updating
		// transaction's id in one its DO UPDATE wrote.
		t.upsert = "WITH pgfence_w (fence, inserted) AS (" + insert + " DO UPDATE SET " +
			strings.Join(excl, ", ") + " WHERE pgfence_t." + fence + " " + s.Mode.op() + " excluded." + fence +
			" RETURNING pgfence_t." + fence + ", (pgfence_t.xmax OPERATOR(pg_catalog.=) 0))" +
			"\nSELECT true, fence, inserted FROM pgfence_w" + refusedBranch(", false")
	} else {
		// A partitioned table's INSERT cannot return a system column
		// (0A000), so xmax cannot tell an insert from an update. The upsert
		// is an INSERT ... DO NOTHING and, only when it inserted nothing, the
		// fenced UPDATE: inserted is true exactly when the INSERT returned the
		// row. A row that another transaction inserted after this statement's
		// snapshot stops the INSERT but is not seen by the UPDATE (READ
		// COMMITTED): nothing is written, and run's re-read explains it (a
		// newer fence) or reports a retryable refusal.
		t.upsert = "WITH pgfence_i (fence) AS (" + insert + " DO NOTHING RETURNING pgfence_t." + fence + ")" +
			", pgfence_u (fence) AS (UPDATE " + from + " AS pgfence_t SET " + strings.Join(sets, ", ") + ", " + fence + " = $1 WHERE " +
			keyWhere + " AND pgfence_t." + fence + " " + s.Mode.op() + " $1 AND NOT EXISTS (SELECT 1 FROM pgfence_i) RETURNING pgfence_t." + fence + ")" +
			", pgfence_w (fence, inserted) AS (SELECT fence, true FROM pgfence_i UNION ALL SELECT fence, false FROM pgfence_u)" +
			"\nSELECT true, fence, inserted FROM pgfence_w" + refusedBranch(", false")
	}

	// The delete names its token with pgfence.use_token, which a guarded
	// table's trigger reads (a DELETE has no new row to carry it).
	t.delete = "WITH pgfence_tok (token) AS MATERIALIZED (SELECT pgfence.use_token($1)), pgfence_w (fence) AS (DELETE FROM " +
		from + " AS pgfence_t USING pgfence_tok WHERE " + keyWhere +
		" AND pgfence_t." + fence + " OPERATOR(pg_catalog.<=) pgfence_tok.token RETURNING pgfence_t." + fence + ")" +
		"\nSELECT true, fence FROM pgfence_w" + refusedBranch("")

	var ret, retCur []string
	for _, c := range s.Read {
		ret = append(ret, "pgfence_t."+ident(c))
		retCur = append(retCur, "pgfence_c."+ident(c))
	}
	t.read = "WITH pgfence_w AS (UPDATE " + from + " AS pgfence_t SET " + fence + " = $1 WHERE " + keyWhere +
		" AND pgfence_t." + fence + " OPERATOR(pg_catalog.<=) $1 RETURNING pgfence_t." + fence + ", " + strings.Join(ret, ", ") + ")" +
		"\nSELECT true, pgfence_w.* FROM pgfence_w" + refusedBranch(", "+strings.Join(retCur, ", "))

	var rk []string
	for i, k := range s.Key {
		rk = append(rk, ident(k)+eq(k)+param(1+i))
	}
	t.reread = "SELECT " + fence + " FROM " + from + " WHERE " + strings.Join(rk, " AND ")
}

func (t *Table) args(token int64, key, set []any, wantSet bool) ([]any, error) {
	if err := checkToken(token); err != nil {
		return nil, err
	}
	if len(key) != len(t.spec.Key) {
		return nil, invalid("key", "%d key values for %d key columns", len(key), len(t.spec.Key))
	}
	for i, v := range key {
		// A NULL key is never equal to anything: Update, Delete and Read
		// would find no row, and Upsert would insert one on every call,
		// never refused.
		if nilcheck.IsNil(v) {
			return nil, invalid("key", "value %d (column %q) is nil: a key identifies one row only with non-NULL values", i, t.spec.Key[i])
		}
	}
	if wantSet && len(set) != len(t.spec.Set) {
		return nil, invalid("set", "%d set values for %d set columns", len(set), len(t.spec.Set))
	}
	args := make([]any, 0, 1+len(key)+len(set))
	args = append(args, token)
	args = append(args, key...)
	if wantSet {
		args = append(args, set...)
	}
	return args, nil
}

func (t *Table) rereader(db pgfence.DBTX, key []any) func(context.Context) (bool, int64, error) {
	return func(ctx context.Context) (bool, int64, error) {
		var f int64
		err := db.QueryRow(ctx, t.reread, key...).Scan(&f)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, 0, nil
		}
		return err == nil, f, err
	}
}

// Update sets the Set columns of the row identified by key to set (values in
// the order of Spec.Key and Spec.Set; a nil key value is [pgfence.ErrInvalid]) and its fence to token, if the row's
// fence allows it (Strict: fence < token; Reentrant: fence <= token).
// Otherwise it returns [pgfence.ErrStaleToken], [pgfence.ErrAlreadyApplied]
// or [pgfence.ErrNotFound]; a guard refusal is [pgfence.ErrGuard]. An
// accepted write is one round trip (the plain fenced UPDATE ... RETURNING); a
// refused one takes a second, which reads the row to say why (if the row
// changed in between so that it would now accept the write, the error has no
// Kind and says so). Bad input ([pgfence.ErrInvalid]) is rejected before any
// SQL runs.
//
// ctx bounds the statement. If it is cancelled while the statement runs the
// write may or may not have been applied; in strict mode repeat it with the
// same token to find out ([pgfence.ErrAlreadyApplied] means it was).
func (t *Table) Update(ctx context.Context, db pgfence.DBTX, token int64, key, set []any) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.Update", t.label)
	args, err := t.args(token, key, set, true)
	if err != nil {
		return Result{}, err
	}
	res, err := t.run(ctx, db, t.update, t.spec.Mode, token, key, args, runUpdate)
	return res, t.record(ctx, "update", token, err)
}

// Upsert inserts a row with key, set and fence = token, or updates the
// existing row under the fence check of Spec.Mode. It never returns
// [pgfence.ErrNotFound]; Result.Inserted reports an insert. Columns not in
// Key or Set get their defaults on insert.
//
// On a partitioned table, whose INSERT ... ON CONFLICT cannot say whether it
// inserted, Upsert is an INSERT ... ON CONFLICT DO NOTHING followed, in the
// same statement, by the fenced update when nothing was inserted. Under READ
// COMMITTED, a row another transaction inserted (and committed) after the
// statement began is then neither inserted nor updated: the write is refused
// with [pgfence.ErrStaleToken] or [pgfence.ErrAlreadyApplied] when that
// row's fence explains it, and otherwise with an error without Kind
// ([pgfence.IsRetryable] is true): nothing was written, send it again.
func (t *Table) Upsert(ctx context.Context, db pgfence.DBTX, token int64, key, set []any) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.Upsert", t.label)
	args, err := t.args(token, key, set, true)
	if err != nil {
		return Result{}, err
	}
	res, err := t.run(ctx, db, t.upsert, t.spec.Mode, token, key, args, runUpsert)
	return res, t.record(ctx, "upsert", token, err)
}

// Delete deletes the row identified by key unless a newer grant wrote it
// (fence <= token, whatever Spec.Mode says: a grant may delete what it
// wrote). A deleted row keeps no fence: an older grant may insert it again
// with Upsert, so prefer a tombstone column where that matters.
func (t *Table) Delete(ctx context.Context, db pgfence.DBTX, token int64, key []any) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.Delete", t.label)
	args, err := t.args(token, key, nil, false)
	if err != nil {
		return Result{}, err
	}
	res, err := t.run(ctx, db, t.delete, Reentrant, token, key, args, runDelete)
	return res, t.record(ctx, "delete", token, err)
}

// record reports the outcome of a fenced statement to Spec.Metrics and
// Spec.Logger and returns err unchanged.
func (t *Table) record(ctx context.Context, op string, token int64, err error) error {
	// Metrics are called only when set: the label argument of a call through
	// the interface is allocated even when the implementation is a no-op.
	m, log := t.spec.Metrics, t.spec.Logger
	if err == nil {
		if m != nil {
			m.Add(ctx, metricdefs.FencedWritesTotal, 1, t.label)
		}
		if log != nil {
			log.DebugContext(ctx, "fencedwrite: applied", "table", t.spec.Table, "op", op, "token", token)
		}
		return nil
	}
	var reason string
	switch {
	case errors.Is(err, pgfence.ErrStaleToken):
		reason = metricdefs.RefusedStale
	case errors.Is(err, pgfence.ErrAlreadyApplied):
		reason = metricdefs.RefusedAlreadyApplied
	case errors.Is(err, pgfence.ErrNotFound):
		reason = metricdefs.RefusedNotFound
	case errors.Is(err, pgfence.ErrGuard):
		reason = metricdefs.RefusedGuard
	default:
		return err
	}
	if m != nil {
		m.Add(ctx, metricdefs.FencedRefusedTotal, 1, t.label, reason)
	}
	if log != nil {
		log.InfoContext(ctx, "fencedwrite: write refused", "table", t.spec.Table, "op", op, "token", token, "reason", reason, "err", err)
	}
	return err
}

// scanBuf holds the destinations of a fenced statement's row (applied,
// fence, inserted) and the slice of pointers to them that Scan takes. A
// pooled one saves the three allocations that passing fresh pointers
// through the pgx.Row interface costs on every write.
type scanBuf struct {
	applied, inserted bool
	fence             int64
	dest              [3]any
}

var scanBufs = sync.Pool{New: func() any {
	sb := &scanBuf{}
	sb.dest = [3]any{&sb.applied, &sb.fence, &sb.inserted}
	return sb
}}

// runKind says which statement run executes and how it answers a refusal.
type runKind uint8

const (
	// runUpdate: a plain fenced UPDATE ... RETURNING; no row = refused or
	// not found, and run re-reads the row to say which.
	runUpdate runKind = iota
	// runUpsert: returns (applied, fence, inserted), from the row as the
	// statement saw it when refused.
	runUpsert
	// runDelete: returns (applied, fence), from the row as the statement saw
	// it when refused; no row = not found.
	runDelete
)

// run executes one fenced statement and turns a refusal into its error. A
// write that changed nothing is always an error: code that checks only err
// never takes it for a success.
func (t *Table) run(ctx context.Context, db pgfence.DBTX, sql string, mode Mode, token int64, key, args []any, kind runKind) (Result, error) {
	if nilcheck.IsNil(db) {
		return Result{}, errNilDB()
	}
	sb := scanBufs.Get().(*scanBuf)
	dest := sb.dest[:2]
	if kind == runUpsert {
		dest = sb.dest[:3]
	}
	err := db.QueryRow(ctx, sql, args...).Scan(dest...)
	applied, fence, inserted := sb.applied, sb.fence, sb.inserted
	sb.applied, sb.fence, sb.inserted = false, 0, false
	scanBufs.Put(sb)
	found := true
	if errors.Is(err, pgx.ErrNoRows) {
		found, err = false, nil
	}
	if err != nil {
		return Result{}, translateErr(err)
	}
	if applied {
		return Result{Fence: fence, Inserted: inserted}, nil
	}
	reread := t.rereader(db, key)
	if kind != runDelete && !found {
		// The update refused without saying why, or the upsert's row went
		// away under it: read the row now.
		found, fence, err = reread(ctx)
		if err != nil {
			return Result{}, translateErr(err)
		}
		if kind == runUpsert && !found {
			return Result{}, concurrentError(token)
		}
	}
	return Result{}, refused(ctx, mode, token, found, fence, reread)
}

// Read is the fenced read of a read-modify-write: it raises the row's fence
// to token (fence <= token) and scans the Spec.Read columns into dest, so a
// write by an older grant is refused from then on. Write back with a
// [Reentrant] table and the same token, or use [Table.Modify]. It returns
// [pgfence.ErrStaleToken] when a newer grant read or wrote the row and
// [pgfence.ErrNotFound] when there is none; dest is only filled on success.
// A dest that cannot hold its column (a *int64 for a text column) is
// [pgfence.ErrInvalid] naming dest, found only once the row is read: the
// read has then been applied, the fence raised (roll the transaction back
// to undo it; on a pool it is committed).
//
// The read is an UPDATE: it locks the row until the transaction ends, and a
// strict guard refuses it when the fence already equals token (guard such
// tables in reentrant mode).
func (t *Table) Read(ctx context.Context, db pgfence.DBTX, token int64, key []any, dest ...any) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.Read", t.label)
	return t.readRow(ctx, db, token, key, dest...)
}

// readRow is [Table.Read] without the Op.
func (t *Table) readRow(ctx context.Context, db pgfence.DBTX, token int64, key []any, dest ...any) (_ Result, err error) {
	defer func() { err = t.record(ctx, "read", token, err) }()
	args, err := t.args(token, key, nil, false)
	if err != nil {
		return Result{}, err
	}
	if len(dest) != len(t.spec.Read) {
		return Result{}, invalid("dest", "%d destinations for %d read columns", len(dest), len(t.spec.Read))
	}
	if nilcheck.IsNil(db) {
		return Result{}, errNilDB()
	}
	rows, err := db.Query(ctx, t.read, args...)
	if err != nil {
		return Result{}, translateErr(err)
	}
	defer rows.Close()
	var (
		applied, found bool
		fence          int64
	)
	if rows.Next() {
		found = true
		vals, err := rows.Values()
		if err != nil {
			return Result{}, translateErr(err)
		}
		applied, _ = vals[0].(bool)
		fence, _ = vals[1].(int64)
		if applied {
			// Scan the columns into dest with pgx's type system.
			if err := rows.Scan(append([]any{nil, nil}, dest...)...); err != nil {
				// The UPDATE has run: the row's fence is the token (on a
				// pool, committed). A dest of the wrong type is the
				// caller's error, not the database's.
				e := invalid("dest", "cannot hold the read columns; the read was applied: the row's fence is now %d", fence)
				e.Err = err
				return Result{Fence: fence}, e
			}
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return Result{}, translateErr(err)
	}
	if applied {
		return Result{Fence: fence}, nil
	}
	return Result{}, refused(ctx, Reentrant, token, found, fence, t.rereader(db, key))
}

// Modify is a read-modify-write of one row in one transaction under one
// fence check: a fenced [Table.Read] of the Spec.Read columns (raising the
// fence to token and locking the row), fn with the values read (as pgx
// decodes them: int64, string, time.Time, ...), and an update of the Set
// columns to the values fn returns with fence <= token, committed together.
// If fn returns an error the transaction is rolled back and nothing changes,
// not even the fence. db may be a pool, a connection, or a transaction (a
// savepoint is used). ctx bounds the whole transaction.
func (t *Table) Modify(ctx context.Context, db Beginner, token int64, key []any,
	fn func(current []any) (next []any, err error)) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.Modify", t.label)
	if _, err := t.args(token, key, nil, false); err != nil {
		return Result{}, err
	}
	if fn == nil {
		return Result{}, invalid("fn", "nil")
	}
	var res Result
	err = inTx(ctx, db, func(tx pgx.Tx) error {
		cur := make([]any, len(t.spec.Read))
		dest := make([]any, len(cur))
		for i := range cur {
			dest[i] = &cur[i]
		}
		if _, err := t.readRow(ctx, tx, token, key, dest...); err != nil {
			return err
		}
		next, err := fn(cur)
		if err != nil {
			return err
		}
		args, err := t.args(token, key, next, true)
		if err != nil {
			return err
		}
		res, err = t.run(ctx, tx, t.updateReentrant, Reentrant, token, key, args, runUpdate)
		return err
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}
