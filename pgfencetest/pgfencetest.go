// Package pgfencetest helps an application's tests prove that its code is
// fenced: that a holder paused past its lease cannot overwrite the work of
// the holder that came after it.
//
// [New] gives a test a PostgreSQL database of its own with pgfence's
// migrations applied. The server comes from, in order: the environment
// variable PGFENCE_TEST_DATABASE_URL (a server where its user may CREATE
// DATABASE); testcontainers-go's postgres module when a Docker engine
// answers (image postgres:15-alpine, or PGFENCE_TEST_IMAGE); the PostgreSQL
// server binaries installed on the machine (initdb, postgres), as a
// throwaway cluster. If none can be had, the test fails and says what to
// install; it is never skipped. Each process migrates one template database
// of the server's user, named after pgfence's newest migration, the contents
// of the migration files and the user, and every test gets a clone of it, so
// tests may call t.Parallel(). A test that fails keeps its database and logs
// its name.
//
// Expiry runs on the database's clock, which no fake clock in Go can move:
// [DB.ExpireNow] and [DB.ExpireClaim] end a lease or a claim now, through
// owner-only test functions of the schema (pgfence.test_expire_lease,
// pgfence.test_expire_claim) that the application role cannot call.
// [DB.TakeOver] and [DB.Pause] make another holder take a lease over, as
// happens while a holder is paused (a stop-the-world pause, a stopped
// process, a slow network): the paused holder keeps its old *pglock.Lease
// and its local deadline, so code that checks only locally goes on and
// writes. [RequireStale] then checks that the write was refused.
//
//	db := pgfencetest.New(t)
//	lease, _ := locker.Acquire(ctx, "invoice:1", time.Minute)
//	db.Pause(t, lease, func(newer *pglock.Lease) {
//		pgfencetest.RequireAccepted(t, pay(ctx, db.Pool, newer, 1)) // the newer holder writes
//	})
//	pgfencetest.RequireStale(t, pay(ctx, db.Pool, lease, 1)) // the paused one wakes and writes
//
// docs/testing.md has the whole example.
package pgfencetest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/pgtext"
	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
)

// envDSN names the environment variable of a server to use.
const envDSN = "PGFENCE_TEST_DATABASE_URL"

// DB is a database of one test, with pgfence's migrations applied. It is
// dropped when the test ends, unless the test failed.
type DB struct {
	// DSN connects to the database as the server's user, which owns it (and
	// so may call the test functions).
	DSN string
	// Pool is a pool on DSN, closed when the test ends.
	Pool *pgxpool.Pool
	// Name is the database's name.
	Name string

	lockerOnce sync.Once
	locker     *pglock.Locker
	lockerErr  error
}

var (
	srvMu   sync.Mutex
	srv     *pgserver.Server
	srvErr  error
	tplMu   sync.Mutex
	tplName string
	tplCopy string // " STRATEGY FILE_COPY" on PostgreSQL 15 and newer
	seq     atomic.Int64
)

