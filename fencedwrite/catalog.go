package fencedwrite

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/nilcheck"
)

// MaxIdentifierBytes is PostgreSQL's identifier limit (NAMEDATALEN - 1).
// Longer names would be truncated silently by the server, so they are refused.
const MaxIdentifierBytes = 63

// CheckIdentifier validates one table or column name: 1..63 bytes of ASCII
// letters, digits and underscores, not starting with a digit. Names are used
// exactly as stored in the catalog (case-sensitive; PostgreSQL folds unquoted
// names to lower case when a table is created). Anything else, including
// quotes, spaces, dots, semicolons and comment markers, is refused with an
// *[IdentifierError]; valid names are still quoted with pgx.Identifier when
// they are put into SQL. what names the input in the error ("table",
// "key column", ...).
func CheckIdentifier(what, name string) error {
	bad := func(reason string) error {
		v := name
		if len(v) > 80 {
			v = v[:80] + "..."
		}
		return &IdentifierError{What: what, Value: v, Reason: reason}
	}
	switch {
	case name == "":
		return bad("empty")
	case len(name) > MaxIdentifierBytes:
		return bad(fmt.Sprintf("%d bytes, the limit is %d", len(name), MaxIdentifierBytes))
	case name[0] >= '0' && name[0] <= '9':
		return bad("starts with a digit")
	}
	for _, r := range name { // by rune, so the error names the letter, not one of its bytes
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return bad(fmt.Sprintf("character %q is not allowed (ASCII letters, digits and _ only)", r))
		}
	}
	return nil
}

// TableName is a validated, optionally schema-qualified table name.
type TableName struct {
	Schema string // empty: resolved through search_path
	Name   string
}

// ParseTableName parses "table" or "schema.table" and validates each part
// with [CheckIdentifier].
func ParseTableName(s string) (TableName, error) {
	parts := strings.Split(s, ".")
	switch len(parts) {
	case 1:
		if err := CheckIdentifier("table", parts[0]); err != nil {
			return TableName{}, err
		}
		return TableName{Name: parts[0]}, nil
	case 2:
		if err := CheckIdentifier("schema", parts[0]); err != nil {
			return TableName{}, err
		}
		if err := CheckIdentifier("table", parts[1]); err != nil {
			return TableName{}, err
		}
		return TableName{Schema: parts[0], Name: parts[1]}, nil
	}
	return TableName{}, CheckIdentifier("table", s) // reports the offending character
}

// Identifier returns the name as a pgx.Identifier.
func (t TableName) Identifier() pgx.Identifier {
	if t.Schema == "" {
		return pgx.Identifier{t.Name}
	}
	return pgx.Identifier{t.Schema, t.Name}
}

// String returns the quoted name, ready for SQL.
func (t TableName) String() string { return t.Identifier().Sanitize() }

// Column describes one column of a table.
type Column struct {
	Name       string
	Type       string // as format_type prints it, e.g. "bigint", "character varying(20)"
	NotNull    bool
	HasDefault bool
}

// TableInfo is what [Inspect] learns about a table from the catalog.
type TableInfo struct {
	Schema     string
	Name       string
	Columns    []Column
	UniqueKeys [][]string // primary key and unique indexes without predicate or expressions
	Guarded    bool       // a pgfence guard is attached
}

// Column returns the named column.
func (ti *TableInfo) Column(name string) (Column, bool) {
	for _, c := range ti.Columns {
		if c.Name == name {
			return c, true
		}
	}
	return Column{}, false
}

// IsUniqueKey reports whether cols (in any order) are exactly the columns of
// a primary key or unique index.
func (ti *TableInfo) IsUniqueKey(cols []string) bool {
	want := slices.Sorted(slices.Values(cols))
	for _, k := range ti.UniqueKeys {
		if slices.Equal(slices.Sorted(slices.Values(k)), want) {
			return true
		}
	}
	return false
}

