package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// guardCostVersion is the version of migration 00007_pgfence_guard_cost.sql,
// which makes the generated guard functions cheaper. TestGuardCostMigration
// attaches guards at the version before it (guardCostVersion-1), migrates up
// and rolls back to that version again.
const guardCostVersion = 7

// guardCostTables are the tables TestGuardCostMigration guards before
// migration 00007: every lock source, both modes, a nullable fence column, a
// table whose check function another role owns, and one whose guard 00007
// cannot attach again (its lock-name column became a domain, which
// pgfence.guard() refuses).
var guardCostTables = []struct {
	name, ddl, guard string
	reentrant        bool
}{
	{"gc_fixed_strict", "", "lock_name => 'gc:one'", false},
	{"gc_fixed_reentrant", "", "lock_name => 'gc:one', mode => 'reentrant'", true},
	{"gc_column_strict", "", "lock_name_column => 'lock'", false},
	{"gc_column_reentrant_null", "fence bigint", "lock_name_column => 'lock', mode => 'reentrant'", true},
	{"gc_expression_reentrant", "", "lock_name_expression => $$'gc:' || substr(lock, 4)$$, mode => 'reentrant'", true},
	{"gc_generated_strict", "lock_gen text GENERATED ALWAYS AS (lock || '') STORED",
		"lock_name_column => 'lock_gen'", false},
	{"gc_owned_reentrant", "", "lock_name => 'gc:one', mode => 'reentrant'", true},
	{"gc_domain_reentrant", "", "lock_name_column => 'lock', mode => 'reentrant'", true},
}

