package cli

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestOnCallRoleGrants: a role with exactly the on-call grants of
// docs/observability.md runs every read command, and cannot read what the
// read commands do not need: the waiter queue (a waiter's key and wait id),
// job payloads, holders and claim tokens, outbox payloads, the lock table
// itself.
func TestOnCallRoleGrants(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		INSERT INTO pgfence.locks(name, token) VALUES ('store:1', 5);
		INSERT INTO pgfence.jobs(queue, payload) VALUES ('q', '{"secret": 1}');
		CREATE TABLE catalogue (sku text PRIMARY KEY, store_lock text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO catalogue VALUES ('a', 'store:1', 5);
		SELECT pgfence.guard('catalogue', lock_name_column => 'store_lock');`); err != nil {
		t.Fatal(err)
	}
	role, oncall := pgtest.DocRole(t, "observability.md", dsn, "pgfence_oncall")
	if _, err := pool.Exec(ctx, "GRANT SELECT ON catalogue TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"locks"}, {"locks", "show", "store:1"}, {"jobs"}, {"jobs", "--queue", "q"}, {"outbox"},
		{"fences", "--table", "catalogue", "--key", "sku", "--lock-column", "store_lock"},
		{"migrate", "status"}, {"advisory", "list"},
	} {
		if r := run(t, oncall, args...); r.code != 0 {
			t.Errorf("%v as the on-call role: exit %d: %s", args, r.code, r.stderr)
		}
	}
	op := pgtest.PoolFor(t, oncall)
	var forged int64
	if err := op.QueryRow(ctx, "SELECT forged_rows FROM pgfence.guarded_fences WHERE unchecked IS NULL").Scan(&forged); err != nil || forged != 0 {
		t.Errorf("guarded_fences as the on-call role: forged %d, %v", forged, err)
	}
	for _, q := range []string{
		"SELECT wkey, wait_id FROM pgfence.lock_queue",
		"SELECT payload FROM pgfence.jobs",
		"SELECT claim_token, holder FROM pgfence.jobs",
		"SELECT payload FROM pgfence.outbox",
		"SELECT * FROM pgfence.locks",
		"SELECT * FROM pgfence.fenced_values",
	} {
		_, err := op.Exec(ctx, q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s as the on-call role: %v, want permission denied (42501)", q, err)
		}
	}
}