// New returns a database of t's own with pgfence's migrations applied: a
// clone of a template migrated once per process (once per server, role and
// version of the migration files for a server given by
// PGFENCE_TEST_DATABASE_URL). t fails if no server can be had. When t ends
// the database is dropped; if t failed it is kept and its name logged, to
// look at with psql. If the drop fails, t fails, naming the database.
func New(t testing.TB) *DB {
	t.Helper()
	s := server(t)
	tpl, strategy, err := template(s)
	if err != nil {
		t.Fatalf("pgfencetest: template database: %v", err)
	}
	name := dbName(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// FILE_COPY copies the template's files instead of WAL-logging each block.
	if err := adminExec(ctx, s, "CREATE DATABASE "+ident(name)+" TEMPLATE "+ident(tpl)+strategy); err != nil {
		t.Fatalf("pgfencetest: create database %s: %v", name, err)
	}
	db := &DB{DSN: withDatabase(s.DSN, name), Name: name}
	t.Cleanup(func() {
		if db.locker != nil {
			db.locker.Close()
		}
		if db.Pool != nil {
			db.Pool.Close()
		}
		if t.Failed() {
			t.Logf("pgfencetest: kept database %s of the failed test: %s", name, redact(db.DSN))
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := adminExec(ctx, s, "DROP DATABASE IF EXISTS "+ident(name)+" WITH (FORCE)"); err != nil {
			// A failure, not a log line shown only with -v: the database
			// stays on the server, unseen, until someone drops it.
			t.Errorf("pgfencetest: drop database %s of the passing test (left on the server): %v", name, err)
		}
	})
	pool, err := pgxpool.New(ctx, db.DSN)
	if err != nil {
		t.Fatalf("pgfencetest: open pool on %s: %v", name, err)
	}
	db.Pool = pool
	return db
}

// ExpireNow ends the live lease on the lock name now, on the database clock,
// as if its holder had paused past its end. The holder, its key and the token
// stay: the holder's renewal and release are refused, its local deadline is
// unchanged, and the next grant of name takes token + 1. t fails if no lease
// on name is live.
func (db *DB) ExpireNow(t testing.TB, name string) {
	t.Helper()
	checkName(t, "ExpireNow", name)
	if token := db.expire(t, "SELECT pgfence.test_expire_lease($1::pg_catalog.text)", name); token == 0 {
		t.Fatalf("pgfencetest.ExpireNow(%q): no live lease on the lock", name)
	}
}

// ExpireClaim ends the live claim of the job jobID now, on the database
// clock. As for any claim that ran out, the job stays running until the next
// claim of its queue takes it with a new claim token; from then on the old
// claim's Complete, Fail, Renew and Release are refused with
// pgfence.ErrLost. t fails if the job has no live claim.
func (db *DB) ExpireClaim(t testing.TB, jobID int64) {
	t.Helper()
	checkJobID(t, "ExpireClaim", jobID)
	if token := db.expire(t, "SELECT pgfence.test_expire_claim($1::pg_catalog.int8)", jobID); token == 0 {
		t.Fatalf("pgfencetest.ExpireClaim(%d): the job has no live claim", jobID)
	}
}

// checkName fails t, naming helper, for a lock name no lease can have (pglock:
// 1 to 512 bytes of UTF-8 without NUL), instead of the server's error.
func checkName(t testing.TB, helper, name string) {
	t.Helper()
	switch {
	case name == "" || len(name) > 512:
		t.Fatalf("pgfencetest.%s: lock name of %d bytes; a lock name is 1 to 512 bytes", helper, len(name))
	case pgtext.Problem(name) != "":
		t.Fatalf("pgfencetest.%s(%q): lock name %s", helper, name, pgtext.Problem(name))
	}
}

// checkJobID fails t, naming helper, for a job id no job has.
func checkJobID(t testing.TB, helper string, id int64) {
	t.Helper()
	if id <= 0 {
		t.Fatalf("pgfencetest.%s(%d): a job id is above 0", helper, id)
	}
}

func (db *DB) expire(t testing.TB, sql string, arg any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var token int64
	if err := db.Pool.QueryRow(ctx, sql, arg).Scan(&token); err != nil {
		t.Fatalf("pgfencetest: %s: %v", sql, err)
	}
	return token
}

// TakeOver makes another holder ("pgfencetest") take the lock name over: the
// live lease on it, if any, ends now ([DB.ExpireNow]), and the lock is
// granted to the other holder for a minute (token + 1). It returns the other
// holder's lease; it is released when t ends, unless the test released it
// or it was lost before (to another TakeOver, say). TakeOver waits behind
// waiters queued for name, for up to 30 seconds.
func (db *DB) TakeOver(t testing.TB, name string) *pglock.Lease {
	t.Helper()
	checkName(t, "TakeOver", name)
	db.expire(t, "SELECT pgfence.test_expire_lease($1::pg_catalog.text)", name)
	db.lockerOnce.Do(func() {
		db.locker, db.lockerErr = pglock.New(db.Pool, &pglock.Config{Holder: "pgfencetest"})
	})
	if db.lockerErr != nil {
		t.Fatalf("pgfencetest.TakeOver: %v", db.lockerErr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lease, err := db.locker.Acquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("pgfencetest.TakeOver(%q): %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// Release after a Release is nil; a lease lost meanwhile is not
		// held, which is what the release is for.
		if err := lease.Release(ctx); err != nil && !errors.Is(err, pgfence.ErrLost) {
			t.Logf("pgfencetest.TakeOver(%q): release at the end of the test: %v", name, err)
		}
	})
	return lease
}

// Pause plays the pause of lease's holder: the lease ends and another holder
// takes the lock over ([DB.TakeOver]); during runs with the other holder's
// lease, for what it does while the first holder is paused (typically its
// own write); then Pause returns and the first holder "wakes": the caller
// goes on with lease, whose local deadline has not passed, as a stopped
// process goes on after SIGCONT.
func (db *DB) Pause(t testing.TB, lease *pglock.Lease, during func(newer *pglock.Lease)) {
	t.Helper()
	if lease == nil {
		t.Fatal("pgfencetest.Pause: nil lease")
	}
	newer := db.TakeOver(t, lease.Name())
	if during != nil {
		during(newer)
	}
}

// RequireStale fails t unless err says a write was refused because a newer
// grant came first (errors.Is(err, pgfence.ErrStaleToken)): what fencedwrite,
// the code `pgfence gen fenced` generates and outbox.Enqueue return.
func RequireStale(t testing.TB, err error) {
	t.Helper()
	switch {
	case err == nil:
		t.Fatal("pgfencetest.RequireStale: the write was accepted, want it refused as stale: " +
			"does it carry the lease's token (fence < token) and raise the row's fence?")
	case !errors.Is(err, pgfence.ErrStaleToken):
		t.Fatalf("pgfencetest.RequireStale: got %v, want an error matching pgfence.ErrStaleToken", err)
	}
}

// RequireAccepted fails t unless err is nil: the write was accepted.
func RequireAccepted(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("pgfencetest.RequireAccepted: the write was refused or failed: %v", err)
	}
}

// RequireFence fails t unless the row of table whose key columns have the
// values in key has the fence want (the token of the grant that wrote it
// last; 0 for a row no fenced write changed). table may be qualified
// ("schema.table"); the fence column is "fence", pgfence's default.
//
// A key column of a built-in type, or of a domain over one, is compared with
// pg_catalog's =, so no = another role creates on the search_path runs; one
// of a type from another schema (an extension's citext, or a domain over
// it) with its own type's =, as fencedwrite compares it.
func (db *DB) RequireFence(t testing.TB, table string, key map[string]any, want int64) {
	t.Helper()
	if len(key) == 0 {
		t.Fatal("pgfencetest.RequireFence: no key columns")
	}
	cols := make([]string, 0, len(key))
	for c := range key {
		cols = append(cols, c)
	}
	slices.Sort(cols)
	name := ident(strings.Split(table, ".")...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := db.Pool.Query(ctx, keyTypesSQL, name)
	if err != nil {
		t.Fatalf("pgfencetest.RequireFence(%s): %v", table, err)
	}
	builtin := map[string]bool{} // column: its type is pg_catalog's
	var (
		col string
		b   bool
	)
	if _, err := pgx.ForEachRow(rows, []any{&col, &b}, func() error { builtin[col] = b; return nil }); err != nil {
		t.Fatalf("pgfencetest.RequireFence(%s): %v", table, err)
	}
	if len(builtin) == 0 {
		t.Fatalf("pgfencetest.RequireFence(%s): relation %s does not exist", table, name)
	}
	var where []string
	var args []any
	for i, c := range cols {
		ours, ok := builtin[c]
		if !ok {
			t.Fatalf("pgfencetest.RequireFence(%s): column %q does not exist", table, c)
		}
		eq := " = "
		if ours {
			eq = " OPERATOR(pg_catalog.=) "
		}
		where = append(where, ident(c)+eq+"$"+strconv.Itoa(i+1))
		args = append(args, key[c])
	}
	sql := "SELECT fence FROM " + name + " WHERE " + strings.Join(where, " AND ")
	rows, err = db.Pool.Query(ctx, sql, args...)
	if err != nil {
		t.Fatalf("pgfencetest.RequireFence(%s): %v", table, err)
	}
	fences, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	switch {
	case err != nil:
		t.Fatalf("pgfencetest.RequireFence(%s): %v", table, err)
	case len(fences) != 1:
		t.Fatalf("pgfencetest.RequireFence(%s, %v): %d rows have that key, want 1", table, key, len(fences))
	case fences[0] != want:
		t.Fatalf("pgfencetest.RequireFence(%s, %v): fence %d, want %d", table, key, fences[0], want)
	}
}

// keyTypesSQL returns the columns of the relation named $1 (quoted, resolved
// through the search_path as the query on it is) and whether each one's
// type, followed through domains to the type that is not one (whose =
// compares the values), is pg_catalog's.
const keyTypesSQL = `WITH RECURSIVE base AS (
	SELECT a.attnum, a.attname, ty.typtype, ty.typbasetype, ty.typnamespace
	FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON (ty.oid OPERATOR(pg_catalog.=) a.atttypid)
	WHERE (a.attrelid OPERATOR(pg_catalog.=) pg_catalog.to_regclass($1::pg_catalog.text))
		AND (a.attnum OPERATOR(pg_catalog.>) 0) AND NOT a.attisdropped
	UNION ALL
	SELECT b.attnum, b.attname, ty.typtype, ty.typbasetype, ty.typnamespace
	FROM base b JOIN pg_catalog.pg_type ty ON (ty.oid OPERATOR(pg_catalog.=) b.typbasetype)
	WHERE (b.typtype OPERATOR(pg_catalog.=) 'd')
)
SELECT b.attname::pg_catalog.text, (b.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace)
FROM base b WHERE (b.typtype OPERATOR(pg_catalog.<>) 'd')`

// RequireHeld fails t unless the lock name is held by holder now, on the
// database clock, and returns the lease's token.
func (db *DB) RequireHeld(t testing.TB, name, holder string) int64 {
	t.Helper()
	checkName(t, "RequireHeld", name)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var (
		h     *string
		token int64
		live  bool
	)
	err := db.Pool.QueryRow(ctx, `SELECT holder, token, COALESCE(expires_at OPERATOR(pg_catalog.>) pg_catalog.now(), false)
		FROM pgfence.locks WHERE name OPERATOR(pg_catalog.=) $1::pg_catalog.text`, name).Scan(&h, &token, &live)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		t.Fatalf("pgfencetest.RequireHeld(%q): the lock was never granted", name)
	case err != nil:
		t.Fatalf("pgfencetest.RequireHeld(%q): %v", name, err)
	case h == nil:
		t.Fatalf("pgfencetest.RequireHeld(%q, %q): released (token %d)", name, holder, token)
	case !live:
		t.Fatalf("pgfencetest.RequireHeld(%q, %q): the lease of %q (token %d) has ended", name, holder, *h, token)
	case *h != holder:
		t.Fatalf("pgfencetest.RequireHeld(%q, %q): held by %q (token %d)", name, holder, *h, token)
	}
	return token
}

// RequireCompletedOnce fails t unless the job jobID is completed: by one
// claim, whose Complete (or, for a transactional claim, whose transaction)
// committed. A job is completed at most once; this fails for a job still
// available or running (a lost completion), or dead.
func (db *DB) RequireCompletedOnce(t testing.TB, jobID int64) {
	t.Helper()
	checkJobID(t, "RequireCompletedOnce", jobID)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var (
		state    string
		attempts int
		outcome  *string
	)
	err := db.Pool.QueryRow(ctx, `SELECT state, attempts, claim_outcome FROM pgfence.jobs WHERE id OPERATOR(pg_catalog.=) $1::pg_catalog.int8`, jobID).
		Scan(&state, &attempts, &outcome)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		t.Fatalf("pgfencetest.RequireCompletedOnce(%d): no such job", jobID)
	case err != nil:
		t.Fatalf("pgfencetest.RequireCompletedOnce(%d): %v", jobID, err)
	case state != "completed":
		t.Fatalf("pgfencetest.RequireCompletedOnce(%d): the job is %s after %d attempt(s), want completed", jobID, state, attempts)
	case outcome != nil && *outcome != "completed":
		t.Fatalf("pgfencetest.RequireCompletedOnce(%d): completed, but its claim's outcome is %q", jobID, *outcome)
	}
}

// server returns the process's server, starting it on first use.
func server(t testing.TB) *pgserver.Server {
	t.Helper()
	srvMu.Lock()
	defer srvMu.Unlock()
	if srv == nil && srvErr == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		srv, srvErr = pgserver.Start(ctx, pgserver.Options{EnvVar: envDSN, Log: os.Stderr})
	}
	if srvErr != nil {
		t.Fatalf("pgfencetest: %v", srvErr)
	}
	return srv
}

