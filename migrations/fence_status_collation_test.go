package migrations_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// fenceStatusCollationVersion is migration
// 00031_pgfence_fence_status_collation.sql.
const fenceStatusCollationVersion = 31

// TestFenceStatusCollation: pgfence.guarded_fences reads each row's lock
// name exactly, whatever the collation of the table's lock-name column. At
// version 30 it grouped and joined under the column's nondeterministic
// (case-insensitive) collation: the rows of 'fs-acme' and 'fs-ACME' made one
// group, counted once per matching lock, and a forged row of 'FS-INV' (a
// lock never issued) hid in the group of 'fs-inv'. The Down gives that back.
func TestFenceStatusCollation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, fenceStatusCollationVersion)
	key := func(b byte) string { return `\x` + strings.Repeat(fmt.Sprintf("%02x", b), 16) }
	for _, q := range []string{
		`CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`,
		`CREATE TABLE public.fs_ci (id integer PRIMARY KEY, lock text COLLATE public.ci NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		`SELECT pgfence.guard('public.fs_ci', lock_name_column => 'lock')`,
		// fs-acme at token 1, fs-ACME at token 3, fs-inv at token 1, all held.
		`SELECT pgfence.lock_grant('fs-acme', 'a', 60000000, '` + key(1) + `')`,
		`SELECT pgfence.lock_grant('fs-ACME', 'b', 60000000, '` + key(2) + `')`,
		`SELECT pgfence.lock_release('fs-ACME', 1, '` + key(2) + `')`,
		`SELECT pgfence.lock_grant('fs-ACME', 'b', 60000000, '` + key(2) + `')`,
		`SELECT pgfence.lock_release('fs-ACME', 2, '` + key(2) + `')`,
		`SELECT pgfence.lock_grant('fs-ACME', 'b', 60000000, '` + key(2) + `')`,
		`SELECT pgfence.lock_grant('fs-inv', 'c', 60000000, '` + key(3) + `')`,
		// Rows written through the guard, each at its lock's token.
		`INSERT INTO public.fs_ci VALUES (1, 'fs-acme', 1), (2, 'fs-ACME', 3), (3, 'fs-inv', 1)`,
		// A forged row, past the guard: its lock was never issued.
		`ALTER TABLE public.fs_ci DISABLE TRIGGER USER`,
		`INSERT INTO public.fs_ci VALUES (4, 'FS-INV', 1)`,
		`ALTER TABLE public.fs_ci ENABLE TRIGGER USER`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	const want = "FS-INV rows 1 forged 1; fs-ACME rows 1 forged 0; fs-acme rows 1 forged 0; fs-inv rows 1 forged 0"
	if got := fenceStatus(t, ctx, pool); got == want {
		t.Fatalf("version 30: %s; want the groups merged under the column's collation (the test shows nothing)", got)
	}
	if _, err := p.UpTo(ctx, fenceStatusCollationVersion); err != nil {
		t.Fatal(err)
	}
	if got := fenceStatus(t, ctx, pool); got != want {
		t.Fatalf("version 31: %s\nwant %s", got, want)
	}
	if _, err := p.DownTo(ctx, fenceStatusCollationVersion-1); err != nil {
		t.Fatal(err)
	}
	if got := fenceStatus(t, ctx, pool); got == want {
		t.Fatalf("after the Down: %s; want version 30's groups back", got)
	}
}

// fenceStatus returns pgfence.guarded_fences' groups of public.fs_ci, sorted
// by lock name in byte order.
func fenceStatus(t *testing.T, ctx context.Context, pool *pgxpool.Pool) string {
	t.Helper()
	rows, err := pool.Query(ctx, `SELECT lock_name, rows, forged_rows FROM pgfence.guarded_fences WHERE table_name LIKE '%fs_ci'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var groups []string
	for rows.Next() {
		var (
			name          string
			n, forgedRows int64
		)
		if err := rows.Scan(&name, &n, &forgedRows); err != nil {
			t.Fatal(err)
		}
		groups = append(groups, fmt.Sprintf("%s rows %d forged %d", name, n, forgedRows))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	sort.Strings(groups)
	return strings.Join(groups, "; ")
}
