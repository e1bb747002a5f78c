package pgfencetest_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pgfencetest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// passes runs f on a recorder and fails t with what it logged if f failed
// the recorder (so that one check's failure does not hide the next).
func passes(t *testing.T, what string, f func(tb testing.TB)) {
	t.Helper()
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	r.cleanup()
	if r.Failed() {
		t.Errorf("%s failed: %s", what, strings.Join(r.msgs, "\n"))
	}
}

// withSearchPath returns dsn with search_path set to public, then
// pg_catalog, as a role that may create in public could make a victim's
// connections run (ALTER ROLE/DATABASE ... SET search_path, PGOPTIONS).
func withSearchPath(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("search_path", "public,pg_catalog")
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " search_path=public,pg_catalog"
}

const plantSQL = `
CREATE SEQUENCE public.pgfencetest_plant_ran;
CREATE FUNCTION public.pgfencetest_plant(what text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_catalog.nextval('public.pgfencetest_plant_ran');
	RAISE EXCEPTION 'pgfencetest: the planted % ran', what;
END $$;
CREATE FUNCTION public.pg_advisory_lock(double precision) RETURNS void LANGUAGE plpgsql AS $$
BEGIN PERFORM public.pgfencetest_plant('pg_advisory_lock(double precision)'); END $$;
CREATE FUNCTION public.pg_advisory_unlock(double precision) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('pg_advisory_unlock(double precision)'); END $$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN PERFORM public.pgfencetest_plant('now()'); RETURN NULL; END $$;
CREATE FUNCTION public.pgfencetest_eq_name(name, name) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('=(name, name)'); END $$;
CREATE OPERATOR public.= (LEFTARG = name, RIGHTARG = name, FUNCTION = public.pgfencetest_eq_name);
CREATE FUNCTION public.pgfencetest_eq_text(text, text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('=(text, text)'); END $$;
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.pgfencetest_eq_text);
CREATE FUNCTION public.pgfencetest_eq_int8(bigint, bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('=(bigint, bigint)'); END $$;
CREATE OPERATOR public.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.pgfencetest_eq_int8);
CREATE FUNCTION public.pgfencetest_eq_int4(integer, integer) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('=(integer, integer)'); END $$;
CREATE OPERATOR public.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = public.pgfencetest_eq_int4);
CREATE FUNCTION public.pgfencetest_gt_tstz(timestamptz, timestamptz) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN public.pgfencetest_plant('>(timestamptz, timestamptz)'); END $$;
CREATE OPERATOR public.> (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = public.pgfencetest_gt_tstz);
`

const unplantSQL = `
DROP FUNCTION IF EXISTS public.pgfencetest_eq_name(name, name), public.pgfencetest_eq_text(text, text),
	public.pgfencetest_eq_int8(bigint, bigint), public.pgfencetest_eq_int4(integer, integer),
	public.pgfencetest_gt_tstz(timestamptz, timestamptz) CASCADE;
DROP FUNCTION IF EXISTS public.pg_advisory_lock(double precision), public.pg_advisory_unlock(double precision),
	public.now(), public.pgfencetest_plant(text);
DROP SEQUENCE IF EXISTS public.pgfencetest_plant_ran;
`

// plant creates, in schema public of the database dsn is on, functions and
// operators that shadow pg_catalog's for a connection whose search_path puts
// public first (and, for pg_advisory_lock(double precision), for any
// connection: an untyped parameter prefers it). Each one that runs counts in
// the sequence public.pgfencetest_plant_ran (which no rollback undoes) and
// raises. They are dropped when t ends; the function plant returns says how
// many times one ran.
func plant(t *testing.T, dsn string) (ran func() int64) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), unplantSQL); err != nil {
			t.Errorf("drop the plants: %v", err)
		}
	})
	if _, err := conn.Exec(ctx, plantSQL); err != nil {
		t.Fatalf("plant: %v", err)
	}
	return func() int64 {
		var last int64
		var called bool
		if err := conn.QueryRow(ctx, "SELECT last_value, is_called FROM public.pgfencetest_plant_ran").Scan(&last, &called); err != nil {
			t.Fatal(err)
		}
		if !called {
			return 0
		}
		return last
	}
}

