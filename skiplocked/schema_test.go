package skiplocked_test

import (
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestMissingSchema: on a database nobody migrated, the job calls say the
// schema is missing and what to run.
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	_, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "q", Payload: []byte(`{}`)})
	pgtest.WantSchemaHint(t, "Enqueue", err)
	_, err = skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "q", Holder: "w", Limit: 1, TTL: time.Minute})
	pgtest.WantSchemaHint(t, "Claim", err)
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Op != "skiplocked.Claim" || !errors.Is(err, pgfence.ErrNoSchema) {
		t.Errorf("Claim without schema pgfence: %T %v, want a *pgfence.Error matching ErrNoSchema", err, err)
	}
}
