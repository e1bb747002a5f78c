package pglock

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestMissingSchema: on a database nobody migrated, the calls that reach the
// database say so and what to run, instead of only the server's "does not
// exist".
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	pool := pgtest.PoolFor(t, pgtest.EmptyDSN(t))
	l := newLocker(t, pool, nil)
	_, err := l.Acquire(ctx, "a", time.Second)
	pgtest.WantSchemaHint(t, "Acquire", err)
	_, err = l.TryAcquire(ctx, "a", time.Second)
	pgtest.WantSchemaHint(t, "TryAcquire", err)
	_, err = Inspect(ctx, pool, "a")
	pgtest.WantSchemaHint(t, "Inspect", err)
}
