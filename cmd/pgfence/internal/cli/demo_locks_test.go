package cli

import (
	"context"
	"slices"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestDemoDeletesOnlyItsOwnLocks: the demo's clean-up deletes the lock rows
// whose name starts with its prefix, and no other. It used the prefix as a
// LIKE pattern, where each '_' of the schema name (pgfence_demo_PID_N)
// matches any character: an application's lock named
// "pgfence-demo:pgfence-demo-..." was deleted, and with it its token.
func TestDemoDeletesOnlyItsOwnLocks(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	const prefix = "pgfence-demo:pgfence_demo_123_0042:"
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks(name, token) VALUES
		('pgfence-demo:pgfence_demo_123_0042:account-1:run1', 1),
		('pgfence-demo:pgfence_demo_123_0042:account-1:run2', 2),
		('pgfence-demo:pgfence-demo-123-0042:account-1:run1', 3), -- '-' where the prefix has '_'
		('pgfence-demo:pgfenceXdemoX123X0042:invoices', 4),
		('pgfence-demo:pgfence_demo_123_0042', 5),                -- the prefix without its ':'
		('PGFENCE-DEMO:pgfence_demo_123_0042:x', 6),
		('pgfence-demo:pgfence_demo_123_00420:x', 7),
		('invoices', 8)`); err != nil {
		t.Fatal(err)
	}
	if err := deleteDemoLocks(ctx, pool, prefix); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT token FROM pgfence.locks ORDER BY token`)
	if err != nil {
		t.Fatal(err)
	}
	var left []int64
	for rows.Next() {
		var tok int64
		if err := rows.Scan(&tok); err != nil {
			t.Fatal(err)
		}
		left = append(left, tok)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if want := []int64{3, 4, 5, 6, 7, 8}; !slices.Equal(left, want) {
		t.Errorf("locks left after deleting the demo's (tokens): %v, want %v", left, want)
	}
}
