package fencedwrite_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// cataloguePool creates a table whose rows are governed per store, with the
// lock name as a stored generated column and as a plain expression source.
func cataloguePool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `
		CREATE TABLE catalogue (
			store_id   int    NOT NULL,
			sku        text   NOT NULL,
			price      bigint NOT NULL DEFAULT 0,
			store_lock text   GENERATED ALWAYS AS ('store:' || store_id) STORED,
			fence      bigint NOT NULL DEFAULT 0,
			PRIMARY KEY (store_id, sku)
		)`)
	return pool
}

func catalogueTable(t testing.TB, pool *pgxpool.Pool, mode fencedwrite.Mode) *fencedwrite.Table {
	return prepare(t, pool, fencedwrite.Spec{Table: "catalogue", Key: []string{"store_id", "sku"},
		Set: []string{"price"}, Mode: mode})
}

// TestGuardEveryChange: with the lock name in a generated column or given
// as an expression, fenced writes of every kind pass, and unfenced, forged
// and superseded INSERT, UPDATE and DELETE are refused, naming table, lock
// and token.
func TestGuardEveryChange(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts fencedwrite.GuardOptions
	}{
		{"generated column", fencedwrite.GuardOptions{LockNameColumn: "store_lock"}},
		{"expression", fencedwrite.GuardOptions{LockNameExpression: "'store:' || store_id"}},
		{"generated column, reentrant", fencedwrite.GuardOptions{LockNameColumn: "store_lock", Mode: fencedwrite.Reentrant}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := cataloguePool(t)
			if err := fencedwrite.Guard(ctx, pool, "catalogue", tc.opts); err != nil {
				t.Fatal(err)
			}
			tbl := catalogueTable(t, pool, tc.opts.Mode)
			old := grant(t, pool, "store:1") // the paused importer's token
			cur := grant(t, pool, "store:1") // the importer that took over

			// Fenced writes with the current token pass.
			if res, err := tbl.Upsert(ctx, pool, cur, []any{1, "a"}, []any{10}); err != nil || !res.Inserted {
				t.Fatalf("fenced insert = %+v, %v", res, err)
			}
			if _, err := tbl.Upsert(ctx, pool, cur, []any{1, "b"}, []any{10}); err != nil {
				t.Fatal(err)
			}
			// The paused importer wakes up: its late INSERT of a new row,
			// UPDATE of a row the new holder has not touched yet, and DELETE
			// are all refused as superseded (a stale token).
			mustExec(t, pool, "ALTER TABLE catalogue DISABLE TRIGGER USER")
			mustExec(t, pool, "INSERT INTO catalogue (store_id, sku, fence) VALUES (1, 'untouched', 0)")
			mustExec(t, pool, "ALTER TABLE catalogue ENABLE TRIGGER USER")
			_, err := tbl.Upsert(ctx, pool, old, []any{1, "late"}, []any{1})
			ge := wantGuard(t, err, superseded)
			if !errors.Is(err, pgfence.ErrStaleToken) || ge.Name != "public.catalogue" {
				t.Fatalf("superseded insert: %v (%+v)", err, ge)
			}
			_, err = tbl.Update(ctx, pool, old, []any{1, "untouched"}, []any{1})
			wantGuard(t, err, superseded)
			_, err = tbl.Delete(ctx, pool, old, []any{1, "untouched"})
			wantGuard(t, err, superseded)
			_, err = tbl.Delete(ctx, pool, old, []any{1, "a"})
			wantStale(t, err, old, cur)

			// Unfenced changes from a forgotten script are refused.
			_, err = pool.Exec(ctx, "INSERT INTO catalogue (store_id, sku) VALUES (1, 'plain')")
			wantGuard(t, fencedwrite.TranslateError(err), notRaised)
			_, err = pool.Exec(ctx, "DELETE FROM catalogue WHERE store_id = 1")
			ge = wantGuard(t, fencedwrite.TranslateError(err), notRaised)
			if !strings.Contains(ge.Reason, `key {"sku": `) || !strings.Contains(ge.Reason, "lock store:1") {
				t.Fatalf("guard error does not name key and lock: %q", ge.Reason)
			}
			_, err = pool.Exec(ctx, "UPDATE catalogue SET price = 0")
			wantGuard(t, fencedwrite.TranslateError(err), notRaised)
		})
	}
}

