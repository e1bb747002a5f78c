package migrations_test

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// guardMarkWhenVersion is the version of migration
// 00011_pgfence_guard_mark_when.sql, which gives the reentrant guard's mark
// trigger its condition as a WHEN clause.
const guardMarkWhenVersion = 11

// TestGuardMarkWhen: guards attached before migration 00011 get a mark
// trigger that fires only for a fence kept equal (or NULL or negative), so
// that an UPDATE raising the fence calls one trigger function per row
// instead of two; they refuse and accept exactly the same changes before the
// migration, after it and after its Down; a strict guard keeps its trigger;
// pgfence.guard() attaches the WHEN clause from then on, and the Down takes
// it away again.
func TestGuardMarkWhen(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pool, db, tables, reentrant, statements := markWhenSetup(t, ctx, "guard_mark_when", guardMarkWhenVersion)
	before := fmt.Sprintf("version %d", guardMarkWhenVersion-1)
	after := fmt.Sprintf("version %d", guardMarkWhenVersion)
	checkMarkWhen(t, ctx, pool, before, tables, func(string) bool { return false })
	beforeOutcomes := guardOutcomes(t, ctx, pool, statements)

	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, guardMarkWhenVersion); err != nil {
		t.Fatal(err)
	}
	checkMarkWhen(t, ctx, pool, after, tables, func(table string) bool { return reentrant[table] })
	compareOutcomes(t, before, beforeOutcomes, after, guardOutcomes(t, ctx, pool, statements), statements)

	// One trigger function call per row for a raised fence, two for a
	// fence kept equal (the mark, then the check).
	for _, c := range []struct{ sql, want string }{
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id = 2", "check=1 mark=0"}, // 7 -> 10: raised
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id = 1", "check=1 mark=1"}, // 10 -> 10: kept
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id IN (1, 2)", "check=2 mark=1"},
		{"UPDATE gc_column_strict SET v = v + 1, fence = 10 WHERE id = 2", "check=1 mark=0"},
	} {
		if got := guardCalls(t, ctx, pool, c.sql); got != c.want {
			t.Errorf("%s: trigger function calls %q, want %q", c.sql, got, c.want)
		}
	}

	// A guard attached from now on gets the WHEN clause too.
	mustExecPool(t, ctx, pool, "SELECT pgfence.guard('gc_column_reentrant_null', lock_name_column => 'lock', mode => 'reentrant')")
	checkMarkWhen(t, ctx, pool, after+", attached again", tables, func(table string) bool { return reentrant[table] })
	compareOutcomes(t, before, beforeOutcomes, after+", attached again", guardOutcomes(t, ctx, pool, statements), statements)

	if err := migrations.DownTo(ctx, db, guardMarkWhenVersion-1); err != nil {
		t.Fatal(err)
	}
	checkMarkWhen(t, ctx, pool, before+" again", tables, func(string) bool { return false })
	compareOutcomes(t, before, beforeOutcomes, before+" again", guardOutcomes(t, ctx, pool, statements), statements)
	mustExecPool(t, ctx, pool, "SELECT pgfence.guard('gc_column_reentrant_null', lock_name_column => 'lock', mode => 'reentrant')")
	checkMarkWhen(t, ctx, pool, before+", attached again", tables, func(string) bool { return false })
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}

// checkMarkWhen checks, for every table, that its guard's mark trigger has
// the WHEN clause if when(table), has none otherwise, and that a strict guard
// has no mark trigger.
func checkMarkWhen(t *testing.T, ctx context.Context, pool *pgxpool.Pool, phase string, tables []string, when func(string) bool) {
	t.Helper()
	for _, tb := range tables {
		def := queryString(t, ctx, pool, `SELECT coalesce(string_agg(pg_get_triggerdef(oid), ' | '), '') FROM pg_trigger
			WHERE tgrelid = $1::regclass AND tgname = 'pgfence_guard_a_mark'`, tb)
		strict := !strings.Contains(tb, "reentrant")
		switch {
		case strict && def != "":
			t.Errorf("%s: strict guard of %s has a mark trigger: %s", phase, tb, def)
		case strict:
		case when(tb) && !strings.Contains(def, "WHEN (((new.fence IS NULL) OR (new.fence < 0) OR (new.fence = COALESCE(old.fence, (0)::bigint))))"):
			t.Errorf("%s: mark trigger of %s: %s, want it WHEN the fence is NULL, negative or kept", phase, tb, def)
		case !when(tb) && (def == "" || strings.Contains(def, "WHEN")):
			t.Errorf("%s: mark trigger of %s: %q, want one without WHEN", phase, tb, def)
		}
	}
}

// guardCalls runs sql in a transaction it rolls back and says how many times
// it called guard check and mark functions: "check=N mark=M".
func guardCalls(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sql string) string {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SET LOCAL track_functions = 'pl'"); err != nil {
		t.Fatal(err)
	}
	// The backend's counts not yet reported (earlier transactions'
	// too): the difference across the statement is its own.
	read := func() (check, mark int64) {
		if err := tx.QueryRow(ctx, `SELECT
				coalesce(sum(calls) FILTER (WHERE funcname NOT LIKE '%\_mark'), 0),
				coalesce(sum(calls) FILTER (WHERE funcname LIKE '%\_mark'), 0)
			FROM pg_stat_xact_user_functions WHERE schemaname = 'pgfence' AND funcname LIKE 'guard\_%'`).Scan(&check, &mark); err != nil {
			t.Fatal(err)
		}
		return check, mark
	}
	c0, m0 := read()
	if _, err := tx.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	c1, m1 := read()
	return fmt.Sprintf("check=%d mark=%d", c1-c0, m1-m0)
}

// markWhenSetup checks that migration version is named
// <version>_pgfence_<name>.sql, rolls a test database back to the version
// before it and guards the tables of guardCostTables (but
// TestGuardCostMigration's cases of 00007) there. It returns the pool, a
// *sql.DB over it, the tables, which of them are reentrant and the
// transactions of guardCostStatements on them.
func markWhenSetup(t *testing.T, ctx context.Context, name string, version int64) (
	pool *pgxpool.Pool, db *sql.DB, tables []string, reentrant map[string]bool, statements []guardCostTx) {
	t.Helper()
	if _, err := fs.Stat(migrations.FS(), fmt.Sprintf("%05d_pgfence_%s.sql", version, name)); err != nil {
		t.Fatalf("version %d is not migration %s: %v", version, name, err)
	}
	pool = pgtest.PoolFor(t, pgtest.DSN(t))
	db = stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	if err := migrations.DownTo(ctx, db, version-1); err != nil {
		t.Fatal(err)
	}
	mustExecPool(t, ctx, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('gc:one', 10), ('gc:two', 20)`)
	reentrant = map[string]bool{}
	for _, tb := range guardCostTables {
		if tb.name == "gc_domain_reentrant" || tb.name == "gc_owned_reentrant" {
			continue // TestGuardCostMigration's cases of 00007
		}
		guardCostTable(t, ctx, pool, tb.name, tb.ddl, tb.guard)
		tables = append(tables, tb.name)
		reentrant[tb.name] = tb.reentrant
	}
	for _, s := range guardCostStatements() {
		if _, ok := reentrant[s.table]; ok {
			statements = append(statements, s)
		}
	}
	return pool, db, tables, reentrant, statements
}
