package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get a migrated database of their own.
func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }

// bundle is what most tests need: a migrated database and a locker on it,
// and a second locker (another process, another lease key) on it.
type bundle struct {
	ctx    context.Context
	pool   *pgxpool.Pool
	locker *pglock.Locker
	other  *pglock.Locker
}

func setup(t *testing.T) bundle {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	pool := pgtest.Pool(t)
	b := bundle{ctx: ctx, pool: pool}
	for _, l := range []**pglock.Locker{&b.locker, &b.other} {
		locker, err := pglock.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = locker.Close() })
		*l = locker
	}
	return b
}

// grant acquires name and returns the lease (released when t ends).
func (b bundle) grant(t *testing.T, name string) *pglock.Lease {
	t.Helper()
	return b.grantBy(t, b.locker, name)
}

func (b bundle) grantBy(t *testing.T, locker *pglock.Locker, name string) *pglock.Lease {
	t.Helper()
	l, err := locker.Acquire(b.ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	return l
}

// regrant releases l and lets the second locker take its lock: the returned
// lease has a newer token, and l's token is stale.
func (b bundle) regrant(t *testing.T, l *pglock.Lease) *pglock.Lease {
	t.Helper()
	if err := l.Release(b.ctx); err != nil {
		t.Fatal(err)
	}
	return b.grantBy(t, b.other, l.Name())
}

// expire ends l's lease on the database's clock without releasing it (as
// the owner of pgfence.locks; the application's role cannot).
func (b bundle) expire(t *testing.T, l *pglock.Lease) {
	t.Helper()
	tag, err := b.pool.Exec(b.ctx, `UPDATE pgfence.locks SET expires_at = now() - interval '1 second'
		WHERE name = $1 AND token = $2`, l.Name(), l.Token())
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("expire %s token %d: %v, %d rows", l.Name(), l.Token(), err, tag.RowsAffected())
	}
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
