package pgfencetest_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pgfencetest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// recorder is a testing.TB whose failures are recorded instead of failing
// the test: a helper's assertion is run on it to check that it fails.
type recorder struct {
	testing.TB
	mu       sync.Mutex
	failed   bool
	msgs     []string
	cleanups []func()
}

func (r *recorder) Helper() {}
func (r *recorder) Fail() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = true
}
func (r *recorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}
func (r *recorder) FailNow()                  { r.Fail(); runtime.Goexit() }
func (r *recorder) Fatal(args ...any)         { r.log(fmt.Sprint(args...)); r.FailNow() }
func (r *recorder) Fatalf(f string, a ...any) { r.log(fmt.Sprintf(f, a...)); r.FailNow() }
func (r *recorder) Error(args ...any)         { r.log(fmt.Sprint(args...)); r.Fail() }
func (r *recorder) Errorf(f string, a ...any) { r.log(fmt.Sprintf(f, a...)); r.Fail() }
func (r *recorder) Log(args ...any)           { r.log(fmt.Sprint(args...)) }
func (r *recorder) Logf(f string, a ...any)   { r.log(fmt.Sprintf(f, a...)) }
func (r *recorder) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}
func (r *recorder) log(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, s)
}

// cleanup runs the recorded cleanups, last first.
func (r *recorder) cleanup() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

// fails runs f on a recorder and returns what it logged; t fails if f did
// not fail the recorder, or if the message lacks want.
func fails(t *testing.T, want string, f func(tb testing.TB)) string {
	t.Helper()
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	r.cleanup()
	msg := strings.Join(r.msgs, "\n")
	if !r.Failed() {
		t.Fatalf("the assertion passed, want it to fail (%q)", msg)
	}
	if !strings.Contains(msg, want) {
		t.Fatalf("failure message %q, want it to contain %q", msg, want)
	}
	return msg
}

func TestNewGivesEachTestItsOwnMigratedDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, b := pgfencetest.New(t), pgfencetest.New(t)
	if a.Name == b.Name || a.DSN == b.DSN {
		t.Fatalf("two tests share database %s", a.Name)
	}
	newest, err := pgfencetest.NewestMigration()
	if err != nil {
		t.Fatal(err)
	}
	for _, db := range []*pgfencetest.DB{a, b} {
		var version int64
		if err := db.Pool.QueryRow(ctx, "SELECT max(version_id) FROM pgfence.goose_db_version").Scan(&version); err != nil {
			t.Fatal(err)
		}
		if version != newest || newest < 2 {
			t.Fatalf("%s is at migration %d, want the newest, %d", db.Name, version, newest)
		}
		var current string
		if err := db.Pool.QueryRow(ctx, "SELECT current_database()").Scan(&current); err != nil || current != db.Name {
			t.Fatalf("Pool connects to %q (%v), want %s", current, err, db.Name)
		}
	}
	// What one test writes, the other does not see.
	if _, err := a.Pool.Exec(ctx, "CREATE TABLE only_in_a (id int)"); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := b.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_a'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("b sees a's table: %d (%v)", n, err)
	}
	t.Logf("server: %s", pgfencetest.ServerKind())
}

// TestFailedTestKeepsItsDatabase: a passing test's database is dropped; a
// failed one's is kept and its name logged.
func TestFailedTestKeepsItsDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgfencetest.New(t)
	exists := func(name string) bool {
		var n int
		if err := admin.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = $1", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}

	passed := &recorder{TB: t}
	db := pgfencetest.New(passed)
	if !exists(db.Name) {
		t.Fatalf("%s does not exist", db.Name)
	}
	passed.cleanup()
	if exists(db.Name) {
		t.Fatalf("%s of a passing test was not dropped", db.Name)
	}

	failed := &recorder{TB: t}
	db = pgfencetest.New(failed)
	failed.Fail()
	failed.cleanup()
	if !exists(db.Name) {
		t.Fatalf("%s of a failed test was dropped", db.Name)
	}
	if msg := strings.Join(failed.msgs, "\n"); !strings.Contains(msg, "kept database "+db.Name) {
		t.Fatalf("log %q does not name the kept database", msg)
	}
	if _, err := admin.Pool.Exec(ctx, "DROP DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Fatal(err)
	}
}

func TestExpireNowAndTakeOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	locker, err := pglock.New(db.Pool, &pglock.Config{Holder: "worker-a"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "report", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if tok := db.RequireHeld(t, "report", "worker-a"); tok != lease.Token() {
		t.Fatalf("RequireHeld: token %d, want %d", tok, lease.Token())
	}
	fails(t, `held by "worker-a"`, func(tb testing.TB) { db.RequireHeld(tb, "report", "worker-b") })

	db.ExpireNow(t, "report")
	// The lease ended on the database clock an hour early: its renewal is
	// refused, while its local deadline is still ahead.
	if err := lease.Renew(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("Renew after ExpireNow: %v, want pgfence.ErrLost", err)
	}
	fails(t, "has ended", func(tb testing.TB) { db.RequireHeld(tb, "report", "worker-a") })
	fails(t, "no live lease", func(tb testing.TB) { db.ExpireNow(tb, "report") })
	// A name no lease can have fails with what is wrong with it, before SQL.
	fails(t, "a lock name is 1 to 512 bytes", func(tb testing.TB) { db.ExpireNow(tb, "") })
	fails(t, "a lock name is 1 to 512 bytes", func(tb testing.TB) { db.RequireHeld(tb, strings.Repeat("n", 513), "x") })
	fails(t, "lock name contains a NUL byte", func(tb testing.TB) { db.TakeOver(tb, "a\x00b") })
	fails(t, "lock name not valid UTF-8", func(tb testing.TB) { db.ExpireNow(tb, "a\xff") })
	fails(t, "a job id is above 0", func(tb testing.TB) { db.ExpireClaim(tb, 0) })
	fails(t, "a job id is above 0", func(tb testing.TB) { db.RequireCompletedOnce(tb, -1) })

	newer := db.TakeOver(t, "report")
	if newer.Token() != lease.Token()+1 || newer.Holder() != "pgfencetest" {
		t.Fatalf("TakeOver: token %d holder %q, want token %d holder pgfencetest", newer.Token(), newer.Holder(), lease.Token()+1)
	}
	if tok := db.RequireHeld(t, "report", "pgfencetest"); tok != newer.Token() {
		t.Fatalf("RequireHeld after TakeOver: %d, want %d", tok, newer.Token())
	}
	// TakeOver of a live lease ends it first.
	again := db.TakeOver(t, "report")
	if again.Token() != newer.Token()+1 {
		t.Fatalf("second TakeOver: token %d, want %d", again.Token(), newer.Token()+1)
	}
	fails(t, "never granted", func(tb testing.TB) { db.RequireHeld(tb, "other", "x") })
}

func TestExpireClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	ids, err := skiplocked.Enqueue(ctx, db.Pool, skiplocked.EnqueueParams{Queue: "mail"})
	if err != nil {
		t.Fatal(err)
	}
	claim := func(holder string) skiplocked.Job {
		jobs, err := skiplocked.Claim(ctx, db.Pool, skiplocked.ClaimParams{Queue: "mail", Holder: holder, Limit: 1, TTL: time.Hour})
		if err != nil || len(jobs) != 1 {
			t.Fatalf("claim by %s: %v %v", holder, jobs, err)
		}
		return jobs[0]
	}
	first := claim("worker-a")
	fails(t, "running", func(tb testing.TB) { db.RequireCompletedOnce(tb, ids[0]) })
	db.ExpireClaim(t, ids[0])
	fails(t, "no live claim", func(tb testing.TB) { db.ExpireClaim(tb, ids[0]) })
	second := claim("worker-b") // takes the job whose claim ended
	if second.ID != first.ID {
		t.Fatalf("second claim took job %d, want %d", second.ID, first.ID)
	}
	if err := skiplocked.Complete(ctx, db.Pool, first.Ref()); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("the first claim's Complete: %v, want pgfence.ErrLost", err)
	}
	if err := skiplocked.Complete(ctx, db.Pool, second.Ref()); err != nil {
		t.Fatal(err)
	}
	db.RequireCompletedOnce(t, ids[0])
	fails(t, "no such job", func(tb testing.TB) { db.RequireCompletedOnce(tb, ids[0]+1000) })
}

