package pglock

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestMain runs the tests and the examples; the examples read DATABASE_URL, as
// an application would, and get a migrated database of their own.
func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }

// isInvalid reports whether err is a *pgfence.Error of kind ErrInvalid whose
// reason names the argument arg.
func isInvalid(err error, arg string) bool {
	var pe *pgfence.Error
	return errors.Is(err, pgfence.ErrInvalid) && errors.As(err, &pe) && strings.HasPrefix(pe.Reason, arg+": ")
}

func newLocker(t testing.TB, pool *pgxpool.Pool, cfg *Config) *Locker {
	t.Helper()
	l, err := New(pool, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func testCtx(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// rowJSON returns the whole lock row as JSON ("" when absent), to prove that
// an operation changed nothing.
func rowJSON(t testing.TB, db pgfence.DBTX, name string) string {
	t.Helper()
	var s *string
	err := db.QueryRow(context.Background(),
		"SELECT (SELECT to_jsonb(l)::text FROM pgfence.locks l WHERE name = $1)", name).Scan(&s)
	if err != nil {
		t.Fatalf("read row %q: %v", name, err)
	}
	if s == nil {
		return ""
	}
	return *s
}

func inspect(t testing.TB, db pgfence.DBTX, name string) LockInfo {
	t.Helper()
	info, err := Inspect(context.Background(), db, name)
	if err != nil {
		t.Fatalf("Inspect(%q): %v", name, err)
	}
	return info
}

func mustAcquire(t testing.TB, l *Locker, name string, ttl time.Duration) *Lease {
	t.Helper()
	s, err := l.TryAcquire(context.Background(), name, ttl)
	for retry := 0; errors.Is(err, pgfence.ErrSlowGrant) && retry < 5; retry++ {
		// A short TTL on a loaded machine: the grant was given back.
		s, err = l.TryAcquire(context.Background(), name, ttl)
	}
	if err != nil {
		t.Fatalf("TryAcquire(%q): %v", name, err)
	}
	return s
}