// TestNoPlantedFunctionRuns: no statement of the package resolves a
// function or an operator through the search_path: functions and operators
// planted in schema public (by a role that may create there) do not run as
// the server's user, neither while the template is looked for (from a
// database of the server with the plants: a test's own, so that they reach
// no other test) nor in the helpers' statements on a test's database.
func TestNoPlantedFunctionRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t) // the server and the template, made without plants

	// The template, looked for from a database with the plants.
	maint := pgfencetest.New(t)
	adminRan := plant(t, maint.DSN)
	if _, err := pgfencetest.Template(withSearchPath(maint.DSN)); err != nil {
		t.Errorf("template with the plants: %v", err)
	}
	if n := adminRan(); n != 0 {
		t.Errorf("finding the template ran a planted function or operator %d time(s)", n)
	}

	// The helpers, on a test's database whose search_path puts public first.
	locker, err := pglock.New(db.Pool, &pglock.Config{Holder: "worker-a"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	if _, err := locker.Acquire(ctx, "report", time.Hour); err != nil {
		t.Fatal(err)
	}
	ids, err := skiplocked.Enqueue(ctx, db.Pool, skiplocked.EnqueueParams{Queue: "mail"})
	if err != nil {
		t.Fatal(err)
	}
	jobs, err := skiplocked.Claim(ctx, db.Pool, skiplocked.ClaimParams{Queue: "mail", Holder: "w", Limit: 1, TTL: time.Hour})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim: %v %v", jobs, err)
	}
	if err := skiplocked.Complete(ctx, db.Pool, jobs[0].Ref()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO accounts VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	dbRan := plant(t, db.DSN)
	planted, err := pgxpool.New(ctx, withSearchPath(db.DSN))
	if err != nil {
		t.Fatal(err)
	}
	plain := db.Pool
	db.Pool = planted
	defer func() { db.Pool = plain; planted.Close() }()
	var sp string
	if err := planted.QueryRow(ctx, "SHOW search_path").Scan(&sp); err != nil || !strings.HasPrefix(sp, "public") {
		t.Fatalf("search_path %q (%v), want public first", sp, err)
	}

	passes(t, "RequireHeld", func(tb testing.TB) { db.RequireHeld(tb, "report", "worker-a") })
	passes(t, "RequireCompletedOnce", func(tb testing.TB) { db.RequireCompletedOnce(tb, ids[0]) })
	passes(t, "RequireFence", func(tb testing.TB) { db.RequireFence(tb, "accounts", map[string]any{"id": 1}, 0) })
	passes(t, "ExpireNow", func(tb testing.TB) { db.ExpireNow(tb, "report") })
	if n := dbRan(); n != 0 {
		t.Errorf("the helpers ran a planted function or operator %d time(s)", n)
	}
}

// TestRedactHidesPasswords: a DSN in a log shows no password, in URL or in
// keyword/value form.
func TestRedactHidesPasswords(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://u:s3cret@db.example:5432/app?sslmode=disable",
		"postgresql://u@db.example/app?password=s3cret&sslmode=disable",
		"host=db.example user=u password=s3cret dbname=app",
		"host=db.example password = s3cret dbname=app",
		"password=s3cret",
		`host=db.example password='s3 cret \' s3cret' dbname=app`,
		`host=db.example password=s3\ cret dbname=app`,
		"host=db.example PASSWORD=s3cret dbname=app",
		"host=db.example\tpassword=s3cret\tdbname=app",
		"host=db.example password='unterminated s3cret",
	} {
		got := pgfencetest.Redact(dsn)
		if strings.Contains(got, "s3") || strings.Contains(got, "cret") {
			t.Errorf("redact(%q) = %q, shows the password", dsn, got)
		}
		if !strings.Contains(dsn, "unterminated") && strings.Contains(dsn, "db.example") && !strings.Contains(got, "db.example") {
			t.Errorf("redact(%q) = %q, want the host kept", dsn, got)
		}
	}
	for _, dsn := range []string{"host=db.example dbname=app", "postgres://u@db.example/app"} {
		if got := pgfencetest.Redact(dsn); got != dsn {
			t.Errorf("redact(%q) = %q, want it unchanged (no password)", dsn, got)
		}
	}
}

