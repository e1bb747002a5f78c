package hatest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/hacluster"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
)

// TestFailoverFirstGrantLost: the HA epoch bump raises the tokens of the
// lock rows the promoted server has, but a lock whose first grant was lost
// in the failover has no row there: its next grant inserted a row with token
// 1, the token the lost grant gave its holder, and a guarded table accepted
// that holder's writes on the new primary. Since migration 00025 a lock's
// first row starts above every bump (asynchronous cluster, paused primary).
func TestFailoverFirstGrantLost(t *testing.T) {
	c := startCluster(t, hacluster.Async)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const db = "zzaudit"
	admin, err := pgx.Connect(ctx, c.DSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		t.Fatal(err)
	}
	admin.Close(ctx)
	waitDatabaseEverywhere(t, ctx, c, db)
	pool, err := pgxpool.New(ctx, c.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, haEnableSQL); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE acct (id text PRIMARY KEY, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO acct (id) VALUES ('fresh')`); err != nil {
		t.Fatal(err)
	}
	if err := fencedwrite.Guard(ctx, pool, "acct", fencedwrite.GuardOptions{LockNameColumn: "id", Mode: fencedwrite.Reentrant}); err != nil {
		t.Fatal(err)
	}
	acct, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "acct", Key: []string{"id"}, Set: []string{"v"}, Mode: fencedwrite.Reentrant})
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.WaitHealthy(ctx)
	if err != nil {
		t.Fatal(err)
	}
	old := h.Leader
	// Holder A's pool: one connection to the old primary, open before the pause.
	cfgA, err := pgxpool.ParseConfig(c.NodeDSN(old, db))
	if err != nil {
		t.Fatal(err)
	}
	cfgA.MaxConns, cfgA.MinConns = 1, 1
	poolA, err := pgxpool.NewWithConfig(ctx, cfgA)
	if err != nil {
		t.Fatal(err)
	}
	defer poolA.Close()
	if err := poolA.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	lockerA, err := pglock.New(poolA, &pglock.Config{Holder: "A", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer lockerA.Close()

	// The primary pauses (Patroni and postmaster stopped, its backends keep
	// serving): a replica is promoted, and its on_role_change callback bumps.
	if err := c.Pause(old); err != nil {
		t.Fatal(err)
	}
	var newLeader string
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if l, err := c.Leader(ctx); err == nil && l != "" && l != old {
			newLeader = l
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new leader%s", c.Logs(30))
		}
	}
	// A is granted the lock "fresh" (its first grant ever) by the old primary,
	// which still acknowledges on its open connection: this grant is lost.
	leaseA, err := lockerA.TryAcquire(ctx, "fresh", 5*time.Minute)
	if err != nil {
		t.Fatalf("A on the old primary: %v", err)
	}
	t.Logf("A granted %q token %d by the old primary %s (lost: a replica was promoted)", leaseA.Name(), leaseA.Token(), old)

	// B on the new primary, once the gate opens (the bump ran).
	poolB, err := pgxpool.New(ctx, c.NodeDSN(newLeader, db))
	if err != nil {
		t.Fatal(err)
	}
	defer poolB.Close()
	lockerB, err := pglock.New(poolB, &pglock.Config{Holder: "B", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer lockerB.Close()
	var leaseB *pglock.Lease
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		leaseB, err = lockerB.TryAcquire(ctx, "fresh", 5*time.Minute)
		if err == nil {
			break
		}
		var pe *pgconn.PgError
		if !(errors.As(err, &pe) && pe.Code == gateSQLState) && time.Now().After(deadline) {
			t.Fatalf("B on the new primary: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("gate never opened: %v", err)
		}
	}
	var bumps int
	if err := poolB.QueryRow(ctx, "SELECT bumps FROM pgfence.ha_epoch").Scan(&bumps); err != nil {
		t.Fatal(err)
	}
	t.Logf("B granted %q token %d by the new primary %s after %d bump(s)", leaseB.Name(), leaseB.Token(), newLeader, bumps)
	if _, err := acct.Update(ctx, poolB, leaseB.Token(), []any{"fresh"}, []any{int64(2)}); err != nil {
		t.Fatalf("B's write: %v", err)
	}
	// A, whose grant was lost, writes on the new primary with its token.
	_, errA := acct.Update(ctx, poolB, leaseA.Token(), []any{"fresh"}, []any{int64(1)})

	if err := c.Resume(old); err != nil {
		t.Fatal(err)
	}
	if bumps < 1 {
		t.Fatalf("no bump ran")
	}
	if leaseA.Token() == leaseB.Token() {
		t.Errorf("token %d of lock %q held by two holders: A (granted by the old primary, lost in the failover) and B "+
			"(granted by the new primary after the epoch bump); the bump only raises rows that exist", leaseA.Token(), "fresh")
	}
	if errA == nil {
		t.Errorf("A's write with the lost token %d was accepted by the guarded table on the new primary", leaseA.Token())
	}
}
