package cli

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// ExitForged is returned by `pgfence fences` when a row's fence is above every
// token its lock ever issued.
const ExitForged = 5

const maxIdentBytes = 63

// fenceRow is one row of `pgfence fences`.
type fenceRow struct {
	Key       []*string `json:"key"` // nil: the key column is NULL (JSON null)
	Fence     int64     `json:"fence"`
	LockName  *string   `json:"lock"`
	LockToken *int64    `json:"lock_token"`
	Status    string    `json:"status"`
}

// Statuses of a fenced row compared with its lock's current token.
const (
	fenceCurrent = "current" // fence = token: written under the latest grant
	fenceBehind  = "behind"  // fence < token: not written since the latest grant (or a writer skipped the check)
	fenceForged  = "FORGED"  // fence > token: a token the lock never issued
	fenceNoLock  = "no-lock" // the governing lock row does not exist
)

func (a *app) fencesCommand() *cobra.Command {
	var (
		table, fenceCol, lockName, lockCol string
		keys                               []string
		limit                              int
		jsonOut                            bool
	)
	cmd := &cobra.Command{
		Use:   "fences --table T (--lock NAME | --lock-column COL)",
		Short: "Show a fenced table's fence values next to the governing lock's token; flag forged fences",
		Long: `For each row of a fenced table, print its key, its fence (the highest token the
row accepted) and the current token of the lock that governs it, with a status:

  current  fence = token: the row was written under the latest grant
  behind   fence < token: not written since the latest grant. After an incident
           ("a newer write was lost"), a row that should have been written by the
           latest holder but is behind means a writer skipped the fence check.
  FORGED   fence > token: the row carries a token the lock never issued (with
           --lock-column, also a fence above 0 under a lock that has no row
           in pgfence.locks: that lock issued no token)
  no-lock  (--lock-column) fence 0 and the lock the row names has no row in
           pgfence.locks: never granted, or a misspelt name in the column

The governing lock is one name for the whole table (--lock; a name with no lock
row exits 3) or a column of the table holding the lock name per row
(--lock-column). Exit code 5 when any row is FORGED.

Rows are listed in key order (the key columns' own types, NULL last), at most
--limit of them; the statuses and the exit code count every row of the table.
When rows are left out, stderr says how many, with the count of each status.

Only ordinary and partitioned tables are read (a view, materialized view,
foreign table or sequence exits 3: a view's query could call any function as
you), in a READ ONLY, REPEATABLE READ transaction. A NULL key is null under
--json and NULL in the table, where a key that is the text NULL or holds a
comma is quoted.`,
		Example: `  pgfence fences --table public.invoices --key id --lock invoices
  pgfence fences --table catalogue --key store_id,sku --lock-column store_lock --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if table == "" {
				return usageErr("--table is required")
			}
			if (lockName == "") == (lockCol == "") {
				return usageErr("give exactly one of --lock NAME or --lock-column COL")
			}
			if limit <= 0 {
				return usageErr("--limit must be > 0")
			}
			// The names, before connecting: exit 2 with or without a database.
			if _, err := splitTable(table); err != nil {
				return err
			}
			if len(keys) == 0 {
				return usageErr("--key needs at least one column")
			}
			if err := checkFlagIdent("--fence-column", fenceCol); err != nil {
				return err
			}
			if lockCol != "" {
				if err := checkFlagIdent("--lock-column", lockCol); err != nil {
					return err
				}
			}
			for _, c := range keys {
				if err := checkFlagIdent("--key", c); err != nil {
					return err
				}
			}
			if lockName != "" {
				if err := checkLockName(lockName); err != nil {
					return err
				}
			}
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, counts, err := queryFences(ctx, pool, table, fenceCol, keys, lockName, lockCol, limit)
			if err != nil {
				return err
			}
			forgedShown := 0
			for _, r := range rows {
				if r.Status == fenceForged {
					forgedShown++
				}
			}
			if jsonOut {
				if err := writeJSON(a.env.Stdout, rows); err != nil {
					return err
				}
			} else {
				tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
				header := make([]string, len(keys))
				for i, k := range keys {
					header[i] = termSafe(strings.ToUpper(k)) // column names: any characters
				}
				fmt.Fprintf(tw, "%s\tFENCE\tLOCK\tLOCK TOKEN\tSTATUS\n", strings.Join(header, ","))
				for _, r := range rows {
					tok := "-"
					if r.LockToken != nil {
						tok = fmt.Sprint(*r.LockToken)
					}
					key := make([]string, len(r.Key))
					for i, k := range r.Key {
						key[i] = keySafe(k) // values from the table: no terminal escapes, no forged rows
					}
					fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", strings.Join(key, ","), r.Fence, termSafeOr(r.LockName, "-"), tok, r.Status)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
			}
			if more := counts.total - int64(len(rows)); more > 0 {
				// The statuses and the exit code count every row; only the
				// listing stops at --limit.
				fmt.Fprintf(a.env.Stderr, "pgfence: %d more row(s) not shown (--limit %d); all %d rows: %d current, %d behind, %d FORGED, %d no-lock\n",
					more, limit, counts.total, counts.current, counts.behind, counts.forged, counts.noLock)
			}
			if counts.forged > 0 {
				msg := fmt.Sprintf("%d row(s) carry a fence above any token issued by their lock", counts.forged)
				if hidden := counts.forged - int64(forgedShown); hidden > 0 {
					msg += fmt.Sprintf(" (%d of them not shown: beyond --limit %d)", hidden, limit)
				}
				return withCode(ExitForged, errors.New(msg))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&table, "table", "", "fenced table, optionally schema-qualified (schema.table)")
	f.StringSliceVar(&keys, "key", []string{"id"}, "key column(s) to print, comma-separated")
	f.StringVar(&fenceCol, "fence-column", "fence", "the table's fence column")
	f.StringVar(&lockName, "lock", "", "name of the lock that governs every row")
	f.StringVar(&lockCol, "lock-column", "", "column holding each row's lock name")
	f.IntVar(&limit, "limit", 1000, "maximum rows listed (the statuses and the exit code count every row)")
	f.BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
}

// keySafe returns a key value of `pgfence fences` for its table output:
// NULL, bare, for SQL NULL; otherwise [termSafe] of the text, also quoted as
// a Go string when it is the text "NULL" or holds a comma (which separates
// the columns of a composite key), so that a printed key is never ambiguous.
func keySafe(k *string) string {
	switch {
	case k == nil:
		return "NULL"
	case *k == "NULL" || strings.Contains(*k, ","):
		return strconv.Quote(*k)
	}
	return termSafe(*k)
}

// checkFlagIdent is checkIdent for a column named by flag, named in the error.
func checkFlagIdent(flag, s string) error {
	if err := checkIdent(s); err != nil {
		return usageErr("%s: %v", flag, err)
	}
	return nil
}

// splitTable turns "schema.table" or "table" into a pgx.Identifier. Quoting is
// left to pgx; names are checked only for emptiness and length.
func splitTable(s string) (pgx.Identifier, error) {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return nil, usageErr("table %q: want table or schema.table", s)
	}
	for _, p := range parts {
		if err := checkIdent(p); err != nil {
			return nil, err
		}
	}
	return pgx.Identifier(parts), nil
}

func checkIdent(s string) error {
	if s == "" {
		return usageErr("empty identifier")
	}
	if len(s) > maxIdentBytes {
		return usageErr("identifier %.20q... is longer than %d bytes", s, maxIdentBytes)
	}
	if strings.ContainsRune(s, 0) {
		return usageErr("identifier contains a NUL byte")
	}
	return nil
}

// Relation kinds `pgfence fences` reads: ordinary and partitioned tables,
// the only relations a fenced write updates. Anything else is refused: a
// view (selecting from it runs its query, in which the view's owner may call
// any function, as the role running pgfence), a foreign table (its wrapper
// runs), and also a materialized view, which would be safe to read (stored
// rows) but is never a fenced table (it cannot be updated) and cannot be
// locked with LOCK TABLE, which closes the window between the checks and
// the read.
const fenceRelkinds = "rp"

// queryFences reads the fences of table, at most limit rows in key order, and
// counts the rows of the whole table by status, in a READ ONLY, REPEATABLE
// READ transaction (the count and the rows agree) that first takes ACCESS
// SHARE on the table (so its kind, row-level security and column types
// checked below cannot change before the read), and refuses
// whatever would run code of the table's owner as the reader: a relation
// that is not a table or materialized view, row-level security policies, a
// column of a type whose output function is not built in. The READ ONLY
// transaction is defence in depth: should code of someone else run anyway,
// it cannot write.
func queryFences(ctx context.Context, pool *pgxpool.Pool, table, fenceCol string, keys []string, lockName, lockCol string, limit int) ([]fenceRow, fenceCounts, error) {
	ident, err := splitTable(table)
	if err != nil {
		return nil, fenceCounts{}, err
	}
	if len(keys) == 0 {
		return nil, fenceCounts{}, usageErr("--key needs at least one column")
	}
	var regclass *uint32
	if err := pool.QueryRow(ctx, "SELECT pg_catalog.to_regclass($1)::pg_catalog.oid", ident.Sanitize()).Scan(&regclass); err != nil {
		return nil, fenceCounts{}, err
	}
	if regclass == nil {
		return nil, fenceCounts{}, withCode(ExitNotFound, fmt.Errorf("no table %s", ident.Sanitize()))
	}
	var kind string
	if err := pool.QueryRow(ctx, "SELECT c.relkind::pg_catalog.text FROM pg_catalog.pg_class c WHERE (c.oid OPERATOR(pg_catalog.=) $1)", *regclass).Scan(&kind); err != nil {
		return nil, fenceCounts{}, err
	}
	if err := checkFenceRelkind(ident, kind); err != nil {
		return nil, fenceCounts{}, err
	}
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fenceCounts{}, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// ACCESS SHARE, the lock the read takes anyway: from here on nobody can
	// turn the table into something else, enable row-level security or
	// change a column's type until the read is done. Checked again under
	// the lock: the name may now resolve to another relation.
	if _, err := tx.Exec(ctx, "LOCK TABLE "+ident.Sanitize()+" IN ACCESS SHARE MODE"); err != nil {
		return nil, fenceCounts{}, err
	}
	var locked *uint32
	if err := tx.QueryRow(ctx, `SELECT c.oid, c.relkind::pg_catalog.text FROM pg_catalog.pg_class c
		WHERE (c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass($1))`, ident.Sanitize()).Scan(&locked, &kind); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fenceCounts{}, err
	}
	if locked == nil || *locked != *regclass {
		return nil, fenceCounts{}, fmt.Errorf("table %s was replaced while pgfence read it: run again", ident.Sanitize())
	}
	if err := checkFenceRelkind(ident, kind); err != nil {
		return nil, fenceCounts{}, err
	}
	// Reading a partitioned or inheritance parent reads its descendants
	// (locked too by LOCK TABLE): each must be a table as well.
	var other *string
	if err := tx.QueryRow(ctx, `WITH RECURSIVE d(oid) AS (
			SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE (i.inhparent OPERATOR(pg_catalog.=) $1)
			UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN d ON (i.inhparent OPERATOR(pg_catalog.=) d.oid))
		SELECT pg_catalog.format('%s (relkind %s)', c.oid::pg_catalog.regclass, c.relkind)
		FROM d JOIN pg_catalog.pg_class c ON (c.oid OPERATOR(pg_catalog.=) d.oid)
		WHERE c.relkind::pg_catalog.text OPERATOR(pg_catalog.<>) ALL ('{r,p}'::pg_catalog.text[]) LIMIT 1`, *regclass).Scan(&other); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fenceCounts{}, err
	}
	if other != nil {
		return nil, fenceCounts{}, fmt.Errorf("table %s has a partition or child that is not a table, %s: not read, reading it could run code of its owner", ident.Sanitize(), termSafe(*other))
	}
	// Row-level security policies are the table owner's code, run as the
	// reader; a superuser bypasses them.
	var rls bool
	if err := tx.QueryRow(ctx, `SELECT c.relrowsecurity AND (c.relowner OPERATOR(pg_catalog.<>) r.oid) AND NOT r.rolsuper
		FROM pg_catalog.pg_class c, pg_catalog.pg_roles r
		WHERE (c.oid OPERATOR(pg_catalog.=) $1) AND (r.rolname OPERATOR(pg_catalog.=) current_user)`, *regclass).Scan(&rls); err != nil {
		return nil, fenceCounts{}, err
	}
	if rls {
		return nil, fenceCounts{}, fmt.Errorf("table %s has row-level security: not read, its policies are code of the table's owner (run this as the owner or a superuser)", ident.Sanitize())
	}
	cols := append([]string{fenceCol}, keys...)
	if lockCol != "" {
		cols = append(cols, lockCol)
	}
	for _, c := range cols {
		if err := checkIdent(c); err != nil {
			return nil, fenceCounts{}, err
		}
		// builtin: a type of pg_catalog, not a domain, so that printing the
		// column (::text) runs no code the table's owner defined; textual: a
		// lock name read as text without a cast function.
		var (
			typ              string
			builtin, textual bool
		)
		err := tx.QueryRow(ctx, `SELECT pg_catalog.format_type(a.atttypid, a.atttypmod),
				(t.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace) AND (t.typtype OPERATOR(pg_catalog.<>) 'd'),
				(a.atttypid OPERATOR(pg_catalog.=) ANY ('{pg_catalog.text,pg_catalog.varchar,pg_catalog.bpchar,pg_catalog.name}'::pg_catalog.regtype[]::pg_catalog.oid[]))
			FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON (t.oid OPERATOR(pg_catalog.=) a.atttypid)
			WHERE (a.attrelid OPERATOR(pg_catalog.=) $1) AND (a.attname OPERATOR(pg_catalog.=) $2)
			  AND (a.attnum OPERATOR(pg_catalog.>) 0) AND NOT a.attisdropped`, *regclass, c).Scan(&typ, &builtin, &textual)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, fenceCounts{}, withCode(ExitNotFound, fmt.Errorf("table %s has no column %q", ident.Sanitize(), c))
		}
		if err != nil {
			return nil, fenceCounts{}, err
		}
		if !builtin || (c == lockCol && !textual) {
			return nil, fenceCounts{}, fmt.Errorf("column %q of %s is of type %s: not read, its conversion to text could run code of the table's owner (lock names: text, varchar, char or name; keys: built-in types)",
				c, ident.Sanitize(), typ)
		}
		if c == fenceCol && typ != "bigint" {
			return nil, fenceCounts{}, withCode(ExitNotFound, fmt.Errorf("column %q of %s is %s, want bigint (a fence column)", c, ident.Sanitize(), typ))
		}
	}

	fence := "t." + pgx.Identifier{fenceCol}.Sanitize()
	var lockExpr string
	args := []any{}
	if lockName != "" {
		// One lock for the whole table: a name with no lock row is a
		// misspelt --lock (exit 3), not a table of no-lock rows.
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pgfence.lock_status l WHERE (l.name OPERATOR(pg_catalog.=) $1::pg_catalog.text))`,
			lockName).Scan(&exists); err != nil {
			return nil, fenceCounts{}, err
		}
		if !exists {
			return nil, fenceCounts{}, withCode(ExitNotFound, fmt.Errorf("no lock named %q: --lock names no row of pgfence.locks (misspelt? pgfence locks lists them)", lockName))
		}
		lockExpr = "$1::pg_catalog.text"
		args = append(args, lockName)
	} else {
		// Byte for byte, as the guard compares it (migration 00030), not
		// under the column's collation: under a nondeterministic one the
		// rows of 'orders-acme' matched the lock of 'orders-ACME' too.
		lockExpr = "(t." + pgx.Identifier{lockCol}.Sanitize() + "::pg_catalog.text COLLATE pg_catalog.\"default\")"
	}
	from := fmt.Sprintf("%s t LEFT JOIN pgfence.lock_status l ON (l.name OPERATOR(pg_catalog.=) %s)", ident.Sanitize(), lockExpr)

	// The statuses of every row, counted in the database: the exit code
	// and the summary cover the whole table, not only the rows listed.
	// The transaction is REPEATABLE READ, so the count and the listing
	// below read the same rows.
	var counts fenceCounts
	if err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT pg_catalog.count(*),
			pg_catalog.count(*) FILTER (WHERE (%[1]s OPERATOR(pg_catalog.=) l.token)),
			pg_catalog.count(*) FILTER (WHERE (%[1]s OPERATOR(pg_catalog.<) l.token)),
			pg_catalog.count(*) FILTER (WHERE (%[1]s OPERATOR(pg_catalog.>) COALESCE(l.token, 0))),
			pg_catalog.count(*) FILTER (WHERE (l.token IS NULL AND %[1]s OPERATOR(pg_catalog.<=) 0))
		FROM %[2]s`, fence, from), args...).Scan(&counts.total, &counts.current, &counts.behind, &counts.forged, &counts.noLock); err != nil {
		return nil, fenceCounts{}, err
	}

	// Keys are printed as text; NULL stays NULL (JSON null, NULL in the
	// table). Rows are listed in the order of the keys' own types (numbers
	// as numbers), NULL last; a key type with no ordering (json, point)
	// falls back to its text.
	keyExprs := make([]string, len(keys))
	keyCols := make([]string, len(keys))
	for i, k := range keys {
		keyCols[i] = "t." + pgx.Identifier{k}.Sanitize()
		keyExprs[i] = keyCols[i] + "::pg_catalog.text"
	}
	page := func(q pgx.Tx, order []string) ([]fenceRow, error) {
		rows, err := q.Query(ctx, fmt.Sprintf(`SELECT ARRAY[%s], %s, %s, l.token FROM %s ORDER BY %s LIMIT %d`,
			strings.Join(keyExprs, ", "), fence, lockExpr, from, strings.Join(order, ", "), limit), args...)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, scanFenceRow)
	}
	// Natively ordered in a savepoint: a type without a btree ordering
	// fails there (42883, no ordering operator or comparison function),
	// and the text order is used instead.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, fenceCounts{}, err
	}
	out, err := page(sp, keyCols)
	if err == nil {
		err = sp.Commit(ctx)
	} else if pgerr.Code(err) == pgerr.UndefinedFunction {
		if err = sp.Rollback(ctx); err == nil {
			out, err = page(tx, keyExprs)
		}
	}
	if err != nil {
		return nil, fenceCounts{}, err
	}
	return out, counts, tx.Commit(ctx)
}

// fenceCounts counts the rows of a fenced table by status.
type fenceCounts struct {
	total, current, behind, forged, noLock int64
}

// scanFenceRow reads one row of the listing of queryFences and gives it its
// status.
func scanFenceRow(row pgx.CollectableRow) (fenceRow, error) {
	var r fenceRow
	if err := row.Scan(&r.Key, &r.Fence, &r.LockName, &r.LockToken); err != nil {
		return r, err
	}
	switch {
	case r.LockToken == nil && r.Fence > 0:
		// No lock row, so no token was ever issued under the name the
		// row's lock column gives: a fence above 0 is not one of its
		// tokens (as pgfence.guarded_fences counts it).
		r.Status = fenceForged
	case r.LockToken == nil:
		// No lock row and no fence: never written under a grant
		// (--lock-column names a lock that was never granted, or is
		// misspelt).
		r.Status = fenceNoLock
	case r.Fence > *r.LockToken:
		r.Status = fenceForged
	case r.Fence == *r.LockToken:
		r.Status = fenceCurrent
	default:
		r.Status = fenceBehind
	}
	return r, nil
}

// checkFenceRelkind refuses a relation `pgfence fences` does not read (see
// fenceRelkinds), exit 3 as for a name that is no table.
func checkFenceRelkind(ident pgx.Identifier, kind string) error {
	if len(kind) == 1 && strings.Contains(fenceRelkinds, kind) {
		return nil
	}
	what := map[string]string{"v": "a view", "m": "a materialized view", "f": "a foreign table", "S": "a sequence", "i": "an index", "I": "a partitioned index",
		"c": "a composite type", "t": "a TOAST table"}[kind]
	if what == "" {
		what = fmt.Sprintf("a relation of kind %q", kind)
	}
	return withCode(ExitNotFound, fmt.Errorf("%s is %s, not a table: not read (fences reads tables and partitioned tables: a view's query, for one, would run as this role)",
		ident.Sanitize(), what))
}