// TestRedactHidesEveryPasswordKey: every key ending in "password" is a
// secret, not only "password": sslpassword (the passphrase of the client
// key) is hidden too, in URL and keyword/value DSNs, in any case; the other
// keys stay readable.
func TestRedactHidesEveryPasswordKey(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://u@db.example/app?sslmode=verify-full&sslkey=/k.pem&sslpassword=s3cret",
		"postgresql://u:s3cret@db.example/app?sslpassword=s3cret&password=s3cret",
		"postgres://u@db.example/app?SSLPassword=s3cret",
		"host=db.example user=u sslkey=/k.pem sslpassword=s3cret dbname=app",
		"host=db.example sslpassword = 's3 cret' password=s3cret dbname=app",
		"host=db.example SSLPASSWORD=s3cret dbname=app",
	} {
		got := pgfencetest.Redact(dsn)
		if strings.Contains(got, "s3") || strings.Contains(got, "cret") {
			t.Errorf("redact(%q) = %q, shows a password", dsn, got)
		}
		if !strings.Contains(got, "db.example") || !strings.Contains(got, "app") {
			t.Errorf("redact(%q) = %q, want the host and database kept", dsn, got)
		}
	}
	if dsn := "host=db.example sslkey=/k.pem sslmode=verify-full dbname=app"; pgfencetest.Redact(dsn) != dsn {
		t.Errorf("redact(%q) = %q, want it unchanged (no password)", dsn, pgfencetest.Redact(dsn))
	}
}

// TestWithDatabaseReplacesEveryDatabaseSetting: the DSN of a test's
// database names that database however the server's DSN named its own: a
// URL's path, its dbname or database query parameter (which pgx reads
// after the path), or a keyword/value dbname. Other settings stay.
func TestWithDatabaseReplacesEveryDatabaseSetting(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"postgres://u@db.example/app?sslmode=disable",
		"postgres://u@db.example/app?dbname=other&sslmode=disable",
		"postgresql://u@db.example/?dbname=other&sslmode=disable",
		"postgres://u@db.example?database=other&sslmode=disable",
		"postgres://u@db.example/app?dbname=a&dbname=b&database=c&sslmode=disable",
		"host=db.example user=u dbname=other sslmode=disable",
	} {
		got := pgfencetest.WithDatabase(dsn, "pgfencetest_mine")
		cfg, err := pgconn.ParseConfig(got)
		if err != nil {
			t.Errorf("WithDatabase(%q) = %q: %v", dsn, got, err)
			continue
		}
		if cfg.Database != "pgfencetest_mine" || cfg.Host != "db.example" || cfg.User != "u" || cfg.TLSConfig != nil {
			t.Errorf("WithDatabase(%q) = %q: database %q, host %q, user %q, TLS %v; want pgfencetest_mine, db.example, u, no TLS (sslmode kept)",
				dsn, got, cfg.Database, cfg.Host, cfg.User, cfg.TLSConfig != nil)
		}
	}
}

// childURLEnv carries, to TestNewWithDbnameInServerURLChild in a child
// process, the URL of this process's server.
const childURLEnv = "PGFENCETEST_CHILD_SERVER_URL"

// TestNewWithDbnameInServerURL: a PGFENCE_TEST_DATABASE_URL that names its
// database with the libpq query parameter (postgresql://host/?dbname=postgres)
// still gives each test its own database, not the server's. A child process
// (the server is chosen once per process) runs New with that URL.
func TestNewWithDbnameInServerURL(t *testing.T) {
	t.Parallel()
	pgfencetest.New(t) // starts this process's server
	u, err := url.Parse(pgfencetest.ServerDSN())
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Skipf("the server's DSN is not a URL (%v): nothing to put ?dbname= in", err)
	}
	maintenance := strings.TrimPrefix(u.Path, "/")
	if maintenance == "" {
		maintenance = "postgres"
	}
	u.Path, u.RawPath = "/", ""
	q := u.Query()
	q.Set("dbname", maintenance)
	u.RawQuery = q.Encode()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestNewWithDbnameInServerURLChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "PGFENCE_TEST_DATABASE_URL="+u.String(), childURLEnv+"="+maintenance)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestNewWithDbnameInServerURLChild") {
		t.Fatalf("child with PGFENCE_TEST_DATABASE_URL=%s: %v\n%s", pgfencetest.Redact(u.String()), err, out)
	}
}

