package fencedwrite_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestIdentifierErrorsKeepTheirType: names refused by pgfence's identifier
// rule reach callers of Prepare as pgfence.ErrInvalid naming the part that
// was wrong and the letter the user typed, before any I/O (db is nil here: a
// name that passes reaches the nil-handle check).
func TestIdentifierErrorsKeepTheirType(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	spec := func(table string, key ...string) fencedwrite.Spec {
		if len(key) == 0 {
			key = []string{"id"}
		}
		return fencedwrite.Spec{Table: table, Key: key, Set: []string{"v"}}
	}
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
		_, err := fencedwrite.Prepare(ctx, nil, spec(in))
		if !matches(err, invalidArg(what)) || !strings.Contains(err.Error(), "invalid name") {
			t.Errorf("Prepare(%q) = %v, want ErrInvalid about the %s name", in, err, what)
		}
	}
	for name, want := range map[string]string{"größe": `'ö'`, "naïve": `'ï'`, "a\x00b": `'\x00'`, "日本": `'日'`} {
		_, err := fencedwrite.Prepare(ctx, nil, spec("t", name))
		var pe *pgfence.Error
		if !matches(err, invalidArg("key column")) || !errors.As(err, &pe) || !strings.Contains(pe.Reason, want) {
			t.Errorf("key %q: %v, want a reason naming %s", name, err, want)
		}
	}
	_, err := fencedwrite.Prepare(ctx, nil, spec("t", strings.Repeat("k", 64)))
	if want := `fencedwrite.Prepare "t": invalid argument: key column: invalid name "` + strings.Repeat("k", 64) + `": 64 bytes, the limit is 63`; err == nil || err.Error() != want {
		t.Errorf("Prepare(64-byte key) = %v", err)
	}
	if _, err := fencedwrite.Prepare(ctx, nil, spec("Billing.Invoices", "MixedCase_1")); !matches(err, invalidArg("db")) {
		t.Errorf("Prepare(Billing.Invoices, MixedCase_1) = %v, want the names accepted", err)
	}
}

// TestUnknownTables: Prepare, Guard and Unguard refuse what is not a table
// with pgfence.ErrInvalid ("table: no such table") naming the input, and a
// bad name with pgfence.ErrInvalid naming the table; a unique index's INCLUDE columns are not part of its key.
func TestUnknownTables(t *testing.T) {
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
	for _, key := range [][]string{{"id"}, {"code"}} {
		if _, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "public.parcels", Key: key, Set: []string{"status"}}); err != nil {
			t.Errorf("Prepare(key %v): %v", key, err)
		}
	}
	_, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "parcels", Key: []string{"code", "status"}, Set: []string{"id"}})
	if !matches(err, invalidArg("Spec.Key")) || !strings.Contains(err.Error(), "not a primary key or unique index") {
		t.Errorf("Prepare(key code, status) = %v, want ErrKeyNotUnique (INCLUDE columns are not a key)", err)
	}
	for _, name := range []string{"parcels_view", "no_such_table", "nope.parcels", "Parcels"} {
		_, perr := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: name, Key: []string{"id"}, Set: []string{"status"}})
		gerr := fencedwrite.Guard(ctx, pool, name, fencedwrite.GuardOptions{LockName: "parcels-lock"})
		_, uerr := fencedwrite.Unguard(ctx, pool, name)
		for call, err := range map[string]error{"Prepare": perr, "Guard": gerr, "Unguard": uerr} {
			if want := "fencedwrite." + call + " " + strconv.Quote(name) + ": invalid argument: table: no such table " +
				strconv.Quote(name); !matches(err, invalidArg("table")) || err.Error() != want {
				t.Errorf("%s(%s) = %v, want ErrInvalid: no such table", call, name, err)
			}
		}
	}
	gerr := fencedwrite.Guard(ctx, pool, "parcels;", fencedwrite.GuardOptions{LockName: "parcels-lock"})
	_, uerr := fencedwrite.Unguard(ctx, pool, "public.parcels;")
	for call, err := range map[string]error{"Guard": gerr, "Unguard": uerr} {
		if !matches(err, invalidArg("table")) || !strings.Contains(err.Error(), "invalid name") {
			t.Errorf("%s(parcels;) = %v, want ErrInvalid about the table name", call, err)
		}
	}
}
