package migrations_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// leaveLiveVersion is migration 00032_pgfence_leave_live.sql.
const leaveLiveVersion = 32

// TestLeaveLive: lock_leave answers a granted_token above 0 only for a
// lease handed to the wait that is still live, and takes out only the row
// of the wait it names. At version 31 it answered the token a release had
// recorded in the wait's row whatever became of the lease: a waiter that
// gave up after its handed lease had expired was told it held token 2 while
// another holder held token 3 (and likewise for a handed lease that expired
// with nobody taking the name, or that the waiter had released); and a late
// leave of an earlier wait of a wkey took the row of the wait that reused
// it, so the lease handed to that wait was lost to it. A live handed lease
// is answered at both versions, and its waiter releases it. The Down gives
// version 31's answers back.
func TestLeaveLive(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, leaveLiveVersion)
	newKey := func() []byte {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		return b
	}
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	leave := func(wkey, wait int64, key []byte) (removed bool, granted int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT removed, granted_token FROM pgfence.lock_leave($1, $2, $3)`,
			wkey, wait, key).Scan(&removed, &granted); err != nil {
			t.Fatalf("lock_leave(%d, %d): %v", wkey, wait, err)
		}
		return removed, granted
	}
	// handed has holder 'a' take name (token 1), waiter 'b' queue as the
	// wait (wkey, wait) with a key of its own, and 'a' release, which hands
	// 'b' the lease (token 2). It returns b's key.
	handed := func(name string, wkey, wait int64) []byte {
		t.Helper()
		ka, kb := newKey(), newKey()
		exec(`SELECT pgfence.lock_grant($1, 'a', 60000000, $2)`, name, ka)
		var granted bool
		if err := pool.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'b', 60000000, $2, $3, $4)`,
			name, kb, wkey, wait).Scan(&granted); err != nil || granted {
			t.Fatalf("%s: b's lock_wait: granted %v, %v; want queued", name, granted, err)
		}
		var handedOff bool
		if err := pool.QueryRow(ctx, `SELECT handed_off FROM pgfence.lock_release($1, 1, $2)`, name, ka).Scan(&handedOff); err != nil || !handedOff {
			t.Fatalf("%s: a's release: handed off %v, %v; want the lease handed to b", name, handedOff, err)
		}
		return kb
	}
	// run plays every scenario on names of its own (tag) and returns what
	// each one saw.
	run := func(tag string, base int64) map[string]string {
		t.Helper()
		got := map[string]string{}

		// Handed to b, expired, taken by c (token 3); then b gives up.
		name := "leave-superseded-" + tag
		kb := handed(name, base+1, 1)
		exec(`SELECT pgfence.test_expire_lease($1)`, name)
		var tok int64
		if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'c', 60000000, $2)`, name, newKey()).Scan(&tok); err != nil || tok != 3 {
			t.Fatalf("%s: c's grant: token %d, %v; want 3", name, tok, err)
		}
		removed, granted := leave(base+1, 1, kb)
		var holder string
		var live bool
		if err := pool.QueryRow(ctx, `SELECT token, holder, expires_at > now() FROM pgfence.locks WHERE name = $1`, name).Scan(&tok, &holder, &live); err != nil {
			t.Fatal(err)
		}
		got["superseded"] = fmt.Sprintf("removed %v granted %d; lock %d %s live %v", removed, granted, tok, holder, live)

		// Handed to b, expired, taken by nobody.
		name = "leave-expired-" + tag
		kb = handed(name, base+2, 2)
		exec(`SELECT pgfence.test_expire_lease($1)`, name)
		removed, granted = leave(base+2, 2, kb)
		got["expired"] = fmt.Sprintf("removed %v granted %d", removed, granted)

		// Handed to b, released by b (it took it from the notification).
		name = "leave-released-" + tag
		kb = handed(name, base+3, 3)
		var released bool
		if err := pool.QueryRow(ctx, `SELECT released FROM pgfence.lock_release($1, 2, $2)`, name, kb).Scan(&released); err != nil || !released {
			t.Fatalf("%s: b's release of its handed lease: %v, %v", name, released, err)
		}
		removed, granted = leave(base+3, 3, kb)
		got["released"] = fmt.Sprintf("removed %v granted %d", removed, granted)

		// Handed to b and live: b holds it, and releases it.
		name = "leave-live-" + tag
		kb = handed(name, base+4, 4)
		removed, granted = leave(base+4, 4, kb)
		released = false
		if granted > 0 {
			if err := pool.QueryRow(ctx, `SELECT released FROM pgfence.lock_release($1, $2, $3)`, name, granted, kb).Scan(&released); err != nil {
				t.Fatal(err)
			}
		}
		var held bool
		if err := pool.QueryRow(ctx, `SELECT holder IS NOT NULL FROM pgfence.locks WHERE name = $1`, name).Scan(&held); err != nil {
			t.Fatal(err)
		}
		got["live"] = fmt.Sprintf("removed %v granted %d; released %v, held after %v", removed, granted, released, held)

		// b queues as wait 5, then waits again as wait 6 under the same
		// wkey (the row is reused), and a's release hands wait 6 the lease;
		// a leave of wait 5 comes late. What is left for wait 6?
		name = "leave-late-" + tag
		ka, kb := newKey(), newKey()
		exec(`SELECT pgfence.lock_grant($1, 'a', 60000000, $2)`, name, ka)
		exec(`SELECT pgfence.lock_wait($1, 'b', 60000000, $2, $3, 5)`, name, kb, base+5)
		exec(`SELECT pgfence.lock_wait($1, 'b', 60000000, $2, $3, 6)`, name, kb, base+5)
		var handedTo int64
		if err := pool.QueryRow(ctx, `SELECT wait_id FROM pgfence.lock_queue WHERE wkey = $1`, base+5).Scan(&handedTo); err != nil || handedTo != 6 {
			t.Fatalf("%s: the row of wkey %d holds wait %d, %v; want 6", name, base+5, handedTo, err)
		}
		exec(`SELECT pgfence.lock_release($1, 1, $2)`, name, ka)
		removed, granted = leave(base+5, 5, kb)
		var handedTok *int64
		if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_handed($1, 6, $2)`, base+5, kb).Scan(&handedTok); err != nil {
			t.Fatal(err)
		}
		removed6, granted6 := leave(base+5, 6, kb)
		h := int64(0)
		if handedTok != nil {
			h = *handedTok
		}
		got["late"] = fmt.Sprintf("wait 5 leaves: removed %v granted %d; wait 6: handed %d, leaves: removed %v granted %d",
			removed, granted, h, removed6, granted6)
		return got
	}
	v31 := map[string]string{
		"superseded": "removed true granted 2; lock 3 c live true",
		"expired":    "removed true granted 2",
		"released":   "removed true granted 2",
		"live":       "removed true granted 2; released true, held after false",
		"late":       "wait 5 leaves: removed true granted 0; wait 6: handed 0, leaves: removed false granted 0",
	}
	v32 := map[string]string{
		"superseded": "removed true granted 0; lock 3 c live true",
		"expired":    "removed true granted 0",
		"released":   "removed true granted 0",
		"live":       "removed true granted 2; released true, held after false",
		"late":       "wait 5 leaves: removed false granted 0; wait 6: handed 2, leaves: removed true granted 2",
	}
	check := func(when string, got, want map[string]string) {
		t.Helper()
		for _, c := range []string{"superseded", "expired", "released", "live", "late"} {
			if got[c] != want[c] {
				t.Errorf("%s, %s: %s\nwant %s", when, c, got[c], want[c])
			}
		}
	}
	check("version 31", run("v31", 1000), v31)
	if _, err := p.UpTo(ctx, leaveLiveVersion); err != nil {
		t.Fatal(err)
	}
	check("version 32", run("v32", 2000), v32)
	if _, err := p.DownTo(ctx, leaveLiveVersion-1); err != nil {
		t.Fatal(err)
	}
	check("after the Down", run("down", 3000), v31)
}

