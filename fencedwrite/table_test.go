package fencedwrite_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func prepare(t testing.TB, db pgfence.DBTX, spec fencedwrite.Spec) *fencedwrite.Table {
	t.Helper()
	tbl, err := fencedwrite.Prepare(context.Background(), db, spec)
	if err != nil {
		t.Fatalf("Prepare(%+v): %v", spec, err)
	}
	return tbl
}

func TestTableUpdateStrictAndReentrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	strict := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"pdf_url", "status"}})
	reent := prepare(t, pool, fencedwrite.Spec{Table: "public.invoices", Key: []string{"id"}, Set: []string{"pdf_url", "status"},
		Mode: fencedwrite.Reentrant})
	if sql := fencedwrite.UpdateSQL(strict); !strings.Contains(sql, `"fence" OPERATOR(pg_catalog.<) $1`) || !strings.Contains(sql, `"public"."invoices"`) {
		t.Fatalf("strict SQL = %s", sql)
	}
	// An accepted write costs the hand-written statement: one plain UPDATE,
	// no diagnosis branch (a refusal is explained by a read afterwards).
	if sql := fencedwrite.UpdateSQL(strict); !strings.HasPrefix(sql, "UPDATE ") || strings.Contains(sql, "UNION") || strings.Contains(sql, "WITH") {
		t.Fatalf("strict SQL is not a plain UPDATE: %s", sql)
	}

	t1 := grant(t, pool, "store-1")
	res, err := strict.Update(ctx, pool, t1, []any{int64(1)}, []any{"s3://a.pdf", "rendered"})
	if err != nil || res.Fence != t1 {
		t.Fatalf("Update = %+v, %v", res, err)
	}
	_, err = strict.Update(ctx, pool, t1, []any{int64(1)}, []any{"s3://replay.pdf", "rendered"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	if _, err := reent.Update(ctx, pool, t1, []any{int64(1)}, []any{"s3://again.pdf", "rendered"}); err != nil {
		t.Fatalf("re-entrant rewrite: %v", err)
	}
	t2 := grant(t, pool, "store-1")
	if _, err := strict.Update(ctx, pool, t2, []any{int64(1)}, []any{"s3://b.pdf", "sent"}); err != nil {
		t.Fatal(err)
	}
	_, err = strict.Update(ctx, pool, t1, []any{int64(1)}, []any{"s3://stale.pdf", "void"})
	wantStale(t, err, t1, t2)
	_, err = reent.Update(ctx, pool, t1, []any{int64(1)}, []any{"s3://stale.pdf", "void"})
	wantStale(t, err, t1, t2)
	if got := queryString(t, pool, "SELECT pdf_url || ' ' || status || ' ' || fence FROM invoices WHERE id = 1"); got != "s3://b.pdf sent 2" {
		t.Fatalf("row = %q", got)
	}
	_, err = strict.Update(ctx, pool, t2, []any{int64(99)}, []any{"x", "y"})
	wantIs(t, err, pgfence.ErrNotFound)

	// Inside the caller's transaction: rolled back with it.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t3 := grant(t, pool, "store-1")
	if _, err := strict.Update(ctx, tx, t3, []any{int64(2)}, []any{"in-tx", "x"}); err != nil {
		t.Fatal(err)
	}
	// A refusal inside the transaction is diagnosed by a read in the same
	// transaction (it sees the transaction's own write) and leaves the
	// transaction usable.
	_, err = strict.Update(ctx, tx, t3, []any{int64(2)}, []any{"replay", "x"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = strict.Update(ctx, tx, t1, []any{int64(2)}, []any{"stale", "x"})
	wantStale(t, err, t1, t3)
	_, err = strict.Update(ctx, tx, t3, []any{int64(98)}, []any{"x", "y"})
	wantIs(t, err, pgfence.ErrNotFound)
	if got := queryString(t, tx, "SELECT pdf_url || ' ' || fence FROM invoices WHERE id = 2"); got != "in-tx "+strconv.FormatInt(t3, 10) {
		t.Fatalf("row in the transaction after the refusals = %q", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if f := queryInt(t, pool, "SELECT fence FROM invoices WHERE id = 2"); f != 0 {
		t.Fatalf("fence after rollback = %d", f)
	}
}

func TestTableUpsertDeleteCompositeKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE SCHEMA billing`)
	mustExec(t, pool, `CREATE TABLE billing.lines (
		invoice_id bigint, line int, amount numeric NOT NULL, version bigint NOT NULL DEFAULT 0,
		PRIMARY KEY (invoice_id, line))`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "billing.lines", Key: []string{"line", "invoice_id"},
		Set: []string{"amount"}, FenceColumn: "version"})
	t1 := grant(t, pool, "lines")
	res, err := tbl.Upsert(ctx, pool, t1, []any{1, 7}, []any{"12.50"})
	if err != nil || !res.Inserted || res.Fence != t1 {
		t.Fatalf("insert = %+v, %v", res, err)
	}
	_, err = tbl.Upsert(ctx, pool, t1, []any{1, 7}, []any{"99"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	t2 := grant(t, pool, "lines")
	res, err = tbl.Upsert(ctx, pool, t2, []any{1, 7}, []any{"13"})
	if err != nil || res.Inserted || res.Fence != t2 {
		t.Fatalf("update by upsert = %+v, %v", res, err)
	}
	_, err = tbl.Upsert(ctx, pool, t1, []any{1, 7}, []any{"1"})
	wantStale(t, err, t1, t2)
	_, err = tbl.Delete(ctx, pool, t1, []any{1, 7})
	wantStale(t, err, t1, t2)
	if _, err := tbl.Delete(ctx, pool, t2, []any{1, 7}); err != nil {
		t.Fatal(err)
	}
	_, err = tbl.Delete(ctx, pool, t2, []any{1, 7})
	wantIs(t, err, pgfence.ErrNotFound)

	// Wrong number of values, bad tokens: refused before SQL.
	_, err = tbl.Update(ctx, pool, t2, []any{1}, []any{"1"})
	wantIs(t, err, invalidArg("key"))
	_, err = tbl.Update(ctx, pool, t2, []any{1, 7}, nil)
	wantIs(t, err, invalidArg("set"))
	_, err = tbl.Update(ctx, pool, 0, []any{1, 7}, []any{"1"})
	wantIs(t, err, invalidArg("token"))
}

func TestPrepareRejects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	mustExec(t, pool, `CREATE TABLE nofence (id int PRIMARY KEY, v text)`)
	mustExec(t, pool, `CREATE TABLE textfence (id int PRIMARY KEY, v text, fence text)`)
	mustExec(t, pool, `CREATE TABLE nokey (id int, v text, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `CREATE TABLE nullfence (id int PRIMARY KEY, v text, fence bigint DEFAULT 0)`)
	mustExec(t, pool, `CREATE VIEW invoices_v AS SELECT * FROM invoices`)
	good := fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}}
	with := func(f func(*fencedwrite.Spec)) fencedwrite.Spec { s := good; f(&s); return s }
	cases := []struct {
		name string
		spec fencedwrite.Spec
		want error
	}{
		{"sql in table", with(func(s *fencedwrite.Spec) { s.Table = "x; drop table y" }), invalidArg("table")},
		{"quote in column", with(func(s *fencedwrite.Spec) { s.Set = []string{`status" = 'x' --`} }), invalidArg("set column")},
		{"empty table", with(func(s *fencedwrite.Spec) { s.Table = "" }), invalidArg("table")},
		{"huge table", with(func(s *fencedwrite.Spec) { s.Table = strings.Repeat("t", 64) }), invalidArg("table")},
		{"three-part name", with(func(s *fencedwrite.Spec) { s.Table = "db.public.invoices" }), invalidArg("table")},
		{"empty key column", with(func(s *fencedwrite.Spec) { s.Key = []string{""} }), invalidArg("key column")},
		{"bad fence column", with(func(s *fencedwrite.Spec) { s.FenceColumn = "fence--" }), invalidArg("fence column")},
		{"no key", with(func(s *fencedwrite.Spec) { s.Key = nil }), invalidArg("Spec.Key")},
		{"no set", with(func(s *fencedwrite.Spec) { s.Set = nil }), invalidArg("Spec.Set")},
		{"fence in set", with(func(s *fencedwrite.Spec) { s.Set = []string{"fence"} }), invalidArg("set column")},
		{"key in set", with(func(s *fencedwrite.Spec) { s.Set = []string{"id"} }), invalidArg("set column")},
		{"bad mode", with(func(s *fencedwrite.Spec) { s.Mode = 3 }), invalidArg("Spec.Mode")},
		{"unknown table", with(func(s *fencedwrite.Spec) { s.Table = "missing" }), invalidArg("table")},
		{"unknown schema", with(func(s *fencedwrite.Spec) { s.Table = "nosuch.invoices" }), invalidArg("table")},
		{"view", with(func(s *fencedwrite.Spec) { s.Table = "invoices_v" }), invalidArg("table")},
		{"case matters", with(func(s *fencedwrite.Spec) { s.Table = "Invoices" }), invalidArg("table")},
		{"unknown set column", with(func(s *fencedwrite.Spec) { s.Set = []string{"nope"} }), invalidArg("set column")},
		{"unknown key column", with(func(s *fencedwrite.Spec) { s.Key = []string{"nope"} }), invalidArg("key column")},
		{"unknown read column", with(func(s *fencedwrite.Spec) { s.Read = []string{"nope"} }), invalidArg("read column")},
		{"no fence column", with(func(s *fencedwrite.Spec) { s.Table = "nofence"; s.Set = []string{"v"} }), invalidArg("fence column")},
		{"text fence column", with(func(s *fencedwrite.Spec) { s.Table = "textfence"; s.Set = []string{"v"} }), invalidArg("fence column")},
		// A NULL fence is never below a token: its row could not be written.
		{"nullable fence column", with(func(s *fencedwrite.Spec) { s.Table = "nullfence"; s.Set = []string{"v"} }), invalidArg("fence column")},
		{"key not unique", with(func(s *fencedwrite.Spec) { s.Table = "nokey"; s.Set = []string{"v"} }), invalidArg("Spec.Key")},
		{"key part of pk", with(func(s *fencedwrite.Spec) { s.Key = []string{"store"}; s.Set = []string{"status"} }), invalidArg("Spec.Key")},
	}
	for _, c := range cases {
		_, err := fencedwrite.Prepare(ctx, pool, c.spec)
		if !matches(err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.name, err, c.want)
		}
	}
	// The errors carry the details.
	_, err := fencedwrite.Prepare(ctx, pool, with(func(s *fencedwrite.Spec) { s.Table = "x; drop table y" }))
	var pe *pgfence.Error
	if !errors.As(err, &pe) || !strings.HasPrefix(pe.Reason, `table: invalid name "x; drop table y"`) {
		t.Errorf("invalid table name: %#v", err)
	}
	_, err = fencedwrite.Prepare(ctx, pool, with(func(s *fencedwrite.Spec) { s.Table = "nofence"; s.Set = []string{"v"} }))
	if !errors.As(err, &pe) || !strings.HasPrefix(pe.Reason, `fence column: "fence" of`) || pe.Name != "public.nofence" ||
		!strings.Contains(err.Error(), "ADD COLUMN") {
		t.Errorf("no fence column: %v", err)
	}
	// Nothing was created or changed by any of this.
	if n := queryInt(t, pool, "SELECT count(*) FROM invoices WHERE fence <> 0 OR status <> 'new'"); n != 0 {
		t.Fatalf("%d rows changed", n)
	}
	if queryInt(t, pool, "SELECT count(*) FROM pg_class WHERE relname = 'y'") != 0 {
		t.Fatal("table y appeared")
	}
}

// accounts is the seed-002 lab: one balance, read-modify-write by two clients.
func accounts(t testing.TB) (pgfence.DBTX, *fencedwrite.Table, func() int64) {
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `INSERT INTO accounts VALUES (1, 100, 0)`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "accounts", Key: []string{"id"}, Set: []string{"balance"},
		Mode: fencedwrite.Reentrant})
	return pool, tbl, func() int64 { return queryInt(t, pool, "SELECT balance FROM accounts WHERE id = 1") }
}

