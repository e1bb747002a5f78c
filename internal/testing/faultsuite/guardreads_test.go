package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/internal/testing/repo"
)

// tenantDB is a migrated database with a tenant role that owns schema tenant
// and table tenant.shelf (lock name per row in column store), an on-call role
// that may read the table and pgfence's views, and tenant.hit(what), which
// counts in tenant.hits every time a function of the tenant runs.
type tenantDB struct {
	dsn            string
	admin          *pgxpool.Pool
	tenant, oncall string
}

func newTenantDB(t *testing.T, ctx context.Context) *tenantDB {
	t.Helper()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	suffix := fmt.Sprintf("%d_%04d", time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	db := &tenantDB{dsn: dsn, admin: admin, tenant: "pgfence_tenant_" + suffix, oncall: "pgfence_oncall_" + suffix}
	ten, on := pgx.Identifier{db.tenant}.Sanitize(), pgx.Identifier{db.oncall}.Sanitize()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, r := range []string{ten, on} {
			if _, err := admin.Exec(ctx, "DROP OWNED BY "+r+" CASCADE"); err != nil {
				t.Logf("drop owned by %s: %v", r, err)
			}
			if _, err := admin.Exec(ctx, "DROP ROLE IF EXISTS "+r); err != nil {
				t.Logf("drop role %s: %v", r, err)
			}
		}
	})
	if _, err := admin.Exec(ctx, `
		CREATE ROLE `+ten+` LOGIN NOSUPERUSER;
		CREATE ROLE `+on+` LOGIN NOSUPERUSER;
		CREATE SCHEMA tenant AUTHORIZATION `+ten+`;
		GRANT USAGE ON SCHEMA pgfence TO `+on+`;
		GRANT SELECT ON pgfence.lock_status, pgfence.guarded_tables, pgfence.guarded_fences TO `+on+`;
		GRANT EXECUTE ON FUNCTION pgfence.guarded_fence_status(), pgfence.lock_column_unsafe(regclass, text),
			pgfence.lock_source_unsafe(regclass, text) TO `+on); err != nil {
		t.Fatal(err)
	}
	db.asTenant(t, ctx, `
		GRANT USAGE ON SCHEMA tenant TO PUBLIC;
		CREATE SEQUENCE tenant.hits;
		GRANT USAGE, SELECT ON SEQUENCE tenant.hits TO PUBLIC;
		CREATE FUNCTION tenant.hit(what text) RETURNS void LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_catalog.nextval('tenant.hits');
			RAISE WARNING 'tenant code: % ran as % (superuser: %)', what, current_user, current_setting('is_superuser');
		END $$;
		CREATE TABLE tenant.shelf (id int PRIMARY KEY, store text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO tenant.shelf VALUES (1, 'store:1', 0), (2, 'store:2', 0);
		GRANT SELECT ON tenant.shelf TO `+on)
	return db
}

func (db *tenantDB) asTenant(t *testing.T, ctx context.Context, sql string) {
	t.Helper()
	if _, err := spConn(t, ctx, db.dsn, db.tenant, "", nil).Exec(ctx, sql); err != nil {
		t.Fatalf("as tenant: %v\n%s", err, sql)
	}
}

func (db *tenantDB) hits(t *testing.T, ctx context.Context) int64 {
	t.Helper()
	var n int64
	if err := db.admin.QueryRow(ctx, "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM tenant.hits").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// readAll reads pgfence.guarded_fences and pgfence.guarded_fence_status() as
// role ("" for the superuser), and runs `pgfence fences --lock-column` on
// every table given, and reports what failed.
func (db *tenantDB) readAll(t *testing.T, ctx context.Context, role string, fencesTables ...string) []string {
	t.Helper()
	var failed []string
	conn := spConn(t, ctx, db.dsn, role, "", nil)
	for _, q := range []string{"SELECT * FROM pgfence.guarded_fences", "SELECT * FROM pgfence.guarded_fence_status()"} {
		rows, err := conn.Query(ctx, q)
		if err == nil {
			for rows.Next() {
			}
			rows.Close()
			err = rows.Err()
		}
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s as %q: %v", q, role, err))
		}
	}
	for _, tbl := range fencesTables {
		_, errb, code := runPgfence(t, ctx, repo.Pgfence(t), asRole(t, db.dsn, role),
			"fences", "--table", tbl, "--key", "id", "--lock-column", "store")
		if code != 0 {
			failed = append(failed, fmt.Sprintf("pgfence fences --table %s as %q: exit %d: %s", tbl, role, code, strings.TrimSpace(errb)))
		}
	}
	return failed
}