// TestGuardCostMigration: guards attached with the first version's generator
// (version 6, the one before guardCostVersion) are attached again by
// migration 00007 with their options, keep
// guarded_at, guarded_by and the owner of their functions, and refuse and
// accept exactly the same changes, with the same SQLSTATE, message, DETAIL,
// HINT and error fields, before the migration, after it, and after its Down;
// a guard 00007 cannot attach again keeps its functions, with a WARNING.
func TestGuardCostMigration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := fs.Stat(migrations.FS(), fmt.Sprintf("%05d_pgfence_guard_cost.sql", guardCostVersion)); err != nil {
		t.Fatalf("guardCostVersion %d is not the guard-cost migration: %v", guardCostVersion, err)
	}
	before := fmt.Sprintf("version %d", guardCostVersion-1)
	after := fmt.Sprintf("version %d", guardCostVersion)
	dsn := pgtest.DSN(t)
	pool, takeWarnings := warningPool(t, ctx, dsn)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if err := migrations.DownTo(ctx, db, guardCostVersion-1); err != nil {
		t.Fatal(err)
	}

	role, roleID := tempRole(t, ctx, pool, dsn, "pgfence_gc")
	mustExecPool(t, ctx, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('gc:one', 10), ('gc:two', 20)`)
	for _, tb := range guardCostTables {
		guardCostTable(t, ctx, pool, tb.name, tb.ddl, tb.guard)
	}
	// A guard another role attached: it owns the table and the functions.
	mustExecPool(t, ctx, pool, "ALTER TABLE gc_owned_reentrant OWNER TO "+roleID)
	mustExecPool(t, ctx, pool, `DO $$ BEGIN EXECUTE format('ALTER FUNCTION pgfence.%I() OWNER TO `+roleID+`',
		(SELECT trigger_function FROM pgfence.guarded_tables WHERE relid = 'gc_owned_reentrant'::regclass)); END $$`)
	mustExecPool(t, ctx, pool, `UPDATE pgfence.guarded_tables SET guarded_by = '`+role+`', guarded_at = '2026-01-02 03:04:05+00'
		WHERE relid = 'gc_owned_reentrant'::regclass`)
	// A lock-name column that became a domain: guard() refuses it now.
	mustExecPool(t, ctx, pool, `CREATE DOMAIN gc_lock AS text; ALTER TABLE gc_domain_reentrant ALTER COLUMN lock TYPE gc_lock`)

	registry := func() []string {
		return strings.Split(queryString(t, ctx, pool, `SELECT string_agg(format('%s %s %s %s', relid, mode, guarded_at, guarded_by),
			E'\n' ORDER BY relid::text) FROM pgfence.guarded_tables`), "\n")
	}
	statements := guardCostStatements()
	beforeRegistry := registry()
	beforeOutcomes := guardOutcomes(t, ctx, pool, statements)
	checkGuardFunctions(t, ctx, pool, before, func(string) bool { return false })
	refused := 0
	for _, o := range beforeOutcomes {
		if strings.HasPrefix(o, "ERR PF") {
			refused++
		}
	}
	if refused < len(statements)/3 {
		t.Fatalf("only %d of %d statements refused by the guard: the scenario does not exercise it", refused, len(statements))
	}

	// To this migration's version, not the newest: a later migration must
	// not change what this test sees.
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, guardCostVersion); err != nil {
		t.Fatal(err)
	}
	got := takeWarnings()
	if len(got) != 1 || !strings.Contains(got[0], "gc_domain_reentrant") || !strings.Contains(got[0], "keeps the trigger functions it had") {
		t.Errorf("warnings of migration 00007: %q, want one for gc_domain_reentrant", got)
	}
	if r := registry(); !slices.Equal(r, beforeRegistry) {
		t.Errorf("pgfence.guarded_tables after 00007:\n%s\nwant\n%s", strings.Join(r, "\n"), strings.Join(beforeRegistry, "\n"))
	}
	checkGuardFunctions(t, ctx, pool, after, func(table string) bool { return table != "gc_domain_reentrant" })
	owners := queryString(t, ctx, pool, `SELECT string_agg(p.proname || ' ' || pg_get_userbyid(p.proowner), ', ' ORDER BY p.proname)
		FROM pg_proc p JOIN pgfence.guarded_tables g ON p.proname IN (g.trigger_function, g.trigger_function || '_mark')
		WHERE g.relid = 'gc_owned_reentrant'::regclass AND p.pronamespace = 'pgfence'::regnamespace`)
	fn := queryString(t, ctx, pool, `SELECT trigger_function FROM pgfence.guarded_tables WHERE relid = 'gc_owned_reentrant'::regclass`)
	if want := fmt.Sprintf("%s %s, %s_mark %s", fn, role, fn, role); owners != want {
		t.Errorf("owners of gc_owned_reentrant's functions after 00007: %q, want %q", owners, want)
	}
	compareOutcomes(t, before, beforeOutcomes, after, guardOutcomes(t, ctx, pool, statements), statements)

	if err := migrations.DownTo(ctx, db, guardCostVersion-1); err != nil {
		t.Fatal(err)
	}
	checkGuardFunctions(t, ctx, pool, before+" again", func(string) bool { return false })
	if r := registry(); !slices.Equal(r, beforeRegistry) {
		t.Errorf("pgfence.guarded_tables after the Down of 00007:\n%s\nwant\n%s", strings.Join(r, "\n"), strings.Join(beforeRegistry, "\n"))
	}
	if n := queryString(t, ctx, pool, `SELECT count(*)::text FROM pg_proc WHERE pronamespace = 'pgfence'::regnamespace
		AND proname LIKE 'guard\_%\_mark'`); n != "0" {
		t.Errorf("%s mark functions left after the Down of 00007", n)
	}
	if owner := queryString(t, ctx, pool, `SELECT pg_get_userbyid(p.proowner) FROM pg_proc p
		JOIN pgfence.guarded_tables g ON p.proname = g.trigger_function
		WHERE g.relid = 'gc_owned_reentrant'::regclass AND p.pronamespace = 'pgfence'::regnamespace`); owner != role {
		t.Errorf("owner of gc_owned_reentrant's function after the Down of 00007: %q, want %q", owner, role)
	}
	compareOutcomes(t, before, beforeOutcomes, before+" after the Down", guardOutcomes(t, ctx, pool, statements), statements)
}

// checkGuardFunctions checks, for every guarded table, which generator made
// its functions: 00007's (regenerated(table)) or the first version's.
func checkGuardFunctions(t *testing.T, ctx context.Context, pool *pgxpool.Pool, phase string, regenerated func(table string) bool) {
	t.Helper()
	for _, tb := range guardCostTables {
		got := queryString(t, ctx, pool, `
			SELECT string_agg(format('%s %s %s', t.tgname, p.proname, coalesce(array_to_string(p.proconfig, ';'), '')), ' | ' ORDER BY t.tgname)
			  FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
			 WHERE t.tgrelid = $1::regclass AND t.tgname LIKE 'pgfence%'`, tb.name)
		fn := queryString(t, ctx, pool, `SELECT trigger_function FROM pgfence.guarded_tables WHERE relid = $1::regclass`, tb.name)
		var want string
		switch {
		case regenerated(tb.name) && tb.reentrant:
			want = fmt.Sprintf("pgfence_guard_a_mark %s_mark search_path=pg_catalog, pg_temp | "+
				"pgfence_guard_b_check %s search_path=pg_catalog, pg_temp;enable_seqscan=off", fn, fn)
		case regenerated(tb.name):
			want = fmt.Sprintf("pgfence_guard_b_check %s search_path=pg_catalog, pg_temp;enable_seqscan=off", fn)
		case tb.reentrant:
			want = fmt.Sprintf("pgfence_guard_a_mark %s search_path=pg_catalog, pg_temp | "+
				"pgfence_guard_b_check %s search_path=pg_catalog, pg_temp", fn, fn)
		default:
			want = fmt.Sprintf("pgfence_guard_b_check %s search_path=pg_catalog, pg_temp", fn)
		}
		if got != want {
			t.Errorf("%s: triggers of %s: %q, want %q", phase, tb.name, got, want)
		}
	}
}

// guardCostTx is one transaction TestGuardCostMigration runs (and rolls
// back) on a guarded table.
type guardCostTx struct {
	table string
	sql   []string
}

// guardCostStatements returns the changes TestGuardCostMigration tries on
// every guarded table.
func guardCostStatements() []guardCostTx {
	var out []guardCostTx
	tokens := []string{"NULL", "-4", "-1", "0", "5", "7", "9", "10", "11", "20", "21"}
	for _, tb := range guardCostTables {
		add := func(sql ...string) {
			for i := range sql {
				sql[i] = strings.ReplaceAll(sql[i], "{t}", tb.name)
			}
			out = append(out, guardCostTx{tb.name, sql})
		}
		for _, lock := range []string{"gc:one", "gc:two", "gc:none"} {
			for _, f := range tokens {
				add(fmt.Sprintf("INSERT INTO {t} (id, lock, fence) VALUES (100, '%s', %s)", lock, f))
			}
		}
		add("INSERT INTO {t} (id, lock) VALUES (100, 'gc:one')")
		for id := 1; id <= 6; id++ {
			add(fmt.Sprintf("UPDATE {t} SET v = v + 1 WHERE id = %d", id))
			add(fmt.Sprintf("UPDATE {t} SET fence = fence WHERE id = %d", id))
			add(fmt.Sprintf("UPDATE {t} SET lock = 'gc:two', fence = 20 WHERE id = %d", id))
			for _, f := range tokens {
				add(fmt.Sprintf("UPDATE {t} SET v = v + 1, fence = %s WHERE id = %d", f, id))
			}
			add(fmt.Sprintf("DELETE FROM {t} WHERE id = %d", id))
			for _, f := range []string{"4", "5", "7", "9", "10", "11", "20", "21"} {
				add(fmt.Sprintf("SELECT pgfence.use_token(%s)", f), fmt.Sprintf("DELETE FROM {t} WHERE id = %d", id))
			}
		}
		add("UPDATE {t} SET v = v + 1")
		add("UPDATE {t} SET fence = 10 WHERE lock = 'gc:one' AND fence <= 10")
		add("UPDATE {t} SET fence = 10 WHERE id IN (1, 2)", "UPDATE {t} SET v = v + 1, fence = 10 WHERE id IN (1, 2)")
		add("UPDATE {t} SET fence = 20")
		add("INSERT INTO {t} (id, lock, fence) VALUES (1, 'gc:one', 10), (3, 'gc:two', 20), (7, 'gc:one', 10) " +
			"ON CONFLICT (id) DO UPDATE SET fence = excluded.fence, v = {t}.v + 1")
		add("INSERT INTO {t} (id, lock, fence) VALUES (2, 'gc:one', 10) ON CONFLICT (id) DO UPDATE SET v = {t}.v + 1")
		add("SELECT pgfence.use_token(10)", "DELETE FROM {t} WHERE lock = 'gc:one'")
	}
	return out
}

// guardOutcomes runs every transaction of statements and rolls it back; an
// outcome is the error of its first failing statement (SQLSTATE, message,
// DETAIL, HINT and the schema, table and column fields) or, if none failed,
// the rows its last statement changed and the table's rows.
func guardOutcomes(t *testing.T, ctx context.Context, pool *pgxpool.Pool, statements []guardCostTx) []string {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	out := make([]string, len(statements))
	for i, tx := range statements {
		if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		var tag pgconn.CommandTag
		for _, sql := range tx.sql {
			if tag, err = conn.Exec(ctx, sql); err != nil {
				break
			}
		}
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr):
			out[i] = fmt.Sprintf("ERR %s | %s | %s | %s | %s.%s.%s", pgErr.Code, pgErr.Message, pgErr.Detail, pgErr.Hint,
				pgErr.SchemaName, pgErr.TableName, pgErr.ColumnName)
		case err != nil:
			t.Fatalf("%q: %v", tx.sql, err)
		default:
			var rows string
			if err := conn.QueryRow(ctx, `SELECT string_agg(format('%s:%s:%s:%s', id, lock, coalesce(fence::text, 'NULL'), v), ' '
				ORDER BY id) FROM `+tx.table).Scan(&rows); err != nil {
				t.Fatalf("%q: read %s: %v", tx.sql, tx.table, err)
			}
			out[i] = fmt.Sprintf("OK %s | %s", tag, rows)
		}
		if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func compareOutcomes(t *testing.T, nameA string, a []string, nameB string, b []string, statements []guardCostTx) {
	t.Helper()
	diffs := 0
	for i := range statements {
		if a[i] != b[i] {
			if diffs++; diffs <= 20 {
				t.Errorf("%q:\n  %s: %s\n  %s: %s", statements[i].sql, nameA, a[i], nameB, b[i])
			}
		}
	}
	if diffs > 0 {
		t.Errorf("%d of %d transactions end otherwise under %s than under %s", diffs, len(statements), nameB, nameA)
	} else {
		t.Logf("%d transactions end alike under %s and %s", len(statements), nameA, nameB)
	}
}

// guardCostTable creates table name of guardCostTables (ddl: extra columns,
// or the fence column itself), writes its rows and attaches its guard.
func guardCostTable(t *testing.T, ctx context.Context, pool *pgxpool.Pool, name, ddl, guard string) {
	t.Helper()
	cols := "id int PRIMARY KEY, lock text NOT NULL, v int NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0"
	if strings.HasPrefix(ddl, "fence ") {
		cols = "id int PRIMARY KEY, lock text NOT NULL, v int NOT NULL DEFAULT 0, " + ddl
	} else if ddl != "" {
		cols += ", " + ddl
	}
	mustExecPool(t, ctx, pool, fmt.Sprintf("CREATE TABLE %s (%s)", name, cols))
	// Rows written before the guard: fences at, below and above nothing
	// in particular, one negative (and, where the column allows it, NULL).
	mustExecPool(t, ctx, pool, fmt.Sprintf(`INSERT INTO %s (id, lock, fence) VALUES
		(1, 'gc:one', 10), (2, 'gc:one', 7), (3, 'gc:two', 0), (4, 'gc:none', 5), (5, 'gc:one', -3)`, name))
	if strings.HasPrefix(ddl, "fence ") {
		mustExecPool(t, ctx, pool, fmt.Sprintf(`INSERT INTO %s (id, lock, fence) VALUES (6, 'gc:one', NULL)`, name))
	}
	mustExecPool(t, ctx, pool, fmt.Sprintf("SELECT pgfence.guard('%s', %s)", name, guard))
}

// warningPool returns a pool on dsn, closed when t ends, and a function
// that returns the WARNINGs its connections received since its last call.
func warningPool(t *testing.T, ctx context.Context, dsn string) (*pgxpool.Pool, func() []string) {
	t.Helper()
	var (
		mu       sync.Mutex
		warnings []string
	)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Severity == "WARNING" {
			mu.Lock()
			warnings = append(warnings, n.Message)
			mu.Unlock()
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, func() []string {
		mu.Lock()
		defer mu.Unlock()
		w := warnings
		warnings = nil
		return w
	}
}

// tempRole creates a NOLOGIN role named prefix_<random> for the test and
// drops it (and what it owns) when the test ends. It returns the name and
// the name quoted as an identifier.
func tempRole(t *testing.T, ctx context.Context, pool *pgxpool.Pool, dsn, prefix string) (role, roleID string) {
	t.Helper()
	role = fmt.Sprintf("%s_%d_%04d", prefix, time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	roleID = pgx.Identifier{role}.Sanitize()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin := pgtest.PoolFor(t, dsn)
		if _, err := admin.Exec(ctx, "DROP OWNED BY "+roleID+" CASCADE"); err != nil {
			t.Logf("drop owned by %s: %v", role, err)
		}
		if _, err := admin.Exec(ctx, "DROP ROLE IF EXISTS "+roleID); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	mustExecPool(t, ctx, pool, "CREATE ROLE "+roleID+" NOLOGIN")
	return role, roleID
}

func mustExecPool(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sql string) {
	t.Helper()
	if _, err := pool.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryString(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) string {
	t.Helper()
	var s *string
	if err := pool.QueryRow(ctx, sql, args...).Scan(&s); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	if s == nil {
		return ""
	}
	return *s
}