// Qualified returns the schema-qualified, quoted table name.
func (ti *TableInfo) Qualified() string { return pgx.Identifier{ti.Schema, ti.Name}.Sanitize() }

// Inspect reads a table's columns and unique keys from the catalog. table is
// "name" (resolved through search_path) or "schema.name". It returns an
// *[IdentifierError] for a bad name and [ErrUnknownTable] when no such table
// exists (views and other relations are not tables).
func Inspect(ctx context.Context, db DBTX, table string) (*TableInfo, error) {
	tn, err := ParseTableName(table)
	if err != nil {
		return nil, err
	}
	if nilcheck.IsNil(db) {
		return nil, errNilDB
	}
	ti := &TableInfo{}
	var oid uint32
	var kind string
	// The name goes in as a bound parameter; to_regclass parses the quoted form.
	err = db.QueryRow(ctx, `
		SELECT c.oid, n.nspname, c.relname, c.relkind::text,
		       EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND t.tgname = 'pgfence_guard_b_check')
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.oid = to_regclass($1)`, tn.String()).Scan(&oid, &ti.Schema, &ti.Name, &kind, &ti.Guarded)
	if errors.Is(err, pgx.ErrNoRows) || err == nil && kind != "r" && kind != "p" {
		return nil, fmt.Errorf("%w: %s", ErrUnknownTable, table)
	}
	if err != nil {
		return nil, TranslateError(err)
	}
	rows, err := db.Query(ctx, `
		SELECT attname::text, pg_catalog.format_type(atttypid, atttypmod), attnotnull, atthasdef
		FROM pg_catalog.pg_attribute
		WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped
		ORDER BY attnum`, oid)
	if err != nil {
		return nil, TranslateError(err)
	}
	ti.Columns, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Column, error) {
		var c Column
		err := r.Scan(&c.Name, &c.Type, &c.NotNull, &c.HasDefault)
		return c, err
	})
	if err != nil {
		return nil, TranslateError(err)
	}
	rows, err = db.Query(ctx, `
		SELECT ARRAY(SELECT a.attname::text
		             FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
		             JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
		             ORDER BY k.ord)
		FROM pg_catalog.pg_index i
		WHERE i.indrelid = $1 AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
		  AND i.indisvalid
		ORDER BY i.indisprimary DESC, i.indexrelid`, oid)
	if err != nil {
		return nil, TranslateError(err)
	}
	ti.UniqueKeys, err = pgx.CollectRows(rows, pgx.RowTo[[]string])
	if err != nil {
		return nil, TranslateError(err)
	}
	return ti, nil
}

// checkColumns validates names syntactically and, when ti is not nil,
// against the catalog.
func checkColumns(ti *TableInfo, what string, cols []string) error {
	for _, c := range cols {
		if err := CheckIdentifier(what, c); err != nil {
			return err
		}
		if ti == nil {
			continue
		}
		if _, ok := ti.Column(c); !ok {
			return &ColumnError{Sentinel: ErrUnknownColumn, Table: ti.Qualified(), Column: c, Detail: what}
		}
	}
	return nil
}

// CheckFenceColumn reports a *[ColumnError] wrapping [ErrNoFenceColumn] unless
// the table has column name of type bigint.
func (ti *TableInfo) CheckFenceColumn(name string) error {
	c, ok := ti.Column(name)
	if !ok {
		return &ColumnError{Sentinel: ErrNoFenceColumn, Table: ti.Qualified(), Column: name,
			Detail: "no such column; add it with: ALTER TABLE " + ti.Qualified() + " ADD COLUMN " +
				pgx.Identifier{name}.Sanitize() + " bigint NOT NULL DEFAULT 0"}
	}
	if c.Type != "bigint" {
		return &ColumnError{Sentinel: ErrNoFenceColumn, Table: ti.Qualified(), Column: name,
			Detail: "type is " + c.Type + ", want bigint"}
	}
	return nil
}
