package fencedwrite_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// wantGuard checks err is a refusal by the guard for reason ("fence not
// raised": pgfence.ErrGuard; "token not issued": pgfence.ErrInvalid; "token
// superseded": pgfence.ErrStaleToken) and returns it.
func wantGuard(t testing.TB, err error, reason string) *pgfence.Error {
	t.Helper()
	kind, prefix := pgfence.ErrGuard, reason+": "
	switch reason {
	case notIssued:
		kind = pgfence.ErrInvalid
	case superseded:
		kind, prefix = pgfence.ErrStaleToken, "refused by the fence guard: "+reason+": "
	}
	var pe *pgfence.Error
	if !errors.Is(err, kind) || !errors.As(err, &pe) || pe.Kind != kind {
		t.Fatalf("err = %v, want %v", err, kind)
	}
	if !strings.HasPrefix(pe.Reason, prefix) {
		t.Fatalf("guard reason = %q, want %q (%v)", pe.Reason, reason, err)
	}
	return pe
}

// The guard's reasons, as the Reason of its errors starts.
const (
	notRaised  = "fence not raised"
	notIssued  = "token not issued"
	superseded = "token superseded"
)

func TestGuardStrict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	tok := grant(t, pool, "invoices-lock")
	if err := fencedwrite.Guard(ctx, pool, "invoices", fencedwrite.GuardOptions{LockName: "invoices-lock"}); err != nil {
		t.Fatal(err)
	}

	// A forgotten code path without a token fails loudly.
	_, err := pool.Exec(ctx, "UPDATE invoices SET status = 'paid' WHERE id = 1")
	ge := wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	if ge.Name != "public.invoices" {
		t.Fatalf("guard error = %+v", ge)
	}
	// A token higher than any issued for the lock (forged) fails.
	_, err = tbl.Update(ctx, pool, tok+1, []any{1}, []any{"forged"})
	wantGuard(t, err, notIssued)
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'forged', fence = 1000000 WHERE id = 1")
	wantGuard(t, fencedwrite.TranslateError(err), notIssued)
	// Lowering the fence by hand fails.
	if _, err := tbl.Update(ctx, pool, tok, []any{2}, []any{"ok"}); err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(ctx, "UPDATE invoices SET fence = 0 WHERE id = 2")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	// A correct fenced write succeeds; a replay is refused by the WHERE
	// clause (ErrAlreadyApplied), before the trigger sees it.
	if _, err := tbl.Update(ctx, pool, tok, []any{1}, []any{"sent"}); err != nil {
		t.Fatal(err)
	}
	_, err = tbl.Update(ctx, pool, tok, []any{1}, []any{"sent"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = tbl.Upsert(ctx, pool, tok, []any{1}, []any{"sent"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = tbl.Upsert(ctx, pool, tok+1, []any{1}, []any{"sent"})
	wantGuard(t, err, notIssued)
	if got := queryString(t, pool, "SELECT string_agg(status || ':' || fence, ',' ORDER BY id) FROM invoices"); got != "sent:1,ok:1,new:0" {
		t.Fatalf("rows = %s", got)
	}
	// Inserts and deletes are checked too: without a token they fail, fenced
	// ones pass.
	_, err = pool.Exec(ctx, "INSERT INTO invoices (id) VALUES (10)")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	_, err = pool.Exec(ctx, "DELETE FROM invoices WHERE id = 2")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	if res, err := tbl.Upsert(ctx, pool, tok, []any{10}, []any{"new"}); err != nil || !res.Inserted {
		t.Fatalf("fenced insert = %+v, %v", res, err)
	}
	if _, err := tbl.Delete(ctx, pool, tok, []any{10}); err != nil {
		t.Fatal(err)
	}

	list, err := fencedwrite.ListGuarded(ctx, pool)
	if err != nil || len(list) != 1 || list[0].Table != "invoices" || list[0].LockName != "invoices-lock" ||
		list[0].Mode != fencedwrite.Strict || !list[0].TableExists || list[0].FenceColumn != "fence" {
		t.Fatalf("ListGuarded = %+v, %v", list, err)
	}

	removed, err := fencedwrite.Unguard(ctx, pool, "invoices")
	if err != nil || !removed {
		t.Fatalf("Unguard = %v, %v", removed, err)
	}
	mustExec(t, pool, "UPDATE invoices SET status = 'free' WHERE id = 1")
	if removed, err := fencedwrite.Unguard(ctx, pool, "invoices"); err != nil || removed {
		t.Fatalf("second Unguard = %v, %v", removed, err)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pg_proc WHERE proname LIKE 'guard\\_%'"); n != 0 {
		t.Fatalf("%d generated guard functions left", n)
	}
	if list, _ := fencedwrite.ListGuarded(ctx, pool); len(list) != 0 {
		t.Fatalf("ListGuarded after unguard = %+v", list)
	}
}

func TestGuardReentrantWithLockColumn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	mustExec(t, pool, "UPDATE invoices SET store = 'store-' || id")
	err := fencedwrite.Guard(ctx, pool, "public.invoices", fencedwrite.GuardOptions{LockNameColumn: "store", Mode: fencedwrite.Reentrant})
	if err != nil {
		t.Fatal(err)
	}
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"},
		Mode: fencedwrite.Reentrant, Read: []string{"status"}})
	t1 := grant(t, pool, "store-1")
	// Fenced read then re-entrant write with the same token: allowed.
	var st string
	if _, err := tbl.Read(ctx, pool, t1, []any{1}, &st); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, pool, t1, []any{1}, []any{"a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, pool, t1, []any{1}, []any{"b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Modify(ctx, pool, t1, []any{1}, func(c []any) ([]any, error) { return []any{c[0].(string) + "c"}, nil }); err != nil {
		t.Fatal(err)
	}
	// Upsert's DO UPDATE assigns the fence as well.
	if res, err := tbl.Upsert(ctx, pool, t1, []any{1}, []any{"bc"}); err != nil || res.Inserted {
		t.Fatalf("re-entrant upsert on a guarded table = %+v, %v", res, err)
	}
	// Unfenced writer: fence unchanged and not assigned.
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'x' WHERE id = 1")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	// Row 2 is governed by lock store-2, which never issued a token.
	_, err = tbl.Update(ctx, pool, t1, []any{2}, []any{"x"})
	wantGuard(t, err, notIssued)
	// Token of another store's lock is too high for this one.
	t2 := grant(t, pool, "store-2")
	grant(t, pool, "store-1")
	big := grant(t, pool, "store-1")
	if _, err := tbl.Update(ctx, pool, big, []any{2}, []any{"x"}); err == nil {
		t.Fatal("token of store-1 accepted for a store-2 row")
	}
	if _, err := tbl.Update(ctx, pool, t2, []any{2}, []any{"y"}); err != nil {
		t.Fatal(err)
	}
	// Negative fence assigned by hand.
	_, err = pool.Exec(ctx, "UPDATE invoices SET fence = -3 WHERE id = 3")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	if got := queryString(t, pool, "SELECT string_agg(status || ':' || fence, ',' ORDER BY id) FROM invoices"); got != "bc:1,y:1,new:0" {
		t.Fatalf("rows = %s", got)
	}
}

// A reentrant guard checks a fence kept equal against the lock as well: a
// holder superseded by a newer grant can no longer write (or read with a
// fenced read) the rows it wrote under its old token, and an UPDATE that
// assigns the fence to itself is refused unless the fence is the lock's
// latest token. Before migration 00015 all of these went through.
func TestGuardReentrantSuperseded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	mustExec(t, pool, "UPDATE invoices SET store = 'store-' || id")
	if err := fencedwrite.Guard(ctx, pool, "public.invoices", fencedwrite.GuardOptions{LockNameColumn: "store", Mode: fencedwrite.Reentrant}); err != nil {
		t.Fatal(err)
	}
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"},
		Mode: fencedwrite.Reentrant, Read: []string{"status"}})
	old := grant(t, pool, "store-1")
	if _, err := tbl.Update(ctx, pool, old, []any{1}, []any{"a"}); err != nil {
		t.Fatal(err)
	}
	// Still the latest grant: writing again with it, and a statement that
	// assigns the fence to itself, pass.
	if _, err := tbl.Update(ctx, pool, old, []any{1}, []any{"b"}); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, "UPDATE invoices SET status = 'c', fence = fence WHERE id = 1")
	cur := grant(t, pool, "store-1")
	_, err := tbl.Update(ctx, pool, old, []any{1}, []any{"stale"})
	wantGuard(t, err, superseded)
	var st string
	_, err = tbl.Read(ctx, pool, old, []any{1}, &st)
	wantGuard(t, err, superseded)
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'tool', fence = fence WHERE id = 1")
	wantGuard(t, fencedwrite.TranslateError(err), superseded)
	// A fence kept at 0 carries no token.
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'tool', fence = fence WHERE id = 3")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	// The new holder writes.
	if _, err := tbl.Update(ctx, pool, cur, []any{1}, []any{"d"}); err != nil {
		t.Fatal(err)
	}
	if got := queryString(t, pool, "SELECT string_agg(status || ':' || fence, ',' ORDER BY id) FROM invoices"); got != fmt.Sprintf("d:%d,new:0,new:0", cur) {
		t.Fatalf("rows = %s", got)
	}
}

func TestGuardRejectsBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	mustExec(t, pool, `CREATE TABLE nofence (id int PRIMARY KEY)`)
	cases := []struct {
		name  string
		table string
		opts  fencedwrite.GuardOptions
		want  error
	}{
		{"sql table", "invoices; drop table invoices", fencedwrite.GuardOptions{LockName: "l"}, invalidArg("table")},
		{"no lock", "invoices", fencedwrite.GuardOptions{}, invalidArg("GuardOptions")},
		{"both locks", "invoices", fencedwrite.GuardOptions{LockName: "l", LockNameColumn: "store"}, invalidArg("GuardOptions")},
		{"unknown table", "missing", fencedwrite.GuardOptions{LockName: "l"}, invalidArg("table")},
		{"no fence", "nofence", fencedwrite.GuardOptions{LockName: "l"}, invalidArg("fence column")},
		{"fence not bigint", "invoices", fencedwrite.GuardOptions{LockName: "l", FenceColumn: "status"}, invalidArg("fence column")},
		{"unknown lock column", "invoices", fencedwrite.GuardOptions{LockNameColumn: "nope"}, invalidArg("lock name column")},
		{"bad lock column", "invoices", fencedwrite.GuardOptions{LockNameColumn: "a b"}, invalidArg("lock name column")},
		{"bad mode", "invoices", fencedwrite.GuardOptions{LockName: "l", Mode: fencedwrite.Mode(7)}, invalidArg("GuardOptions.Mode")},
		{"huge lock name", "invoices", fencedwrite.GuardOptions{LockName: strings.Repeat("l", 513)}, invalidArg("GuardOptions.LockName")},
		{"lock name with a NUL byte", "invoices", fencedwrite.GuardOptions{LockName: "l\x00"}, invalidArg("GuardOptions.LockName")},
		{"lock name not UTF-8", "invoices", fencedwrite.GuardOptions{LockName: "l\xff"}, invalidArg("GuardOptions.LockName")},
		{"expression with a NUL byte", "invoices", fencedwrite.GuardOptions{LockNameExpression: "'store:' || \x00store"}, invalidArg("GuardOptions.LockNameExpression")},
	}
	for _, c := range cases {
		if err := fencedwrite.Guard(ctx, pool, c.table, c.opts); !matches(err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.name, err, c.want)
		}
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pgfence.guarded_tables"); n != 0 {
		t.Fatalf("%d guarded tables after refused calls", n)
	}
	// The SQL function checks too, for DBAs calling it from psql.
	_, err := pool.Exec(ctx, "SELECT pgfence.guard('invoices')")
	if err == nil {
		t.Fatal("pgfence.guard without a lock accepted")
	}
}

