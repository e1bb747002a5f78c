package pgident

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

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
	// Builtin: the column's type, or for a domain the base type under it
	// (through domains over domains), is one of PostgreSQL's own (schema
	// pg_catalog), whose operators statements name as
	// OPERATOR(pg_catalog.op). A domain's value is compared with its base
	// type's operators once the operator is named so.
	Builtin bool `json:"builtin"`
}

// UnusableKey is a unique index that does not identify one row for a
// fenced write (see [Table.UniqueKeys]).
type UnusableKey struct {
	Columns []string
	// Problem says why, naming the columns concerned.
	Problem string
}

// Table is what [Lookup] reads from the catalog.
type Table struct {
	OID    uint32
	Schema string
	Name   string
	// Partitioned: the table is partitioned (relkind p); its rows live in
	// its partitions. Otherwise it is an ordinary table (relkind r), whose
	// inheritance children, if any, are tables of their own.
	Partitioned bool
	// Columns in attnum order, dropped columns left out.
	Columns []Column
	// UniqueKeys holds the key columns of the primary key (first) and of
	// each valid unique index without predicate or expressions whose key
	// identifies at most one row to an "=" on its columns: not deferrable,
	// each column compared by the index as the column's own "=" compares it
	// (the index's collation equal to the column's, or both deterministic;
	// its type's default btree operator class, or another with the same
	// equality operator on a deterministically compared column), and every
	// column NOT NULL
	// unless the index is NULLS NOT DISTINCT. INCLUDE columns are not part
	// of a key.
	UniqueKeys [][]string
	// UnusableKeys holds the other valid unique indexes without predicate
	// or expressions, each with the reason it is not in UniqueKeys.
	UnusableKeys []UnusableKey
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
	return slices.ContainsFunc(keys, func(k []string) bool { return sameColumns(k, cols) })
}

