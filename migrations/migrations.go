// Package migrations holds pgfence's SQL schema as goose v3 migrations and applies
// them to a caller's database.
//
// There are two ways to install the schema.
//
// Let pgfence apply it (recommended): call [Up] with a *sql.DB or [UpPool] with a
// *pgxpool.Pool at start-up. pgfence keeps its own goose version table,
// [VersionTable] (pgfence.goose_db_version), so an application's own goose
// history is never touched, and serialises concurrent migrators with a blocking
// session-level advisory lock on [LockID]: when N processes start at once, one
// applies the migrations and the others wait, then find nothing left to do.
//
// Or copy the files: the SQL files of this directory are plain goose migrations
// and can be copied into an application's own goose directory (renumbered to fit
// its sequence). [FS] returns them for tooling that wants to copy or embed them.
//
// The role that runs the migrations (the schema owner) needs CREATE on the
// database. The role that uses pgfence at run time needs only the grants
// listed in docs/migrations.md; with them, [Up] and [UpPool] succeed without
// any change when the schema is current, and fail, changing nothing, with an
// error saying to migrate as the schema owner when migrations are pending.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgfence/pgfence/internal/pgerr"
)

//go:embed *.sql
var files embed.FS

// Schema is the PostgreSQL schema that holds every pgfence object.
const Schema = "pgfence"

// VersionTable is the goose version table pgfence uses, apart from any
// goose_db_version table of the application.
const VersionTable = Schema + ".goose_db_version"

// LockID is the key of the session-level advisory lock that serialises
// concurrent pgfence migrators. It differs from goose's default key, so pgfence
// migrations do not wait for an application's own goose run, nor it for them.
const LockID int64 = 0x7067_6665_6e63_6501 // "pgfence" + 0x01

// FS returns the embedded migration files (NNNNN_name.sql, goose format).
func FS() fs.FS { return files }

// NewProvider returns a goose provider for pgfence's migrations on db, using
// [VersionTable] and the [LockID] session locker. Extra goose options (for
// example goose.WithVerbose or goose.WithSlog) are appended.
//
// NewProvider creates schema pgfence and the version table when they are
// missing (serialised by the same advisory lock), so that every method of the
// provider, including read-only ones such as Status and GetDBVersion, works on
// an empty database.
func NewProvider(ctx context.Context, db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	if db == nil {
		return nil, errors.New("migrations: nil *sql.DB")
	}
	locker := sessionLocker{id: LockID}
	base := []goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, files, append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	if err := bootstrap(ctx, db, locker); err != nil {
		return nil, err
	}
	if err := checkKnownVersions(ctx, db, p); err != nil {
		return nil, err
	}
	return p, nil
}

// ErrUnknownMigration is returned (wrapped) by [NewProvider], and so by [Up]
// and [DownTo], when the database records an applied pgfence migration that
// this build does not have: a database migrated by a pre-release build
// (whose 19 migrations were replaced by one baseline) or by a newer release.
// Nothing is changed. A pre-release database is dropped and migrated again
// (docs/migrations.md); for a newer release, run that release's binary.
var ErrUnknownMigration = errors.New("migrations: the database has a pgfence migration applied that this build does not have")

// checkKnownVersions refuses a database whose version table names an
// applied migration that is not among p's sources.
func checkKnownVersions(ctx context.Context, db *sql.DB, p *goose.Provider) error {
	applied, err := appliedVersions(ctx, db)
	if err != nil {
		return err
	}
	known := knownVersions(p)
	var newest int64
	for v := range known {
		newest = max(newest, v)
	}
	var unknown, newer []int64
	for _, v := range applied {
		switch {
		case v > newest:
			newer = append(newer, v)
		case !known[v]:
			unknown = append(unknown, v)
		}
	}
	switch {
	case len(unknown) > 0:
		return fmt.Errorf("%w: versions %v are applied in %s (a database migrated by a pre-release build: drop schema %s and migrate again, see docs/migrations.md)",
			ErrUnknownMigration, unknown, VersionTable, Schema)
	case len(newer) > 0:
		// Never the pre-release advice: dropping the schema would drop
		// every lease, job and guard of a database a newer release
		// migrated.
		return fmt.Errorf("%w: versions %v are applied in %s, newer than this build's newest migration (%d): "+
			"a newer release of pgfence migrated this database; use that release (its migrate down --to %d rolls the schema back to this build's)",
			ErrUnknownMigration, newer, VersionTable, newest, newest)
	}
	return nil
}