// TestNewWithDbnameInServerURLChild is TestNewWithDbnameInServerURL's child:
// it runs only there.
func TestNewWithDbnameInServerURLChild(t *testing.T) {
	maintenance := os.Getenv(childURLEnv)
	if maintenance == "" {
		t.Skip("run by TestNewWithDbnameInServerURL in a child process")
	}
	db := pgfencetest.New(t)
	var cur string
	if err := db.Pool.QueryRow(context.Background(), "SELECT pg_catalog.current_database()::pg_catalog.text").Scan(&cur); err != nil {
		t.Fatal(err)
	}
	if cur != db.Name {
		t.Fatalf("db.Pool is on database %q, want the test's own %q (not the server's %q); DSN %s", cur, db.Name, maintenance, pgfencetest.Redact(db.DSN))
	}
	var migrated bool
	if err := db.Pool.QueryRow(context.Background(), "SELECT pg_catalog.to_regclass('pgfence.locks') IS NOT NULL").Scan(&migrated); err != nil || !migrated {
		t.Fatalf("the test's database has no pgfence.locks (%v)", err)
	}
}

// TestTemplateOfAnotherRole: a second role with CREATEDB on the same server
// gets a template of its own, whose schema it owns, not the first role's.
func TestTemplateOfAnotherRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgfencetest.New(t)
	var mine string
	if err := admin.Pool.QueryRow(ctx, "SELECT CURRENT_USER::text").Scan(&mine); err != nil {
		t.Fatal(err)
	}
	myTpl, err := pgfencetest.Template(pgfencetest.ServerDSN())
	if err != nil {
		t.Fatal(err)
	}
	role := "pgfencetest_other_" + randHex(t)
	id := pgx.Identifier{role}.Sanitize()
	if _, err := admin.Pool.Exec(ctx, "CREATE ROLE "+id+" LOGIN CREATEDB PASSWORD 'pgfencetest'"); err != nil {
		t.Fatal(err)
	}
	var made []string // databases the role made, to drop
	t.Cleanup(func() {
		ctx := context.Background()
		for _, name := range made {
			if name == myTpl {
				continue // the shared template of the old code: not ours to drop
			}
			d := pgx.Identifier{name}.Sanitize()
			for _, s := range []string{"ALTER DATABASE " + d + " WITH IS_TEMPLATE false", "DROP DATABASE " + d + " WITH (FORCE)"} {
				if _, err := admin.Pool.Exec(ctx, s); err != nil {
					t.Errorf("%s: %v", s, err)
				}
			}
		}
		if _, err := admin.Pool.Exec(ctx, "DROP ROLE "+id); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	u, err := url.Parse(pgfencetest.ServerDSN())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "pgfencetest")
	theirs := u.String()

	tpl, err := pgfencetest.Template(theirs)
	if err != nil {
		t.Fatalf("the other role's template: %v", err)
	}
	made = append(made, tpl)
	if tpl == myTpl {
		t.Errorf("roles %s and %s share template %s", mine, role, tpl)
	}
	clone := "pgfencetest_other_clone_" + randHex(t)
	conn, err := pgx.Connect(ctx, theirs)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+clone+" TEMPLATE "+pgx.Identifier{tpl}.Sanitize())
	conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	made = append(made, clone)
	u.Path = "/" + clone
	conn, err = pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var token int64
	if err := conn.QueryRow(ctx, "SELECT pgfence.test_expire_lease('job')").Scan(&token); err != nil {
		t.Fatalf("the other role's clone: %v", err)
	}
	want, err := pgfencetest.TemplateName(migrations.FS(), role)
	if err != nil {
		t.Fatal(err)
	}
	if tpl != want {
		t.Errorf("the other role's template is %s, want %s", tpl, want)
	}
}

