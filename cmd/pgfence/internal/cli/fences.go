package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
)

// ExitForged is returned by `pgfence fences` when a row's fence is above every
// token its lock ever issued.
const ExitForged = 5

const maxIdentBytes = 63

// fenceRow is one row of `pgfence fences`.
type fenceRow struct {
	Key       []string `json:"key"`
	Fence     int64    `json:"fence"`
	LockName  *string  `json:"lock"`
	LockToken *int64   `json:"lock_token"`
	Status    string   `json:"status"`
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
  FORGED   fence > token: the row carries a token the lock never issued
  no-lock  the lock row does not exist

The governing lock is one name for the whole table (--lock) or a column of the
table holding the lock name per row (--lock-column). Exit code 5 when any row is
FORGED.`,
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
			for _, c := range append([]string{fenceCol, lockCol}, keys...) {
				if c == lockCol && c == "" {
					continue
				}
				if err := checkIdent(c); err != nil {
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
			rows, err := queryFences(ctx, pool, table, fenceCol, keys, lockName, lockCol, limit)
			if err != nil {
				return err
			}
			forged := 0
			for _, r := range rows {
				if r.Status == fenceForged {
					forged++
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
						key[i] = termSafe(k) // values from the table: no terminal escapes, no forged rows
					}
					fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", strings.Join(key, ","), r.Fence, termSafeOr(r.LockName, "-"), tok, r.Status)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
			}
			if forged > 0 {
				return withCode(ExitForged, fmt.Errorf("%d row(s) carry a fence above any token issued by their lock", forged))
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
	f.IntVar(&limit, "limit", 1000, "maximum rows")
	f.BoolVar(&jsonOut, "json", false, "print JSON")
	return cmd
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

func queryFences(ctx context.Context, pool *pgxpool.Pool, table, fenceCol string, keys []string, lockName, lockCol string, limit int) ([]fenceRow, error) {
	ident, err := splitTable(table)
	if err != nil {
		return nil, err
	}
	var regclass *uint32
	if err := pool.QueryRow(ctx, "SELECT pg_catalog.to_regclass($1)::pg_catalog.oid", ident.Sanitize()).Scan(&regclass); err != nil {
		return nil, err
	}
	if regclass == nil {
		return nil, withCode(ExitNotFound, fmt.Errorf("no table %s", ident.Sanitize()))
	}
	// Row-level security policies are the table owner's code, run as the
	// reader; a superuser bypasses them.
	var rls bool
	if err := pool.QueryRow(ctx, `SELECT c.relrowsecurity AND (c.relowner OPERATOR(pg_catalog.<>) r.oid) AND NOT r.rolsuper
		FROM pg_catalog.pg_class c, pg_catalog.pg_roles r
		WHERE (c.oid OPERATOR(pg_catalog.=) $1) AND (r.rolname OPERATOR(pg_catalog.=) current_user)`, *regclass).Scan(&rls); err != nil {
		return nil, err
	}
	if rls {
		return nil, fmt.Errorf("table %s has row-level security: not read, its policies are code of the table's owner (run this as the owner or a superuser)", ident.Sanitize())
	}
	cols := append([]string{fenceCol}, keys...)
	if lockCol != "" {
		cols = append(cols, lockCol)
	}
	if len(keys) == 0 {
		return nil, usageErr("--key needs at least one column")
	}
	for _, c := range cols {
		if err := checkIdent(c); err != nil {
			return nil, err
		}
		// builtin: a type of pg_catalog, not a domain, so that printing the
		// column (::text) runs no code the table's owner defined; textual: a
		// lock name read as text without a cast function.
		var (
			typ              string
			builtin, textual bool
		)
		err := pool.QueryRow(ctx, `SELECT pg_catalog.format_type(a.atttypid, a.atttypmod),
				(t.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace) AND (t.typtype OPERATOR(pg_catalog.<>) 'd'),
				(a.atttypid OPERATOR(pg_catalog.=) ANY ('{pg_catalog.text,pg_catalog.varchar,pg_catalog.bpchar,pg_catalog.name}'::pg_catalog.regtype[]::pg_catalog.oid[]))
			FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON (t.oid OPERATOR(pg_catalog.=) a.atttypid)
			WHERE (a.attrelid OPERATOR(pg_catalog.=) $1) AND (a.attname OPERATOR(pg_catalog.=) $2)
			  AND (a.attnum OPERATOR(pg_catalog.>) 0) AND NOT a.attisdropped`, *regclass, c).Scan(&typ, &builtin, &textual)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, withCode(ExitNotFound, fmt.Errorf("table %s has no column %q", ident.Sanitize(), c))
		}
		if err != nil {
			return nil, err
		}
		if !builtin || (c == lockCol && !textual) {
			return nil, fmt.Errorf("column %q of %s is of type %s: not read, its conversion to text could run code of the table's owner (lock names: text, varchar, char or name; keys: built-in types)",
				c, ident.Sanitize(), typ)
		}
		if c == fenceCol && typ != "bigint" {
			return nil, withCode(ExitNotFound, fmt.Errorf("column %q of %s is %s, want bigint (a fence column)", c, ident.Sanitize(), typ))
		}
	}

	keyExprs := make([]string, len(keys))
	for i, k := range keys {
		keyExprs[i] = "COALESCE(t." + pgx.Identifier{k}.Sanitize() + "::pg_catalog.text, 'NULL')"
	}
	fence := "t." + pgx.Identifier{fenceCol}.Sanitize()
	var lockExpr string
	args := []any{}
	if lockName != "" {
		lockExpr = "$1::pg_catalog.text"
		args = append(args, lockName)
	} else {
		lockExpr = "t." + pgx.Identifier{lockCol}.Sanitize() + "::pg_catalog.text"
	}
	q := fmt.Sprintf(`SELECT ARRAY[%s], %s, %s, l.token
		FROM %s t LEFT JOIN pgfence.lock_status l ON (l.name OPERATOR(pg_catalog.=) %s)
		ORDER BY %s LIMIT %d`,
		strings.Join(keyExprs, ", "), fence, lockExpr,
		ident.Sanitize(), lockExpr,
		strings.Join(keyExprs, ", "), limit)
	rows, err := pool.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (fenceRow, error) {
		var r fenceRow
		if err := row.Scan(&r.Key, &r.Fence, &r.LockName, &r.LockToken); err != nil {
			return r, err
		}
		switch {
		case r.LockToken == nil:
			r.Status = fenceNoLock
			if r.Fence > 0 {
				r.Status = fenceForged
			}
		case r.Fence > *r.LockToken:
			r.Status = fenceForged
		case r.Fence == *r.LockToken:
			r.Status = fenceCurrent
		default:
			r.Status = fenceBehind
		}
		return r, nil
	})
	return out, err
}
