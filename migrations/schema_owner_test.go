package migrations_test

import (
	"context"
	"errors"
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
// owner role (not a superuser) is brought up to date. The objects a
// migration creates belong to the role that runs it; a superuser used to be
// let in, and its SECURITY DEFINER functions (lock_grant_many among them),
// writing tables the owner role owns, ran the owner role's triggers as the
// superuser: the owner role made itself superuser through the application's
// next call. A superuser (or any role that may create objects in the schema
// but does not own it) is now refused, changing nothing, through Up and
// through a provider's own methods (what pgfence migrate up calls), with an
// error saying how to migrate as the owner; doing so (the connection's role
// set to the owner) migrates, and every function is the owner's.
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
	version := func() string {
		return queryString(t, ctx, admin, `SELECT max(version_id)::text FROM pgfence.goose_db_version`)
	}
	foreign := func() string {
		return queryString(t, ctx, admin, `SELECT count(*)::text FROM pg_catalog.pg_proc p
			JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = 'pgfence' AND p.proowner <> n.nspowner`)
	}

	err = migrations.UpPool(ctx, admin)
	if err == nil || !strings.Contains(err.Error(), "owned by role "+owner+",") || !strings.Contains(err.Error(), "PGOPTIONS='-c role="+owner+"'") {
		t.Fatalf("superuser's UpPool into role %s's schema = %v; want a refusal naming the owner and how to migrate as it", owner, err)
	}
	sdb := openDB(t, dsn)
	if _, err := migrations.NewProvider(ctx, sdb); err == nil || !strings.Contains(err.Error(), "owned by role "+owner+",") {
		t.Fatalf("superuser's NewProvider on role %s's schema = %v; want the same refusal", owner, err)
	}
	if v, n := version(), foreign(); v != "23" || n != "0" {
		t.Fatalf("after the refusals: version %s, %s functions not owned by the schema's owner; want 23 and 0", v, n)
	}

	// As the owner: the superuser's connection with its role set.
	asOwner := pgtest.PoolFor(t, dsn+"&options=-c%20role%3D"+owner)
	if got := queryString(t, ctx, asOwner, `SELECT current_user::text`); got != owner {
		t.Fatalf("current_user with options role=%s: %s", owner, got)
	}
	if err := migrations.UpPool(ctx, asOwner); err != nil {
		t.Fatalf("UpPool as role %s (the superuser's connection, role set): %v", owner, err)
	}
	if v, n := version(), foreign(); v == "23" || n != "0" {
		t.Fatalf("after migrating as the owner: version %s, %s functions not owned by the schema's owner; want the newest and 0", v, n)
	}
}

// TestSuperuserMigratesSuperusersSchema: a schema another superuser owns
// is migrated: its owner has every right already, so nothing the migration
// creates there gives it more.
func TestSuperuserMigratesSuperusersSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	admin := pgtest.PoolFor(t, dsn)
	p, err := migrations.NewProvider(ctx, openDB(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 23); err != nil {
		t.Fatalf("migrating to 23: %v", err)
	}
	other, id := loginRole(t, ctx, dsn, admin, "othersuper")
	mustExecPool(t, ctx, admin, "ALTER ROLE "+id+" SUPERUSER")
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "ALTER ROLE "+id+" NOSUPERUSER") })
	if err := migrations.UpPool(ctx, pgtest.PoolFor(t, withUser(t, dsn, other))); err != nil {
		t.Fatalf("superuser %s's UpPool into another superuser's schema: %v", other, err)
	}
	if v := queryString(t, ctx, admin, `SELECT max(version_id)::text FROM pgfence.goose_db_version`); v == "23" {
		t.Fatalf("version still 23 after UpPool")
	}
}

// TestMemberMigratesOwnerRoleSchema: a member of the schema's owner role
// (which may create objects there through the owner's rights) is refused
// like a superuser: the functions it created would run with its own rights,
// and the owner role could make them run its code. With its connection's
// role set to the owner it migrates.
func TestMemberMigratesOwnerRoleSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	admin := pgtest.PoolFor(t, dsn)
	owner, id := loginRole(t, ctx, dsn, admin, "pgfowner")
	member, mid := loginRole(t, ctx, dsn, admin, "pgfmember")
	mustExecPool(t, ctx, admin, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
	db := openDB(t, withUser(t, dsn, owner))
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 23); err != nil {
		t.Fatalf("owner role migrating to 23: %v", err)
	}
	mustExecPool(t, ctx, admin, "GRANT "+id+" TO "+mid)
	mdsn := withUser(t, dsn, member)
	if err := migrations.UpPool(ctx, pgtest.PoolFor(t, mdsn)); err == nil || !strings.Contains(err.Error(), "owned by role "+owner+",") {
		t.Fatalf("member %s's UpPool into role %s's schema = %v; want a refusal naming the owner", member, owner, err)
	}
	if v := queryString(t, ctx, admin, `SELECT max(version_id)::text FROM pgfence.goose_db_version`); v != "23" {
		t.Fatalf("after the refusal: version %s, want 23", v)
	}
	if err := migrations.UpPool(ctx, pgtest.PoolFor(t, mdsn+"&options=-c%20role%3D"+owner)); err != nil {
		t.Fatalf("member's UpPool with its role set to %s: %v", owner, err)
	}
	if n := queryString(t, ctx, admin, `SELECT count(*)::text FROM pg_catalog.pg_proc p
		JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'pgfence' AND p.proowner <> n.nspowner`); n != "0" {
		t.Fatalf("%s functions in pgfence not owned by the schema's owner; want 0", n)
	}
}

