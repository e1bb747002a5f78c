package exporter

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestExporterRoleGrants: a role with exactly the exporter grants of
// docs/observability.md serves every metric family (none is left out for
// lack of a privilege), and cannot read job or outbox payloads, the waiter
// queue or the lock table.
func TestExporterRoleGrants(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	exec(t, admin, `INSERT INTO pgfence.locks(name, token) VALUES ('a', 3);
		INSERT INTO pgfence.jobs(queue, payload) VALUES ('q', '{"secret": 1}')`)
	_, roleDSN := pgtest.DocRole(t, "observability.md", dsn, "pgfence_exporter")
	pool := pgtest.PoolFor(t, roleDSN)
	code, body := scrape(t, newExporter(t, pool, Options{}))
	if code != http.StatusOK {
		t.Fatalf("scrape as the exporter role: %d\n%s", code, body)
	}
	f := parse(t, body)
	if v := f.get(t, "pgfence_up"); v != 1 {
		t.Fatalf("pgfence_up = %v as the exporter role\n%s", v, body)
	}
	if v := f.get(t, "pgfence_jobs", "queue", "q", "state", "available"); v != 1 {
		t.Errorf("pgfence_jobs{queue=q,state=available} = %v, want 1", v)
	}
	f.get(t, "pgfence_jobs_dead_total")
	f.get(t, "pgfence_locks")
	for _, q := range []string{
		"SELECT payload FROM pgfence.jobs",
		"SELECT holder FROM pgfence.jobs",
		"SELECT payload FROM pgfence.outbox",
		"SELECT wkey FROM pgfence.lock_queue",
		"SELECT * FROM pgfence.locks",
	} {
		_, err := pool.Exec(context.Background(), q)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s as the exporter role: %v, want permission denied (42501)", q, err)
		}
	}
}
