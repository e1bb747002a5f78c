package faultsuite

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// runtimeGrants are the grants docs/migrations.md documents for the role an
// application runs as (no superuser, no DDL).
const runtimeGrants = `
GRANT USAGE ON SCHEMA pgfence TO pgfence_app;
GRANT SELECT, INSERT, UPDATE ON pgfence.locks TO pgfence_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.lock_queue TO pgfence_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.jobs, pgfence.fenced_values TO pgfence_app;
GRANT USAGE ON SEQUENCE pgfence.jobs_claim_token_seq TO pgfence_app;
GRANT SELECT ON pgfence.guarded_tables TO pgfence_app;
`

// TestLeastPrivilege runs every package's main path as a role with only the
// documented grants, and checks that role cannot change the schema.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	role := "pgfence_app"
	if _, err := admin.Exec(ctx, `
		DO $$ BEGIN
			IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'pgfence_app') THEN
				CREATE ROLE pgfence_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
			END IF;
		END $$;
		CREATE TABLE invoices (id int PRIMARY KEY, status text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices VALUES (1, 'new', 0);
		SELECT pgfence.guard('invoices', lock_name => 'invoices');
		GRANT SELECT, UPDATE ON invoices TO pgfence_app;`+runtimeGrants); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	app := pgtest.PoolFor(t, u.String())

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
	if _, err := tbl.Update(ctx, app, lease.Token()+100, []any{1}, []any{"forged"}); !errors.Is(err, fencedwrite.ErrGuardRejected) {
		t.Fatalf("forged token: %v", err)
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
