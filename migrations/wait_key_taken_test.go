package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// waitKeyTakenVersion is migration 00017_pgfence_wait_key_taken.sql.
const waitKeyTakenVersion = 17

// TestWaitKeyTaken: a lock_wait whose wkey another key has queued under is
// refused with PF013 and changes nothing. At version 16 it answered "queued"
// (granted false) while nothing was queued for it, so a release handed the
// lease to a later waiter; the Down gives that answer back.
func TestWaitKeyTaken(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	const (
		holderKey  = `\x000102030405060708090a0b0c0d0e0f`
		squatKey   = `\x100102030405060708090a0b0c0d0e0f`
		victimKey  = `\x200102030405060708090a0b0c0d0e0f`
		laterKey   = `\x300102030405060708090a0b0c0d0e0f`
		victimWkey = 4242
	)
	// state is everything the scenario could change.
	state := func(name string) string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT coalesce((SELECT jsonb_agg(q ORDER BY q.wkey)::text FROM pgfence.lock_queue q), '')
			|| coalesce((SELECT to_jsonb(l)::text FROM pgfence.locks l WHERE l.name = $1), '')`, name).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	// run plays the scenario at the current version: a holder of name, a
	// squatter queued (on another held name) under the victim's wkey, the
	// victim's lock_wait, a later waiter, the release. It returns the
	// victim's SQLSTATE and who the release handed the lease to.
	run := func(version int) (code, handedTo string) {
		t.Helper()
		name, other := fmt.Sprintf("wkey-taken-%d", version), fmt.Sprintf("wkey-other-%d", version)
		for _, n := range []string{name, other} {
			if _, err := pool.Exec(ctx, `SELECT pgfence.lock_grant($1, 'holder', 3600000000, '`+holderKey+`')`, n); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_wait($1, 'squatter', 3600000000, '`+squatKey+`', $2, 1)`, other, victimWkey); err != nil {
			t.Fatal(err)
		}
		before := state(name)
		var granted *bool
		err := pool.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'victim', 3600000000, '`+victimKey+`', $2, 2)`,
			name, victimWkey).Scan(&granted)
		code = sqlState(err)
		if err == nil && (granted == nil || *granted) {
			t.Fatalf("version %d: victim's lock_wait: granted %v; want queued or refused", version, granted)
		}
		if code != "" && state(name) != before {
			t.Errorf("version %d: the refused lock_wait changed\n%s\nto\n%s", version, before, state(name))
		}
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_wait($1, 'later', 3600000000, '`+laterKey+`', $2, 3)`, name, 1000+version); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_release($1, 1, '`+holderKey+`')`, name); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, `SELECT coalesce(holder, '') FROM pgfence.locks WHERE name = $1`, name).Scan(&handedTo); err != nil {
			t.Fatal(err)
		}
		// Clean up the squatter's row for the next run.
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_leave($1, 1, '`+squatKey+`')`, victimWkey); err != nil {
			t.Fatal(err)
		}
		return code, handedTo
	}

	if err := migrations.DownTo(ctx, db, waitKeyTakenVersion-1); err != nil {
		t.Fatal(err)
	}
	if code, to := run(waitKeyTakenVersion - 1); code != "" || to != "later" {
		t.Errorf("version %d: victim %q, lease handed to %q; want no error and the later waiter (the old answer)", waitKeyTakenVersion-1, code, to)
	}
	if _, err := p.UpTo(ctx, waitKeyTakenVersion); err != nil {
		t.Fatal(err)
	}
	if code, to := run(waitKeyTakenVersion); code != "PF013" || to != "later" {
		t.Errorf("version %d: victim %q, lease handed to %q; want PF013 (and the later waiter, the only one queued)", waitKeyTakenVersion, code, to)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}

// TestWaitKeyTakenRace: another key's row under the wkey that commits while
// the victim's lock_wait waits for it (its first check saw nothing) is
// found by the check after the statement: PF013, and the victim is queued
// nowhere and told so (before, it answered "queued").
func TestWaitKeyTakenRace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	const (
		holderKey = `\x000102030405060708090a0b0c0d0e0f`
		squatKey  = `\x100102030405060708090a0b0c0d0e0f`
		victimKey = `\x200102030405060708090a0b0c0d0e0f`
		wkey      = 4242
	)
	for _, n := range []string{"race", "other"} {
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_grant($1, 'holder', 3600000000, '`+holderKey+`')`, n); err != nil {
			t.Fatal(err)
		}
	}
	sq, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sq.Rollback(ctx) }()
	if _, err := sq.Exec(ctx, `SELECT pgfence.lock_wait('other', 'squatter', 3600000000, '`+squatKey+`', $1, 1)`, wkey); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		var g *bool
		err := pool.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait('race', 'victim', 3600000000, '`+victimKey+`', $1, 2)`, wkey).Scan(&g)
		if err == nil {
			err = fmt.Errorf("granted %v (NULL: %v), no error", g != nil && *g, g == nil)
		}
		done <- err
	}()
	if !awaitLockWait(t, ctx, pool, "lock_wait('race'", done) {
		t.Fatalf("the victim's lock_wait did not wait for the squatter's row: %v", <-done)
	}
	if err := sq.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err = <-done
	var queued int
	if err2 := pool.QueryRow(ctx, `SELECT count(*) FROM pgfence.lock_queue WHERE name = 'race'`).Scan(&queued); err2 != nil {
		t.Fatal(err2)
	}
	if sqlState(err) != "PF013" || queued != 0 {
		t.Fatalf("victim: %v (queue rows for its name: %d); want PF013 and none", err, queued)
	}
}
