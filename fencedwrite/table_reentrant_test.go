package fencedwrite_test

import (
	"context"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestTableUpsertReentrantAtEqualToken: a Reentrant table's Upsert of an
// existing row accepts the token that wrote it (and writes again), where a
// Strict one refuses it as already applied, and refuses a lower token as
// stale; the same on a plain table (INSERT ... ON CONFLICT) and a
// partitioned one (an INSERT then an UPDATE).
func TestTableUpsertReentrantAtEqualToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE re_plain (id bigint PRIMARY KEY, v text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `CREATE TABLE re_part (id bigint, v text NOT NULL, fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (id))
		PARTITION BY RANGE (id)`)
	mustExec(t, pool, `CREATE TABLE re_part_a PARTITION OF re_part FOR VALUES FROM (0) TO (100)`)
	for _, table := range []string{"re_plain", "re_part"} {
		reent := prepare(t, pool, fencedwrite.Spec{Table: table, Key: []string{"id"}, Set: []string{"v"}, Mode: fencedwrite.Reentrant})
		strict := prepare(t, pool, fencedwrite.Spec{Table: table, Key: []string{"id"}, Set: []string{"v"}})
		key := []any{int64(1)}
		row := func() string { return queryString(t, pool, `SELECT v || ':' || fence FROM `+table+` WHERE id = 1`) }

		if res, err := reent.Upsert(ctx, pool, 7, key, []any{"a"}); err != nil || !res.Inserted || res.Fence != 7 {
			t.Fatalf("%s: Upsert of a new row: %+v, %v", table, res, err)
		}
		if res, err := reent.Upsert(ctx, pool, 7, key, []any{"b"}); err != nil || res.Inserted || res.Fence != 7 {
			t.Fatalf("%s: re-entrant Upsert with the row's own token: %+v, %v; want applied as an update", table, res, err)
		}
		if got := row(); got != "b:7" {
			t.Fatalf("%s: row = %q, want b:7", table, got)
		}
		_, err := strict.Upsert(ctx, pool, 7, key, []any{"c"})
		wantIs(t, err, pgfence.ErrAlreadyApplied)
		_, err = reent.Upsert(ctx, pool, 6, key, []any{"c"})
		wantStale(t, err, 6, 7)
		if got := row(); got != "b:7" {
			t.Fatalf("%s: row after the refused Upserts = %q, want b:7", table, got)
		}
		if res, err := reent.Upsert(ctx, pool, 8, key, []any{"d"}); err != nil || res.Inserted || res.Fence != 8 {
			t.Fatalf("%s: re-entrant Upsert with a newer token: %+v, %v", table, res, err)
		}
		if got := row(); got != "d:8" {
			t.Fatalf("%s: row = %q, want d:8", table, got)
		}
	}
}