// stopServer stops a server this process started (for this package's own
// TestMain; a user's process leaves it to die with the process).
func stopServer() {
	srvMu.Lock()
	defer srvMu.Unlock()
	if srv != nil {
		_ = srv.Stop()
		srv, srvErr = nil, nil
	}
	tplMu.Lock()
	tplName = ""
	tplMu.Unlock()
}

// templateLock serialises template creation between processes: an
// advisory lock in the server's maintenance database postgres, which every
// process takes whatever database its DSN names (advisory locks are per
// database: two processes whose DSNs named two databases of one server both
// made the template, and one dropped it, half-made as it looked, under the
// other). In the DSN's database when postgres cannot be reached.
const templateLock = 0x7066_7465_7374 // "pftest"

// template returns the name of the template database of the server's user
// for pgfence's migrations, creating and migrating it first if no process
// has, and the clause of CREATE DATABASE that copies it fastest.
func template(s *pgserver.Server) (name, strategy string, err error) {
	tplMu.Lock()
	defer tplMu.Unlock()
	if tplName == "" {
		tplName, tplCopy, err = makeTemplate(s)
	}
	return tplName, tplCopy, err
}

// makeTemplate finds or makes the template database of the user of s.DSN.
// Every statement names what it applies (pg_catalog's functions, operators
// and types): it runs as the server's user, often a superuser, and a
// function or operator another role planted in a schema on the search_path
// must not run as that user.
func makeTemplate(s *pgserver.Server) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		return "", "", err
	}
	defer admin.Close(context.Background())
	var role string
	if err := admin.QueryRow(ctx, "SELECT CURRENT_USER::pg_catalog.text").Scan(&role); err != nil {
		return "", "", err
	}
	name, err := templateName(migrations.FS(), role)
	if err != nil {
		return "", "", err
	}
	lock := admin
	mctx, mcancel := context.WithTimeout(ctx, 10*time.Second)
	c, err := pgx.Connect(mctx, withDatabase(s.DSN, "postgres"))
	mcancel()
	switch code := pgerr.Code(err); {
	case err == nil:
		defer c.Close(context.Background())
		lock = c
	case code == "3D000" || code == "42501" || code == "28000" || code == "28P01":
		// No database postgres, or this role may not connect to it: the
		// DSN's database (processes sharing it still take one lock).
	default:
		return "", "", fmt.Errorf("connect to the maintenance database postgres for the template lock: %w", err)
	}
	if _, err := lock.Exec(ctx, "SELECT pg_catalog.pg_advisory_lock($1::pg_catalog.int8)", templateLock); err != nil {
		return "", "", err
	}
	defer lock.Exec(context.Background(), "SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)", templateLock) //nolint:errcheck // the session ends next
	strategy := ""
	if admin.PgConn().ParameterStatus("server_version") >= "15" {
		strategy = " STRATEGY FILE_COPY"
	}
	var (
		ready bool
		owner string
	)
	err = admin.QueryRow(ctx, `SELECT datistemplate, pg_catalog.pg_get_userbyid(datdba)::pg_catalog.text
		FROM pg_catalog.pg_database WHERE datname OPERATOR(pg_catalog.=) $1::pg_catalog.name`, name).Scan(&ready, &owner)
	switch {
	case err == nil && owner != role:
		// Its schema would be owner's, which role may not use.
		return "", "", fmt.Errorf("template database %s belongs to role %s, not %s: drop it", name, owner, role)
	case err == nil && ready:
		return name, strategy, nil
	case err == nil:
		// Left half-made by a process that died: make it again.
		if _, err := admin.Exec(ctx, "DROP DATABASE "+ident(name)+" WITH (FORCE)"); err != nil {
			return "", "", err
		}
	case !errors.Is(err, pgx.ErrNoRows):
		return "", "", err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+ident(name)); err != nil {
		return "", "", err
	}
	pool, err := pgxpool.New(ctx, withDatabase(s.DSN, name))
	if err != nil {
		return "", "", err
	}
	err = migrations.UpPool(ctx, pool)
	pool.Close()
	if err != nil {
		return "", "", fmt.Errorf("migrate %s: %w", name, err)
	}
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+ident(name)+" WITH IS_TEMPLATE true"); err != nil {
		return "", "", err
	}
	return name, strategy, nil
}