// TestTemplateNameFollowsMigrationFiles: a migration edited under its
// number (while it is developed) names another template, instead of
// reusing one migrated with its old text; so does another role.
func TestTemplateNameFollowsMigrationFiles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgfencetest.New(t)
	var role string
	if err := admin.Pool.QueryRow(ctx, "SELECT CURRENT_USER::text").Scan(&role); err != nil {
		t.Fatal(err)
	}
	newest, err := pgfencetest.NewestMigration()
	if err != nil {
		t.Fatal(err)
	}
	name, err := pgfencetest.TemplateName(migrations.FS(), role)
	if err != nil {
		t.Fatal(err)
	}
	if prefix := fmt.Sprintf("pgfencetest_tpl_v%d_", newest); !strings.HasPrefix(name, prefix) || len(name) > 63 {
		t.Errorf("template name %q: want the prefix %q and at most 63 bytes", name, prefix)
	}
	if tpl, err := pgfencetest.Template(pgfencetest.ServerDSN()); err != nil || tpl != name {
		t.Errorf("the template is %q (%v), want %q", tpl, err, name)
	}

	edited := fstest.MapFS{}
	files, err := fs.Glob(migrations.FS(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		b, err := fs.ReadFile(migrations.FS(), f)
		if err != nil {
			t.Fatal(err)
		}
		edited[f] = &fstest.MapFile{Data: b}
	}
	newestFile := files[len(files)-1]
	edited[newestFile] = &fstest.MapFile{Data: append(edited[newestFile].Data, "\n-- edited\n"...)}
	if again, err := pgfencetest.TemplateName(edited, role); err != nil || again == name {
		t.Errorf("with %s edited the template is %q (%v), the same as before", newestFile, again, err)
	}
	if other, err := pgfencetest.TemplateName(migrations.FS(), role+"_other"); err != nil || other == name {
		t.Errorf("another role's template is %q (%v), the same as %s's", other, err, role)
	}
}

// TestNewAfterKeptDatabaseOfSamePid: a database left on the server by an
// earlier run (a failed test keeps its database) or made by a process of
// another PID namespace with the same process id and sequence number does
// not make New fail. Not parallel: it predicts the process's next number.
func TestNewAfterKeptDatabaseOfSamePid(t *testing.T) {
	ctx := context.Background()
	admin := pgfencetest.New(t)
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
	// The name the next New of this process took before: test, pid, number.
	kept := fmt.Sprintf("pgfencetest_%s_%d_%d", b.String(), os.Getpid(), pgfencetest.NextSeq())
	if _, err := admin.Pool.Exec(ctx, "CREATE DATABASE "+kept); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Pool.Exec(context.Background(), "DROP DATABASE "+kept+" WITH (FORCE)"); err != nil {
			t.Error(err)
		}
	})
	passes(t, "New after a kept database", func(tb testing.TB) { pgfencetest.New(tb) })

	// Names fit PostgreSQL's 63 bytes and differ, also for a long test name.
	seen := map[string]bool{}
	long := named{TB: t, name: strings.Repeat("TestAVeryLongName/with_subtests#01", 4)}
	for range 100 {
		n := pgfencetest.DBName(long)
		if len(n) > 63 || seen[n] {
			t.Fatalf("database name %q: %d bytes, or seen before", n, len(n))
		}
		seen[n] = true
	}
}

// named is a testing.TB of another name.
type named struct {
	testing.TB
	name string
}

func (n named) Name() string { return n.name }

// TestFailedDropFailsTest: a passing test whose database cannot be dropped
// fails, naming the database, instead of leaking it with a log line that
// shows only with -v.
func TestFailedDropFailsTest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgfencetest.New(t)
	r := &recorder{TB: t}
	db := pgfencetest.New(r)
	name := pgx.Identifier{db.Name}.Sanitize()
	// A template database cannot be dropped.
	if _, err := admin.Pool.Exec(ctx, "ALTER DATABASE "+name+" WITH IS_TEMPLATE true"); err != nil {
		t.Fatal(err)
	}
	r.cleanup()
	msg := strings.Join(r.msgs, "\n")
	if !r.Failed() || !strings.Contains(msg, db.Name) {
		t.Errorf("the drop of %s failed, and the test: failed %v, log %q; want it failed, naming the database", db.Name, r.Failed(), msg)
	}
	for _, s := range []string{"ALTER DATABASE " + name + " WITH IS_TEMPLATE false", "DROP DATABASE " + name + " WITH (FORCE)"} {
		if _, err := admin.Pool.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
}