func TestRequireStaleAcceptedFence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO accounts VALUES (1, 100)`); err != nil {
		t.Fatal(err)
	}
	tbl, err := fencedwrite.Prepare(ctx, db.Pool, fencedwrite.Spec{Table: "accounts", Key: []string{"id"}, Set: []string{"balance"}})
	if err != nil {
		t.Fatal(err)
	}
	locker, err := pglock.New(db.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "account:1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	key := map[string]any{"id": 1}
	db.RequireFence(t, "accounts", key, 0)
	db.Pause(t, lease, func(newer *pglock.Lease) {
		_, err := tbl.Update(ctx, db.Pool, newer.Token(), []any{1}, []any{150})
		pgfencetest.RequireAccepted(t, err)
		db.RequireFence(t, "public.accounts", key, newer.Token())
	})
	_, err = tbl.Update(ctx, db.Pool, lease.Token(), []any{1}, []any{110})
	pgfencetest.RequireStale(t, err)

	fails(t, "want an error matching pgfence.ErrStaleToken", func(tb testing.TB) { pgfencetest.RequireStale(tb, errors.New("boom")) })
	fails(t, "the write was accepted", func(tb testing.TB) { pgfencetest.RequireStale(tb, nil) })
	fails(t, "refused or failed", func(tb testing.TB) { pgfencetest.RequireAccepted(tb, err) })
	fails(t, "fence 2, want 1", func(tb testing.TB) { db.RequireFence(tb, "accounts", key, lease.Token()) })
	fails(t, "0 rows have that key", func(tb testing.TB) { db.RequireFence(tb, "accounts", map[string]any{"id": 2}, 0) })
	fails(t, "no key columns", func(tb testing.TB) { db.RequireFence(tb, "accounts", nil, 0) })
	// An identifier that looks like SQL is a name, not SQL.
	fails(t, "does not exist", func(tb testing.TB) {
		db.RequireFence(tb, "accounts; DROP TABLE accounts", key, 0)
	})
	db.RequireFence(t, "accounts", key, lease.Token()+1)
}

// TestAppRoleCannotExpire: the test functions are the owner's: the
// documented application role cannot end a lease or a claim with them.
func TestAppRoleCannotExpire(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgfencetest.New(t)
	name, appDSN := pgtest.DocRole(t, "migrations.md", db.DSN, "app")
	// The role may need a password (a server with password authentication).
	if _, err := db.Pool.Exec(ctx, "ALTER ROLE "+pgx.Identifier{name}.Sanitize()+" PASSWORD 'pgfencetest'"); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(appDSN)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(name, "pgfencetest")
	app, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	locker, err := pglock.New(app, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "job", time.Minute)
	if err != nil {
		t.Fatalf("the app role's Acquire: %v", err)
	}
	for _, sql := range []string{"SELECT pgfence.test_expire_lease('job')", "SELECT pgfence.test_expire_claim(1)"} {
		_, err := app.Exec(ctx, sql)
		if code := pgCode(err); code != "42501" {
			t.Fatalf("%s as the app role: %v, want SQLSTATE 42501 (permission denied)", sql, err)
		}
	}
	db.RequireHeld(t, "job", lease.Holder())
	// The owner may.
	db.ExpireNow(t, "job")
}

func pgCode(err error) string {
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return pe.SQLState()
	}
	return ""
}

// BenchmarkNew measures a database per test: "clone" is New (a copy of the
// migrated template, and the drop when the test ends); "migrate" is what it
// saves, an empty database migrated and dropped.
func BenchmarkNew(b *testing.B) {
	admin := pgfencetest.New(b) // the template, once
	b.Run("clone", func(b *testing.B) {
		for b.Loop() {
			r := &recorder{TB: b}
			pgfencetest.New(r)
			r.cleanup()
		}
	})
	b.Run("migrate", func(b *testing.B) {
		ctx := context.Background()
		for i := 0; b.Loop(); i++ {
			name := fmt.Sprintf("pgfencetest_bench_%d", i)
			if _, err := admin.Pool.Exec(ctx, "CREATE DATABASE "+name); err != nil {
				b.Fatal(err)
			}
			u, err := url.Parse(admin.DSN)
			if err != nil {
				b.Fatal(err)
			}
			u.Path = "/" + name
			pool, err := pgxpool.New(ctx, u.String())
			if err != nil {
				b.Fatal(err)
			}
			if err := migrations.UpPool(ctx, pool); err != nil {
				b.Fatal(err)
			}
			pool.Close()
			if _, err := admin.Pool.Exec(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
				b.Fatal(err)
			}
		}
	})
}