// TestMigrateRefusesForgedSchema: a role with CREATE on the database that
// creates schema pgfence first can forge every sign that pgfence migrated it
// (a version table, a function named lock_grant). A superuser used to take
// the forged function as the owner role's baseline and migrate into the
// schema; the squatter then owned the schema of superuser-owned SECURITY
// DEFINER functions, and swapped pgfence.locks for a table with a trigger
// of its own that the application's next lock_grant ran as the superuser.
// Refused now, through Up and a provider's methods, creating nothing.
func TestMigrateRefusesForgedSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	admin := pgtest.PoolFor(t, dsn)
	squatter, id := loginRole(t, ctx, dsn, admin, "squatter")
	mustExecPool(t, ctx, admin, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
	sq := pgtest.PoolFor(t, withUser(t, dsn, squatter))
	mustExecPool(t, ctx, sq, `CREATE SCHEMA pgfence`)
	mustExecPool(t, ctx, sq, `CREATE FUNCTION pgfence.lock_grant() RETURNS int LANGUAGE sql AS 'SELECT 1'`)
	procs := func() string {
		return queryString(t, ctx, admin, `SELECT count(*)::text FROM pg_catalog.pg_proc WHERE pronamespace = 'pgfence'::regnamespace`)
	}

	// The schema and the function alone (the check bootstrap makes).
	if err := migrations.UpPool(ctx, admin); err == nil || !strings.Contains(err.Error(), "owned by role "+squatter+",") {
		t.Fatalf("UpPool into a schema of %s with a forged lock_grant = %v; want a refusal naming it", squatter, err)
	}
	// With a forged version table too (NewProvider's bootstrap finds it
	// and creates nothing; the provider's own methods are what the CLI's
	// migrate up calls).
	mustExecPool(t, ctx, sq, `CREATE TABLE pgfence.goose_db_version (id serial PRIMARY KEY, version_id bigint NOT NULL,
		is_applied boolean NOT NULL, tstamp timestamp DEFAULT now())`)
	mustExecPool(t, ctx, sq, `INSERT INTO pgfence.goose_db_version (version_id, is_applied) VALUES (0, true)`)
	mustExecPool(t, ctx, sq, `GRANT ALL ON pgfence.goose_db_version, pgfence.goose_db_version_id_seq TO PUBLIC`)
	if err := migrations.UpPool(ctx, admin); err == nil || !strings.Contains(err.Error(), "owned by role "+squatter+",") {
		t.Fatalf("UpPool into a forged schema of %s = %v; want a refusal naming it", squatter, err)
	}
	if _, err := migrations.NewProvider(ctx, openDB(t, dsn)); err == nil || !strings.Contains(err.Error(), "owned by role "+squatter+",") {
		t.Fatalf("NewProvider on a forged schema of %s = %v; want a refusal naming it", squatter, err)
	}
	if n := procs(); n != "1" {
		t.Fatalf("%s functions in the squatted schema; want the squatter's 1", n)
	}
	// The advisory lock was given back with each refusal: a migrator of
	// another database on the same pool would otherwise wait for ever.
	if n := queryString(t, ctx, admin, `SELECT count(*)::text FROM pg_catalog.pg_locks
		WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())`); n != "0" {
		t.Fatalf("%s advisory locks held after the refusals; want 0", n)
	}
}

