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

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// SQLSTATEs the door tests expect.
const (
	sqlStateDenied     = "42501" // insufficient_privilege
	sqlStateBadArgment = "PF011" // a lease function refused an argument
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
		t.Fatalf("the door tests create roles: they need a superuser DSN (rolsuper %v, %v)", super, err)
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

// TestLeaseDoorProbes: as a role with exactly docs/migrations.md's grants,
// every direct write to pgfence.locks and pgfence.lock_queue fails with
// permission denied, and the door's functions refuse everything but a grant
// of a free lease, a renewal or release with the lease's key, and a waiter's
// own queue row: a session that knows the victim's name, holder and token
// (all public) and the hash of its key (readable in the table) cannot renew,
// release, take over or hand itself the lease, nor read, leave or take over
// the victim's waiter; bad arguments fail with PF011 naming the argument.
// Nothing changes, and the victim's lease and fenced writes work afterwards.
func TestLeaseDoorProbes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, app, role := integritySetup(t, ctx)

	// victim: held by "victim" at token 3; free: released at token 1;
	// expired: granted for 200 ms at token 1 and left to expire; queued:
	// held by "other", with the victim's Locker waiting for it.
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
	held, err := other.TryAcquire(ctx, "queued", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	waitCtx, stopWaiting := context.WithCancel(ctx)
	defer stopWaiting()
	waited := make(chan error, 1)
	go func() {
		s, err := victimL.Acquire(waitCtx, "queued", time.Minute)
		if err == nil {
			_ = s.Release(context.Background())
		}
		waited <- err
	}()
	var wkey, waitID int64
	for deadline := time.Now().Add(30 * time.Second); ; {
		err := admin.QueryRow(ctx, "SELECT wkey, wait_id FROM pgfence.lock_queue WHERE name = 'queued' AND granted_token IS NULL").Scan(&wkey, &waitID)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) || time.Now().After(deadline) {
			t.Fatalf("the victim's wait never queued: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // "expired" is past its 200 ms
	tbl, err := fencedwrite.Prepare(ctx, app, fencedwrite.Spec{Table: "integ_items", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}
	var victimHash []byte
	if err := app.QueryRow(ctx, "SELECT key_hash FROM pgfence.locks WHERE name = 'victim'").Scan(&victimHash); err != nil || len(victimHash) != 32 {
		t.Fatalf("the lock row (readable by the app role) has key_hash %x (%v)", victimHash, err)
	}

	rows := func() string {
		t.Helper()
		var q string
		if err := admin.QueryRow(ctx, `SELECT coalesce(jsonb_agg(to_jsonb(q) - 'alive_until' ORDER BY q.wkey), '[]')::text
			FROM pgfence.lock_queue q`).Scan(&q); err != nil {
			t.Fatal(err)
		}
		return lockRows(t, ctx, admin) + " queue " + q
	}
	before := rows()

	// Direct writes: permission denied, whatever they would write.
	for _, stmt := range []string{
		"UPDATE pgfence.locks SET token = 1000000 WHERE name = 'victim'",
		"UPDATE pgfence.locks SET token = token - 1 WHERE name = 'victim'",
		"UPDATE pgfence.locks SET holder = 'mallory', expires_at = now() + interval '100 years' WHERE name = 'victim'",
		"UPDATE pgfence.locks SET key_hash = sha256('mallory''s key') WHERE name = 'victim'",
		"UPDATE pgfence.locks SET holder = NULL, key_hash = NULL, expires_at = NULL WHERE name = 'victim'",
		"INSERT INTO pgfence.locks (name, token) VALUES ('huge', 9223372036854775807)",
		"INSERT INTO pgfence.locks AS l (name, token) VALUES ('victim', 1) ON CONFLICT (name) DO UPDATE SET token = 1000000",
		"DELETE FROM pgfence.locks WHERE name = 'free'",
		"TRUNCATE pgfence.locks",
		"SELECT * FROM pgfence.lock_queue",
		"INSERT INTO pgfence.lock_queue (wkey, name, holder, key_hash, ttl_us, alive_until) VALUES (1, 'victim', 'mallory', sha256('k'), 1000000, now() + interval '1 hour')",
		"UPDATE pgfence.lock_queue SET ticket = DEFAULT",
		"DELETE FROM pgfence.lock_queue",
		"SELECT 1 FROM pgfence.locks WHERE name = 'victim' FOR UPDATE",
	} {
		if _, err := app.Exec(ctx, stmt); sqlState(err) != sqlStateDenied {
			t.Errorf("%s as %s: %v, want SQLSTATE %s", stmt, role, err, sqlStateDenied)
		}
	}
	_, err = app.CopyFrom(ctx, pgx.Identifier{"pgfence", "locks"}, []string{"name", "token"},
		pgx.CopyFromRows([][]any{{"copied", int64(1) << 62}}))
	if sqlState(err) != sqlStateDenied {
		t.Errorf("COPY into pgfence.locks: %v, want SQLSTATE %s", err, sqlStateDenied)
	}
	for _, stmt := range []string{
		"ALTER TABLE pgfence.locks ADD COLUMN x int",
		"CREATE TRIGGER a_first BEFORE UPDATE ON pgfence.locks FOR EACH ROW EXECUTE FUNCTION pgfence.ha_gate()",
		"SET session_replication_role = replica",
		"CREATE OR REPLACE FUNCTION pgfence.lock_release(name text, token bigint, key bytea, OUT released boolean, OUT handed_off boolean, OUT notified boolean) LANGUAGE sql AS $$ SELECT true, false, false $$",
		"SELECT pgfence.ha_bump()",
	} {
		if _, err := app.Exec(ctx, stmt); err == nil {
			t.Errorf("%s succeeded as %s", stmt, role)
		}
	}
	if after := rows(); after != before {
		t.Fatalf("direct writes changed the lease tables:\nbefore %s\nafter  %s", before, after)
	}

	// Through the door, without the key: the lease's name, holder and token
	// (public) are not enough, and neither is the hash of its key.
	keys := map[string][]byte{
		"mallory's key":    []byte("mallory's 16-byte key"),
		"the key's hash":   victimHash,
		"the hash as text": []byte(fmt.Sprintf("%x", victimHash)),
	}
	for what, key := range keys {
		var exp *time.Time
		if err := app.QueryRow(ctx, "SELECT expires_at FROM pgfence.lock_renew('victim', 3, $1, 86400000000)", key).Scan(&exp); err != nil || exp != nil {
			t.Errorf("lock_renew of the victim's lease with %s: expiry %v, %v; want NULL", what, exp, err)
		}
		var released bool
		if err := app.QueryRow(ctx, "SELECT released FROM pgfence.lock_release('victim', 3, $1)", key).Scan(&released); err != nil || released {
			t.Errorf("lock_release of the victim's lease with %s: released %v, %v", what, released, err)
		}
		var token *int64
		var heldBy *string
		if err := app.QueryRow(ctx, "SELECT token, held_by FROM pgfence.lock_grant('victim', 'victim', 60000000, $1)", key).Scan(&token, &heldBy); err != nil || token != nil || heldBy == nil || *heldBy != "victim" {
			t.Errorf("lock_grant of the held lease with %s: token %v held_by %v, %v", what, token, heldBy, err)
		}
		// Refused outright since migration 00017: the wkey is queued under
		// the victim's key.
		if err := app.QueryRow(ctx, "SELECT token FROM pgfence.lock_wait('queued', 'victim', 60000000, $1, $2, $3)", key, wkey, waitID).Scan(&token); sqlState(err) != "PF013" {
			t.Errorf("lock_wait with the victim waiter's wkey and wait id and %s: token %v, %v; want PF013", what, token, err)
		}
		if err := app.QueryRow(ctx, "SELECT token FROM pgfence.lock_handed($1, $2, $3)", wkey, waitID, key).Scan(&token); err != nil || token != nil {
			t.Errorf("lock_handed of the victim's wait with %s: token %v, %v", what, token, err)
		}
		var removed bool
		if err := app.QueryRow(ctx, "SELECT removed FROM pgfence.lock_leave($1, $2, $3)", wkey, waitID, key).Scan(&removed); err != nil || removed {
			t.Errorf("lock_leave of the victim's wait with %s: removed %v, %v", what, removed, err)
		}
	}
	if after := rows(); after != before {
		t.Fatalf("keyless calls changed the lease tables:\nbefore %s\nafter  %s", before, after)
	}

	// Bad arguments: PF011, naming what is wrong; nothing changes.
	long := strings.Repeat("n", 513)
	for _, c := range []struct {
		sql  string
		args []any
		says string
	}{
		{"SELECT pgfence.lock_grant(NULL, 'h', 1000000, $1)", []any{keys["mallory's key"]}, "name must be 1 to 512 bytes, got NULL"},
		{"SELECT pgfence.lock_grant('', 'h', 1000000, $1)", []any{keys["mallory's key"]}, "got 0 bytes"},
		{"SELECT pgfence.lock_grant($2, 'h', 1000000, $1)", []any{keys["mallory's key"], long}, "got 513 bytes"},
		{"SELECT pgfence.lock_grant('n', '', 1000000, $1)", []any{keys["mallory's key"]}, "holder must be 1 to 512 bytes"},
		{"SELECT pgfence.lock_grant('n', 'h', 0, $1)", []any{keys["mallory's key"]}, "ttl_us must be 1000 to 86400000000"},
		{"SELECT pgfence.lock_grant('n', 'h', -1, $1)", []any{keys["mallory's key"]}, "got -1"},
		{"SELECT pgfence.lock_grant('n', 'h', 86400000001, $1)", []any{keys["mallory's key"]}, "got 86400000001"},
		{"SELECT pgfence.lock_grant('n', 'h', 1000000, NULL)", nil, "key must be 16 to 64 random bytes, got NULL"},
		{"SELECT pgfence.lock_grant('n', 'h', 1000000, $1)", []any{make([]byte, 15)}, "got 15 bytes"},
		{"SELECT pgfence.lock_grant('n', 'h', 1000000, $1)", []any{make([]byte, 65)}, "got 65 bytes"},
		{"SELECT pgfence.lock_renew('victim', 0, $1, 1000000)", []any{keys["mallory's key"]}, "token must be > 0, got 0"},
		{"SELECT pgfence.lock_renew('victim', 3, $1, 0)", []any{keys["mallory's key"]}, "ttl_us must be"},
		{"SELECT pgfence.lock_release('victim', -3, $1)", []any{keys["mallory's key"]}, "token must be > 0, got -3"},
		{"SELECT pgfence.lock_release('victim', NULL, $1)", []any{keys["mallory's key"]}, "got NULL"},
		{"SELECT pgfence.lock_wait('victim', 'h', 1000000, $1, NULL, 1)", []any{keys["mallory's key"]}, "wkey and wait_id"},
		{"SELECT pgfence.lock_handed(1, 1, $1)", []any{[]byte("short")}, "key must be 16 to 64"},
		{"SELECT pgfence.lock_leave(1, 1, NULL)", nil, "key must be 16 to 64"},
	} {
		_, err := app.Exec(ctx, c.sql, c.args...)
		if sqlState(err) != sqlStateBadArgment || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want SQLSTATE %s saying %q", c.sql, err, sqlStateBadArgment, c.says)
		}
	}
	if after := rows(); after != before {
		t.Fatalf("refused arguments changed the lease tables:\nbefore %s\nafter  %s", before, after)
	}

	// The guard still refuses a token never issued; the victim's lease,
	// fenced writes and wait work.
	if _, err := tbl.Update(ctx, app, 1000000, []any{1}, []any{"forged"}); !errors.Is(err, pgfence.ErrInvalid) {
		t.Errorf("fenced write with token 1000000: %v, want ErrInvalid", err)
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
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("the victim's wait after the probes: %v", err)
	}
	// The names probed with forged inserts are granted from token 1.
	for _, name := range []string{"huge", "copied"} {
		s, err := other.TryAcquire(ctx, name, time.Minute)
		if err != nil || s.Token() != 1 {
			t.Fatalf("first grant of %q after the probes: %v (token %d), want token 1", name, err, tokenOf(s))
		}
		_ = s.Release(ctx)
	}
}

// TestDoorAppPaths: through the door's functions, everything pglock,
// fencedwrite and skiplocked do works as a role with exactly docs/migrations.md's
// grants: first grant, grant of a free and of an expired lease, renewal,
// keep-alive, Adopt, RenewToken and ReleaseToken, release, AcquireMany, the
// longest TTL, a waiter's wait mark and the release's NOTIFY, fenced writes
// (a stale token refused) and job claims.
func TestDoorAppPaths(t *testing.T) {
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
	if _, err := tbl.Update(ctx, app, old, []any{1}, []any{"stale"}); !errors.Is(err, pgfence.ErrStaleToken) {
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
	a2 := newIntegLocker(t, app, pglock.Config{Holder: "a", Key: s.Key()}) // another process with a's key
	if _, err := a2.RenewToken(ctx, "tok", s.Token(), time.Minute); err != nil {
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
	if err := a2.ReleaseToken(ctx, "tok", s.Token()); err != nil {
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

// TestDoorContended: eight lockers of the documented role hand one lock to
// each other (grants, waiters' queue rows, handoffs and notifies, renewals,
// releases all racing) through the door's functions; the tokens issued are
// exactly 1..n.
func TestDoorContended(t *testing.T) {
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

// tokenOf is s's token, 0 for no lease.
func tokenOf(s *pglock.Lease) int64 {
	if s == nil {
		return 0
	}
	return s.Token()
}
