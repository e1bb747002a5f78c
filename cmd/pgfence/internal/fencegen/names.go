package fencegen

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// defaultFenceColumn is the fence column of fencedwrite.Spec and
// fencedwrite.GuardOptions when they name none.
const defaultFenceColumn = "fence"

// op is the Op of this package's *pgfence.Errors.
const op = "pgfence gen fenced"

// checkIdent checks one name with pgfence's identifier rule and reports a
// refused one as pgfence.ErrInvalid naming the input, as fencedwrite.Prepare
// does.
func checkIdent(what, name string) error { return identError(pgident.Check(what, name)) }

// parseTable parses "table" or "schema.table" with pgfence's identifier rule.
func parseTable(s string) (pgident.TableName, error) {
	tn, err := pgident.ParseTableName(s)
	return tn, identError(err)
}

func identError(err error) error {
	var ie *pgident.Error
	if errors.As(err, &ie) {
		return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: fmt.Sprintf("%s: invalid name %q: %s", ie.What, ie.Value, ie.Reason)}
	}
	return err
}

// lookup reads table from the catalog: pgfence.ErrNotFound when there is no
// such table (the CLI's "not found" exit code), a database error translated
// by fencedwrite.TranslateError.
func lookup(ctx context.Context, db pgfence.DBTX, table string) (*pgident.Table, error) {
	tn, err := parseTable(table)
	if err != nil {
		return nil, err
	}
	if nilcheck.IsNil(db) {
		return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: "db: nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx"}
	}
	t, err := pgident.Lookup(ctx, db, tn)
	if errors.Is(err, pgident.ErrUnknownTable) {
		return nil, &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Name: table, Reason: "table: no such table"}
	}
	if err != nil {
		return nil, fencedwrite.TranslateError(err)
	}
	return t, nil
}

// checkFenceColumn reports pgfence.ErrNotFound naming the fence column
// unless t has column name of type bigint.
func checkFenceColumn(t *pgident.Table, name string) error {
	if p := t.FenceColumnProblem(name); p != "" {
		return &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Name: t.Schema + "." + t.Name,
			Reason: fmt.Sprintf("fence column: %q of %s: %s", name, t.Qualified(), p)}
	}
	return nil
}

// OwnEqualKeys returns the key columns of opts whose type is not built in
// (an enum, citext or another extension's type, or a domain over one; a
// domain over a built-in type counts as built in), for
// Options.OwnEqualKeys: their comparisons keep the type's own "=" instead of
// pg_catalog's, as [fencedwrite.Table] does. It only reads the catalog;
// a table or key column the database does not have is left to [Validate]
// to report (a missing column is not listed).
func OwnEqualKeys(ctx context.Context, db pgfence.DBTX, opts Options) ([]string, error) {
	t, err := lookup(ctx, db, opts.Table)
	if err != nil {
		return nil, err
	}
	var own []string
	for _, k := range opts.Key {
		if c, ok := t.Column(k); ok && !c.Builtin {
			own = append(own, k)
		}
	}
	return own, nil
}

// Partitioned reports whether opts.Table is a partitioned table, for
// Options.Partitioned. It only reads the catalog.
func Partitioned(ctx context.Context, db pgfence.DBTX, opts Options) (bool, error) {
	t, err := lookup(ctx, db, opts.Table)
	if err != nil {
		return false, err
	}
	return t.Partitioned, nil
}
