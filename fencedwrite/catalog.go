package fencedwrite

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// defaultFenceColumn is the fence column of a [Spec] or [GuardOptions] that
// names none.
const defaultFenceColumn = "fence"

// checkIdent validates one table or column name with pgfence's identifier
// rule (1..63 bytes of ASCII letters, digits and underscores, not starting
// with a digit, case kept) and reports a refused one as an *[IdentifierError].
// what names the input in the error ("table", "key column", ...).
func checkIdent(what, name string) error {
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

// lookup reads a table's columns and unique keys from the catalog. table is
// "name" (resolved through search_path) or "schema.name". It returns an
// *[IdentifierError] for a bad name and [ErrUnknownTable] when no such table
// exists (views and other relations are not tables).
func lookup(ctx context.Context, db DBTX, table string) (*pgident.Table, error) {
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
	return t, nil
}

// checkColumns validates names syntactically and, when t is not nil,
// against the catalog.
func checkColumns(t *pgident.Table, what string, cols []string) error {
	for _, c := range cols {
		if err := checkIdent(what, c); err != nil {
			return err
		}
		if t == nil {
			continue
		}
		if _, ok := t.Column(c); !ok {
			return &ColumnError{Sentinel: ErrUnknownColumn, Table: t.Qualified(), Column: c, Detail: what}
		}
	}
	return nil
}

// checkFenceColumn reports a *[ColumnError] wrapping [ErrNoFenceColumn]
// unless t has column name of type bigint.
func checkFenceColumn(t *pgident.Table, name string) error {
	if p := t.FenceColumnProblem(name); p != "" {
		return &ColumnError{Sentinel: ErrNoFenceColumn, Table: t.Qualified(), Column: name, Detail: p}
	}
	return nil
}
