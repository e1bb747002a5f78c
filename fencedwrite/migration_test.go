package fencedwrite_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestMigrationComments: every table, column and function the fencedwrite
// migration adds carries a comment a DBA can read with \d+ and \df+.
func TestMigrationComments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	rows, err := pool.Query(ctx, `
		SELECT c.relname || '.' || a.attname
		FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
		WHERE a.attrelid IN ('pgfence.fenced_values'::regclass, 'pgfence.guarded_tables'::regclass)
		  AND a.attnum > 0 AND NOT a.attisdropped AND col_description(a.attrelid, a.attnum) IS NULL
		UNION ALL
		SELECT c.relname FROM pg_class c
		WHERE c.oid IN ('pgfence.fenced_values'::regclass, 'pgfence.guarded_tables'::regclass)
		  AND obj_description(c.oid, 'pg_class') IS NULL
		UNION ALL
		SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = 'pgfence'::regnamespace AND obj_description(p.oid, 'pg_proc') IS NULL
		  AND (p.proname IN ('guard', 'unguard') OR p.proname LIKE 'guard\_%')`)
	if err != nil {
		t.Fatal(err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(missing) > 0 {
		t.Fatalf("objects without COMMENT: %v", missing)
	}
	if n := queryInt(t, pool, "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgfence'::regnamespace AND proname IN ('guard', 'unguard')"); n != 2 {
		t.Fatalf("%d guard functions, want 2", n)
	}
}