// TestRollout follows seed 002's rollout: add the fence column with default 0
// to a table with live rows, unfenced writers keep working, fenced writers
// work beside them, then the guard makes the unfenced writers fail.
func TestRollout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE catalogue (store_id int PRIMARY KEY, prices jsonb NOT NULL)`)
	mustExec(t, pool, `INSERT INTO catalogue SELECT g, '{"sku": 1}' FROM generate_series(1, 100) g`)
	legacy := func() error {
		_, err := pool.Exec(ctx, `UPDATE catalogue SET prices = '{"sku": 2}' WHERE store_id = 7`)
		return fencedwrite.TranslateError(err)
	}

	// Step 1: the column (metadata-only change in PostgreSQL 11+).
	mustExec(t, pool, `ALTER TABLE catalogue ADD COLUMN fence bigint NOT NULL DEFAULT 0`)
	if n := queryInt(t, pool, "SELECT count(*) FROM catalogue WHERE fence = 0"); n != 100 {
		t.Fatalf("%d rows with fence 0, want 100", n)
	}
	if err := legacy(); err != nil {
		t.Fatalf("unfenced writer broke after adding the column: %v", err)
	}
	// Step 2: writers that send tokens.
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "catalogue", Key: []string{"store_id"}, Set: []string{"prices"}})
	tok := grant(t, pool, "catalogue")
	if _, err := tbl.Update(ctx, pool, tok, []any{7}, []any{`{"sku": 3}`}); err != nil {
		t.Fatal(err)
	}
	if err := legacy(); err != nil {
		t.Fatalf("unfenced writer broke beside fenced ones: %v", err)
	}
	// Step 3: the guard, last.
	if err := fencedwrite.Guard(ctx, pool, "catalogue", fencedwrite.GuardOptions{LockName: "catalogue"}); err != nil {
		t.Fatal(err)
	}
	wantGuard(t, legacy(), notRaised)
	tok = grant(t, pool, "catalogue")
	if _, err := tbl.Update(ctx, pool, tok, []any{7}, []any{`{"sku": 4}`}); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, pool, tok, []any{8}, []any{`{"sku": 4}`}); err != nil {
		t.Fatalf("first fenced write of a fence-0 row under the guard: %v", err)
	}
	if got := queryString(t, pool, "SELECT prices->>'sku' FROM catalogue WHERE store_id = 7"); got != "4" {
		t.Fatalf("sku = %s", got)
	}
}

// TestMigrationDownRemovesGuards: rolling pgfence's migrations back detaches
// guards from application tables, and up again works.
func TestMigrationDownRemovesGuards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	grant(t, pool, "l")
	if err := fencedwrite.Guard(ctx, pool, "invoices", fencedwrite.GuardOptions{LockName: "l", Mode: fencedwrite.Reentrant}); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, `CREATE TABLE doomed (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0)`)
	if err := fencedwrite.Guard(ctx, pool, "doomed", fencedwrite.GuardOptions{LockName: "l"}); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, `DROP TABLE doomed`)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := migrations.DownTo(ctx, db, 0); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'pgfence%'"); n != 0 {
		t.Fatalf("%d pgfence triggers left after down", n)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'pgfence'"); n != 0 {
		t.Fatalf("%d pgfence functions left after down", n)
	}
	mustExec(t, pool, "UPDATE invoices SET status = 'free'")
	if err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
}
