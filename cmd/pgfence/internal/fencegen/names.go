package fencegen

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// defaultFenceColumn is the fence column of fencedwrite.Spec and
// fencedwrite.GuardOptions when they name none.
const defaultFenceColumn = "fence"

// checkIdent checks one name with pgfence's identifier rule and reports a
// refused one as the *fencedwrite.IdentifierError that fencedwrite.Prepare
// returns for it too.
func checkIdent(what, name string) error { return identError(pgident.Check(what, name)) }

// parseTable parses "table" or "schema.table" with pgfence's identifier rule.
func parseTable(s string) (pgident.TableName, error) {
	tn, err := pgident.ParseTableName(s)
	return tn, identError(err)
}

func identError(err error) error {
	var ie *pgident.Error
	if errors.As(err, &ie) {
		return &fencedwrite.IdentifierError{What: ie.What, Value: ie.Value, Reason: ie.Reason}
	}
	return err
}

// lookup reads table from the catalog: fencedwrite.ErrUnknownTable when there
// is no such table, a database error translated by fencedwrite.TranslateError.
func lookup(ctx context.Context, db fencedwrite.DBTX, table string) (*pgident.Table, error) {
	tn, err := parseTable(table)
	if err != nil {
		return nil, err
	}
	if nilcheck.IsNil(db) {
		return nil, fmt.Errorf("%w: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx", fencedwrite.ErrNilDB)
	}
	t, err := pgident.Lookup(ctx, db, tn)
	if errors.Is(err, pgident.ErrUnknownTable) {
		return nil, fmt.Errorf("%w: %s", fencedwrite.ErrUnknownTable, table)
	}
	if err != nil {
		return nil, fencedwrite.TranslateError(err)
	}
	return t, nil
}

// checkFenceColumn reports a *fencedwrite.ColumnError wrapping
// fencedwrite.ErrNoFenceColumn unless t has column name of type bigint.
func checkFenceColumn(t *pgident.Table, name string) error {
	if p := t.FenceColumnProblem(name); p != "" {
		return &fencedwrite.ColumnError{Sentinel: fencedwrite.ErrNoFenceColumn, Table: t.Qualified(), Column: name, Detail: p}
	}
	return nil
}