// TestLeaveLiveRace: a leave whose DELETE waits for the queue row while a
// release that hands the wait the lease commits is answered that lease
// (token 2): lock_leave reads the lock row in a snapshot taken after the
// DELETE, which sees the release's grant. (Read in the DELETE's own
// statement, the lock row still had the releasing holder's token 1, and the
// handed lease was answered as 0: held by nobody who knew it until it
// expired.)
func TestLeaveLiveRace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	const (
		name = "leave-race"
		ka   = `\x000102030405060708090a0b0c0d0e0f`
		kb   = `\x100102030405060708090a0b0c0d0e0f`
	)
	for _, q := range []string{
		`SELECT pgfence.lock_grant('` + name + `', 'a', 60000000, '` + ka + `')`,
		`SELECT pgfence.lock_wait('` + name + `', 'b', 60000000, '` + kb + `', 77, 88)`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	rel, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rel.Rollback(ctx) }()
	var handedOff bool
	if err := rel.QueryRow(ctx, `SELECT handed_off FROM pgfence.lock_release('`+name+`', 1, '`+ka+`')`).Scan(&handedOff); err != nil || !handedOff {
		t.Fatalf("a's release: handed off %v, %v", handedOff, err)
	}
	type answer struct {
		removed bool
		granted int64
		err     error
	}
	done := make(chan answer, 1)
	go func() {
		var a answer
		a.err = pool.QueryRow(ctx, `SELECT removed, granted_token FROM pgfence.lock_leave(77, 88, '`+kb+`')`).Scan(&a.removed, &a.granted)
		done <- a
	}()
	if !awaitLockWait(t, ctx, pool, "lock_leave", done) {
		t.Fatalf("lock_leave did not wait for the release's queue row: %+v", <-done)
	}
	if err := rel.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if a := <-done; a.err != nil || !a.removed || a.granted != 2 {
		t.Fatalf("lock_leave racing the handoff: removed %v granted %d, %v; want true, 2 (the lease handed to it)", a.removed, a.granted, a.err)
	}
	var released bool
	if err := pool.QueryRow(ctx, `SELECT released FROM pgfence.lock_release('`+name+`', 2, '`+kb+`')`).Scan(&released); err != nil || !released {
		t.Fatalf("b's release of the lease it was answered: %v, %v", released, err)
	}
}
