package fencedwrite_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestCheckIdentifierNamesTheCharacter: a refused non-ASCII name is reported
// with the letter the user typed, not one of its UTF-8 bytes.
func TestCheckIdentifierNamesTheCharacter(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"größe":   `'ö'`,
		"naïve":   `'ï'`,
		"tbl;x":   `';'`,
		"a\x00b":  `'\x00'`,
		"日本":      `'日'`,
		"ok_name": "",
	} {
		err := fencedwrite.CheckIdentifier("table", name)
		if want == "" {
			if err != nil {
				t.Errorf("%q: %v", name, err)
			}
			continue
		}
		var ie *fencedwrite.IdentifierError
		if !errors.As(err, &ie) || !errors.Is(err, fencedwrite.ErrInvalidIdentifier) || !strings.Contains(ie.Reason, want) {
			t.Errorf("%q: %v, want a reason naming %s", name, err, want)
		}
	}
}

// TestIdentifierErrorsKeepTheirType: refusals of the shared identifier rule
// reach callers as *IdentifierError naming the part that was wrong.
func TestIdentifierErrorsKeepTheirType(t *testing.T) {
	t.Parallel()
	for in, what := range map[string]string{
		"":            "table",
		"s;x.t":       "schema",
		"s.t;drop":    "table",
		"a.b.c":       "table",
		"t$1":         "table",
		"1t":          "table",
		"Ünïcode.t":   "schema",
		"x'; --":      "table",
		"public.\x00": "table",
	} {
		_, err := fencedwrite.ParseTableName(in)
		var ie *fencedwrite.IdentifierError
		if !errors.As(err, &ie) || !errors.Is(err, fencedwrite.ErrInvalidIdentifier) || ie.What != what {
			t.Errorf("ParseTableName(%q) = %v, want an *IdentifierError about the %s", in, err, what)
		}
	}
	err := fencedwrite.CheckIdentifier("key column", strings.Repeat("k", fencedwrite.MaxIdentifierBytes+1))
	if want := `fencedwrite: invalid key column name "` + strings.Repeat("k", 64) + `": 64 bytes, the limit is 63`; err == nil || err.Error() != want {
		t.Errorf("CheckIdentifier(64 bytes) = %v", err)
	}
	if err := fencedwrite.CheckIdentifier("key column", "MixedCase_1"); err != nil {
		t.Errorf("CheckIdentifier(MixedCase_1) = %v", err)
	}
	tn, err := fencedwrite.ParseTableName("Billing.Invoices")
	if err != nil || tn.String() != `"Billing"."Invoices"` || tn.Identifier().Sanitize() != tn.String() {
		t.Errorf("ParseTableName(Billing.Invoices) = %v, %v", tn, err)
	}
}

// TestInspect reads columns, unique keys (INCLUDE columns are not part of a
// key) and the guard from the catalog, and refuses what is not a table.
func TestInspect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE TABLE parcels (
			id     bigint PRIMARY KEY,
			code   text NOT NULL,
			status varchar(10) DEFAULT 'new',
			fence  bigint NOT NULL DEFAULT 0
		);
		CREATE UNIQUE INDEX ON parcels (code) INCLUDE (status);
		CREATE VIEW parcels_view AS SELECT * FROM parcels;`); err != nil {
		t.Fatal(err)
	}
	ti, err := fencedwrite.Inspect(ctx, pool, "parcels")
	if err != nil {
		t.Fatal(err)
	}
	want := []fencedwrite.Column{
		{Name: "id", Type: "bigint", NotNull: true},
		{Name: "code", Type: "text", NotNull: true},
		{Name: "status", Type: "character varying(10)", HasDefault: true},
		{Name: "fence", Type: "bigint", NotNull: true, HasDefault: true},
	}
	if ti.Schema != "public" || ti.Name != "parcels" || ti.Qualified() != `"public"."parcels"` ||
		!reflect.DeepEqual(ti.Columns, want) || ti.Guarded {
		t.Fatalf("Inspect = %+v", ti)
	}
	if !ti.IsUniqueKey([]string{"id"}) || !ti.IsUniqueKey([]string{"code"}) || ti.IsUniqueKey([]string{"code", "status"}) {
		t.Fatalf("unique keys = %v", ti.UniqueKeys)
	}
	if err := ti.CheckFenceColumn("fence"); err != nil {
		t.Fatal(err)
	}
	if err := fencedwrite.Guard(ctx, pool, "parcels", fencedwrite.GuardOptions{LockName: "parcels-lock"}); err != nil {
		t.Fatal(err)
	}
	if ti, err := fencedwrite.Inspect(ctx, pool, "public.parcels"); err != nil || !ti.Guarded {
		t.Fatalf("Inspect after Guard = %+v, %v", ti, err)
	}
	for _, name := range []string{"parcels_view", "no_such_table", "nope.parcels", "Parcels"} {
		if _, err := fencedwrite.Inspect(ctx, pool, name); !errors.Is(err, fencedwrite.ErrUnknownTable) ||
			err.Error() != "fencedwrite: unknown table: "+name {
			t.Errorf("Inspect(%s) = %v, want ErrUnknownTable", name, err)
		}
	}
	if _, err := fencedwrite.Inspect(ctx, pool, "parcels;"); !errors.Is(err, fencedwrite.ErrInvalidIdentifier) {
		t.Errorf("Inspect(parcels;) = %v", err)
	}
}
