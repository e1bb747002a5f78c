package fencedwrite

import (
	"context"
	"errors"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// defaultFenceColumn is the fence column of a [Spec] or [GuardOptions] that
// names none.
const defaultFenceColumn = "fence"

// checkIdent validates one table or column name with pgfence's identifier
// rule (1..63 bytes of ASCII letters, digits and underscores, not starting
// with a digit, case kept) and reports a refused one as [pgfence.ErrInvalid] naming it.
// what names the input in the error ("table", "key column", ...).
func checkIdent(what, name string) error {
	return identError(pgident.Check(what, name))
}

// identError turns a *pgident.Error into pgfence.ErrInvalid naming the
// input ("table", "key column", ...).
func identError(err error) error {
	var ie *pgident.Error
	if errors.As(err, &ie) {
		return invalid(ie.What, "invalid name %q: %s", ie.Value, ie.Reason)
	}
	return err
}

// lookup reads a table's columns and unique keys from the catalog. table is
// "name" (resolved through search_path) or "schema.name". It returns an
// [pgfence.ErrInvalid] for a bad name or when no such table exists (views
// and other relations are not tables).
func lookup(ctx context.Context, db pgfence.DBTX, table string) (*pgident.Table, error) {
	tn, err := pgident.ParseTableName(table)
	if err != nil {
		return nil, identError(err)
	}
	if nilcheck.IsNil(db) {
		return nil, errNilDB()
	}
	t, err := pgident.Lookup(ctx, db, tn)
	if errors.Is(err, pgident.ErrUnknownTable) {
		e := invalid("table", "no such table %q", table)
		e.Name = table
		return nil, e
	}
	if err != nil {
		return nil, translateErr(err)
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
			e := invalid(what, "no column %q in %s", c, t.Qualified())
			e.Name = t.Schema + "." + t.Name
			return e
		}
	}
	return nil
}

// checkFenceColumn reports [pgfence.ErrInvalid] naming the fence column
// unless t has column name of type bigint NOT NULL.
func checkFenceColumn(t *pgident.Table, name string) error {
	if p := t.FenceColumnProblem(name); p != "" {
		e := invalid("fence column", "%q of %s: %s", name, t.Qualified(), p)
		e.Name = t.Schema + "." + t.Name
		return e
	}
	return nil
}