// TestScenario3WritesOnlyFencingLosesAnUpdate reproduces seed 002, scenario 3:
// A reads and pauses, B is granted and reads, A (whose token passes because no
// write carried a higher one yet) writes, B writes from its stale read. Every
// write was fenced, yet A's +50 is lost: 110 instead of 160.
func TestScenario3WritesOnlyFencingLosesAnUpdate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tbl, balance := accounts(t)
	key := []any{1}
	readPlain := func() int64 { return balance() } // unfenced read

	tokA := grant(t, db, "account-1")
	aRead := readPlain()
	// A pauses; its lease expires; B is granted the lock.
	tokB := grant(t, db, "account-1")
	bRead := readPlain()
	if _, err := tbl.Update(ctx, db, tokA, key, []any{aRead + 50}); err != nil {
		t.Fatalf("A's write (token %d) was accepted in the lab, got %v", tokA, err)
	}
	if _, err := tbl.Update(ctx, db, tokB, key, []any{bRead + 10}); err != nil {
		t.Fatal(err)
	}
	if got := balance(); got != 110 {
		t.Fatalf("balance = %d, the lab's lost update gives 110", got)
	}
}

// TestScenario4FencedReadsKeepEveryUpdate is the same timing with the token on
// the read too: B's fenced read raises the fence to 2, A's write is refused
// as stale, A starts over with a new grant, and the balance is 160.
func TestScenario4FencedReadsKeepEveryUpdate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tbl, balance := accounts(t)
	key := []any{1}
	read := func(tok int64) int64 {
		t.Helper()
		var b int64
		if _, err := tbl.Read(ctx, db, tok, key, &b); err != nil {
			t.Fatalf("fenced read with token %d: %v", tok, err)
		}
		return b
	}

	tokA := grant(t, db, "account-1")
	aRead := read(tokA)
	tokB := grant(t, db, "account-1")
	bRead := read(tokB)
	_, err := tbl.Update(ctx, db, tokA, key, []any{aRead + 50})
	wantStale(t, err, tokA, tokB)
	if _, err := tbl.Update(ctx, db, tokB, key, []any{bRead + 10}); err != nil {
		t.Fatal(err)
	}
	// A's fenced read is refused as well now.
	var b int64
	_, err = tbl.Read(ctx, db, tokA, key, &b)
	wantStale(t, err, tokA, tokB)
	// A starts over under a new grant.
	tokA2 := grant(t, db, "account-1")
	if _, err := tbl.Update(ctx, db, tokA2, key, []any{read(tokA2) + 50}); err != nil {
		t.Fatal(err)
	}
	if got := balance(); got != 160 {
		t.Fatalf("balance = %d, want 160", got)
	}
}