// templateName names role's template database for the migrations in fsys:
// pgfencetest_tpl_v, the newest migration's number, then 8 hex digits of a
// hash of the migration files (names and contents) and 8 of a hash of role.
// A migration edited under its number (while it is developed) names another
// template instead of reusing one migrated with its old text, and each role
// has its own, whose schema it owns.
func templateName(fsys fs.FS, role string) (string, error) {
	version, sum, err := migrationFiles(fsys)
	if err != nil {
		return "", err
	}
	r := sha256.Sum256([]byte(role))
	return fmt.Sprintf("pgfencetest_tpl_v%d_%s_%s", version, sum, hex.EncodeToString(r[:4])), nil
}

// newestMigration returns the number of pgfence's newest migration.
func newestMigration() (int64, error) {
	newest, _, err := migrationFiles(migrations.FS())
	return newest, err
}

// migrationFiles returns the number of the newest migration in fsys and 8
// hex digits of a SHA-256 of the files' names and contents.
func migrationFiles(fsys fs.FS) (newest int64, sum string, err error) {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return 0, "", err
	}
	slices.Sort(names)
	h := sha256.New()
	for _, n := range names {
		num, _, _ := strings.Cut(path.Base(n), "_")
		v, err := strconv.ParseInt(num, 10, 64)
		if err != nil {
			return 0, "", fmt.Errorf("migration %s: %w", n, err)
		}
		newest = max(newest, v)
		b, err := fs.ReadFile(fsys, n)
		if err != nil {
			return 0, "", err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", n, len(b))
		h.Write(b)
	}
	if newest == 0 {
		return 0, "", errors.New("no migrations embedded")
	}
	return newest, hex.EncodeToString(h.Sum(nil)[:4]), nil
}