// knownVersions returns the versions of p's sources, and 0 (the row goose
// writes when it creates the version table).
func knownVersions(p *goose.Provider) map[int64]bool {
	known := map[int64]bool{0: true}
	for _, src := range p.ListSources() {
		known[src.Version] = true
	}
	return known
}

// queryer is a *sql.DB or a *sql.Conn.
type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// appliedVersions returns the versions [VersionTable] records as applied, in
// ascending order. Reading the table needs SELECT on it, which the
// application role of docs/migrations.md has.
func appliedVersions(ctx context.Context, q queryer) ([]int64, error) {
	rows, err := q.QueryContext(ctx, `SELECT version_id FROM (SELECT DISTINCT ON (version_id) version_id, is_applied
		FROM `+VersionTable+` ORDER BY version_id, id DESC) v WHERE is_applied ORDER BY version_id`)
	if err != nil {
		if pgerr.Code(err) == pgerr.InsufficientPrivilege {
			return nil, fmt.Errorf("migrations: read %s: %w (grant the role SELECT on it, as docs/migrations.md does, or %s)",
				VersionTable, err, migrateAsOwner)
		}
		return nil, fmt.Errorf("migrations: read %s: %w", VersionTable, err)
	}
	defer rows.Close()
	var applied []int64
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("migrations: read %s: %w", VersionTable, err)
		}
		applied = append(applied, v)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("migrations: read %s: %w", VersionTable, err)
	}
	return applied, nil
}

// migrateAsOwner ends the error of a role that may not apply pgfence's
// migrations: what to run instead.
const migrateAsOwner = "migrate as the schema owner: pgfence migrate up"

// bootstrap creates the schema and the version table while holding the
// migration lock: goose creates its version table from methods that take no
// lock (HasPending, GetDBVersion), and concurrent first runs would otherwise
// race on CREATE SCHEMA and CREATE TABLE.
//
// Everything runs on the one connection that holds the lock. Asking the
// provider to create the table (it takes a connection of its own) would need a
// second connection while the first is held: on a *sql.DB or pool limited to
// one connection that waits for ever.
func bootstrap(ctx context.Context, db *sql.DB, l sessionLocker) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	defer conn.Close()
	if err := l.SessionLock(ctx, conn); err != nil {
		return err
	}
	defer func() {
		if uerr := l.SessionUnlock(context.WithoutCancel(ctx), conn); err == nil {
			err = uerr
		}
	}()
	// A migrated database needs nothing: and CREATE SCHEMA IF NOT EXISTS
	// needs CREATE on the database even when the schema exists, which a
	// read-only role running status or version does not have.
	var exists bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_catalog.to_regclass($1) IS NOT NULL", VersionTable).Scan(&exists); err != nil {
		return fmt.Errorf("migrations: look for %s: %w", VersionTable, err)
	}
	if exists {
		return nil
	}
	if _, err := conn.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+Schema); err != nil {
		if pgerr.Code(err) == pgerr.InsufficientPrivilege {
			return fmt.Errorf("migrations: schema %s is not migrated and this role may not create it: %s: %w",
				Schema, migrateAsOwner, err)
		}
		return fmt.Errorf("migrations: create schema %s: %w", Schema, err)
	}
	if err := checkSchemaOwner(ctx, conn); err != nil {
		return err
	}
	if err := createVersionTable(ctx, conn); err != nil {
		return fmt.Errorf("migrations: create version table %s: %w", VersionTable, err)
	}
	return nil
}

