package outbox_test

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/outbox"
)

// TestMissingSchema: on a database nobody migrated, Enqueue and Status say
// the schema is missing and what to run.
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	b := setup(t)
	lease, err := b.locker.Acquire(b.ctx, "schema-test", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lease.Release(b.ctx) }()
	empty := pgtest.PoolFor(t, pgtest.EmptyDSN(t)) // the lease is from another database
	_, err = outbox.Enqueue(b.ctx, empty, lease, intent("k1"))
	pgtest.WantSchemaHint(t, "Enqueue", err)
	_, err = outbox.Status(b.ctx, empty)
	pgtest.WantSchemaHint(t, "Status", err)
}