// TestTakeOverReleasedWhenTestEnds: the other holder's lease that TakeOver
// returns is released when the test that took it ends, as its godoc says.
func TestTakeOverReleasedWhenTestEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	r := &recorder{TB: t}
	lease := db.TakeOver(r, "report")
	db.RequireHeld(t, "report", "pgfencetest")
	// A lease the test released itself, or lost to a later TakeOver, is no
	// error at the end.
	released := db.TakeOver(r, "released")
	if err := released.Release(ctx); err != nil {
		t.Fatal(err)
	}
	db.TakeOver(r, "twice")
	again := db.TakeOver(r, "twice")
	r.cleanup()
	if r.Failed() {
		t.Fatalf("the test failed at its end: %s", strings.Join(r.msgs, "\n"))
	}
	for _, name := range []string{"report", "twice"} {
		var holder *string
		if err := db.Pool.QueryRow(ctx, "SELECT holder FROM pgfence.locks WHERE name = $1", name).Scan(&holder); err != nil {
			t.Fatal(err)
		}
		if holder != nil {
			t.Errorf("the lease on %s (token %d, %d) is still held by %q after the test ended", name, lease.Token(), again.Token(), *holder)
		}
	}
}

func randHex(t *testing.T) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// TestRequireFenceKeyTypes: RequireFence, which compares a built-in key
// with pg_catalog's =, still reads keys of other types (a domain's, with its
// own =), views, and says which key column does not exist.
func TestRequireFenceKeyTypes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	if _, err := db.Pool.Exec(ctx, `CREATE DOMAIN acct_id AS int CHECK (VALUE > 0);
		CREATE TABLE accts (id acct_id PRIMARY KEY, region varchar(8) NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO accts VALUES (1, 'eu', 3), (2, 'us', 4);
		CREATE VIEW accts_v AS SELECT * FROM accts`); err != nil {
		t.Fatal(err)
	}
	db.RequireFence(t, "accts", map[string]any{"id": 1}, 3)
	db.RequireFence(t, "public.accts", map[string]any{"region": "us"}, 4)
	db.RequireFence(t, "accts_v", map[string]any{"id": 2, "region": "us"}, 4)
	fails(t, `column "nope" does not exist`, func(tb testing.TB) { db.RequireFence(tb, "accts", map[string]any{"nope": 1}, 0) })
	fails(t, "does not exist", func(tb testing.TB) { db.RequireFence(tb, "missing", map[string]any{"id": 1}, 0) })
}

// TestRequireFenceDomainKeyBuiltinEquals: a key column of a domain over a
// built-in type is compared with pg_catalog's =, as fencedwrite compares it:
// an = another role created for the domain on the search_path ran (the
// domain's own schema was taken for its type's).
func TestRequireFenceDomainKeyBuiltinEquals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	if _, err := db.Pool.Exec(ctx, `
		CREATE DOMAIN acct AS bigint;
		CREATE DOMAIN acct2 AS acct;
		CREATE TABLE accts (id acct PRIMARY KEY, id2 acct2 NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO accts VALUES (1, 1, 3);
		CREATE SEQUENCE planted_ran;
		CREATE FUNCTION public.planted_eq(acct, acct) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_catalog.nextval('public.planted_ran'); RETURN true; END $$;
		CREATE OPERATOR public.= (LEFTARG = acct, RIGHTARG = acct, FUNCTION = public.planted_eq);
		CREATE FUNCTION public.planted_eq2(acct2, acct2) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_catalog.nextval('public.planted_ran'); RETURN true; END $$;
		CREATE OPERATOR public.= (LEFTARG = acct2, RIGHTARG = acct2, FUNCTION = public.planted_eq2)`); err != nil {
		t.Fatal(err)
	}
	db.RequireFence(t, "accts", map[string]any{"id": 1}, 3)
	db.RequireFence(t, "accts", map[string]any{"id2": 1}, 3)
	var called bool
	if err := db.Pool.QueryRow(ctx, "SELECT is_called FROM planted_ran").Scan(&called); err != nil {
		t.Fatal(err)
	}
	if called {
		t.Errorf("RequireFence ran an = created for the domain")
	}
}
