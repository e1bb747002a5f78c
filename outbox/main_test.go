package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get a migrated database of their own.
func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }

// bundle is what most tests need: a migrated database and a locker on it.
type bundle struct {
	ctx    context.Context
	pool   *pgxpool.Pool
	locker *pglock.Locker
}

func setup(t *testing.T) bundle {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	pool := pgtest.Pool(t)
	locker, err := pglock.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = locker.Close() })
	return bundle{ctx: ctx, pool: pool, locker: locker}
}

// grant acquires name and returns the lease (released when t ends).
func (b bundle) grant(t *testing.T, name string) *pglock.Lease {
	t.Helper()
	l, err := b.locker.Acquire(b.ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	return l
}

// regrant releases l and acquires its lock again: the returned lease has a
// newer token, and l's token is stale.
func (b bundle) regrant(t *testing.T, l *pglock.Lease) *pglock.Lease {
	t.Helper()
	if err := l.Release(b.ctx); err != nil {
		t.Fatal(err)
	}
	return b.grant(t, l.Name())
}

// counts returns the number of intents and of outbox jobs.
func (b bundle) counts(t *testing.T) (intents, jobs int) {
	t.Helper()
	if err := b.pool.QueryRow(b.ctx, `SELECT (SELECT count(*) FROM pgfence.outbox),
		(SELECT count(*) FROM pgfence.jobs WHERE queue LIKE 'outbox:%')`).Scan(&intents, &jobs); err != nil {
		t.Fatal(err)
	}
	return intents, jobs
}
