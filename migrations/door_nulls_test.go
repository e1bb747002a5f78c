package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// doorNullsVersion is migration 00014_pgfence_door_nulls.sql.
const doorNullsVersion = 14

// sqlState returns the SQLSTATE of err ("" for none).
func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// beforeMigration returns a pool of 8 connections to a new database
// migrated to the version before version, and a provider to migrate it on
// with. Both are closed when the test ends.
func beforeMigration(t *testing.T, ctx context.Context, version int64) (*pgxpool.Pool, *goose.Provider) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.DownTo(ctx, db, version-1); err != nil {
		t.Fatal(err)
	}
	return pool, p
}

// awaitLockWait waits until another backend whose statement contains call
// waits for a lock, or until done (when not nil) has a value, which it puts
// back and reports as false. No signal exists for another backend's lock
// wait: it is looked up in pg_stat_activity. It fails the test after 30 s.
func awaitLockWait[T any](t *testing.T, ctx context.Context, pool *pgxpool.Pool, call string, done chan T) (waiting bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()`, call).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return true
		}
		if done != nil {
			select {
			case v := <-done:
				done <- v
				return false
			default:
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no statement calling %s waited for a lock within 30 s", call)
		}
	}
}

// TestDoorNulls: after migration 00014, lock_leave and lock_handed refuse a
// NULL wkey or wait_id with PF011 (lock_leave with a NULL wait_id took out
// the queue row of a wait a release had already handed a lease, and answered
// that nothing was handed), and fence_refused refuses an unknown mode, a
// NULL row_found or a NULL or negative fence of a found row with PF011
// instead of PF006; its other answers are unchanged. Before it (the Down),
// the old lock_leave is shown to lose the handed lease that way.
func TestDoorNulls(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.DownTo(ctx, db, doorNullsVersion-1); err != nil {
		t.Fatal(err)
	}
	const (
		key  = `\x000102030405060708090a0b0c0d0e0f`
		wkey = `\x100102030405060708090a0b0c0d0e0f`
	)
	// handed: "held" granted to h (token 1), waiter 777/888 queued, then the
	// release hands it the lease (token 2).
	handed := func(name string) {
		t.Helper()
		for _, q := range []string{
			`SELECT token FROM pgfence.lock_grant($1, 'h', 3600000000, '` + key + `')`,
			`SELECT granted FROM pgfence.lock_wait($1, 'waiter', 3600000000, '` + wkey + `', 777, 888)`,
			`SELECT handed_off FROM pgfence.lock_release($1, 1, '` + key + `')`,
		} {
			var v any
			if err := pool.QueryRow(ctx, q, name).Scan(&v); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		if tok := handedToken(t, ctx, pool); tok != 2 {
			t.Fatalf("setup of %s: lock_handed gives token %d, want 2", name, tok)
		}
	}

	// Version 13: a NULL wait_id takes the handed wait's row out and reports
	// nothing handed.
	handed("door-nulls-13")
	var removed bool
	var granted int64
	if err := pool.QueryRow(ctx, `SELECT removed, granted_token FROM pgfence.lock_leave(777, NULL, '`+wkey+`')`).Scan(&removed, &granted); err != nil {
		t.Fatalf("version 13: lock_leave(777, NULL): %v", err)
	}
	if !removed || granted != 0 || handedToken(t, ctx, pool) != 0 {
		t.Fatalf("version 13: lock_leave(777, NULL) = %v, %d; the handed lease is lost to its waiter only if removed and 0: the test shows nothing", removed, granted)
	}

	if _, err := p.UpTo(ctx, doorNullsVersion); err != nil {
		t.Fatal(err)
	}
	handed("door-nulls-14")
	for _, q := range []string{
		`SELECT * FROM pgfence.lock_leave(777, NULL, '` + wkey + `')`,
		`SELECT * FROM pgfence.lock_leave(NULL, 888, '` + wkey + `')`,
		`SELECT * FROM pgfence.lock_leave(NULL, NULL, '` + wkey + `')`,
		`SELECT * FROM pgfence.lock_handed(777, NULL, '` + wkey + `')`,
		`SELECT * FROM pgfence.lock_handed(NULL, 888, '` + wkey + `')`,
	} {
		_, err := pool.Exec(ctx, q)
		if got := sqlState(err); got != "PF011" {
			t.Errorf("%s: %v (SQLSTATE %q), want PF011", q, err, got)
		}
	}
	if tok := handedToken(t, ctx, pool); tok != 2 {
		t.Fatalf("after the refused calls lock_handed gives token %d, want 2 (the handed lease)", tok)
	}
	if err := pool.QueryRow(ctx, `SELECT removed, granted_token FROM pgfence.lock_leave(777, 888, '`+wkey+`')`).Scan(&removed, &granted); err != nil || !removed || granted != 2 {
		t.Fatalf("lock_leave(777, 888) = %v, %d, %v; want true, 2", removed, granted, err)
	}

	for _, c := range []struct {
		args string
		want string
	}{
		{`'bogus', 3, 3, true`, "PF011"},
		{`'Strict', 3, 3, true`, "PF011"},
		{`NULL, 3, 3, true`, "PF011"},
		{`'strict', 3, NULL, true`, "PF011"},
		{`'strict', 3, -5, true`, "PF011"},
		{`'strict', 3, 3, NULL`, "PF011"},
		// Unchanged answers.
		{`'strict', 0, 3, true`, "PF007"},
		{`'bogus', NULL, 3, true`, "PF007"},
		{`'strict', 3, NULL, false`, "PF005"},
		{`'strict', 3, 5, true`, "PF003"},
		{`'reentrant', 3, 5, true`, "PF003"},
		{`'strict', 3, 3, true`, "PF004"},
		{`'reentrant', 3, 3, true`, "PF006"},
		{`'strict', 3, 1, true`, "PF006"},
	} {
		_, err := pool.Exec(ctx, `SELECT pgfence.fence_refused('t', 'k', `+c.args+`)`)
		if got := sqlState(err); got != c.want {
			t.Errorf("fence_refused(%s): %v (SQLSTATE %q), want %s", c.args, err, got, c.want)
		}
	}
}

// handedToken is the token lock_handed gives the wait 777/888 (0: nothing).
func handedToken(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int64 {
	t.Helper()
	var tok *int64
	if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_handed(777, 888, '\x100102030405060708090a0b0c0d0e0f')`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if tok == nil {
		return 0
	}
	return *tok
}
