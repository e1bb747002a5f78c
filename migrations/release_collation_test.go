package migrations_test

import (
	"context"
	"crypto/rand"
	"testing"
	"time"
)

// releaseCollationVersion is migration 00028_pgfence_release_collation.sql.
const releaseCollationVersion = 28

// TestReleaseCollation: a release whose name argument carries a
// nondeterministic (case-insensitive) collation of the caller's, which any
// role may create in pg_temp, releases only the lease of that exact name.
// At version 27 the holder of 'ORDERS-LEADER' released it as
// 'orders-leader' COLLATE pg_temp.ci, and the release handed the lease of
// 'ORDERS-LEADER' to a waiter of 'orders-leader' (its queue row marked
// granted, a tagged notification sent), while another holder still held
// 'orders-leader'. The Down gives that back.
func TestReleaseCollation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, releaseCollationVersion)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// The collation lives in this session's pg_temp: one connection.
	if _, err := conn.Exec(ctx, `CREATE COLLATION pg_temp.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`); err != nil {
		t.Fatalf("an ICU collation (PostgreSQL built with ICU): %v", err)
	}
	key := func() []byte {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		return b
	}
	// attack runs the scenario on names of its own and reports whether the
	// victim's waiter was handed a lease, and the victim's lock's token.
	attack := func(suffix string, wkey int64) (handed bool, victimToken int64, victimKey []byte) {
		t.Helper()
		victim, upper := "orders-leader-"+suffix, "ORDERS-LEADER-"+suffix
		victimKey = key()
		if _, err := conn.Exec(ctx, `SELECT pgfence.lock_grant($1, 'victim-holder', 60000000, $2)`, victim, victimKey); err != nil {
			t.Fatal(err)
		}
		var granted bool
		if err := conn.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'victim-waiter', 60000000, $2, $3, 1)`,
			victim, key(), wkey).Scan(&granted); err != nil || granted {
			t.Fatalf("the victim's waiter queues: granted %v, %v", granted, err)
		}
		ka := key()
		var tok int64
		if err := conn.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'attacker', 60000000, $2)`, upper, ka).Scan(&tok); err != nil || tok <= 0 {
			t.Fatalf("the attacker's grant of %s: %d, %v", upper, tok, err)
		}
		if _, err := conn.Exec(ctx, `SELECT pgfence.lock_release($1::text COLLATE pg_temp.ci, $2, $3)`, victim, tok, ka); err != nil {
			t.Fatalf("the attacker's release: %v", err)
		}
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pgfence.lock_queue WHERE name = $1 AND granted_token IS NOT NULL)`,
			victim).Scan(&handed); err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRow(ctx, `SELECT token FROM pgfence.locks WHERE name = $1`, victim).Scan(&victimToken); err != nil {
			t.Fatal(err)
		}
		return handed, victimToken, victimKey
	}
	if handed, _, _ := attack("v27", 1001); !handed {
		t.Fatal("version 27: the victim's waiter was not handed a lease: the test shows nothing")
	}
	if _, err := p.UpTo(ctx, releaseCollationVersion); err != nil {
		t.Fatal(err)
	}
	handed, tok, vkey := attack("v28", 1002)
	if handed || tok != 1 {
		t.Fatalf("version 28: the victim's waiter handed a lease %v, the victim's token %d; want no handoff, token 1", handed, tok)
	}
	// The victim's own release still hands the lease to its waiter.
	var handedOff bool
	if err := conn.QueryRow(ctx, `SELECT handed_off FROM pgfence.lock_release('orders-leader-v28', 1, $1)`, vkey).Scan(&handedOff); err != nil || !handedOff {
		t.Fatalf("version 28: the holder's own release handed off %v, %v; want true", handedOff, err)
	}
	// The Down gives version 27's behaviour back.
	if _, err := p.DownTo(ctx, releaseCollationVersion-1); err != nil {
		t.Fatal(err)
	}
	if handed, _, _ := attack("down", 1003); !handed {
		t.Fatal("after the Down: the victim's waiter was not handed a lease; want the version-27 behaviour back")
	}
}
