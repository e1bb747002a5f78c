package pgident

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// ErrUnknownTable is matched by every *[TableError].
var ErrUnknownTable = errors.New("unknown table")

// TableError reports a name that is not an ordinary or partitioned table.
type TableError struct {
	Table string // the quoted name that was looked up
	Kind  string // pg_class.relkind of what the name is; empty when nothing is
}

// Error names the table and, for another kind of relation, its relkind.
func (e *TableError) Error() string {
	if e.Kind == "" {
		return e.Table
	}
	return fmt.Sprintf("%s is not a table (relkind %s)", e.Table, e.Kind)
}

// Is reports whether target is [ErrUnknownTable].
func (e *TableError) Is(target error) bool { return target == ErrUnknownTable }

// Querier runs one query: *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Column is one column of a [Table].
type Column struct {
	Name       string `json:"name"`
	Type       string `json:"type"` // as format_type prints it, e.g. "bigint", "character varying(20)"
	NotNull    bool   `json:"not_null"`
	HasDefault bool   `json:"has_default"` // a default or a generation expression
	Generated  bool   `json:"generated"`   // GENERATED ALWAYS AS (...) STORED
	// Builtin: the column's type is one of PostgreSQL's own (schema
	// pg_catalog), whose operators statements name as OPERATOR(pg_catalog.op).
	Builtin bool `json:"builtin"`
}

// Table is what [Lookup] reads from the catalog.
type Table struct {
	OID    uint32
	Schema string
	Name   string
	// Columns in attnum order, dropped columns left out.
	Columns []Column
	// UniqueKeys holds the key columns of the primary key (first) and of
	// each valid unique index without predicate or expressions; INCLUDE
	// columns are not part of a key.
	UniqueKeys [][]string
	// Triggers names the table's user triggers, sorted.
	Triggers []string
}

// Qualified returns the schema-qualified, quoted name.
func (t *Table) Qualified() string { return Quote(t.Schema, t.Name) }

// Column returns the named column (exact, case-sensitive match).
func (t *Table) Column(name string) (Column, bool) {
	for _, c := range t.Columns {
		if c.Name == name {
			return c, true
		}
	}
	return Column{}, false
}

// IsUniqueKey reports whether cols, in any order, are exactly the columns of
// one of keys.
func IsUniqueKey(keys [][]string, cols []string) bool {
	want := slices.Sorted(slices.Values(cols))
	for _, k := range keys {
		if slices.Equal(slices.Sorted(slices.Values(k)), want) {
			return true
		}
	}
	return false
}

// lookupSQL reads everything in one round trip. The name is a bound
// parameter; to_regclass parses its quoted form, resolves it through
// search_path and returns NULL (no row) when it does not exist.
const lookupSQL = `
SELECT c.oid, n.nspname::pg_catalog.text, c.relname::pg_catalog.text, c.relkind::pg_catalog.text,
       ARRAY(SELECT t.tgname::pg_catalog.text FROM pg_catalog.pg_trigger t
             WHERE (t.tgrelid OPERATOR(pg_catalog.=) c.oid) AND NOT t.tgisinternal ORDER BY 1),
       COALESCE((SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                        'name', a.attname::pg_catalog.text,
                        'type', pg_catalog.format_type(a.atttypid, a.atttypmod),
                        'not_null', a.attnotnull,
                        'has_default', a.atthasdef,
                        'generated', (a.attgenerated OPERATOR(pg_catalog.<>) ''),
                        'builtin', (ty.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace)) ORDER BY a.attnum)
                 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON (ty.oid OPERATOR(pg_catalog.=) a.atttypid)
                 WHERE (a.attrelid OPERATOR(pg_catalog.=) c.oid) AND (a.attnum OPERATOR(pg_catalog.>) 0) AND NOT a.attisdropped), '[]'),
       COALESCE((SELECT pg_catalog.json_agg(ARRAY(
                        SELECT a.attname::pg_catalog.text
                        FROM pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(attnum, ord)
                        JOIN pg_catalog.pg_attribute a ON (a.attrelid OPERATOR(pg_catalog.=) i.indrelid) AND (a.attnum OPERATOR(pg_catalog.=) k.attnum)
                        WHERE (k.ord OPERATOR(pg_catalog.<=) i.indnkeyatts)
                        ORDER BY k.ord) ORDER BY i.indisprimary DESC, i.indexrelid)
                 FROM pg_catalog.pg_index i
                 WHERE (i.indrelid OPERATOR(pg_catalog.=) c.oid) AND i.indisunique AND i.indisvalid
                   AND i.indpred IS NULL AND i.indexprs IS NULL), '[]')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON (n.oid OPERATOR(pg_catalog.=) c.relnamespace)
WHERE (c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass($1))`

// Lookup reads table t from the catalog through q: its columns, unique keys
// and triggers. It returns a *[TableError] when t does not exist or is not an
// ordinary or partitioned table (a view, sequence, ...); database errors are
// returned as they are. q must not be nil.
func Lookup(ctx context.Context, q Querier, t TableName) (*Table, error) {
	ti := &Table{}
	var kind string
	err := q.QueryRow(ctx, lookupSQL, t.String()).Scan(
		&ti.OID, &ti.Schema, &ti.Name, &kind, &ti.Triggers, &ti.Columns, &ti.UniqueKeys)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, &TableError{Table: t.String()}
	}
	if err != nil {
		return nil, err
	}
	if kind != "r" && kind != "p" {
		return nil, &TableError{Table: t.String(), Kind: kind}
	}
	return ti, nil
}

// FenceColumnProblem says why column name of t cannot be a fence column
// (missing, not bigint, or nullable), with the statements that fix it; ""
// when it is a bigint NOT NULL column.
func (t *Table) FenceColumnProblem(name string) string {
	c, ok := t.Column(name)
	if !ok {
		return "no such column; add it with: ALTER TABLE " + t.Qualified() + " ADD COLUMN " +
			Quote(name) + " bigint NOT NULL DEFAULT 0"
	}
	if c.Type != "bigint" {
		return "type is " + c.Type + ", want bigint"
	}
	if !c.NotNull {
		// A NULL fence is never below a token: its row could not be
		// written, and reading it back would fail.
		return "nullable, want NOT NULL; fix it with: UPDATE " + t.Qualified() + " SET " + Quote(name) + " = 0 WHERE " +
			Quote(name) + " IS NULL; ALTER TABLE " + t.Qualified() + " ALTER COLUMN " + Quote(name) + " SET NOT NULL"
	}
	return ""
}
