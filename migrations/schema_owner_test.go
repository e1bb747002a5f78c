package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// TestMigrateRefusesSchemaOfAnotherRole: a role with CREATE on the database
// that creates schema pgfence before the first migration owns it, and a
// schema's owner may drop and replace every function in it: the migrations
// ran into such a schema without a word, and its owner then replaced
// pgfence.lock_release with one that releases without the key. The
// migrations now refuse a schema that neither the migrating role nor a role
// it belongs to owns, naming the owner, and change nothing.
func TestMigrateRefusesSchemaOfAnotherRole(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	owner := pgtest.PoolFor(t, dsn)
	squatter, id := loginRole(t, ctx, dsn, owner, "squatter")
	mustExecPool(t, ctx, owner, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
	sq := pgtest.PoolFor(t, withUser(t, dsn, squatter))
	mustExecPool(t, ctx, sq, `CREATE SCHEMA pgfence`)
	mustExecPool(t, ctx, sq, `GRANT ALL ON SCHEMA pgfence TO PUBLIC`)

	err := migrations.UpPool(ctx, owner)
	if err == nil || !strings.Contains(err.Error(), "owned by role "+squatter) {
		t.Fatalf("UpPool into a schema owned by %s = %v; want an error naming the owner", squatter, err)
	}
	if n := queryString(t, ctx, owner, `SELECT count(*)::text FROM pg_catalog.pg_proc WHERE pronamespace = 'pgfence'::regnamespace`); n != "0" {
		t.Errorf("%s functions were created in the squatted schema; want none", n)
	}

	// The squatter made the version table too: still refused (the
	// migrating role is a superuser here, a member of every role).
	mustExecPool(t, ctx, sq, `CREATE TABLE pgfence.goose_db_version (id serial PRIMARY KEY, version_id bigint NOT NULL,
		is_applied boolean NOT NULL, tstamp timestamp DEFAULT now())`)
	mustExecPool(t, ctx, sq, `INSERT INTO pgfence.goose_db_version (version_id, is_applied) VALUES (0, true)`)
	if err := migrations.UpPool(ctx, owner); err == nil || !strings.Contains(err.Error(), "owned by role "+squatter) {
		t.Fatalf("UpPool into a schema and version table owned by %s = %v; want an error naming the owner", squatter, err)
	}
	mustExecPool(t, ctx, owner, `DROP TABLE pgfence.goose_db_version`)

	// Owned by the migrating role (here: given to it), the schema is migrated.
	mustExecPool(t, ctx, owner, `REVOKE ALL ON SCHEMA pgfence FROM PUBLIC`)
	mustExecPool(t, ctx, owner, `ALTER SCHEMA pgfence OWNER TO CURRENT_USER`)
	if err := migrations.UpPool(ctx, owner); err != nil {
		t.Fatalf("UpPool into the migrating role's own schema: %v", err)
	}
}

// TestSuperuserMigratesOwnerRoleSchema: a database migrated by a dedicated
// owner role (not a superuser) is brought up to date by a superuser: the
// schema is the owner role's, which owns the baseline's functions too, so
// the superuser is not refused as a squatter's victim would be.
func TestSuperuserMigratesOwnerRoleSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	admin := pgtest.PoolFor(t, dsn)
	owner, id := loginRole(t, ctx, dsn, admin, "pgfowner")
	mustExecPool(t, ctx, admin, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
	db := stdlib.OpenDBFromPool(pgtest.PoolFor(t, withUser(t, dsn, owner)))
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 23); err != nil {
		t.Fatalf("owner role migrating to 23: %v", err)
	}
	if err := migrations.UpPool(ctx, admin); err != nil {
		t.Errorf("superuser applying the rest to the owner role's schema: %v", err)
	}
}

// loginRole creates a LOGIN role named prefix_<digits> through pool (on
// the server of dsn) and drops it, with what it owns, when the test ends.
// It returns the name and the quoted identifier.
func loginRole(t *testing.T, ctx context.Context, dsn string, pool *pgxpool.Pool, prefix string) (name, id string) {
	t.Helper()
	name = fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1_000_000_000)
	id = pgx.Identifier{name}.Sanitize()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		a := pgtest.PoolFor(t, dsn)
		_, _ = a.Exec(ctx, "DROP OWNED BY "+id+" CASCADE")
		_, _ = a.Exec(ctx, "DROP ROLE IF EXISTS "+id)
	})
	mustExecPool(t, ctx, pool, "CREATE ROLE "+id+" LOGIN")
	return name, id
}