// TestMigrateRefusesForeignObjects: what a migration creates runs with the
// migrating role's rights on the schema's tables, so the owners of those
// count, not only the schema's. A squatter's version table kept when a
// superuser took the squatter's schema over fired the squatter's trigger as
// the superuser on goose's first insert; an owner role's tables kept when
// the schema alone was given to a superuser took triggers that the
// superuser's new SECURITY DEFINER functions ran. Both are refused now,
// naming the owner; with the objects given over too, the schema migrates.
func TestMigrateRefusesForeignObjects(t *testing.T) {
	t.Parallel()
	ctxFor := func(t *testing.T) context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		t.Cleanup(cancel)
		return ctx
	}

	t.Run("squatter's version table", func(t *testing.T) {
		t.Parallel()
		ctx := ctxFor(t)
		dsn := pgtest.EmptyDSN(t)
		admin := pgtest.PoolFor(t, dsn)
		squatter, id := loginRole(t, ctx, dsn, admin, "squatter")
		mustExecPool(t, ctx, admin, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
		sq := pgtest.PoolFor(t, withUser(t, dsn, squatter))
		mustExecPool(t, ctx, sq, `CREATE SCHEMA pgfence`)
		mustExecPool(t, ctx, sq, `GRANT USAGE ON SCHEMA pgfence TO PUBLIC`)
		mustExecPool(t, ctx, sq, `CREATE TABLE pgfence.goose_db_version (id serial PRIMARY KEY, version_id bigint NOT NULL,
			is_applied boolean NOT NULL, tstamp timestamp DEFAULT now())`)
		mustExecPool(t, ctx, sq, `INSERT INTO pgfence.goose_db_version (version_id, is_applied) VALUES (0, true)`)
		mustExecPool(t, ctx, sq, `CREATE SCHEMA squat`)
		mustExecPool(t, ctx, sq, `GRANT USAGE ON SCHEMA squat TO PUBLIC`)
		mustExecPool(t, ctx, sq, `CREATE FUNCTION squat.up() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				IF (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
					EXECUTE pg_catalog.format('ALTER ROLE %I SUPERUSER', `+"'"+squatter+"'"+`);
				END IF;
				RETURN NEW;
			END $$`)
		mustExecPool(t, ctx, sq, `CREATE TRIGGER up BEFORE INSERT ON pgfence.goose_db_version FOR EACH ROW EXECUTE FUNCTION squat.up()`)
		if err := migrations.UpPool(ctx, admin); err == nil {
			t.Fatalf("UpPool into %s's schema: not refused", squatter)
		}
		mustExecPool(t, ctx, admin, "ALTER SCHEMA pgfence OWNER TO CURRENT_USER")
		err := migrations.UpPool(ctx, admin)
		if err == nil || !strings.Contains(err.Error(), "owned by role(s) "+squatter) {
			t.Errorf("UpPool into the schema taken over, %s's version table kept = %v; want a refusal naming it", squatter, err)
		}
		if su := queryString(t, ctx, admin, `SELECT rolsuper::text FROM pg_catalog.pg_roles WHERE rolname = $1`, squatter); su != "false" {
			t.Fatalf("role %s is superuser now", squatter)
		}
	})

	t.Run("owner role's tables", func(t *testing.T) {
		t.Parallel()
		ctx := ctxFor(t)
		dsn := pgtest.EmptyDSN(t)
		admin := pgtest.PoolFor(t, dsn)
		owner, id := loginRole(t, ctx, dsn, admin, "pgfowner")
		mustExecPool(t, ctx, admin, "GRANT CREATE ON DATABASE "+pgx.Identifier{dbName(t, dsn)}.Sanitize()+" TO "+id)
		p, err := migrations.NewProvider(ctx, openDB(t, withUser(t, dsn, owner)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.UpTo(ctx, 1); err != nil {
			t.Fatalf("owner role migrating to 1: %v", err)
		}
		mustExecPool(t, ctx, admin, "ALTER SCHEMA pgfence OWNER TO CURRENT_USER")
		err = migrations.UpPool(ctx, admin)
		if err == nil || !strings.Contains(err.Error(), "owned by role(s) "+owner) {
			t.Fatalf("superuser's UpPool into a schema whose tables role %s owns = %v; want a refusal naming it", owner, err)
		}
		if v := queryString(t, ctx, admin, `SELECT max(version_id)::text FROM pgfence.goose_db_version`); v != "1" {
			t.Fatalf("after the refusal: version %s, want 1", v)
		}
		mustExecPool(t, ctx, admin, "REASSIGN OWNED BY "+id+" TO CURRENT_USER")
		if err := migrations.UpPool(ctx, admin); err != nil {
			t.Fatalf("UpPool once the objects are the superuser's too: %v", err)
		}
	})
}

// TestUpOnNewerDatabase: a database a newer release migrated (a version
// above this build's newest) is refused with ErrUnknownMigration, changing
// nothing, and the error says so: it used to give the pre-release advice,
// to drop the schema, which would drop every lease, job and guard.
func TestUpOnNewerDatabase(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.EmptyDSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	mustExecPool(t, ctx, pool, `INSERT INTO pgfence.goose_db_version (version_id, is_applied) VALUES (99, true)`)
	err := migrations.UpPool(ctx, pool)
	if !errors.Is(err, migrations.ErrUnknownMigration) {
		t.Fatalf("UpPool on a database with version 99 = %v; want ErrUnknownMigration", err)
	}
	if msg := err.Error(); strings.Contains(msg, "drop schema") || !strings.Contains(msg, "newer release") || !strings.Contains(msg, "[99]") {
		t.Fatalf("error = %q; want it to name version 99 as a newer release's, without the advice to drop the schema", msg)
	}
	// A pre-release database (its versions 3 and 4 this build skips)
	// still gets the pre-release advice.
	mustExecPool(t, ctx, pool, `DELETE FROM pgfence.goose_db_version WHERE version_id = 99`)
	mustExecPool(t, ctx, pool, `INSERT INTO pgfence.goose_db_version (version_id, is_applied) VALUES (3, true)`)
	if err := migrations.UpPool(ctx, pool); !errors.Is(err, migrations.ErrUnknownMigration) || !strings.Contains(err.Error(), "pre-release") {
		t.Fatalf("UpPool on a database with version 3 = %v; want ErrUnknownMigration with the pre-release advice", err)
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