// TestModifyInOneTransaction: the transaction helper does read and write under
// one check; a stale grant's Modify never calls fn, and fn's error rolls back.
func TestModifyInOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, tbl, balance := accounts(t)
	pool := db.(fencedwrite.Beginner)
	key := []any{1}
	add := func(d int64) func([]any) ([]any, error) {
		return func(cur []any) ([]any, error) { return []any{cur[0].(int64) + d}, nil }
	}
	tokA := grant(t, db, "account-1")
	tokB := grant(t, db, "account-1")
	if _, err := tbl.Modify(ctx, pool, tokB, key, add(10)); err != nil {
		t.Fatal(err)
	}
	_, err := tbl.Modify(ctx, pool, tokA, key, func([]any) ([]any, error) { t.Error("fn called for stale token"); return nil, nil })
	wantStale(t, err, tokA, tokB)
	tokA2 := grant(t, db, "account-1")
	if _, err := tbl.Modify(ctx, pool, tokA2, key, add(50)); err != nil {
		t.Fatal(err)
	}
	if got := balance(); got != 160 {
		t.Fatalf("balance = %d, want 160", got)
	}
	boom := errors.New("boom")
	tok := grant(t, db, "account-1")
	if _, err := tbl.Modify(ctx, pool, tok, key, func([]any) ([]any, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("err = %v", err)
	}
	if f := queryInt(t, db, "SELECT fence FROM accounts"); f != tokA2 {
		t.Fatalf("fence = %d after rolled-back modify, want %d", f, tokA2)
	}
	// Modify inside the caller's transaction uses a savepoint.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tbl.Modify(ctx, tx, tok, key, add(1)); err != nil {
		t.Fatal(err)
	}
	var inTx int64
	if err := tx.QueryRow(ctx, "SELECT balance FROM accounts").Scan(&inTx); err != nil || inTx != 161 {
		t.Fatalf("balance in tx = %d, %v", inTx, err)
	}
	_ = tx.Rollback(ctx)
	if got := balance(); got != 160 {
		t.Fatalf("balance after outer rollback = %d", got)
	}
	var _ pgx.Tx = tx
}

// A fence column named like a column of the statements' own results
// ("inserted") works: Upsert named its inserted flag "inserted" too, and
// every Upsert of such a table failed with 42702 (ambiguous column).
func TestUpsertFenceNamedInserted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE odd_fence (id int PRIMARY KEY, v text, inserted bigint NOT NULL DEFAULT 0)`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "odd_fence", Key: []string{"id"}, Set: []string{"v"}, FenceColumn: "inserted"})
	tok := grant(t, pool, "odd")
	res, err := tbl.Upsert(ctx, pool, tok, []any{1}, []any{"a"})
	if err != nil || !res.Inserted || res.Fence != tok {
		t.Fatalf("Upsert of a new row: %+v, %v; want inserted with fence %d", res, err, tok)
	}
	tok2 := grant(t, pool, "odd")
	res, err = tbl.Upsert(ctx, pool, tok2, []any{1}, []any{"b"})
	if err != nil || res.Inserted || res.Fence != tok2 {
		t.Fatalf("Upsert of an existing row: %+v, %v; want updated with fence %d", res, err, tok2)
	}
}
