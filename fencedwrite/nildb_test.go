package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

// Every call that takes a database handle refuses a nil one (untyped, or a
// typed nil pool inside the interface) with pgfence.ErrInvalid naming db instead of panicking.
func TestNilDatabaseHandle(t *testing.T) {
	ctx := context.Background()
	var pool *pgxpool.Pool
	value := []byte(`{"a":1}`)
	for _, db := range []pgfence.DBTX{nil, pool} {
		calls := map[string]error{}
		_, calls["UpdateValue"] = fencedwrite.UpdateValue(ctx, db, 1, fencedwrite.Strict, "k", value)
		_, calls["UpsertValue"] = fencedwrite.UpsertValue(ctx, db, 1, fencedwrite.Strict, "k", value)
		_, calls["DeleteValue"] = fencedwrite.DeleteValue(ctx, db, 1, "k")
		_, calls["ReadValue"] = fencedwrite.ReadValue(ctx, db, 1, "k")
		_, calls["GetValue"] = fencedwrite.GetValue(ctx, db, "k")
		_, calls["Prepare"] = fencedwrite.Prepare(ctx, db, fencedwrite.Spec{Table: "t", Key: []string{"id"}, Set: []string{"v"}})
		calls["Guard"] = fencedwrite.Guard(ctx, db, "t", fencedwrite.GuardOptions{LockName: "l"})
		_, calls["Unguard"] = fencedwrite.Unguard(ctx, db, "t")
		_, calls["ListGuarded"] = fencedwrite.ListGuarded(ctx, db)
		for name, err := range calls {
			if !matches(err, invalidArg("db")) {
				t.Errorf("%s(%T nil) = %v, want ErrInvalid naming db", name, db, err)
			}
		}
	}
	var beginner fencedwrite.Beginner
	if _, err := fencedwrite.ModifyValue(ctx, beginner, 1, "k", keep); !matches(err, invalidArg("db")) {
		t.Errorf("ModifyValue(nil) = %v, want ErrInvalid naming db", err)
	}
	var tx pgx.Tx
	if _, err := fencedwrite.ModifyValue(ctx, tx, 1, "k", keep); !matches(err, invalidArg("db")) {
		t.Errorf("ModifyValue(nil tx) = %v, want ErrInvalid naming db", err)
	}
}

func keep(v json.RawMessage) (json.RawMessage, error) { return v, nil }

// TestTableBadCalls: a prepared Table's methods refuse a nil database handle,
// a Read with the wrong number of destinations and a Modify without a
// function, with ErrInvalid naming the argument, and change nothing.
func TestTableBadCalls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"pdf_url"}, Read: []string{"pdf_url", "status"}})
	const tok = 5
	key, set := []any{int64(1)}, []any{"x.pdf"}
	var nilPool *pgxpool.Pool
	var nilBeginner fencedwrite.Beginner
	var a, b string
	calls := []struct {
		name string
		err  error
		want invalidArg
	}{}
	add := func(name string, want invalidArg, err error) {
		calls = append(calls, struct {
			name string
			err  error
			want invalidArg
		}{name, err, want})
	}
	for _, db := range []pgfence.DBTX{nil, nilPool} {
		_, err := tbl.Update(ctx, db, tok, key, set)
		add("Update(nil db)", "db", err)
		_, err = tbl.Upsert(ctx, db, tok, key, set)
		add("Upsert(nil db)", "db", err)
		_, err = tbl.Delete(ctx, db, tok, key)
		add("Delete(nil db)", "db", err)
		_, err = tbl.Read(ctx, db, tok, key, &a, &b)
		add("Read(nil db)", "db", err)
	}
	_, err := tbl.Modify(ctx, nilBeginner, tok, key, func(cur []any) ([]any, error) { return []any{"y.pdf"}, nil })
	add("Modify(nil db)", "db", err)
	_, err = tbl.Read(ctx, pool, tok, key, &a)
	add("Read(one destination for two columns)", "dest", err)
	_, err = tbl.Read(ctx, pool, tok, key, &a, &b, &a)
	add("Read(three destinations for two columns)", "dest", err)
	_, err = tbl.Modify(ctx, pool, tok, key, nil)
	add("Modify(nil fn)", "fn", err)
	for _, c := range calls {
		if !matches(c.err, c.want) {
			t.Errorf("%s = %v, want ErrInvalid naming %s", c.name, c.err, string(c.want))
		}
	}
	var fence int64
	var pdf *string
	if err := pool.QueryRow(ctx, "SELECT fence, pdf_url FROM invoices WHERE id = 1").Scan(&fence, &pdf); err != nil || fence != 0 || pdf != nil {
		t.Fatalf("row 1 after refused calls: fence %d, pdf_url %v, %v; want 0, NULL", fence, pdf, err)
	}
}

// TestTableReadWrongDest: a Read whose dest cannot hold its column (a
// *int64 for a text column) is ErrInvalid naming dest, and says the read was
// applied: the pgx scan error came back untyped, like a database failure,
// though the UPDATE had raised the fence. In a transaction a rollback undoes
// it.
func TestTableReadWrongDest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"pdf_url"},
		Read: []string{"status"}, Mode: fencedwrite.Reentrant})
	var n int64
	res, err := tbl.Read(ctx, pool, 5, []any{int64(1)}, &n)
	var scanErr pgx.ScanArgError
	if !matches(err, invalidArg("dest")) || !strings.Contains(err.Error(), "the row's fence is now 5") || res.Fence != 5 ||
		!errors.As(err, &scanErr) {
		t.Fatalf("Read(text column into *int64) = %+v, %v; want ErrInvalid naming dest, saying the fence is now 5, wrapping pgx's scan error", res, err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tbl.Read(ctx, tx, 6, []any{int64(2)}, &n); !matches(err, invalidArg("dest")) {
		t.Fatalf("Read in a transaction = %v; want ErrInvalid naming dest", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var f1, f2 int64
	if err := pool.QueryRow(ctx, "SELECT (SELECT fence FROM invoices WHERE id = 1), (SELECT fence FROM invoices WHERE id = 2)").Scan(&f1, &f2); err != nil || f1 != 5 || f2 != 0 {
		t.Fatalf("fences after the reads: row 1 %d, row 2 %d, %v; want 5 (applied on the pool), 0 (rolled back)", f1, f2, err)
	}
}
