package fencedwrite

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// MaxIdentifierBytes is PostgreSQL's identifier limit (NAMEDATALEN - 1).
// Longer names would be truncated silently by the server, so they are refused.
const MaxIdentifierBytes = pgident.MaxBytes

// CheckIdentifier validates one table or column name: 1..63 bytes of ASCII
// letters, digits and underscores, not starting with a digit. Names are used
// exactly as stored in the catalog (case-sensitive; PostgreSQL folds unquoted
// names to lower case when a table is created). Anything else, including
// quotes, spaces, dots, semicolons and comment markers, is refused with an
// *[IdentifierError]; valid names are still quoted with pgx.Identifier when
// they are put into SQL. what names the input in the error ("table",
// "key column", ...).
func CheckIdentifier(what, name string) error {
	return identError(pgident.Check(what, name))
}

// identError turns a *pgident.Error into an *IdentifierError.
func identError(err error) error {
	var ie *pgident.Error
	if errors.As(err, &ie) {
		return &IdentifierError{What: ie.What, Value: ie.Value, Reason: ie.Reason}
	}
	return err
}

// TableName is a validated, optionally schema-qualified table name.
type TableName struct {
	Schema string // empty: resolved through search_path
	Name   string
}

// ParseTableName parses "table" or "schema.table" and validates each part
// with [CheckIdentifier].
func ParseTableName(s string) (TableName, error) {
	tn, err := pgident.ParseTableName(s)
	if err != nil {
		return TableName{}, identError(err)
	}
	return TableName(tn), nil
}

// Identifier returns the name as a pgx.Identifier.
func (t TableName) Identifier() pgx.Identifier { return pgident.TableName(t).Identifier() }

// String returns the quoted name, ready for SQL.
func (t TableName) String() string { return pgident.TableName(t).String() }

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

	builtin map[string]bool // columns of a type of schema pg_catalog
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
func (ti *TableInfo) IsUniqueKey(cols []string) bool { return pgident.IsUniqueKey(ti.UniqueKeys, cols) }

// Qualified returns the schema-qualified, quoted table name.
func (ti *TableInfo) Qualified() string { return pgident.Quote(ti.Schema, ti.Name) }

// guardTrigger is the trigger pgfence.guard attaches; its presence marks a
// guarded table.
const guardTrigger = "pgfence_guard_b_check"

// Inspect reads a table's columns and unique keys from the catalog. table is
// "name" (resolved through search_path) or "schema.name". It returns an
// *[IdentifierError] for a bad name and [ErrUnknownTable] when no such table
// exists (views and other relations are not tables).
func Inspect(ctx context.Context, db DBTX, table string) (*TableInfo, error) {
	tn, err := pgident.ParseTableName(table)
	if err != nil {
		return nil, identError(err)
	}
	if nilcheck.IsNil(db) {
		return nil, errNilDB
	}
	t, err := pgident.Lookup(ctx, db, tn)
	if errors.Is(err, pgident.ErrUnknownTable) {
		return nil, fmt.Errorf("%w: %s", ErrUnknownTable, table)
	}
	if err != nil {
		return nil, TranslateError(err)
	}
	ti := &TableInfo{Schema: t.Schema, Name: t.Name, UniqueKeys: t.UniqueKeys,
		Guarded: slices.Contains(t.Triggers, guardTrigger)}
	ti.Columns = make([]Column, len(t.Columns))
	ti.builtin = make(map[string]bool, len(t.Columns))
	for i, c := range t.Columns {
		ti.Columns[i] = Column{Name: c.Name, Type: c.Type, NotNull: c.NotNull, HasDefault: c.HasDefault}
		ti.builtin[c.Name] = c.Builtin
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
