package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// The SQLSTATEs of the lock table's integrity trigger (pgfence.locks_integrity).
const (
	sqlStateTokenIntegrity = "PF009" // a token forged, lowered, skipped or reset; a row renamed, deleted or truncated
	sqlStateLeaseRule      = "PF010" // not a grant, renewal, release or wait mark the lease's state allows
)

// readmeGrants returns the grants of docs/migrations.md's block for the
// application role (pgtest.DocGrants), with %s in place of the role: the
// tests run with exactly what docs/migrations.md tells users to grant.
func readmeGrants(t *testing.T) string {
	t.Helper()
	grants := pgtest.DocGrants(t, "migrations.md", "app", "%s")
	joined := strings.Join(grants, ";\n") + ";"
	if !strings.Contains(joined, "ON pgfence.locks TO %s") {
		t.Fatalf("docs/migrations.md's block for role app grants nothing on pgfence.locks:\n%s", joined)
	}
	return joined
}

// integRole creates a LOGIN role (no superuser, no DDL) named prefix plus a
// unique suffix, runs grants (with %s standing for the quoted role), and
// drops the role when t ends, after reassigning what it owns in db.
func integRole(t *testing.T, ctx context.Context, admin *pgxpool.Pool, prefix, grants string) string {
	t.Helper()
	var super bool
	if err := admin.QueryRow(ctx, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&super); err != nil || !super {
		t.Fatalf("the lock integrity tests create roles: they need a superuser DSN (rolsuper %v, %v)", super, err)
	}
	role := fmt.Sprintf("%s_%d_%04d", prefix, time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	id := pgx.Identifier{role}.Sanitize()
	if _, err := admin.Exec(ctx, "CREATE ROLE "+id+" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, stmt := range []string{"REASSIGN OWNED BY " + id + " TO CURRENT_USER", "DROP OWNED BY " + id + " CASCADE", "DROP ROLE IF EXISTS " + id} {
			if _, err := admin.Exec(ctx, stmt); err != nil {
				t.Logf("%s: %v", stmt, err)
			}
		}
	})
	if grants != "" {
		if _, err := admin.Exec(ctx, strings.ReplaceAll(grants, "%s", id)); err != nil {
			t.Fatal(err)
		}
	}
	return role
}

// poolAs opens a pool on dsn as role, closed when t ends (before the role is
// dropped: cleanups run last-registered first).
func poolAs(t *testing.T, dsn, role string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return pgtest.PoolFor(t, u.String())
}

