package faultsuite

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestLeastPrivilege runs every package's main path as the application role
// docs/migrations.md creates (its block of grants, nothing else), and checks
// that role cannot change the schema or call what it was not granted.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	role, roleDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")
	if _, err := admin.Exec(ctx, `
		CREATE TABLE invoices (id int PRIMARY KEY, status text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (1, 'new', 0);
		SELECT pgfence.guard('invoices', lock_name => 'invoices');
		GRANT SELECT, UPDATE ON invoices TO `+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	app := pgtest.PoolFor(t, roleDSN)

	locker, err := pglock.New(app, &pglock.Config{Holder: "least-privilege"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "invoices", time.Minute)
	if err != nil {
		t.Fatalf("acquire as %s: %v", role, err)
	}
	if err := lease.Renew(ctx); err != nil {
		t.Fatalf("renew: %v", err)
	}
	tbl, err := fencedwrite.Prepare(ctx, app, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	if err != nil {
		t.Fatalf("prepare: %v", err)
	}
	if _, err := tbl.Update(ctx, app, lease.Token(), []any{1}, []any{"paid"}); err != nil {
		t.Fatalf("fenced write through the guard: %v", err)
	}
	// Forged token: refused by the guard, nothing changes.
	if _, err := tbl.Update(ctx, app, lease.Token()+100, []any{1}, []any{"forged"}); !errors.Is(err, pgfence.ErrInvalid) {
		t.Fatalf("forged token: %v", err)
	}
	// A generated-style fenced statement's refusal path (pgfence.fence_refused).
	if _, err := app.Exec(ctx, `SELECT pgfence.fence_refused('invoices', '{"id":1}', 'strict', 1, 2, true)`); err == nil ||
		!errors.Is(fencedwrite.TranslateError(err), pgfence.ErrStaleToken) {
		t.Fatalf("pgfence.fence_refused as the app role: %v, want a stale-token refusal", err)
	}
	// An outbox intent under the lease, in a transaction (checked again at COMMIT).
	if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
		_, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: "t", Key: "k1", Payload: []byte(`{}`)})
		return err
	}); err != nil {
		t.Fatalf("outbox enqueue as the app role: %v", err)
	}
	// A fenced value.
	if _, err := fencedwrite.UpsertValue(ctx, app, lease.Token(), fencedwrite.Strict, "invoices:1", []byte(`"v"`)); err != nil {
		t.Fatalf("fenced value as the app role: %v", err)
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}

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

	// No DDL, no way around the guard.
	for _, stmt := range []string{
		"CREATE TABLE pgfence.x (i int)",
		"DROP TABLE pgfence.locks",
		"ALTER TABLE invoices DISABLE TRIGGER USER",
		"DELETE FROM pgfence.locks",
		"SELECT pgfence.unguard('invoices')",
		"SELECT pgfence.ha_bump()",
		"SELECT pgfence.ha_disable()",
		"SELECT pgfence.guard('invoices', lock_name => 'x')",
	} {
		if _, err := app.Exec(ctx, stmt); err == nil {
			t.Errorf("%s succeeded as %s", stmt, role)
		}
	}
	var status string
	if err := admin.QueryRow(ctx, "SELECT status FROM invoices WHERE id = 1").Scan(&status); err != nil || status != "paid" {
		t.Fatalf("invoice: %q %v", status, err)
	}
}