// checkSchemaOwner refuses a schema pgfence that the current role does not
// own. A schema created beforehand by another role (CREATE on the database
// suffices) stays that role's, and a schema's owner may drop and replace
// every function in it, the SQL door included. A superuser may take over a
// schema another superuser owns (its owner has every right already). See
// also [checkMigrator].
func checkSchemaOwner(ctx context.Context, conn *sql.Conn) error {
	var owner string
	var ours bool
	if err := conn.QueryRowContext(ctx, `SELECT n.nspowner::pg_catalog.regrole::pg_catalog.text,
		n.nspowner OPERATOR(pg_catalog.=) r.oid OR (o.rolsuper AND r.rolsuper)
		FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r, pg_catalog.pg_roles o
		WHERE n.nspname OPERATOR(pg_catalog.=) $1 AND r.rolname OPERATOR(pg_catalog.=) current_user
		AND o.oid OPERATOR(pg_catalog.=) n.nspowner`, Schema).Scan(&owner, &ours); err != nil {
		return fmt.Errorf("migrations: read the owner of schema %s: %w", Schema, err)
	}
	if !ours {
		return fmt.Errorf("migrations: schema %s is owned by role %s, not by the migrating role, "+
			"and pgfence's migrations did not create it: that role could replace every function of pgfence's; "+
			"drop the schema and migrate again, or %s", Schema, owner, migrateAsRole(owner))
	}
	return nil
}

// migrateAsRole is the end of the error of a role that may not migrate a
// schema owner owns: how to migrate as owner instead.
func migrateAsRole(owner string) string {
	return fmt.Sprintf("if role %[1]s is yours, migrate as %[1]s: connect as it, or, as a member of it or a superuser, "+
		"set the connection's role: PGOPTIONS='-c role=%[1]s' in the environment, options='-c role=%[1]s' in a "+
		"key=value connection string, or options=-c%%20role%%3D%[1]s in a URL", owner)
}

// checkMigrator refuses, on conn, a role that may create objects in schema
// pgfence (a superuser, a member of the schema's owner, a role granted
// CREATE on it) where what it created could be made to run another role's
// code with its rights: the schema is not its own (unless a superuser owns
// it and it is a superuser too), or a table, sequence, view or function
// (other than a trigger function: the guards' belong to the role that
// attached them) of the schema is owned by a role that is neither it nor a
// superuser. The objects a migration creates belong to the role that runs
// it: a superuser's SECURITY DEFINER function writing a table another role
// owns runs that role's triggers as the superuser, and the owner of the
// schema (or a squatter that created it first, forging any sign that
// pgfence migrated it, or that kept its tables when the schema was taken
// over) would gain the migrating role's rights through the application's
// calls; even reading the version table, were it the other role's view,
// would run its functions with the reader's rights. Any other role passes:
// one that may only use the schema (the application's role), or a database
// without the schema.
//
// The session locker runs it before anything of the schema is read, in
// [NewProvider] (so in [Up] and [DownTo]) and before every operation of
// the provider it returns: Up, UpTo, Down, DownTo, and Status and
// GetDBVersion too.
func checkMigrator(ctx context.Context, conn *sql.Conn) error {
	var owner, role, foreign string
	var ours, create bool
	err := conn.QueryRowContext(ctx, `SELECT n.nspowner::pg_catalog.regrole::pg_catalog.text,
		CURRENT_USER::pg_catalog.text,
		n.nspowner OPERATOR(pg_catalog.=) r.oid OR (o.rolsuper AND r.rolsuper),
		pg_catalog.has_schema_privilege(n.oid, 'CREATE'),
		coalesce((SELECT pg_catalog.string_agg(DISTINCT f.rolname::pg_catalog.text, ', ')
			FROM (SELECT c.relowner AS owner FROM pg_catalog.pg_class c WHERE c.relnamespace OPERATOR(pg_catalog.=) n.oid
				UNION SELECT p.proowner FROM pg_catalog.pg_proc p WHERE p.pronamespace OPERATOR(pg_catalog.=) n.oid
					AND p.prorettype OPERATOR(pg_catalog.<>) 'pg_catalog.trigger'::pg_catalog.regtype) x
			JOIN pg_catalog.pg_roles f ON f.oid OPERATOR(pg_catalog.=) x.owner
			WHERE x.owner OPERATOR(pg_catalog.<>) r.oid AND NOT f.rolsuper), '')
		FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r, pg_catalog.pg_roles o
		WHERE n.nspname OPERATOR(pg_catalog.=) $1 AND r.rolname OPERATOR(pg_catalog.=) current_user
		AND o.oid OPERATOR(pg_catalog.=) n.nspowner`, Schema).Scan(&owner, &role, &ours, &create, &foreign)
	if errors.Is(err, sql.ErrNoRows) {
		return nil // no schema yet: bootstrap creates it, owned by this role
	}
	if err != nil {
		return fmt.Errorf("migrations: read the owners of schema %s: %w", Schema, err)
	}
	switch {
	case !create:
		return nil
	case !ours:
		return fmt.Errorf("migrations: schema %s is owned by role %s, not by role %s, which may create objects in it but must not migrate it: "+
			"what it created there would run with its rights, and the schema's owner could make it run its own code; %s",
			Schema, owner, role, migrateAsRole(owner))
	case foreign != "":
		return fmt.Errorf("migrations: objects of schema %s are owned by role(s) %s, neither role %s nor a superuser: "+
			"what %s created there could be made to run their code with its rights; give them to the schema's owner "+
			"(ALTER TABLE / ALTER FUNCTION ... OWNER TO %s) or drop the schema and migrate again",
			Schema, foreign, role, role, owner)
	}
	return nil
}