// lockRows is every row of pgfence.locks as JSON, ordered by name.
func lockRows(t *testing.T, ctx context.Context, db *pgxpool.Pool) string {
	t.Helper()
	var s string
	if err := db.QueryRow(ctx, "SELECT coalesce(jsonb_agg(to_jsonb(l) ORDER BY l.name), '[]')::text FROM pgfence.locks l").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// integritySetup returns a migrated database's admin pool (superuser, owner
// of pgfence.locks), a pool as a role with exactly docs/migrations.md's run-time
// grants plus SELECT, UPDATE on a guarded table integ_items (one row, id 1,
// governed by lock "victim"), and that role's name.
func integritySetup(t *testing.T, ctx context.Context) (dsn string, admin, app *pgxpool.Pool, role string) {
	t.Helper()
	dsn = pgtest.DSN(t)
	admin = pgtest.PoolFor(t, dsn)
	if _, err := admin.Exec(ctx, `
		CREATE TABLE integ_items (id int PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO integ_items VALUES (1, 'new', 0);
		SELECT pgfence.guard('integ_items', lock_name => 'victim')`); err != nil {
		t.Fatal(err)
	}
	role = integRole(t, ctx, admin, "pgfence_integ_app", readmeGrants(t)+"GRANT SELECT, UPDATE ON integ_items TO %s;")
	return dsn, admin, poolAs(t, dsn, role), role
}

func newIntegLocker(t *testing.T, pool *pgxpool.Pool, cfg pglock.Config) *pglock.Locker {
	t.Helper()
	l, err := pglock.New(pool, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// TestLockIntegrityProbes: as a role with exactly docs/migrations.md's grants, every
// way of writing pgfence.locks other than pglock's grant, renewal, release and
// wait mark is refused with PF009 or PF010, and nothing changes: forged,
// lowered, skipped and reset tokens, stolen, extended, revived and shortened
// leases, and the ways around the trigger (DDL, another trigger,
// session_replication_role). The victim's lease and fenced writes work
// afterwards, a forged token is still refused by the guard, and a name
// probed with the bigint maximum is granted normally.
func TestLockIntegrityProbes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, app, role := integritySetup(t, ctx)

	// victim: held by "victim" at token 3; free: released at token 1;
	// expired: granted for 200 ms at token 1 and left to expire.
	victimL := newIntegLocker(t, app, pglock.Config{Holder: "victim"})
	for range 2 {
		s, err := victimL.TryAcquire(ctx, "victim", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	victim, err := victimL.TryAcquire(ctx, "victim", time.Minute)
	if err != nil || victim.Token() != 3 {
		t.Fatalf("victim lease: %v (token %d)", err, tokenOf(victim))
	}
	other := newIntegLocker(t, app, pglock.Config{Holder: "other"})
	s, err := other.TryAcquire(ctx, "free", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := other.TryAcquire(ctx, "expired", 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	tbl, err := fencedwrite.Prepare(ctx, app, fencedwrite.Spec{Table: "integ_items", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}

	const grantTo = `holder = 'mallory', acquired_at = now(), renewed_at = NULL, expires_at = now() + interval '1 minute'`
	probes := []struct {
		name, sql string
		code      string
		lock      string // the lock the error must name; "" = not checked
		says      string // more text the error must contain
	}{
		// Tokens.
		{"forge a high token", "UPDATE pgfence.locks SET token = 1000000 WHERE name = 'victim'", sqlStateTokenIntegrity, "victim", "token 3 -> 1000000"},
		{"forge every token", "UPDATE pgfence.locks SET token = 1000000", sqlStateTokenIntegrity, "", "-> 1000000"},
		{"lower a held lock's token", "UPDATE pgfence.locks SET token = token - 1 WHERE name = 'victim'", sqlStateTokenIntegrity, "victim", "token 3 -> 2"},
		{"lower a free lock's token", "UPDATE pgfence.locks SET token = token - 1 WHERE name = 'free'", sqlStateTokenIntegrity, "free", "token 1 -> 0"},
		{"reset a token", "UPDATE pgfence.locks SET token = 0 WHERE name = 'victim'", sqlStateTokenIntegrity, "victim", "never go down"},
		{"null a token", "UPDATE pgfence.locks SET token = NULL WHERE name = 'victim'", sqlStateTokenIntegrity, "victim", "-> NULL"},
		{"grant of a free lock by 2", "UPDATE pgfence.locks SET token = token + 2, " + grantTo + " WHERE name = 'free'", sqlStateTokenIntegrity, "free", "exactly 1"},
		{"raise a held lock's token", "UPDATE pgfence.locks SET token = token + 1 WHERE name = 'victim'", sqlStateLeaseRule, "victim", "held by 'victim'"},
		{"raise a free lock's token without a grant", "UPDATE pgfence.locks SET token = token + 1 WHERE name = 'free'", sqlStateLeaseRule, "free", "token 1 -> 2"},
		{"rename a lock", "UPDATE pgfence.locks SET name = 'renamed' WHERE name = 'victim'", sqlStateTokenIntegrity, "victim", "keeps its name"},
		{"insert the bigint maximum", "INSERT INTO pgfence.locks (name, token) VALUES ('huge', 9223372036854775807)", sqlStateTokenIntegrity, "huge", "token 9223372036854775807"},
		{"insert a granted row at the bigint maximum", "INSERT INTO pgfence.locks (name, token, holder, acquired_at, expires_at) VALUES ('huge', 9223372036854775807, 'mallory', now(), now() + interval '1 minute')", sqlStateTokenIntegrity, "huge", "starts at token 1"},
		{"insert a row at token 0", "INSERT INTO pgfence.locks (name) VALUES ('zero')", sqlStateTokenIntegrity, "zero", "token 0"},
		{"upsert a token", "INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, expires_at) VALUES ('victim', 1, 'mallory', now(), now() + interval '1 minute') ON CONFLICT (name) DO UPDATE SET token = 1000000", sqlStateTokenIntegrity, "victim", "token 3 -> 1000000"},

		// Leases.
		{"steal a held lease for 100 years", "UPDATE pgfence.locks SET holder = 'mallory', expires_at = now() + interval '100 years' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "holder 'victim' -> 'mallory'"},
		{"steal a held lease like a renewal", "UPDATE pgfence.locks SET holder = 'mallory', renewed_at = now(), expires_at = now() + interval '1 minute' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "holder 'victim' -> 'mallory'"},
		{"grant a held lease", "UPDATE pgfence.locks SET token = token + 1, " + grantTo + " WHERE name = 'victim'", sqlStateLeaseRule, "victim", "held by 'victim'"},
		{"grant a free lock for 100 years", "UPDATE pgfence.locks SET token = token + 1, holder = 'mallory', acquired_at = now(), renewed_at = NULL, expires_at = now() + interval '100 years' WHERE name = 'free'", sqlStateLeaseRule, "free", "at most 24 hours"},
		{"insert a first grant for 100 years", "INSERT INTO pgfence.locks (name, token, holder, acquired_at, expires_at) VALUES ('new', 1, 'mallory', now(), now() + interval '100 years')", sqlStateLeaseRule, "new", "at most 24 hours"},
		{"extend someone else's lease by 100 years", "UPDATE pgfence.locks SET renewed_at = now(), expires_at = now() + interval '100 years' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "a renewal"},
		{"extend without marking the renewal", "UPDATE pgfence.locks SET expires_at = expires_at + interval '1 minute' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "a renewal"},
		{"cut someone else's lease short", "UPDATE pgfence.locks SET renewed_at = now(), expires_at = now() - interval '1 second' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "a renewal"},
		{"revive an expired lease", "UPDATE pgfence.locks SET renewed_at = now(), expires_at = now() + interval '1 minute' WHERE name = 'expired'", sqlStateLeaseRule, "expired", "expired since"},
		{"take an expired lease without a grant", "UPDATE pgfence.locks SET holder = 'mallory', expires_at = now() + interval '1 minute' WHERE name = 'expired'", sqlStateLeaseRule, "expired", "only a grant"},
		{"take a free lock without a grant", "UPDATE pgfence.locks SET " + grantTo + " WHERE name = 'free'", sqlStateLeaseRule, "free", "only a grant"},
		{"backdate a grant", "UPDATE pgfence.locks SET acquired_at = now() - interval '1 hour' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "acquired_at"},
		{"release without clearing the expiry", "UPDATE pgfence.locks SET holder = NULL WHERE name = 'victim'", sqlStateLeaseRule, "victim", "a release"},
		{"wait mark in the future", "UPDATE pgfence.locks SET waiting_since = now() + interval '1 day' WHERE name = 'victim'", sqlStateLeaseRule, "victim", "wait mark"},
		{"metadata of a free lock", `UPDATE pgfence.locks SET metadata = '{"x": 1}' WHERE name = 'free'`, sqlStateLeaseRule, "free", "only a grant"},
	}
	before := lockRows(t, ctx, admin)
	for _, p := range probes {
		_, err := app.Exec(ctx, p.sql)
		if got := sqlState(err); got != p.code {
			t.Errorf("%s: SQLSTATE %q (%v), want %s", p.name, got, err, p.code)
		} else {
			msg := err.Error()
			if p.lock != "" && !strings.Contains(msg, "lock '"+p.lock+"'") {
				t.Errorf("%s: the error does not name lock %q: %s", p.name, p.lock, msg)
			}
			if !strings.Contains(msg, p.says) {
				t.Errorf("%s: the error does not say %q: %s", p.name, p.says, msg)
			}
		}
		if after := lockRows(t, ctx, admin); after != before {
			t.Fatalf("%s changed pgfence.locks:\nbefore %s\nafter  %s", p.name, before, after)
		}
	}

	// COPY fires the same trigger.
	_, err = app.CopyFrom(ctx, pgx.Identifier{"pgfence", "locks"}, []string{"name", "token"},
		pgx.CopyFromRows([][]any{{"copied", int64(1) << 62}}))
	if got := sqlState(err); got != sqlStateTokenIntegrity {
		t.Errorf("COPY of a forged token: SQLSTATE %q (%v), want %s", got, err, sqlStateTokenIntegrity)
	}

	// No way around the trigger for this role.
	for _, stmt := range []string{
		"ALTER TABLE pgfence.locks DISABLE TRIGGER locks_integrity",
		"ALTER TABLE pgfence.locks DISABLE TRIGGER USER",
		"DROP TRIGGER locks_integrity ON pgfence.locks",
		"CREATE TRIGGER a_first BEFORE UPDATE ON pgfence.locks FOR EACH ROW EXECUTE FUNCTION pgfence.locks_integrity()",
		"SET session_replication_role = replica",
		"DELETE FROM pgfence.locks WHERE name = 'free'",
		"TRUNCATE pgfence.locks",
		"CREATE OR REPLACE FUNCTION pgfence.locks_integrity() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$",
	} {
		if _, err := app.Exec(ctx, stmt); err == nil {
			t.Errorf("%s succeeded as %s", stmt, role)
		}
	}
	if after := lockRows(t, ctx, admin); after != before {
		t.Fatalf("pgfence.locks changed:\nbefore %s\nafter  %s", before, after)
	}

	// A multi-statement transaction gets no further: the first refused
	// statement aborts it.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE pgfence.locks SET holder = NULL, expires_at = NULL, renewed_at = NULL WHERE name = 'victim'"); err != nil {
		t.Fatalf("a release in a transaction: %v", err)
	}
	if _, err := tx.Exec(ctx, "UPDATE pgfence.locks SET token = token + 2 WHERE name = 'victim'"); sqlState(err) != sqlStateTokenIntegrity {
		t.Errorf("skip a token after a release in one transaction: %v", err)
	}
	_ = tx.Rollback(ctx)
	if after := lockRows(t, ctx, admin); after != before {
		t.Fatalf("pgfence.locks changed:\nbefore %s\nafter  %s", before, after)
	}

	// The guard still refuses the token that could not be forged; the
	// victim's lease and fenced writes work.
	if _, err := tbl.Update(ctx, app, 1000000, []any{1}, []any{"forged"}); !errors.Is(err, fencedwrite.ErrGuardRejected) {
		t.Errorf("fenced write with token 1000000: %v, want ErrGuardRejected", err)
	}
	if err := victim.Renew(ctx); err != nil {
		t.Fatalf("the victim's renewal after the probes: %v", err)
	}
	if _, err := tbl.Update(ctx, app, victim.Token(), []any{1}, []any{"victim"}); err != nil {
		t.Fatalf("the victim's fenced write: %v", err)
	}
	var v string
	var fence int64
	if err := admin.QueryRow(ctx, "SELECT v, fence FROM integ_items WHERE id = 1").Scan(&v, &fence); err != nil || v != "victim" || fence != victim.Token() {
		t.Fatalf("integ_items row 1: %q fence %d (%v), want %q fence %d", v, fence, err, "victim", victim.Token())
	}
	if err := victim.Release(ctx); err != nil {
		t.Fatalf("the victim's release: %v", err)
	}
	// The names probed with forged inserts are granted from token 1.
	for _, name := range []string{"huge", "zero", "copied"} {
		s, err := other.TryAcquire(ctx, name, time.Minute)
		if err != nil || s.Token() != 1 {
			t.Fatalf("first grant of %q after the probes: %v (token %d), want token 1", name, err, tokenOf(s))
		}
		_ = s.Release(ctx)
	}
}

// TestLockIntegrityAppPaths: with the trigger in place, everything pglock,
// fencedwrite and skiplocked do works as a role with exactly docs/migrations.md's
// grants: first grant, grant of a free and of an expired lease, renewal,
// keep-alive, Adopt, RenewToken and ReleaseToken, release, AcquireMany, the
// longest TTL, a waiter's wait mark and the release's NOTIFY, fenced writes
// (a stale token refused) and job claims.
func TestLockIntegrityAppPaths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, app, _ := integritySetup(t, ctx)

	a := newIntegLocker(t, app, pglock.Config{Holder: "a"})
	b := newIntegLocker(t, app, pglock.Config{Holder: "b"})

	// First grant, renewal, release, grant of a free lock.
	s, err := a.Acquire(ctx, "victim", time.Minute)
	if err != nil || s.Token() != 1 {
		t.Fatalf("first grant: %v", err)
	}
	if err := s.Renew(ctx); err != nil {
		t.Fatalf("renew: %v", err)
	}
	tbl, err := fencedwrite.Prepare(ctx, app, fencedwrite.Spec{Table: "integ_items", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, app, s.Token(), []any{1}, []any{"a"}); err != nil {
		t.Fatalf("fenced write: %v", err)
	}
	old := s.Token()
	if err := s.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	s, err = b.TryAcquire(ctx, "victim", time.Minute)
	if err != nil || s.Token() != old+1 {
		t.Fatalf("grant of a free lock: %v (token %d, want %d)", err, tokenOf(s), old+1)
	}
	if _, err := tbl.Update(ctx, app, s.Token(), []any{1}, []any{"b"}); err != nil {
		t.Fatalf("fenced write: %v", err)
	}
	if _, err := tbl.Update(ctx, app, old, []any{1}, []any{"stale"}); !errors.Is(err, fencedwrite.ErrStaleToken) {
		t.Fatalf("fenced write with the released token: %v, want ErrStaleToken", err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// Grant of an expired lease.
	if _, err := a.TryAcquire(ctx, "exp", 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	s, err = b.TryAcquire(ctx, "exp", time.Minute)
	if err != nil || s.Token() != 2 {
		t.Fatalf("grant of an expired lease: %v (token %d)", err, tokenOf(s))
	}
	_ = s.Release(ctx)

	// The longest TTL, renewed.
	s, err = a.TryAcquire(ctx, "max", pglock.MaxTTL)
	if err != nil {
		t.Fatalf("grant for MaxTTL: %v", err)
	}
	if err := s.Renew(ctx); err != nil {
		t.Fatalf("renewal for MaxTTL: %v", err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// RenewToken, ReleaseToken and Adopt (the CLI's and reconciliation's paths).
	s, err = a.TryAcquire(ctx, "tok", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	a2 := newIntegLocker(t, app, pglock.Config{Holder: "a"})
	if _, err := a2.RenewToken(ctx, "tok", "a", s.Token(), time.Minute); err != nil {
		t.Fatalf("RenewToken: %v", err)
	}
	adopted, err := a2.Adopt(ctx, "tok", s.Token(), time.Minute)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	if err := adopted.Release(ctx); err != nil {
		t.Fatalf("release of an adopted lease: %v", err)
	}
	s, err = a.TryAcquire(ctx, "tok", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := a2.ReleaseToken(ctx, "tok", "a", s.Token()); err != nil {
		t.Fatalf("ReleaseToken: %v", err)
	}

	// AcquireMany.
	many, err := b.AcquireMany(ctx, []string{"m:1", "m:2", "m:3"}, time.Minute)
	if err != nil {
		t.Fatalf("AcquireMany: %v", err)
	}
	for _, s := range many {
		if err := s.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}

	// Keep-alive: a 1.5 s lease renewed every 0.5 s outlives three TTLs.
	ka := newIntegLocker(t, app, pglock.Config{Holder: "ka", KeepAlive: true})
	s, err = ka.TryAcquire(ctx, "ka", 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(4500 * time.Millisecond)
	if err := s.Err(); err != nil {
		t.Fatalf("keep-alive lease after three TTLs: %v", err)
	}
	var renewed bool
	if err := admin.QueryRow(ctx, "SELECT renewed_at IS NOT NULL AND expires_at > now() FROM pgfence.locks WHERE name = 'ka'").Scan(&renewed); err != nil || !renewed {
		t.Fatalf("keep-alive: renewed and held %v (%v)", renewed, err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A waiter marks the held lock; the release notifies it, so it gets the
	// lock long before the holder's 1-minute expiry.
	held, err := a.TryAcquire(ctx, "wait", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		s   *pglock.Lease
		err error
	}
	got := make(chan result, 1)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() {
		s, err := b.Acquire(wctx, "wait", time.Minute)
		got <- result{s, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var marked bool
		if err := admin.QueryRow(ctx, "SELECT waiting_since IS NOT NULL FROM pgfence.locks WHERE name = 'wait'").Scan(&marked); err != nil {
			t.Fatal(err)
		}
		if marked {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the waiter's mark never appeared")
		}
		time.Sleep(10 * time.Millisecond)
	}
	released := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		t.Fatalf("waiter: %v", r.err)
	}
	if r.s.Token() != held.Token()+1 {
		t.Fatalf("waiter's token %d, want %d", r.s.Token(), held.Token()+1)
	}
	if took := time.Since(released); took > 10*time.Second {
		t.Errorf("the waiter took %v after the release: not woken by its NOTIFY", took)
	}
	_ = r.s.Release(ctx)

	// Job claims.
	if _, err := skiplocked.Enqueue(ctx, app, skiplocked.EnqueueParams{Queue: "q", Payload: []byte(`{}`)}); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	jobs, err := skiplocked.Claim(ctx, app, skiplocked.ClaimParams{Queue: "q", Holder: "w", Limit: 1, TTL: time.Minute})
	if err != nil || len(jobs) != 1 {
		t.Fatalf("claim: %v %d", err, len(jobs))
	}
	if err := skiplocked.Complete(ctx, app, jobs[0].Ref()); err != nil {
		t.Fatalf("complete: %v", err)
	}
}

// TestLockIntegrityContended: eight lockers of the documented role hand one lock
// to each other (grants, waiters' marks and notifies, renewals, releases all
// racing) and the trigger refuses none of it; the tokens issued are exactly
// 1..n.
func TestLockIntegrityContended(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, app, _ := integritySetup(t, ctx)
	const workers, rounds = 8, 15
	var issued atomic.Int64
	errs := make(chan error, workers)
	for w := range workers {
		l := newIntegLocker(t, app, pglock.Config{Holder: fmt.Sprintf("w%d", w)})
		go func() {
			for range rounds {
				actx, cancel := context.WithTimeout(ctx, 30*time.Second)
				s, err := l.Acquire(actx, "hot", 5*time.Second)
				cancel()
				if err != nil {
					errs <- err
					return
				}
				issued.Add(1)
				if err := s.Renew(ctx); err != nil {
					errs <- err
					return
				}
				if err := s.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatalf("a worker failed: %v", err)
		}
	}
	var token int64
	if err := admin.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = 'hot'").Scan(&token); err != nil || token != issued.Load() {
		t.Fatalf("token %d after %d grants (%v)", token, issued.Load(), err)
	}
}

// TestLockIntegrityOwnerMaintenance: the table's owner, a member of the
// owner's role and a superuser may change lock rows freely (the epoch bump
// after a failover, clearing a lease, deleting a row); the documented role may
// not, even with the owner changed; a role granted DELETE and TRUNCATE is
// refused by the trigger.
func TestLockIntegrityOwnerMaintenance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, admin, app, _ := integritySetup(t, ctx)
	l := newIntegLocker(t, app, pglock.Config{Holder: "app"})
	s, err := l.TryAcquire(ctx, "victim", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	const epoch = int64(1) << 32
	bump := "UPDATE pgfence.locks SET token = token + $1"

	// The documented role cannot bump.
	if _, err := app.Exec(ctx, bump, epoch); sqlState(err) != sqlStateTokenIntegrity {
		t.Fatalf("epoch bump as the app role: %v, want %s", err, sqlStateTokenIntegrity)
	}
	// A superuser can.
	if _, err := admin.Exec(ctx, bump, epoch); err != nil {
		t.Fatalf("epoch bump as a superuser: %v", err)
	}
	// So can a non-superuser owner, and a member of the owner's role.
	owner := integRole(t, ctx, admin, "pgfence_integ_owner", "GRANT USAGE ON SCHEMA pgfence TO %s; ALTER TABLE pgfence.locks OWNER TO %s;")
	dba := integRole(t, ctx, admin, "pgfence_integ_dba", "GRANT "+pgx.Identifier{owner}.Sanitize()+" TO %s;")
	ownerPool, dbaPool := poolAs(t, dsn, owner), poolAs(t, dsn, dba)
	if _, err := ownerPool.Exec(ctx, bump, epoch); err != nil {
		t.Fatalf("epoch bump as the owner (no superuser): %v", err)
	}
	if _, err := dbaPool.Exec(ctx, bump, epoch); err != nil {
		t.Fatalf("epoch bump as a member of the owner's role: %v", err)
	}
	if _, err := app.Exec(ctx, bump, epoch); sqlState(err) != sqlStateTokenIntegrity {
		t.Fatalf("epoch bump as the app role after the owner changed: %v, want %s", err, sqlStateTokenIntegrity)
	}
	var token int64
	if err := admin.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = 'victim'").Scan(&token); err != nil || token != 1+3*epoch {
		t.Fatalf("token after three bumps: %d (%v), want %d", token, err, 1+3*epoch)
	}
	// The old holder's lease is lost: its renewal names token 1.
	if err := s.Renew(ctx); !errors.Is(err, pglock.ErrLeaseLost) {
		t.Fatalf("renewal of the pre-bump lease: %v, want ErrLeaseLost", err)
	}
	// The owner clears the lease by hand; the next grant is above the bump.
	if _, err := ownerPool.Exec(ctx, "UPDATE pgfence.locks SET holder = NULL, expires_at = NULL WHERE name = 'victim'"); err != nil {
		t.Fatalf("clearing a lease as the owner: %v", err)
	}
	s, err = l.TryAcquire(ctx, "victim", time.Minute)
	if err != nil || s.Token() != 2+3*epoch {
		t.Fatalf("grant after the bump: %v (token %d, want %d)", err, tokenOf(s), 2+3*epoch)
	}
	_ = s.Release(ctx)

	// A role granted DELETE and TRUNCATE (beyond docs/migrations.md) is refused by
	// the trigger; the owner may delete.
	sloppy := integRole(t, ctx, admin, "pgfence_integ_sloppy", "GRANT USAGE ON SCHEMA pgfence TO %s; GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON pgfence.locks TO %s;")
	sloppyPool := poolAs(t, dsn, sloppy)
	before := lockRows(t, ctx, admin)
	if _, err := sloppyPool.Exec(ctx, "DELETE FROM pgfence.locks WHERE name = 'victim'"); sqlState(err) != sqlStateTokenIntegrity || !strings.Contains(err.Error(), "lock 'victim'") {
		t.Errorf("DELETE with a DELETE grant: %v, want %s naming the lock", err, sqlStateTokenIntegrity)
	}
	if _, err := sloppyPool.Exec(ctx, "TRUNCATE pgfence.locks"); sqlState(err) != sqlStateTokenIntegrity {
		t.Errorf("TRUNCATE with a TRUNCATE grant: %v, want %s", err, sqlStateTokenIntegrity)
	}
	if after := lockRows(t, ctx, admin); after != before {
		t.Fatalf("pgfence.locks changed:\nbefore %s\nafter  %s", before, after)
	}
	if tag, err := ownerPool.Exec(ctx, "DELETE FROM pgfence.locks WHERE name = 'victim'"); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("DELETE as the owner: %v %v", tag, err)
	}
}

// TestLockIntegrityStateMachine tries every combination of new values for
// token, holder, acquired_at, renewed_at, expires_at and waiting_since on a
// free, a held and an expired lock (4860 UPDATEs) and for a new row (384
// INSERTs), as the documented role, each in a subtransaction that is rolled
// back, and checks each outcome against the documented table: a grant
// (token + 1 of a free or expired lease, with a holder, acquired_at =
// now(), renewed_at NULL and an expiry within 24 hours, waiting_since kept),
// a renewal, a release or a wait mark of a held lease, no change at all, or
// a first grant (a new row at token 1); everything else fails with PF009
// (the token does not go up by exactly 1, a new row not at token 1) or
// PF010.
func TestLockIntegrityStateMachine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, app, _ := integritySetup(t, ctx)
	if _, err := admin.Exec(ctx, `INSERT INTO pgfence.locks (name, token, holder, acquired_at, renewed_at, expires_at, waiting_since) VALUES
		('m:free',    5, NULL, now() - interval '1 hour',    NULL,                          NULL,                         now() - interval '10 seconds'),
		('m:held',    5, 'h',  now() - interval '1 minute',  now() - interval '30 seconds', now() + interval '1 hour',    now() - interval '10 seconds'),
		('m:expired', 5, 'h',  now() - interval '2 minutes', NULL,                          now() - interval '1 minute',  NULL)`); err != nil {
		t.Fatal(err)
	}
	conn, err := app.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `
		CREATE TEMP TABLE integ_outcomes (state text, tk text, ho text, aq text, rn text, ex text, ws text, code text);
		DO $do$
		DECLARE
			st text; tk text; ho text; aq text; rn text; ex text; ws text; code text;
		BEGIN
			FOREACH st IN ARRAY ARRAY['free', 'held', 'expired'] LOOP
			FOREACH tk IN ARRAY ARRAY['token', 'token + 1', 'token + 2', 'token - 1'] LOOP
			FOREACH ho IN ARRAY ARRAY['holder', 'NULL', '''x'''] LOOP
			FOREACH aq IN ARRAY ARRAY['acquired_at', 'now()', 'now() - interval ''1 hour'''] LOOP
			FOREACH rn IN ARRAY ARRAY['renewed_at', 'NULL', 'now()'] LOOP
			FOREACH ex IN ARRAY ARRAY['expires_at', 'NULL', 'now() + interval ''1 minute''', 'now() + interval ''25 hours''',
			                          'now() - interval ''1 second'''] LOOP
			FOREACH ws IN ARRAY ARRAY['waiting_since', 'now()', 'NULL'] LOOP
				BEGIN
					EXECUTE format('UPDATE pgfence.locks SET token = %s, holder = %s, acquired_at = %s, renewed_at = %s, '
					               'expires_at = %s, waiting_since = %s WHERE name = %L', tk, ho, aq, rn, ex, ws, 'm:' || st);
					RAISE EXCEPTION 'integ: allowed';
				EXCEPTION WHEN OTHERS THEN
					code := CASE WHEN SQLERRM = 'integ: allowed' THEN 'ok' ELSE SQLSTATE END;
				END;
				INSERT INTO integ_outcomes VALUES (st, tk, ho, aq, rn, ex, ws, code);
			END LOOP; END LOOP; END LOOP; END LOOP; END LOOP; END LOOP; END LOOP;
		END
		$do$`); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, "SELECT state, tk, ho, aq, rn, ex, ws, code FROM integ_outcomes")
	if err != nil {
		t.Fatal(err)
	}
	type combo struct{ State, Tk, Ho, Aq, Rn, Ex, Ws, Code string }
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[combo])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "DROP TABLE integ_outcomes"); err != nil {
		t.Fatal(err)
	}
	if len(all) != 3*4*3*3*3*5*3 {
		t.Fatalf("%d outcomes, want %d", len(all), 3*4*3*3*3*5*3)
	}
	// The columns that are NULL in each old row.
	oldNull := map[string]map[string]bool{
		"free":    {"holder": true, "renewed_at": true, "expires_at": true},
		"held":    {},
		"expired": {"renewed_at": true, "waiting_since": true},
	}
	allowed, bad := 0, 0
	for _, c := range all {
		col := map[string]string{"holder": c.Ho, "acquired_at": c.Aq, "renewed_at": c.Rn, "expires_at": c.Ex, "waiting_since": c.Ws}
		// same: the new value is the old one (the column itself, or NULL for NULL).
		same := func(name string) bool { return col[name] == name || (col[name] == "NULL" && oldNull[c.State][name]) }
		null := func(name string) bool { return col[name] == "NULL" || (col[name] == name && oldNull[c.State][name]) }
		delta := map[string]int{"token": 0, "token + 1": 1, "token + 2": 2, "token - 1": -1}[c.Tk]
		held := c.State == "held"
		// An expiry after now() and at most 24 hours later: the held lock's
		// old one (in an hour) or now() + 1 minute.
		inTTL := c.Ex == "now() + interval '1 minute'" || (held && same("expires_at"))
		var ok bool
		switch {
		case delta != 0:
			ok = delta == 1 && !held && !null("holder") && c.Aq == "now()" && null("renewed_at") && inTTL && same("waiting_since")
		case held:
			release := null("holder") && null("expires_at") && null("renewed_at") && same("waiting_since")
			mark := same("holder") && same("expires_at") && same("renewed_at") && (same("waiting_since") || c.Ws == "now()")
			renew := same("holder") && c.Rn == "now()" && inTTL && same("waiting_since")
			ok = same("acquired_at") && (release || mark || renew)
		default:
			ok = same("holder") && same("acquired_at") && same("renewed_at") && same("expires_at") && same("waiting_since")
		}
		want := "ok"
		switch {
		case !ok && (delta < 0 || delta > 1):
			want = sqlStateTokenIntegrity
		case !ok:
			want = sqlStateLeaseRule
		case null("holder") != null("expires_at"):
			want = "23514" // CHECK locks_holder_has_expiry
		}
		if want == "ok" {
			allowed++
		}
		if c.Code != want {
			bad++
			if bad <= 20 {
				t.Errorf("%s lock: SET token = %s, holder = %s, acquired_at = %s, renewed_at = %s, expires_at = %s, waiting_since = %s: %s, want %s",
					c.State, c.Tk, c.Ho, c.Aq, c.Rn, c.Ex, c.Ws, c.Code, want)
			}
		}
	}
	// The same for a new row: only a first grant is allowed.
	if _, err := conn.Exec(ctx, `
		CREATE TEMP TABLE integ_inserts (tk text, ho text, aq text, rn text, ex text, ws text, code text);
		DO $do$
		DECLARE
			tk text; ho text; aq text; rn text; ex text; ws text; code text;
		BEGIN
			FOREACH tk IN ARRAY ARRAY['0', '1', '2', '9223372036854775807'] LOOP
			FOREACH ho IN ARRAY ARRAY['NULL', '''x'''] LOOP
			FOREACH aq IN ARRAY ARRAY['NULL', 'now()', 'now() - interval ''1 hour'''] LOOP
			FOREACH rn IN ARRAY ARRAY['NULL', 'now()'] LOOP
			FOREACH ex IN ARRAY ARRAY['NULL', 'now() + interval ''1 minute''', 'now() + interval ''25 hours''',
			                          'now() - interval ''1 second'''] LOOP
			FOREACH ws IN ARRAY ARRAY['NULL', 'now()'] LOOP
				BEGIN
					EXECUTE format('INSERT INTO pgfence.locks (name, token, holder, acquired_at, renewed_at, expires_at, waiting_since) '
					               'VALUES (''m:new'', %s, %s, %s, %s, %s, %s)', tk, ho, aq, rn, ex, ws);
					RAISE EXCEPTION 'integ: allowed';
				EXCEPTION WHEN OTHERS THEN
					code := CASE WHEN SQLERRM = 'integ: allowed' THEN 'ok' ELSE SQLSTATE END;
				END;
				INSERT INTO integ_inserts VALUES (tk, ho, aq, rn, ex, ws, code);
			END LOOP; END LOOP; END LOOP; END LOOP; END LOOP; END LOOP;
		END
		$do$`); err != nil {
		t.Fatal(err)
	}
	rows, err = conn.Query(ctx, "SELECT tk, ho, aq, rn, ex, ws, code FROM integ_inserts")
	if err != nil {
		t.Fatal(err)
	}
	type insert struct{ Tk, Ho, Aq, Rn, Ex, Ws, Code string }
	inserts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[insert])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "DROP TABLE integ_inserts"); err != nil {
		t.Fatal(err)
	}
	if len(inserts) != 4*2*3*2*4*2 {
		t.Fatalf("%d insert outcomes, want %d", len(inserts), 4*2*3*2*4*2)
	}
	insertsAllowed := 0
	for _, c := range inserts {
		want := "ok"
		switch {
		case c.Tk != "1":
			want = sqlStateTokenIntegrity
		case !(c.Ho != "NULL" && c.Aq == "now()" && c.Rn == "NULL" && c.Ex == "now() + interval '1 minute'" && c.Ws == "NULL"):
			want = sqlStateLeaseRule
		default:
			insertsAllowed++
		}
		if c.Code != want {
			bad++
			t.Errorf("INSERT token %s, holder %s, acquired_at %s, renewed_at %s, expires_at %s, waiting_since %s: %s, want %s",
				c.Tk, c.Ho, c.Aq, c.Rn, c.Ex, c.Ws, c.Code, want)
		}
	}
	if insertsAllowed != 1 {
		t.Errorf("%d first grants allowed, want 1", insertsAllowed)
	}
	if bad > 0 {
		t.Errorf("%d of %d outcomes differ from the documented state machine", bad, len(all)+len(inserts))
	}
	if allowed < 10 {
		t.Errorf("only %d combinations allowed: the battery misses pglock's own changes", allowed)
	}
	t.Logf("%d UPDATEs, %d allowed; %d INSERTs, %d allowed", len(all), allowed, len(inserts), insertsAllowed)
}

// BenchmarkLockIntegrity measures pglock's grant, renewal and release with
// the lock table's integrity trigger and without it (disabled in a second
// database of the same server), interleaved operation by operation on one
// connection each so that both see the same load. It reports µs per
// operation (round trip included) for each, and the ratios with/without.
//
//	go test -run '^$' -bench LockIntegrity -count 5 ./internal/faultsuite/
func BenchmarkLockIntegrity(b *testing.B) {
	ctx := context.Background()
	lockers := [2]*pglock.Locker{integrityLocker(b, false, 1), integrityLocker(b, true, 1)} // 0: trigger on, 1: off
	var took [2][3]time.Duration                                                            // [on/off][grant, renew, release]
	leases := make([]*pglock.Lease, 2)
	b.ResetTimer()
	for n := range b.N {
		order := []int{n % 2, 1 - n%2} // alternate which goes first
		for _, i := range order {
			t0 := time.Now()
			s, err := lockers[i].TryAcquire(ctx, "bench", time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			took[i][0] += time.Since(t0)
			leases[i] = s
		}
		for _, i := range order {
			t0 := time.Now()
			if err := leases[i].Renew(ctx); err != nil {
				b.Fatal(err)
			}
			took[i][1] += time.Since(t0)
		}
		for _, i := range order {
			t0 := time.Now()
			if err := leases[i].Release(ctx); err != nil {
				b.Fatal(err)
			}
			took[i][2] += time.Since(t0)
		}
	}
	b.StopTimer()
	for k, op := range []string{"grant", "renew", "release"} {
		on := float64(took[0][k].Microseconds()) / float64(b.N)
		off := float64(took[1][k].Microseconds()) / float64(b.N)
		b.ReportMetric(on, "µs/"+op+"-on")
		b.ReportMetric(off, "µs/"+op+"-off")
		b.ReportMetric(on/off, "ratio-"+op)
	}
}

// integrityLocker returns a polling Locker on a fresh database of the test
// server, with the integrity trigger of pgfence.locks disabled if off, on a
// pool of conns connections, warmed up: the row "bench" exists and the
// statements are prepared on every connection in use.
func integrityLocker(b *testing.B, off bool, conns int32) *pglock.Locker {
	b.Helper()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	if off {
		if _, err := pool.Exec(ctx, "ALTER TABLE pgfence.locks DISABLE TRIGGER locks_integrity"); err != nil {
			b.Fatal(err)
		}
	}
	l, err := pglock.New(pool, &pglock.Config{Holder: "bench", PollOnly: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = l.Close() })
	// Warm up: the first grant inserts the row and prepares the statements.
	for range 10 {
		s, err := l.TryAcquire(ctx, "bench", time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Renew(ctx); err != nil {
			b.Fatal(err)
		}
		if err := s.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	return l
}

// BenchmarkLockIntegrityConcurrent is BenchmarkLockIntegrity's question at
// concurrency: 8 goroutines each loop TryAcquire + Release on a name of
// their own (the B1 shape), with the integrity trigger and without it (two
// databases of one server). Each iteration runs one phase of 25 cycles per
// goroutine on each database, in alternating order, so both see the same
// machine. It reports cycles per second for each and their ratio.
//
//	go test -run '^$' -bench LockIntegrityConcurrent -benchtime 40x ./internal/faultsuite/
func BenchmarkLockIntegrityConcurrent(b *testing.B) {
	const workers, cycles = 8, 25
	ctx := context.Background()
	lockers := [2]*pglock.Locker{integrityLocker(b, false, workers), integrityLocker(b, true, workers)} // 0: on, 1: off
	phase := func(l *pglock.Locker) (time.Duration, error) {
		errs := make(chan error, workers)
		start := time.Now()
		for w := range workers {
			go func() {
				name := fmt.Sprintf("bench-%d", w)
				for range cycles {
					s, err := l.TryAcquire(ctx, name, time.Minute)
					if err == nil {
						err = s.Release(ctx)
					}
					if err != nil {
						errs <- err
						return
					}
				}
				errs <- nil
			}()
		}
		var first error
		for range workers {
			if err := <-errs; err != nil && first == nil {
				first = err
			}
		}
		return time.Since(start), first
	}
	for _, l := range lockers { // create the rows, prepare on every connection
		if _, err := phase(l); err != nil {
			b.Fatal(err)
		}
	}
	var took [2]time.Duration
	b.ResetTimer()
	for n := range b.N {
		for _, i := range []int{n % 2, 1 - n%2} {
			d, err := phase(lockers[i])
			if err != nil {
				b.Fatal(err)
			}
			took[i] += d
		}
	}
	b.StopTimer()
	rate := func(d time.Duration) float64 { return float64(b.N*workers*cycles) / d.Seconds() }
	b.ReportMetric(rate(took[0]), "cycles/s-on")
	b.ReportMetric(rate(took[1]), "cycles/s-off")
	b.ReportMetric(rate(took[0])/rate(took[1]), "ratio-on/off")
}

// tokenOf is s's token, 0 for no lease.
func tokenOf(s *pglock.Lease) int64 {
	if s == nil {
		return 0
	}
	return s.Token()
}