// TestGuardForgedAndUngoverned: tokens above the lock's latest, rows whose
// lock was never granted, and a token set for another store's lock are
// refused; the error names the lock and the token.
func TestGuardForgedAndUngoverned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := cataloguePool(t)
	if err := fencedwrite.Guard(ctx, pool, "catalogue", fencedwrite.GuardOptions{LockNameColumn: "store_lock"}); err != nil {
		t.Fatal(err)
	}
	tbl := catalogueTable(t, pool, fencedwrite.Strict)
	s1 := grant(t, pool, "store:1")
	grant(t, pool, "store:2")
	s2 := grant(t, pool, "store:2")

	_, err := tbl.Upsert(ctx, pool, s1+5, []any{1, "a"}, []any{1})
	ge := wantGuard(t, err, notIssued)
	if !strings.Contains(ge.Reason, "store:1") || !strings.Contains(ge.Reason, "latest token") {
		t.Fatalf("forged token error does not name lock and tokens: %v / %s", ge.Reason, ge.Reason)
	}
	_, err = tbl.Upsert(ctx, pool, s1, []any{3, "a"}, []any{1})
	wantGuard(t, err, notIssued) // no lock row for store:3
	// store 1's token is lower than store 2's latest: superseded there.
	_, err = tbl.Upsert(ctx, pool, s2-1, []any{2, "a"}, []any{1})
	wantGuard(t, err, superseded)

	// A DELETE in a transaction that named a token passes only for that
	// lock's latest token.
	if _, err := tbl.Upsert(ctx, pool, s1, []any{1, "a"}, []any{1}); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Upsert(ctx, pool, s2, []any{2, "a"}, []any{1}); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pgfence.use_token($1)", s1); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DELETE FROM catalogue WHERE store_id = 2")
		return err
	})
	// (store 2's rows carry fence s2 > s1: refused as not raising the fence)
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pgfence.use_token($1)", s1); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DELETE FROM catalogue WHERE store_id = 1")
		return err
	})
	if err != nil {
		t.Fatalf("delete under the current token: %v", err)
	}
	// The token setting ends with its transaction.
	_, err = pool.Exec(ctx, "DELETE FROM catalogue WHERE store_id = 2")
	wantGuard(t, fencedwrite.TranslateError(err), notRaised)
	// use_token refuses tokens <= 0.
	_, err = pool.Exec(ctx, "SELECT pgfence.use_token(0)")
	wantIs(t, fencedwrite.TranslateError(err), invalidArg("token"))
	if n := queryInt(t, pool, "SELECT count(*) FROM catalogue"); n != 1 {
		t.Fatalf("%d rows left, want 1", n)
	}
}

// TestGuardBadLockSource: bad lock sources are refused by Guard and by
// pgfence.guard, and change nothing.
func TestGuardBadLockSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := cataloguePool(t)
	for _, opts := range []fencedwrite.GuardOptions{
		{},
		{LockName: "x", LockNameExpression: "'a'"},
		{LockNameColumn: "store_lock", LockNameExpression: "'a'"},
		{LockNameExpression: "no_such_column || 'x'"},
		{LockNameExpression: "'a'; DROP TABLE catalogue"},
		{LockNameExpression: "1) FROM catalogue; DROP TABLE catalogue; SELECT (1"},
		{LockNameExpression: string(make([]byte, 5000))},
	} {
		err := fencedwrite.Guard(ctx, pool, "catalogue", opts)
		if !matches(err, invalidArg("GuardOptions")) {
			t.Errorf("Guard(%.40q...) = %v, want ErrInvalid naming GuardOptions", opts.LockNameExpression, err)
		}
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pgfence.guarded_tables"); n != 0 {
		t.Fatalf("%d guarded tables after bad input", n)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pg_class WHERE relname = 'catalogue'"); n != 1 {
		t.Fatal("catalogue was dropped")
	}
}
