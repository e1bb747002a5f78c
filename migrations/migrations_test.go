package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func openDB(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	pool := pgtest.PoolFor(t, dsn)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	return db
}

func tableExists(t *testing.T, db *sql.DB, name string) bool {
	t.Helper()
	var ok bool
	if err := db.QueryRow("SELECT to_regclass($1) IS NOT NULL", name).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func currentVersion(t *testing.T, db *sql.DB) int64 {
	t.Helper()
	p, err := migrations.NewProvider(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	v, err := p.GetDBVersion(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func lastVersion(t *testing.T) int64 {
	t.Helper()
	p, err := migrations.NewProvider(context.Background(), openDB(t, pgtest.EmptyDSN(t)))
	if err != nil {
		t.Fatal(err)
	}
	srcs := p.ListSources()
	if len(srcs) == 0 {
		t.Fatal("no embedded migrations")
	}
	return srcs[len(srcs)-1].Version
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openDB(t, pgtest.EmptyDSN(t))
	want := lastVersion(t)

	if err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if got := currentVersion(t, db); got != want {
		t.Fatalf("version after up = %d, want %d", got, want)
	}
	if !tableExists(t, db, "pgfence.locks") {
		t.Fatal("pgfence.locks missing after up")
	}
	// Up again is a no-op.
	if err := migrations.Up(ctx, db); err != nil {
		t.Fatalf("second up: %v", err)
	}

	if err := migrations.DownTo(ctx, db, 0); err != nil {
		t.Fatal(err)
	}
	if got := currentVersion(t, db); got != 0 {
		t.Fatalf("version after down = %d, want 0", got)
	}
	if tableExists(t, db, "pgfence.locks") {
		t.Fatal("pgfence.locks still there after down to 0")
	}

	if err := migrations.Up(ctx, db); err != nil {
		t.Fatalf("up after down: %v", err)
	}
	if got := currentVersion(t, db); got != want {
		t.Fatalf("version after up again = %d, want %d", got, want)
	}
}

func TestVersionTableApartFromApplication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openDB(t, pgtest.EmptyDSN(t))

	// The application has its own goose history in public.goose_db_version.
	appDir := t.TempDir()
	if err := os.WriteFile(appDir+"/00001_app.sql", []byte(
		"-- +goose Up\nCREATE TABLE app_things (id int primary key);\n-- +goose Down\nDROP TABLE app_things;\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	app, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS(appDir))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Up(ctx); err != nil {
		t.Fatal(err)
	}
	var appRowsBefore int
	if err := db.QueryRow("SELECT count(*) FROM public.goose_db_version").Scan(&appRowsBefore); err != nil {
		t.Fatal(err)
	}

	if err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}

	var appRowsAfter int
	if err := db.QueryRow("SELECT count(*) FROM public.goose_db_version").Scan(&appRowsAfter); err != nil {
		t.Fatal(err)
	}
	if appRowsAfter != appRowsBefore {
		t.Fatalf("application's goose_db_version changed: %d rows -> %d", appRowsBefore, appRowsAfter)
	}
	if !tableExists(t, db, migrations.VersionTable) {
		t.Fatalf("%s missing", migrations.VersionTable)
	}
	// The application's provider still sees only its own migration.
	v, err := app.GetDBVersion(ctx)
	if err != nil || v != 1 {
		t.Fatalf("application version = %d, %v; want 1", v, err)
	}
	if got, want := currentVersion(t, db), lastVersion(t); got != want {
		t.Fatalf("pgfence version = %d, want %d", got, want)
	}
}

func TestConcurrentGoroutines(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.EmptyDSN(t)
	const n = 4
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool, err := pgxpool.New(ctx, dsn)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			errs[i] = migrations.UpPool(ctx, pool)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	db := openDB(t, dsn)
	assertAppliedOnce(t, db)
}

func TestConcurrentProcesses(t *testing.T) {
	t.Parallel()
	dsn := pgtest.EmptyDSN(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const n = 4
	cmds := make([]*exec.Cmd, n)
	outs := make([]*strings.Builder, n)
	for i := range n {
		outs[i] = &strings.Builder{}
		cmds[i] = exec.Command(exe, "-test.run=^$")
		cmds[i].Env = append(os.Environ(), "PGFENCE_MIGRATE_CHILD_DSN="+dsn)
		cmds[i].Stdout, cmds[i].Stderr = outs[i], outs[i]
		if err := cmds[i].Start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Errorf("migrator process %d: %v: %s", i, err, outs[i])
		}
	}
	assertAppliedOnce(t, openDB(t, dsn))
}

// assertAppliedOnce checks every migration was recorded exactly once.
func assertAppliedOnce(t *testing.T, db *sql.DB) {
	t.Helper()
	rows, err := db.Query("SELECT version_id, count(*) FROM " + migrations.VersionTable +
		" WHERE version_id > 0 GROUP BY version_id ORDER BY version_id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var versions []int64
	for rows.Next() {
		var v, c int64
		if err := rows.Scan(&v, &c); err != nil {
			t.Fatal(err)
		}
		if c != 1 {
			t.Errorf("version %d recorded %d times", v, c)
		}
		versions = append(versions, v)
	}
	if want := lastVersion(t); len(versions) == 0 || versions[len(versions)-1] != want {
		t.Fatalf("applied versions %v, want up to %d", versions, want)
	}
}

func TestLocksTableConstraintsAndComments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	// The CHECK constraints bind the owner too (the integrity trigger exempts
	// the owner from its rules of change, not from these): SQLSTATE 23514 and
	// the constraint's name, on INSERT and on UPDATE.
	if _, err := conn.Exec(ctx, "INSERT INTO pgfence.locks(name, token) VALUES ('held', 0)"); err != nil {
		t.Fatal(err)
	}
	bad := []struct {
		name, sql, constraint string
		args                  []any
	}{
		{"empty name", "INSERT INTO pgfence.locks(name) VALUES ($1)", "locks_name_length", []any{""}},
		{"513-byte name", "INSERT INTO pgfence.locks(name) VALUES ($1)", "locks_name_length", []any{strings.Repeat("x", 513)}},
		{"negative token", "INSERT INTO pgfence.locks(name, token) VALUES ('a', -1)", "locks_token_nonnegative", nil},
		{"holder without expiry", "INSERT INTO pgfence.locks(name, holder) VALUES ('a', 'h')", "locks_holder_has_expiry", nil},
		{"expiry without holder", "UPDATE pgfence.locks SET expires_at = now() WHERE name = 'held'", "locks_holder_has_expiry", nil},
		{"empty holder", "UPDATE pgfence.locks SET holder = '', expires_at = now() WHERE name = 'held'", "locks_holder_length", nil},
		{"513-byte holder", "UPDATE pgfence.locks SET holder = $1, expires_at = now() WHERE name = 'held'", "locks_holder_length",
			[]any{strings.Repeat("h", 513)}},
		{"empty name by update", "UPDATE pgfence.locks SET name = '' WHERE name = 'held'", "locks_name_length", nil},
		{"negative token by update", "UPDATE pgfence.locks SET token = -5 WHERE name = 'held'", "locks_token_nonnegative", nil},
		{"16 MiB of metadata", "UPDATE pgfence.locks SET metadata = pg_catalog.to_jsonb(pg_catalog.repeat('m', 16 << 20)) WHERE name = 'held'",
			"locks_metadata_size", nil},
		{"16 MiB job payload", "INSERT INTO pgfence.jobs(queue, payload) VALUES ('q', pg_catalog.to_jsonb(pg_catalog.repeat('p', 16 << 20)))",
			"jobs_payload_size", nil},
	}
	for _, b := range bad {
		_, err := conn.Exec(ctx, b.sql, b.args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" || pgErr.ConstraintName != b.constraint {
			t.Errorf("%s: err = %v, want check_violation 23514 of %s", b.name, err, b.constraint)
		}
	}
	var held string
	if err := conn.QueryRow(ctx, "SELECT format('%s/%s/%s', token, holder, expires_at) FROM pgfence.locks WHERE name = 'held'").Scan(&held); err != nil || held != "0//" {
		t.Errorf("row after refused updates: %q, %v; want token 0, no holder, no expiry", held, err)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO pgfence.locks(name) VALUES ($1)", strings.Repeat("x", 512)); err != nil {
		t.Errorf("512-byte name refused: %v", err)
	}

	// Every column carries a comment a DBA can read with \d+.
	rows, err := conn.Query(ctx, `
		SELECT a.attname
		FROM pg_attribute a
		WHERE a.attrelid = 'pgfence.locks'::regclass AND a.attnum > 0 AND NOT a.attisdropped
		  AND col_description(a.attrelid, a.attnum) IS NULL`)
	if err != nil {
		t.Fatal(err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(missing) > 0 {
		t.Errorf("columns without COMMENT: %v", missing)
	}
	var tableComment *string
	if err := conn.QueryRow(ctx, "SELECT obj_description('pgfence.locks'::regclass, 'pg_class')").Scan(&tableComment); err != nil {
		t.Fatal(err)
	}
	if tableComment == nil || *tableComment == "" {
		t.Error("pgfence.locks has no table comment")
	}
}

// TestGeneratedQueriesMatchSchema runs the sqlc-generated queries against the
// migrated schema, so a query that no longer fits the tables fails here.
func TestGeneratedQueriesMatchSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, "INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at) VALUES ('a', 3, 'h', now(), now() + interval '1 minute'), ('b', 0, NULL, NULL, NULL)"); err != nil {
		t.Fatal(err)
	}
	q := dbsqlc.New()
	row, err := q.GetLock(ctx, pool, "a")
	if err != nil {
		t.Fatal(err)
	}
	if row.Token != 3 || row.Holder == nil || *row.Holder != "h" || row.ExpiresAt == nil || !row.ExpiresAt.After(row.DbNow) {
		t.Fatalf("GetLock = %+v", row)
	}
	rows, err := q.ListLocks(ctx, pool, dbsqlc.ListLocksParams{NamePattern: "%", States: []string{"held", "expired", "free"}, MaxRows: 10})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 || rows[0].Name != "a" || rows[1].Name != "b" || rows[1].Holder != nil {
		t.Fatalf("ListLocks = %+v", rows)
	}
	if _, err := q.GetLock(ctx, pool, "missing"); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("GetLock(missing) err = %v, want pgx.ErrNoRows", err)
	}
}

func TestLockStatusView(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks(name, token, holder, acquired_at, expires_at) VALUES
		('held', 2, 'h', now(), now() + interval '10 seconds'),
		('expired', 5, 'h', now() - interval '1 minute', now() - interval '30 seconds'),
		('free', 1, NULL, now() - interval '1 hour', NULL)`); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, "SELECT name, state, seconds_left::float8 FROM pgfence.lock_status ORDER BY name")
	if err != nil {
		t.Fatal(err)
	}
	type st struct {
		Name, State string
		Left        *float64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[st])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 ||
		got[0].Name != "expired" || got[0].State != "expired" || got[0].Left == nil || *got[0].Left > -29 ||
		got[1].Name != "free" || got[1].State != "free" || got[1].Left != nil ||
		got[2].Name != "held" || got[2].State != "held" || got[2].Left == nil || *got[2].Left < 9 || *got[2].Left > 10 {
		t.Fatalf("lock_status = %+v", got)
	}
}

func TestOperatorViews(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		INSERT INTO pgfence.jobs(queue, run_at) VALUES ('mail', now() - interval '40 seconds'), ('mail', now() + interval '1 hour');
		INSERT INTO pgfence.locks(name, token) VALUES ('inv', 5), ('store:1', 2);
		CREATE TABLE invoices (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (1, 5), (2, 3);
		CREATE TABLE catalogue (id int PRIMARY KEY, store_lock text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO catalogue VALUES (1, 'store:1', 2), (2, 'store:1', 1);
		SELECT pgfence.guard('invoices', lock_name => 'inv');
		SELECT pgfence.guard('catalogue', lock_name_column => 'store_lock');
		-- A forged fence, written with the guard briefly off (as a one-off script would).
		ALTER TABLE catalogue DISABLE TRIGGER USER;
		INSERT INTO catalogue VALUES (3, 'store:1', 9);
		ALTER TABLE catalogue ENABLE TRIGGER USER;`); err != nil {
		t.Fatal(err)
	}
	var jobs int64
	var ready float64
	if err := pool.QueryRow(ctx, "SELECT jobs, oldest_ready_seconds::float8 FROM pgfence.job_summary WHERE queue = 'mail' AND state = 'available'").Scan(&jobs, &ready); err != nil {
		t.Fatal(err)
	}
	if jobs != 2 || ready < 39 || ready > 60 {
		t.Fatalf("job_summary: jobs %d ready %v", jobs, ready)
	}
	rows, err := pool.Query(ctx, "SELECT table_name, lock_name, rows, max_fence, lock_token, forged_rows FROM pgfence.guarded_fences ORDER BY table_name")
	if err != nil {
		t.Fatal(err)
	}
	type gf struct {
		Table, Lock                   string
		Rows, MaxFence, Token, Forged int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[gf])
	if err != nil {
		t.Fatal(err)
	}
	want := []gf{{"catalogue", "store:1", 3, 9, 2, 1}, {"invoices", "inv", 2, 5, 5, 0}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("guarded_fences = %+v, want %+v", got, want)
	}
}

// onePool opens a pool on dsn that never has more than one connection.
func onePool(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestUpPoolOneConnection: UpPool needs only one connection of the caller's
// pool. It once held one for the migration lock while goose waited for a
// second, so a MaxConns=1 pool hung until the context's deadline (forever
// without one).
func TestUpPoolOneConnection(t *testing.T) {
	t.Parallel()
	dsn := pgtest.EmptyDSN(t)
	pool := onePool(t, dsn)
	// Open the connection first, so the measure is UpPool's own work.
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The deadline only keeps a regression from hanging the test binary.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	err := migrations.UpPool(ctx, pool)
	took := time.Since(start)
	t.Logf("UpPool on a MaxConns=1 pool, empty database: %v", took)
	if err != nil {
		t.Fatalf("UpPool on a MaxConns=1 pool: %v (after %v)", err, took)
	}
	// 80-300 ms measured (with and without -race, a loaded 2-core VM), the
	// whole schema included; the bound is loose for busy machines and still
	// far below the deadline that a hang would reach (the old code failed at
	// it after 30 s).
	if took > 10*time.Second {
		t.Errorf("UpPool on a MaxConns=1 pool took %v", took)
	}
	assertAppliedOnce(t, openDB(t, dsn))

	// Again, with every migration applied; and DownTo and Up on a *sql.DB
	// with one open connection.
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatalf("second UpPool: %v", err)
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	db.SetMaxOpenConns(1)
	if err := migrations.DownTo(ctx, db, 0); err != nil {
		t.Fatalf("DownTo on a one-connection *sql.DB: %v", err)
	}
	if err := migrations.Up(ctx, db); err != nil {
		t.Fatalf("Up on a one-connection *sql.DB: %v", err)
	}
	if got, want := currentVersion(t, db), lastVersion(t); got != want {
		t.Fatalf("version = %d, want %d", got, want)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired from the pool after UpPool", n)
	}
}

// TestUpPoolOneConnectionConcurrent: migrators on several MaxConns=1 pools
// still take turns, and each applies nothing twice.
func TestUpPoolOneConnectionConcurrent(t *testing.T) {
	t.Parallel()
	dsn := pgtest.EmptyDSN(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 3
	pools := make([]*pgxpool.Pool, n)
	for i := range pools {
		pools[i] = onePool(t, dsn)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, pool := range pools {
		wg.Go(func() { errs[i] = migrations.UpPool(ctx, pool) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	assertAppliedOnce(t, openDB(t, dsn))
}

// TestUpAsAppRole: the application role of docs/migrations.md, created
// from that block alone, may call Up and UpPool at start-up. With every
// migration applied they succeed and change nothing; with one pending, or
// on a database without the schema, they change nothing and say to migrate
// as the owner.
func TestUpAsAppRole(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	owner := openDB(t, dsn)
	role, appDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")

	// Current: no DDL, no error (the role has no CREATE anywhere; any DDL
	// would fail).
	var canCreate bool
	if err := owner.QueryRowContext(ctx, `SELECT has_database_privilege($1, current_database(), 'CREATE')
		OR has_schema_privilege($1, 'pgfence', 'CREATE')`, role).Scan(&canCreate); err != nil {
		t.Fatal(err)
	}
	if canCreate {
		t.Fatalf("the documented role %s has CREATE on the database or schema pgfence", role)
	}
	appPool := pgtest.PoolFor(t, appDSN)
	if err := migrations.UpPool(ctx, appPool); err != nil {
		t.Fatalf("UpPool as the app role on a current schema: %v", err)
	}
	if err := migrations.Up(ctx, openDB(t, appDSN)); err != nil {
		t.Fatalf("Up as the app role on a current schema: %v", err)
	}

	// Pending: the owner rolled back to 0 (schema pgfence and its version
	// table stay, and so does the role's USAGE and SELECT).
	if err := migrations.DownTo(ctx, owner, 0); err != nil {
		t.Fatal(err)
	}
	err := migrations.UpPool(ctx, appPool)
	if err == nil || !strings.Contains(err.Error(), "pending") ||
		!strings.Contains(err.Error(), "migrate as the schema owner: pgfence migrate up") {
		t.Fatalf("UpPool as the app role with a migration pending: %v, want an error saying to migrate as the schema owner", err)
	}
	t.Logf("pending, as %s: %v", role, err)
	if err := migrations.Up(ctx, openDB(t, appDSN)); err == nil || !strings.Contains(err.Error(), "migrate as the schema owner") {
		t.Fatalf("Up as the app role with a migration pending: %v", err)
	}
	if tableExists(t, owner, "pgfence.locks") || currentVersion(t, owner) != 0 {
		t.Fatal("the app role's Up changed the schema")
	}
	// The owner migrates; the app role's start-up succeeds again.
	if err := migrations.Up(ctx, owner); err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, appPool); err != nil {
		t.Fatalf("UpPool as the app role after the owner migrated: %v", err)
	}

	// No schema at all: a role without CREATE on the database is told the
	// same, and nothing is created.
	empty := pgtest.EmptyDSN(t)
	bare := openDB(t, empty)
	if _, err := bare.ExecContext(ctx, "CREATE ROLE "+pgx.Identifier{role + "_bare"}.Sanitize()+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = bare.Exec("DROP ROLE IF EXISTS " + pgx.Identifier{role + "_bare"}.Sanitize()) })
	if _, err := bare.ExecContext(ctx, "REVOKE CREATE ON DATABASE "+pgx.Identifier{dbName(t, empty)}.Sanitize()+" FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	bareDSN := withUser(t, empty, role+"_bare")
	err = migrations.UpPool(ctx, pgtest.PoolFor(t, bareDSN))
	if err == nil || !strings.Contains(err.Error(), "migrate as the schema owner: pgfence migrate up") {
		t.Fatalf("UpPool without CREATE on an empty database: %v, want an error saying to migrate as the schema owner", err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("UpPool without CREATE: %v does not wrap the server's 42501", err)
	}
	if tableExists(t, bare, "pgfence.goose_db_version") {
		t.Fatal("UpPool without CREATE created the version table")
	}
}

func dbName(t *testing.T, dsn string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
}

func withUser(t *testing.T, dsn, user string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(user)
	return u.String()
}
