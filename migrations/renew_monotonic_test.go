package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// renewMonotonicVersion is migration 00022_pgfence_lock_renew_monotonic.sql.
const renewMonotonicVersion = 22

// TestRenewNeverShortens: of two renewals of one lease that overlap, the one
// that began first (a keep-alive batch, lock_renew_many, waiting for the row
// of another of its leases) commits last. At version 21 it set the expiry to
// its own start + TTL, earlier than the expiry the other renewal
// (lock_renew, begun later) had answered: the lease ended in the database
// before its holder's deadline. At 22 the expiry stays the later one, and
// each function answers the expiry it leaves.
func TestRenewNeverShortens(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, renewMonotonicVersion)
	const (
		key = `\x000102030405060708090a0b0c0d0e0f`
		ttl = int64(60_000_000) // 1 minute in µs
	)
	// play returns the expiry the later lock_renew answered, the expiry
	// lock_renew_many answered for the same lease, and the lease's expiry
	// in the table once both committed.
	play := func(version int) (answered, batchAnswered, stored time.Time) {
		t.Helper()
		a, z := fmt.Sprintf("renew-%d-a", version), fmt.Sprintf("renew-%d-z", version)
		toks := map[string]int64{}
		for _, n := range []string{a, z} {
			var tok int64
			if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'h', $2, '`+key+`')`, n, ttl).Scan(&tok); err != nil {
				t.Fatalf("version %d: lock_grant %s: %v", version, n, err)
			}
			toks[n] = tok
		}
		// Another transaction holds a's row: the batch (a, z) waits there,
		// in name order, before it touches z.
		other, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = other.Rollback(ctx) }()
		if _, err := other.Exec(ctx, "SELECT 1 FROM pgfence.locks WHERE name = $1 FOR UPDATE", a); err != nil {
			t.Fatal(err)
		}
		type answer struct {
			exp time.Time
			err error
		}
		batch := make(chan answer, 1)
		go func() {
			var exp time.Time
			err := pool.QueryRow(ctx, `SELECT expires_at FROM pgfence.lock_renew_many(ARRAY[$1, $2], ARRAY[$3, $4]::bigint[], '`+key+`', ARRAY[$5, $5]::bigint[]) WHERE name = $2`,
				a, z, toks[a], toks[z], ttl).Scan(&exp)
			batch <- answer{exp, err}
		}()
		if !awaitLockWait(t, ctx, pool, "lock_renew_many", batch) {
			t.Fatalf("version %d: lock_renew_many did not wait for the row of %s", version, a)
		}
		// The later renewal of z commits first.
		if err := pool.QueryRow(ctx, `SELECT expires_at FROM pgfence.lock_renew($1, $2, '`+key+`', $3)`, z, toks[z], ttl).Scan(&answered); err != nil {
			t.Fatal(err)
		}
		if err := other.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		b := <-batch
		if b.err != nil {
			t.Fatalf("version %d: lock_renew_many: %v", version, b.err)
		}
		if err := pool.QueryRow(ctx, "SELECT expires_at FROM pgfence.locks WHERE name = $1", z).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		return answered, b.exp, stored
	}

	v := renewMonotonicVersion - 1
	if answered, _, stored := play(v); !stored.Before(answered) {
		t.Errorf("version %d: expiry %v after lock_renew answered %v; want earlier (the old behaviour)", v, stored, answered)
	}
	if _, err := p.UpTo(ctx, renewMonotonicVersion); err != nil {
		t.Fatal(err)
	}
	v = renewMonotonicVersion
	if answered, batchAnswered, stored := play(v); !stored.Equal(answered) || !batchAnswered.Equal(stored) {
		t.Errorf("version %d: lock_renew answered %v, lock_renew_many answered %v, the table holds %v; want all three equal",
			v, answered, batchAnswered, stored)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