// createVersionTable creates [VersionTable] with its version-0 row, as goose
// does (same store, same statements), unless it exists. The caller holds the
// migration lock on conn.
func createVersionTable(ctx context.Context, conn *sql.Conn) error {
	store, err := database.NewStore(database.DialectPostgres, VersionTable)
	if err != nil {
		return err
	}
	ext, ok := store.(database.StoreExtender)
	if !ok {
		return fmt.Errorf("goose store %T cannot check for the table", store)
	}
	exists, err := ext.TableExists(ctx, conn)
	if err != nil || exists {
		return err
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // after Commit: sql.ErrTxDone, nothing to undo
	if err := store.CreateVersionTable(ctx, tx); err != nil {
		return err
	}
	if err := store.Insert(ctx, tx, database.InsertRequest{Version: 0}); err != nil {
		return err
	}
	return tx.Commit()
}

// Up applies every pending migration to db. It is safe to call from many
// processes at once. It uses one connection of db at a time, so a *sql.DB
// limited to one open connection works.
//
// When every migration is applied, Up changes nothing and needs only the
// grants of the application role in docs/migrations.md: an application may
// call it at start-up as that role once its deploy has migrated as the
// owner. When migrations are pending and the role does not own pgfence's
// objects, Up changes nothing and returns an error that says to migrate as
// the schema's owner. A role that may create objects in schema pgfence
// without owning it and them (a superuser, a member of the owner role) is
// refused whether migrations are pending or not: see checkMigrator.
func Up(ctx context.Context, db *sql.DB) error {
	p, err := NewProvider(ctx, db)
	if err != nil {
		return err
	}
	pending, err := checkPending(ctx, db, p)
	if err != nil || !pending {
		return err
	}
	if _, err := p.Up(ctx); err != nil {
		if pgerr.Code(err) == pgerr.InsufficientPrivilege {
			return fmt.Errorf("migrations: up: %s: %w", migrateAsOwner, err)
		}
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// checkPending reports whether p has migrations that db has not applied,
// read while holding the migration lock (so a migrator that is applying
// them is waited for), and, when it has, returns an error unless the
// current role may apply them: it may use the owner of [VersionTable]'s
// rights, owns the schema ([checkSchemaOwner]) and passes [checkMigrator].
func checkPending(ctx context.Context, db *sql.DB, p *goose.Provider) (pending bool, err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("migrations: %w", err)
	}
	defer conn.Close()
	l := sessionLocker{id: LockID}
	if err := l.SessionLock(ctx, conn); err != nil {
		return false, err
	}
	defer func() {
		if uerr := l.SessionUnlock(context.WithoutCancel(ctx), conn); err == nil {
			err = uerr
		}
	}()
	applied, err := appliedVersions(ctx, conn)
	if err != nil {
		return false, err
	}
	done := make(map[int64]bool, len(applied))
	for _, v := range applied {
		done[v] = true
	}
	var missing []int64
	for _, src := range p.ListSources() {
		if !done[src.Version] {
			missing = append(missing, src.Version)
		}
	}
	if len(missing) == 0 {
		return false, nil
	}
	var owns bool
	var role, owner string
	if err := conn.QueryRowContext(ctx, `SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE'),
			CURRENT_USER::pg_catalog.text, c.relowner::pg_catalog.regrole::pg_catalog.text
		FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass($1)`,
		VersionTable).Scan(&owns, &role, &owner); err != nil {
		return false, fmt.Errorf("migrations: find the owner of %s: %w", VersionTable, err)
	}
	if !owns {
		return false, fmt.Errorf("migrations: %d pgfence migration(s) pending (versions %v) and role %s does not own schema %s (%s does): %s",
			len(missing), missing, role, Schema, owner, migrateAsOwner)
	}
	if err := checkSchemaOwner(ctx, conn); err != nil {
		return false, err
	}
	return true, nil
}

// UpPool is [Up] for a pgx pool. It uses one connection of pool (so MaxConns
// = 1 works), returned when UpPool returns.
func UpPool(ctx context.Context, pool *pgxpool.Pool) error {
	if pool == nil {
		return errors.New("migrations: nil *pgxpool.Pool")
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	// Everything runs on this one connection (TestUpPoolOneConnection).
	db.SetMaxOpenConns(1)
	return Up(ctx, db)
}

// DownTo rolls back migrations newer than version (0 rolls back all of them).
// Schema pgfence itself is kept, since it holds [VersionTable].
func DownTo(ctx context.Context, db *sql.DB, version int64) error {
	p, err := NewProvider(ctx, db)
	if err != nil {
		return err
	}
	if _, err := p.DownTo(ctx, version); err != nil {
		return fmt.Errorf("migrations: down to %d: %w", version, err)
	}
	return nil
}

// sessionLocker serialises migrators with a blocking pg_advisory_lock: no
// polling, the next migrator starts the moment the previous one unlocks.
// Once it holds the lock it refuses a role [checkMigrator] refuses, before
// anything of the schema is read.
type sessionLocker struct{ id int64 }

var _ lock.SessionLocker = sessionLocker{}

// SessionLock takes the lock, then refuses a role [checkMigrator] refuses,
// unlocking again.
func (l sessionLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, "SELECT pg_catalog.pg_advisory_lock($1)", l.id); err != nil {
		return fmt.Errorf("migrations: take advisory lock %d: %w", l.id, err)
	}
	if err := checkMigrator(ctx, conn); err != nil {
		// goose closes conn without unlocking when SessionLock fails: a
		// pooled connection would go back to its pool holding the lock.
		if uerr := l.SessionUnlock(context.WithoutCancel(ctx), conn); uerr != nil {
			return errors.Join(err, uerr)
		}
		return err
	}
	return nil
}

func (l sessionLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	var ok bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_catalog.pg_advisory_unlock($1)", l.id).Scan(&ok); err != nil {
		return fmt.Errorf("migrations: release advisory lock %d: %w", l.id, err)
	}
	if !ok {
		return fmt.Errorf("migrations: advisory lock %d was not held", l.id)
	}
	return nil
}