// dbName names t's database: pgfencetest_, then the test's name (letters,
// digits and _ only, shortened), a number unique in the process, and 8
// random hex digits, so that no other process sharing the server (in
// another PID namespace, say) and no database kept by an earlier run has
// the name. It stays within PostgreSQL's 63 bytes.
func dbName(t testing.TB) string {
	var b strings.Builder
	for _, r := range strings.ToLower(t.Name()) {
		if b.Len() >= 24 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	var suffix [4]byte
	_, _ = rand.Read(suffix[:]) // never fails (crypto/rand.Read)
	return fmt.Sprintf("pgfencetest_%s_%d_%s", b.String(), seq.Add(1), hex.EncodeToString(suffix[:]))
}

func adminExec(ctx context.Context, s *pgserver.Server, sql string) error {
	conn, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

func ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

// withDatabase replaces the database of a URL- or keyword-style DSN. A
// URL's query parameters dbname and database name the database too, and pgx
// reads them after the path: they are removed. In a keyword/value DSN the
// last dbname wins.
func withDatabase(dsn, db string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path, u.RawPath = "/"+db, ""
		if q := u.Query(); q.Has("dbname") || q.Has("database") {
			q.Del("dbname")
			q.Del("database")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return dsn + " dbname=" + db
}

// dsnNotShown stands for a DSN redact cannot read (and so cannot redact).
const dsnNotShown = "(DSN not shown)"

// redact hides the passwords of a DSN, for a log: a URL's (user:password@,
// ?password=, ?sslpassword=) and a keyword/value DSN's (password=...,
// sslpassword=..., quoted or not): the value of every key ending in
// "password", in any case. A DSN it cannot read is not shown at all.
func redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		hidden := false
		for k := range q {
			if secretKey(k) {
				q[k] = []string{"xxxxx"}
				hidden = true
			}
		}
		if hidden {
			u.RawQuery = q.Encode()
		}
		return u.Redacted()
	}
	if strings.Contains(dsn, "://") {
		return dsnNotShown
	}
	return redactKeywords(dsn)
}

// secretKey reports whether the value of the DSN key is a secret redact
// hides: a key ending in "password" (password, sslpassword), in any case.
func secretKey(key string) bool {
	return strings.HasSuffix(strings.ToLower(key), "password")
}

// redactKeywords replaces the value of each key ending in "password" of a
// keyword/value DSN with xxxxx, reading it as libpq does: key = value, the
// value in single quotes or up to the next white space, a backslash
// escaping the next character.
func redactKeywords(dsn string) string {
	space := func(c byte) bool { return strings.IndexByte(" \t\n\r\f\v", c) >= 0 }
	var out strings.Builder
	for i := 0; ; {
		start := i
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		if i == len(dsn) {
			out.WriteString(dsn[start:])
			return out.String()
		}
		k := i
		for i < len(dsn) && dsn[i] != '=' && !space(dsn[i]) {
			i++
		}
		key := dsn[k:i]
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		if i == len(dsn) || dsn[i] != '=' {
			return dsnNotShown
		}
		i++
		for i < len(dsn) && space(dsn[i]) {
			i++
		}
		out.WriteString(dsn[start:i])
		v := i
		if i < len(dsn) && dsn[i] == '\'' {
			for i++; ; i++ {
				if i >= len(dsn) {
					return dsnNotShown // no closing quote
				}
				if dsn[i] == '\\' {
					i++
				} else if dsn[i] == '\'' {
					i++
					break
				}
			}
		} else {
			for i < len(dsn) && !space(dsn[i]) {
				if dsn[i] == '\\' {
					i++
				}
				i++
			}
			i = min(i, len(dsn))
		}
		if secretKey(key) {
			out.WriteString("xxxxx")
		} else {
			out.WriteString(dsn[v:i])
		}
	}
}