func sameColumns(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// UnusableKeyProblem returns the Problem of the first of t.UnusableKeys
// whose columns are cols, in any order: why that unique index cannot
// identify a row. It returns "" when there is none.
func (t *Table) UnusableKeyProblem(cols []string) string {
	for _, k := range t.UnusableKeys {
		if sameColumns(k.Columns, cols) {
			return k.Problem
		}
	}
	return ""
}

// lookupSQL reads everything in one round trip. The name is a bound
// parameter; to_regclass parses its quoted form, resolves it through
// search_path and returns NULL (no row) when it does not exist. Every
// operator is named OPERATOR(pg_catalog.op): the query runs on the caller's
// search_path.
//
// base follows each column's type through domains (typbasetype) down to a
// type that is not a domain, the type whose operators compare its values.
// A unique index's key columns are read with, per column, whether the
// index's collation (indcollation) is the column's or both are
// deterministic (equal only when byte-equal), whether its operator class
// (indclass) is the default btree operator class of the column's (base)
// type or, on a column with a deterministic collation, one whose equality
// (btree strategy 3) is that default class's (text_pattern_ops), and whether
// the column is NOT NULL. The default operator
// class is the one of the base type itself when there is one (as
// PostgreSQL picks it); a type without one (varchar, an enum, an array) is
// indexed with a default class of a type it is binary-coercible to or of a
// polymorphic type, and any default btree class counts then.
// indnullsnotdistinct (PostgreSQL 15+) is read through to_jsonb so that
// the query also runs on 13 and 14, where it is absent (false).
const lookupSQL = `
WITH RECURSIVE rel AS (
  SELECT c.oid, c.relnamespace, c.relname, c.relkind FROM pg_catalog.pg_class c
  WHERE (c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass($1))
), cols AS (
  SELECT a.attnum, a.attname, a.atttypid, a.atttypmod, a.attnotnull, a.atthasdef, a.attgenerated, a.attcollation
  FROM pg_catalog.pg_attribute a JOIN rel ON (a.attrelid OPERATOR(pg_catalog.=) rel.oid)
  WHERE (a.attnum OPERATOR(pg_catalog.>) 0) AND NOT a.attisdropped
), base AS (
  SELECT cols.attnum, ty.oid AS typ, ty.typtype, ty.typbasetype, ty.typnamespace
  FROM cols JOIN pg_catalog.pg_type ty ON (ty.oid OPERATOR(pg_catalog.=) cols.atttypid)
  UNION ALL
  SELECT base.attnum, ty.oid, ty.typtype, ty.typbasetype, ty.typnamespace
  FROM base JOIN pg_catalog.pg_type ty ON (ty.oid OPERATOR(pg_catalog.=) base.typbasetype)
  WHERE (base.typtype OPERATOR(pg_catalog.=) 'd')
), colbase AS (
  SELECT cols.*, base.typ AS basetype,
         (base.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace) AS builtin,
         COALESCE((SELECT co.collisdeterministic FROM pg_catalog.pg_collation co
                   WHERE (co.oid OPERATOR(pg_catalog.=) cols.attcollation)), true) AS deterministic
  FROM cols JOIN base ON (base.attnum OPERATOR(pg_catalog.=) cols.attnum) AND (base.typtype OPERATOR(pg_catalog.<>) 'd')
)
SELECT rel.oid, n.nspname::pg_catalog.text, rel.relname::pg_catalog.text, rel.relkind::pg_catalog.text,
       ARRAY(SELECT t.tgname::pg_catalog.text FROM pg_catalog.pg_trigger t
             WHERE (t.tgrelid OPERATOR(pg_catalog.=) rel.oid) AND NOT t.tgisinternal ORDER BY 1),
       COALESCE((SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                        'name', a.attname::pg_catalog.text,
                        'type', pg_catalog.format_type(a.atttypid, a.atttypmod),
                        'not_null', a.attnotnull,
                        'has_default', a.atthasdef,
                        'generated', (a.attgenerated OPERATOR(pg_catalog.<>) ''),
                        'builtin', a.builtin) ORDER BY a.attnum)
                 FROM colbase a), '[]'),
       COALESCE((SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                        'columns', k.cols,
                        'deferrable', NOT i.indimmediate,
                        'nulls_not_distinct', COALESCE((pg_catalog.to_jsonb(i) OPERATOR(pg_catalog.->>) 'indnullsnotdistinct')::pg_catalog.bool, false),
                        'collation', k.collation,
                        'opclass', k.opclass,
                        'nullable', k.nullable) ORDER BY i.indisprimary DESC, i.indexrelid)
                 FROM pg_catalog.pg_index i
                 CROSS JOIN LATERAL (
                   SELECT pg_catalog.array_agg(a.attname::pg_catalog.text ORDER BY k.ord) AS cols,
                          COALESCE(pg_catalog.array_agg(a.attname::pg_catalog.text ORDER BY k.ord)
                                   FILTER (WHERE (i.indcollation[k.ord::pg_catalog.int4 OPERATOR(pg_catalog.-) 1] OPERATOR(pg_catalog.<>) a.attcollation)
                                     AND NOT (a.deterministic AND COALESCE((SELECT co.collisdeterministic FROM pg_catalog.pg_collation co
                                       WHERE (co.oid OPERATOR(pg_catalog.=) i.indcollation[k.ord::pg_catalog.int4 OPERATOR(pg_catalog.-) 1])), true))), '{}') AS collation,
                          COALESCE(pg_catalog.array_agg(a.attname::pg_catalog.text ORDER BY k.ord)
                                   FILTER (WHERE NOT EXISTS (
                                     SELECT FROM pg_catalog.pg_opclass oc
                                     WHERE (oc.oid OPERATOR(pg_catalog.=) i.indclass[k.ord::pg_catalog.int4 OPERATOR(pg_catalog.-) 1])
                                       AND (oc.opcmethod OPERATOR(pg_catalog.=) (SELECT am.oid FROM pg_catalog.pg_am am WHERE (am.amname OPERATOR(pg_catalog.=) 'btree')))
                                       AND ((oc.opcdefault
                                       AND ((oc.opcintype OPERATOR(pg_catalog.=) a.basetype) OR NOT EXISTS (
                                         SELECT FROM pg_catalog.pg_opclass d
                                         WHERE (d.opcmethod OPERATOR(pg_catalog.=) oc.opcmethod) AND d.opcdefault
                                           AND (d.opcintype OPERATOR(pg_catalog.=) a.basetype))))
                                       -- Another btree class whose equality is the "=" of the
                                       -- default class a key of the type gets (text_pattern_ops),
                                       -- on a column compared deterministically.
                                       OR (a.deterministic AND EXISTS (
                                         SELECT FROM pg_catalog.pg_opclass d
                                         JOIN pg_catalog.pg_amop de ON (de.amopfamily OPERATOR(pg_catalog.=) d.opcfamily)
                                           AND (de.amoplefttype OPERATOR(pg_catalog.=) d.opcintype) AND (de.amoprighttype OPERATOR(pg_catalog.=) d.opcintype)
                                           AND (de.amopstrategy OPERATOR(pg_catalog.=) 3)
                                         JOIN pg_catalog.pg_amop oe ON (oe.amopfamily OPERATOR(pg_catalog.=) oc.opcfamily)
                                           AND (oe.amoplefttype OPERATOR(pg_catalog.=) oc.opcintype) AND (oe.amoprighttype OPERATOR(pg_catalog.=) oc.opcintype)
                                           AND (oe.amopstrategy OPERATOR(pg_catalog.=) 3)
                                         WHERE (d.opcmethod OPERATOR(pg_catalog.=) oc.opcmethod) AND d.opcdefault
                                           AND (oe.amopopr OPERATOR(pg_catalog.=) de.amopopr)
                                           AND ((d.opcintype OPERATOR(pg_catalog.=) a.basetype) OR NOT EXISTS (
                                             SELECT FROM pg_catalog.pg_opclass d2
                                             WHERE (d2.opcmethod OPERATOR(pg_catalog.=) oc.opcmethod) AND d2.opcdefault
                                               AND (d2.opcintype OPERATOR(pg_catalog.=) a.basetype)))))))), '{}') AS opclass,
                          COALESCE(pg_catalog.array_agg(a.attname::pg_catalog.text ORDER BY k.ord)
                                   FILTER (WHERE NOT a.attnotnull), '{}') AS nullable
                   FROM pg_catalog.unnest(i.indkey::pg_catalog.int2[]) WITH ORDINALITY AS k(attnum, ord)
                   JOIN colbase a ON (a.attnum OPERATOR(pg_catalog.=) k.attnum)
                   WHERE (k.ord OPERATOR(pg_catalog.<=) i.indnkeyatts)) k
                 WHERE (i.indrelid OPERATOR(pg_catalog.=) rel.oid) AND i.indisunique AND i.indisvalid
                   AND i.indpred IS NULL AND i.indexprs IS NULL), '[]')
FROM rel JOIN pg_catalog.pg_namespace n ON (n.oid OPERATOR(pg_catalog.=) rel.relnamespace)`

// catalogKey is one unique index as lookupSQL reads it.
type catalogKey struct {
	Columns          []string `json:"columns"`
	Deferrable       bool     `json:"deferrable"`
	NullsNotDistinct bool     `json:"nulls_not_distinct"`
	Collation        []string `json:"collation"` // key columns indexed under another collation than their own
	Opclass          []string `json:"opclass"`   // key columns indexed with another than their type's default btree class
	Nullable         []string `json:"nullable"`  // key columns without NOT NULL
}

// problem says why k does not identify one row; "" when it does.
func (k catalogKey) problem() string {
	list := func(cols []string) string {
		q := make([]string, len(cols))
		for i, c := range cols {
			q[i] = strconv.Quote(c)
		}
		return strings.Join(q, ", ")
	}
	switch {
	case k.Deferrable:
		return "the unique index is DEFERRABLE: duplicates may exist inside a transaction, and INSERT ... ON CONFLICT cannot use it"
	case len(k.Collation) > 0:
		return "the unique index compares column " + list(k.Collation) + " under another collation than the column's own, " +
			"so one key can match several rows"
	case len(k.Opclass) > 0:
		return "the unique index compares column " + list(k.Opclass) + " with an operator class other than its type's default btree class, " +
			"so one key can match several rows"
	case len(k.Nullable) > 0 && !k.NullsNotDistinct:
		return "column " + list(k.Nullable) + " is nullable and the unique index is not NULLS NOT DISTINCT: rows with NULL in the key never conflict; " +
			"make the column NOT NULL"
	}
	return ""
}

// Lookup reads table t from the catalog through q: its columns, unique keys
// and triggers. It returns a *[TableError] when t does not exist or is not an
// ordinary or partitioned table (a view, sequence, ...); database errors are
// returned as they are. q must not be nil.
func Lookup(ctx context.Context, q Querier, t TableName) (*Table, error) {
	ti := &Table{}
	var kind string
	var keys []catalogKey
	err := q.QueryRow(ctx, lookupSQL, t.String()).Scan(
		&ti.OID, &ti.Schema, &ti.Name, &kind, &ti.Triggers, &ti.Columns, &keys)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, &TableError{Table: t.String()}
	}
	if err != nil {
		return nil, err
	}
	if kind != "r" && kind != "p" {
		return nil, &TableError{Table: t.String(), Kind: kind}
	}
	ti.Partitioned = kind == "p"
	ti.UniqueKeys = [][]string{}
	for _, k := range keys {
		if p := k.problem(); p != "" {
			ti.UnusableKeys = append(ti.UnusableKeys, UnusableKey{Columns: k.Columns, Problem: p})
		} else {
			ti.UniqueKeys = append(ti.UniqueKeys, k.Columns)
		}
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
