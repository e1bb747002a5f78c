package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
)

// TestHAEpochFunctions runs the HA epoch of the schema on one server, with a
// promotion simulated by moving the recorded timeline: disabled, it changes
// nothing; enabled, grants work on the epoch's timeline, are refused with
// PFHA1 on any other until pgfence.ha_bump() ran, and the bump raises every
// token by 2^32 once per timeline, recording the tokens before it; disabled
// again, the gate is gone. No function of it is executable by PUBLIC.
func TestHAEpochFunctions(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	for _, fn := range []string{"ha_timeline()", "ha_gate()", "ha_bump()", "ha_enable()", "ha_disable()"} {
		var public bool
		if err := pool.QueryRow(ctx, "SELECT has_function_privilege('public', $1, 'EXECUTE')", "pgfence."+fn).Scan(&public); err != nil {
			t.Fatal(err)
		}
		if public {
			t.Errorf("PUBLIC can execute pgfence.%s", fn)
		}
	}
	locker, err := pglock.New(pool, &pglock.Config{Holder: "ha", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	cycle := func() (int64, error) {
		lease, err := locker.TryAcquire(ctx, "ha:lock", time.Minute)
		if err != nil {
			return 0, err
		}
		return lease.Token(), lease.Release(ctx)
	}
	bump := func() bool {
		var did bool
		if err := pool.QueryRow(ctx, "SELECT pgfence.ha_bump()").Scan(&did); err != nil {
			t.Fatal(err)
		}
		return did
	}
	// Disabled: the bump does nothing.
	if tok, err := cycle(); err != nil || tok != 1 {
		t.Fatalf("grant before ha_enable: token %d, %v", tok, err)
	}
	if bump() {
		t.Fatal("ha_bump did something before ha_enable")
	}
	// Enabled, same timeline: grants work, the bump has nothing to do.
	for range 2 { // idempotent
		if _, err := pool.Exec(ctx, "SELECT pgfence.ha_enable()"); err != nil {
			t.Fatal(err)
		}
	}
	if tok, err := cycle(); err != nil || tok != 2 {
		t.Fatalf("grant after ha_enable: token %d, %v", tok, err)
	}
	if bump() {
		t.Fatal("ha_bump did something on the epoch's own timeline")
	}
	// A promotion: the server's timeline is not the epoch's any more.
	if _, err := pool.Exec(ctx, "UPDATE pgfence.ha_epoch SET timeline = timeline - 1"); err != nil {
		t.Fatal(err)
	}
	_, err = cycle()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "PFHA1" {
		t.Fatalf("grant before the bump: %v, want SQLSTATE PFHA1", err)
	}
	if !bump() {
		t.Fatal("ha_bump did nothing after a promotion")
	}
	if bump() {
		t.Fatal("ha_bump ran twice on one timeline")
	}
	var bumps int
	var before int64
	if err := pool.QueryRow(ctx, "SELECT e.bumps, b.token_before FROM pgfence.ha_epoch e, pgfence.ha_bumps b WHERE b.name = 'ha:lock'").Scan(&bumps, &before); err != nil {
		t.Fatal(err)
	}
	if bumps != 1 || before != 2 {
		t.Errorf("after the bump: bumps %d, token before %d; want 1, 2", bumps, before)
	}
	if tok, err := cycle(); err != nil || tok != 2+(1<<32)+1 {
		t.Fatalf("grant after the bump: token %d, %v; want %d", tok, err, int64(2+(1<<32)+1))
	}
	// Disabled again: no gate, whatever the timeline.
	if _, err := pool.Exec(ctx, "SELECT pgfence.ha_disable()"); err != nil {
		t.Fatal(err)
	}
	var triggers int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'pgfence_ha_gate%'").Scan(&triggers); err != nil || triggers != 0 {
		t.Fatalf("%d gate triggers left after ha_disable (%v)", triggers, err)
	}
	if _, err := cycle(); err != nil {
		t.Fatalf("grant after ha_disable: %v", err)
	}
}

// TestNoFunctionForPublic: no function of schema pgfence (the ones the
// baseline creates and the trigger functions pgfence.guard() generates) is
// executable by PUBLIC. A role gets EXECUTE only where docs/migrations.md or
// docs/observability.md grants it.
func TestNoFunctionForPublic(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE guarded (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
		SELECT pgfence.guard('guarded', lock_name => 'g')`); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT p.oid::regprocedure::text, has_function_privilege('public', p.oid, 'EXECUTE')
		FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for rows.Next() {
		var fn string
		var public bool
		if err := rows.Scan(&fn, &public); err != nil {
			t.Fatal(err)
		}
		n++
		if public {
			t.Errorf("PUBLIC can execute %s", fn)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n < 20 {
		t.Fatalf("only %d functions in schema pgfence: the query reads the wrong schema", n)
	}
}

// TestHANewLockStartsAboveBumps: with the HA epoch enabled, ha_bump raises
// the tokens of the lock rows the promoted server has; a lock granted on the
// lost primary whose row never reached the standby has none, and its next
// grant on the promoted server was token 1 again, the token the lost holder
// still writes with. Since 00025 a lock's first row starts bumps x 2^32 up.
func TestHANewLockStartsAboveBumps(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, 25)
	locker, err := pglock.New(pool, &pglock.Config{Holder: "ha", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	first := func(name string) int64 {
		t.Helper()
		lease, err := locker.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("first grant of %s: %v", name, err)
		}
		if err := lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
		return lease.Token()
	}
	mustExecPool(t, ctx, pool, "SELECT pgfence.ha_enable()")
	if tok := first("before-any-bump"); tok != 1 {
		t.Fatalf("first grant with the epoch, no bump yet: token %d, want 1", tok)
	}
	// A promotion and its bump.
	mustExecPool(t, ctx, pool, "UPDATE pgfence.ha_epoch SET timeline = timeline - 1")
	mustExecPool(t, ctx, pool, "SELECT pgfence.ha_bump()")
	if tok := first("lost-on-the-old-primary"); tok != 1 {
		t.Fatalf("at 24: first grant after a bump: token %d; the test expected 1 (the defect)", tok)
	}
	if _, err := p.UpTo(ctx, 25); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"another-lost-lock", "and-one-more"} {
		if tok := first(name); tok != 1<<32+1 {
			t.Errorf("at 25: first grant of %s after one bump: token %d, want %d", name, tok, int64(1<<32+1))
		}
	}
	// Many at once (lock_grant_many) and through a wait (lock_wait).
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.lock_grant_many(ARRAY['m1', 'm2'], 'h', ARRAY[60000000, 60000000]::bigint[],
		'\x000102030405060708090a0b0c0d0e0f') WHERE token = 4294967297`).Scan(&n); err != nil || n != 2 {
		t.Errorf("lock_grant_many of two new names after a bump: %d at token 2^32+1, %v; want 2", n, err)
	}
	var waited *int64
	if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_wait('waited-for', 'h', 60000000,
		'\x000102030405060708090a0b0c0d0e0f', 1, 1)`).Scan(&waited); err != nil || waited == nil || *waited != 1<<32+1 {
		t.Errorf("lock_wait of a new name after a bump: %v, %v; want token %d", waited, err, int64(1<<32+1))
	}
	// Without the epoch nothing changes.
	mustExecPool(t, ctx, pool, "SELECT pgfence.ha_disable()")
	if tok := first("after-disable"); tok != 1 {
		t.Errorf("first grant with the epoch disabled: token %d, want 1", tok)
	}
}