// unchecked returns the unchecked column of guarded_fences for table.
func (db *tenantDB) unchecked(t *testing.T, ctx context.Context, table string) *string {
	t.Helper()
	var reason *string
	if err := db.admin.QueryRow(ctx, "SELECT unchecked FROM pgfence.guarded_fences WHERE table_name::regclass = $1::regclass", table).Scan(&reason); err != nil {
		t.Fatalf("guarded_fences row of %s: %v", table, err)
	}
	return reason
}

// TestGuardReadsRunNoTenantCode: a guarded table's owner (the tenant) gives
// the lock-name column a type of its own with a cast to text, a domain whose
// CHECK calls its function, a generation expression that calls its
// function, or turns on row-level security with a policy that calls its
// function. A superuser and the on-call role then read
// pgfence.guarded_fences and guarded_fence_status() and run `pgfence fences
// --lock-column`: none of the tenant's functions runs, and the table shows
// as unchecked (with the reason) instead of breaking the view for every
// other table. guard() refuses such lock sources up front, and never runs the
// tenant's code either.
func TestGuardReadsRunNoTenantCode(t *testing.T) {
	t.Parallel()
	const hostileType = `
		CREATE TYPE tenant.lk AS (s text);
		CREATE FUNCTION tenant.lk_text(tenant.lk) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
		BEGIN PERFORM tenant.hit('cast'); RETURN ($1).s; END $$;
		CREATE CAST (tenant.lk AS text) WITH FUNCTION tenant.lk_text(tenant.lk) AS IMPLICIT;`
	for _, tc := range []struct {
		name string
		// before runs as the tenant before the superuser guards the table;
		// guardSQL is the guard call; after runs as the tenant once the
		// table is guarded.
		before, guardSQL, after string
		// refused: guard() refuses the lock source (SQLSTATE 22023).
		refused bool
		// readable: the rows are still checked (no reason to skip them).
		readable bool
	}{
		{name: "cast of a type of the tenant's",
			before:   hostileType,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_column => 'store')",
			after:    "ALTER TABLE tenant.shelf ALTER COLUMN store TYPE tenant.lk USING ROW(store)::tenant.lk"},
		{name: "column already of a type of the tenant's",
			before: hostileType + `
				ALTER TABLE tenant.shelf ALTER COLUMN store TYPE tenant.lk USING ROW(store)::tenant.lk`,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_column => 'store')",
			refused:  true},
		{name: "domain with a CHECK that calls the tenant",
			before: `
				CREATE FUNCTION tenant.ok(text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
				BEGIN PERFORM tenant.hit('domain check'); RETURN true; END $$;
				CREATE DOMAIN tenant.lockname AS text CHECK (tenant.ok(VALUE));`,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_column => 'store')",
			after:    "ALTER TABLE tenant.shelf ALTER COLUMN store TYPE tenant.lockname"},
		{name: "generation expression that calls the tenant",
			before: `
				CREATE FUNCTION tenant.prefix(text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
				BEGIN PERFORM tenant.hit('generation expression'); RETURN $1; END $$;
				ALTER TABLE tenant.shelf DROP COLUMN store;
				ALTER TABLE tenant.shelf ADD COLUMN store text GENERATED ALWAYS AS (tenant.prefix('store:') || id) STORED;`,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_column => 'store')",
			refused:  true}, // checking it would plan the tenant's function as the guarder
		{name: "expression that calls the tenant",
			before: `
				CREATE FUNCTION tenant.prefix(text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
				BEGIN PERFORM tenant.hit('expression'); RETURN $1; END $$;`,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_expression => $$tenant.prefix('s:') || store$$)",
			refused:  true},
		{name: "expression over a column retyped by the tenant",
			before:   hostileType,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_expression => $$'s:' || store$$)",
			after:    "ALTER TABLE tenant.shelf ALTER COLUMN store TYPE tenant.lk USING ROW(store)::tenant.lk"},
		{name: "row-level security policy that calls the tenant",
			before: `
				CREATE FUNCTION tenant.visible() RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
				BEGIN PERFORM tenant.hit('policy'); RETURN true; END $$;`,
			guardSQL: "SELECT pgfence.guard('tenant.shelf', lock_name_column => 'store')",
			after: `
				ALTER TABLE tenant.shelf ENABLE ROW LEVEL SECURITY;
				CREATE POLICY everyone ON tenant.shelf USING (tenant.visible());`,
			readable: true}, // by the superuser, who bypasses policies
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			db := newTenantDB(t, ctx)
			// A second guarded table the tenant cannot touch: its figures
			// must stay readable whatever the tenant does.
			if _, err := db.admin.Exec(ctx, `
				CREATE TABLE public.safe (id int PRIMARY KEY, store text, fence bigint NOT NULL DEFAULT 0);
				INSERT INTO public.safe VALUES (1, 'safe:1', 0);
				SELECT pgfence.guard('public.safe', lock_name_column => 'store');
				GRANT SELECT ON public.safe TO `+pgx.Identifier{db.oncall}.Sanitize()); err != nil {
				t.Fatal(err)
			}
			db.asTenant(t, ctx, tc.before)
			base := db.hits(t, ctx)
			_, err := db.admin.Exec(ctx, tc.guardSQL)
			if got := db.hits(t, ctx); got != base {
				t.Fatalf("guard() by the superuser ran the tenant's code %d times", got-base)
			}
			var pgErr *pgconn.PgError
			if tc.refused {
				if !errors.As(err, &pgErr) || pgErr.Code != "22023" {
					t.Fatalf("guard: %v, want SQLSTATE 22023", err)
				}
				t.Logf("refused: %s", pgErr.Message)
				var n int
				if err := db.admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.guarded_tables WHERE relid = 'tenant.shelf'::regclass").Scan(&n); err != nil || n != 0 {
					t.Fatalf("guarded after the refusal: %d %v", n, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("guard: %v", err)
			}
			db.asTenant(t, ctx, tc.after)
			base = db.hits(t, ctx)

			failed := db.readAll(t, ctx, "", "tenant.shelf", "public.safe")
			failed = append(failed, db.readAll(t, ctx, db.oncall, "public.safe")...)
			if got := db.hits(t, ctx); got != base {
				t.Fatalf("reading guarded_fences ran the tenant's code %d times (as superuser and as on-call)", got-base)
			}
			// The superuser's fences on tenant.shelf may refuse a column it
			// cannot read safely; nothing else may fail.
			for _, f := range failed {
				if !strings.HasPrefix(f, "pgfence fences --table tenant.shelf") || tc.readable {
					t.Errorf("%s", f)
				} else {
					t.Logf("%s", f)
				}
			}
			if r := db.unchecked(t, ctx, "public.safe"); r != nil {
				t.Errorf("public.safe unchecked: %s", *r)
			}
			r := db.unchecked(t, ctx, "tenant.shelf")
			switch {
			case tc.readable && r != nil:
				t.Errorf("tenant.shelf unchecked: %s", *r)
			case !tc.readable && r == nil:
				t.Errorf("tenant.shelf checked, want it marked unchecked")
			case r != nil:
				t.Logf("tenant.shelf unchecked: %s", *r)
			}
			// The on-call role is subject to the policy: the table is
			// marked for it, never read through the policy.
			var onReason *string
			if err := spConn(t, ctx, db.dsn, db.oncall, "", nil).QueryRow(ctx,
				"SELECT unchecked FROM pgfence.guarded_fences WHERE table_name::regclass = 'tenant.shelf'::regclass").Scan(&onReason); err != nil {
				t.Fatal(err)
			}
			if strings.Contains(tc.name, "row-level security") && onReason == nil {
				t.Errorf("tenant.shelf checked for the on-call role through the tenant's policy")
			}
			if got := db.hits(t, ctx); got != base {
				t.Fatalf("reading guarded_fences ran the tenant's code %d times", got-base)
			}
		})
	}

	// The guard trigger runs as the writer, never as its definer: a
	// SECURITY DEFINER guard would run the table owner's casts and
	// generation expressions with the guarder's rights.
	ctx := context.Background()
	db := pgtest.PoolFor(t, pgtest.DSN(t))
	if _, err := db.Exec(ctx, `CREATE TABLE public.sd (id int PRIMARY KEY, store text, fence bigint NOT NULL DEFAULT 0);
		SELECT pgfence.guard('public.sd', lock_name_column => 'store', mode => 'reentrant')`); err != nil {
		t.Fatal(err)
	}
	var definers int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgfence'::regnamespace
		AND proname LIKE 'guard%' AND prosecdef`).Scan(&definers); err != nil || definers != 0 {
		t.Fatalf("%d SECURITY DEFINER guard functions (%v)", definers, err)
	}
}

// TestGuardedFencesEveryLockForm: guarded_fences has the right figures for
// tables guarded by a fixed lock name, a plain lock-name column, a generated
// lock-name column and a lock-name expression, all at once (an expression
// once made the view fail for every reader: "null values cannot be formatted
// as an SQL identifier").
func TestGuardedFencesEveryLockForm(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	if _, err := pool.Exec(ctx, `
		INSERT INTO pgfence.locks (name, token) VALUES ('inv', 5), ('store:1', 2), ('store:2', 7), ('parcel:eu', 3);
		CREATE TABLE invoices (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (1, 5), (2, 3), (3, 6);
		CREATE TABLE shelves (id int PRIMARY KEY, store varchar(20), fence bigint NOT NULL DEFAULT 0);
		INSERT INTO shelves VALUES (1, 'store:1', 2), (2, 'store:1', 1), (3, 'store:2', 8), (4, 'store:9', 0);
		CREATE TABLE catalogue (store_id int NOT NULL, sku text NOT NULL,
			store_lock text GENERATED ALWAYS AS ('store:' || store_id) STORED,
			fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (store_id, sku));
		INSERT INTO catalogue (store_id, sku, fence) VALUES (1, 'a', 2), (1, 'b', 3), (2, 'a', 7);
		CREATE TABLE parcels (id int PRIMARY KEY, region text NOT NULL, weight int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO parcels VALUES (1, 'EU', 1, 3), (2, 'eu', 2, 1), (3, 'US', 1, 4);
		SELECT pgfence.guard('invoices', lock_name => 'inv');
		SELECT pgfence.guard('shelves', lock_name_column => 'store');
		SELECT pgfence.guard('catalogue', lock_name_column => 'store_lock', mode => 'reentrant');
		SELECT pgfence.guard('parcels', lock_name_expression => $$'parcel:' || lower(region)$$);`); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT table_name, coalesce(lock_name, '-'), rows, coalesce(max_fence, -1),
		coalesce(lock_token, -1), forged_rows FROM pgfence.guarded_fences ORDER BY 1, 2`)
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
	want := []gf{
		{"catalogue", "store:1", 2, 3, 2, 1},
		{"catalogue", "store:2", 1, 7, 7, 0},
		{"invoices", "inv", 3, 6, 5, 1},
		{"parcels", "parcel:eu", 2, 3, 3, 0},
		{"parcels", "parcel:us", 1, 4, -1, 1},
		{"shelves", "store:1", 2, 2, 2, 0},
		{"shelves", "store:2", 1, 8, 7, 1},
		{"shelves", "store:9", 1, 0, -1, 0},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("guarded_fences =\n%v\nwant\n%v", got, want)
	}
	var unchecked int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.guarded_fences WHERE unchecked IS NOT NULL").Scan(&unchecked); err != nil || unchecked != 0 {
		t.Fatalf("%d unchecked rows (%v)", unchecked, err)
	}
}
