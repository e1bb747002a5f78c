package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// releaseLockOrderVersion is migration 00016_pgfence_release_lock_order.sql.
const releaseLockOrderVersion = 16

// TestReleaseLockOrder: a lock_release that has to wait for the lease's row
// of pgfence.locks holds no row of pgfence.lock_queue meanwhile (lock_wait
// takes the lock row first and its queue row after: holding the queue row
// while waiting for the lock row is half of a deadlock with it). At version
// 15 the waiting release holds the waiter's queue row (a probe with NOWAIT
// is refused with 55P03); from 16 on it holds none, and the release still
// hands the lease to the waiter once the lock row is free.
func TestReleaseLockOrder(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, releaseLockOrderVersion)
	const (
		key  = `\x000102030405060708090a0b0c0d0e0f`
		wkey = `\x100102030405060708090a0b0c0d0e0f`
	)
	// probe returns the SQLSTATE a NOWAIT lock of the waiter's queue row
	// gets while a release of the lease waits for the lease's lock row.
	probe := func(version int) string {
		t.Helper()
		name := fmt.Sprintf("release-order-%d", version)
		var tok int64
		if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'h', 3600000000, '`+key+`')`, name).Scan(&tok); err != nil || tok != 1 {
			t.Fatalf("version %d: lock_grant: %d, %v", version, tok, err)
		}
		var granted bool
		if err := pool.QueryRow(ctx, `SELECT granted FROM pgfence.lock_wait($1, 'waiter', 3600000000, '`+wkey+`', $2, 1)`,
			name, int64(version)).Scan(&granted); err != nil || granted {
			t.Fatalf("version %d: lock_wait: granted %v, %v; want queued", version, granted, err)
		}
		row, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = row.Rollback(ctx) }()
		if _, err := row.Exec(ctx, `SELECT 1 FROM pgfence.locks WHERE name = $1 FOR UPDATE`, name); err != nil {
			t.Fatal(err)
		}
		handed := make(chan error, 1)
		go func() {
			var h bool
			err := pool.QueryRow(ctx, `SELECT handed_off FROM pgfence.lock_release($1, 1, '`+key+`')`, name).Scan(&h)
			if err == nil && !h {
				err = fmt.Errorf("handed_off false")
			}
			handed <- err
		}()
		if !awaitLockWait(t, ctx, pool, "lock_release", handed) {
			t.Fatalf("version %d: the release returned without waiting for the lock row: %v", version, <-handed)
		}
		pr, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, perr := pr.Exec(ctx, `SELECT 1 FROM pgfence.lock_queue WHERE name = $1 FOR UPDATE NOWAIT`, name)
		_ = pr.Rollback(ctx)
		if err := row.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-handed; err != nil {
			t.Fatalf("version %d: lock_release after the lock row was free: %v", version, err)
		}
		return sqlState(perr)
	}

	if got := probe(releaseLockOrderVersion - 1); got != "55P03" {
		t.Errorf("version %d: the waiting release held no queue row (probe: %q); the scenario does not show the old order", releaseLockOrderVersion-1, got)
	}
	if _, err := p.UpTo(ctx, releaseLockOrderVersion); err != nil {
		t.Fatal(err)
	}
	if got := probe(releaseLockOrderVersion); got != "" {
		t.Errorf("version %d: a release waiting for the lock row holds the waiter's queue row (probe: %s)", releaseLockOrderVersion, got)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
