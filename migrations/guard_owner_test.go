package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGuardNeedsOwner: a role that owns a table and has EXECUTE on
// pgfence.guard and pgfence.unguard, and nothing else of schema pgfence,
// cannot attach a guard (permission denied, nothing attached): guards are
// attached by the pgfence owner, as docs/migrations.md says.
func TestGuardNeedsOwner(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	_, roleID := tempRole(t, ctx, pool, dsn, "pgfence_go")
	mustExecPool(t, ctx, pool, "CREATE TABLE go_owned (id int PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)")
	mustExecPool(t, ctx, pool, "ALTER TABLE go_owned OWNER TO "+roleID)
	mustExecPool(t, ctx, pool, "GRANT USAGE ON SCHEMA pgfence TO "+roleID)
	mustExecPool(t, ctx, pool, "GRANT EXECUTE ON FUNCTION pgfence.guard(regclass, text, text, text, text, text), pgfence.unguard(regclass) TO "+roleID)

	for _, mode := range []string{"strict", "reentrant"} {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = conn.Exec(ctx, "SET ROLE "+roleID)
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT pgfence.guard('go_owned', lock_name_column => 'lock', mode => $1)", mode)
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s: guard as the table's owner with EXECUTE on guard only: %v, want permission denied (42501)", mode, err)
		}
		_, _ = conn.Exec(ctx, "RESET ROLE")
		conn.Release()
		if n := queryString(t, ctx, pool, `SELECT count(*)::text FROM pg_trigger WHERE tgrelid = 'go_owned'::regclass`); n != "0" {
			t.Errorf("%s: %s triggers on the table after the refused guard", mode, n)
		}
		if n := queryString(t, ctx, pool, `SELECT count(*)::text FROM pgfence.guarded_tables WHERE relid = 'go_owned'::regclass`); n != "0" {
			t.Errorf("%s: the refused guard is registered", mode)
		}
	}
	// The owner of schema pgfence (this test's role) attaches it.
	mustExecPool(t, ctx, pool, "SELECT pgfence.guard('go_owned', lock_name_column => 'lock', mode => 'reentrant')")
	if n := queryString(t, ctx, pool, `SELECT count(*)::text FROM pg_trigger WHERE tgrelid = 'go_owned'::regclass`); n != "2" {
		t.Errorf("%s triggers after the owner's guard, want 2", n)
	}
}
