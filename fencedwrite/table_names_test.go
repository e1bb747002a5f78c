package fencedwrite_test

import (
	"context"
	"strings"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestTableSQLLookingNames: tables and columns named like SQL keywords
// ("select", "true", "excluded") and like the aliases and CTEs of the
// generated statements themselves (pgfence_t, pgfence_c, pgfence_w,
// pgfence_i, pgfence_u, pgfence_tok, and their result columns token,
// inserted, applied, fence) are written, read and refused exactly like any
// other table, plain and partitioned (whose Upsert is another statement):
// no name is ambiguous, none is taken for a keyword, and a refused write
// changes nothing.
func TestTableSQLLookingNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	set := []string{"pgfence_c", "pgfence_w", "pgfence_i", "pgfence_u", "pgfence_tok", "excluded", "true",
		"token", "inserted", "applied", "fence"}
	types := map[string]string{"token": "bigint", "inserted": "boolean", "applied": "boolean", "fence": "bigint"}
	cols := []string{`"select" bigint NOT NULL`, `"pgfence_t" bigint NOT NULL DEFAULT 0`}
	for _, c := range set {
		typ := types[c]
		if typ == "" {
			typ = "text"
		}
		cols = append(cols, `"`+c+`" `+typ)
	}
	// The row's set values, all derived from s, in the order of set.
	values := func(s string) []any {
		v := make([]any, 0, len(set))
		for _, c := range set {
			switch types[c] {
			case "bigint":
				v = append(v, int64(len(s)))
			case "boolean":
				v = append(v, s != "")
			default:
				v = append(v, s)
			}
		}
		return v
	}
	for _, c := range []struct {
		table       string
		partitioned bool
	}{
		{"pgfence_w", false},
		{"pgfence_tok", false},
		{"pgfence_t", false},
		{"pgfence_c", true},
		{"pgfence_i", true},
		{"pgfence_u", true},
	} {
		ddl := `CREATE TABLE ` + c.table + ` (` + strings.Join(cols, ", ") + `, PRIMARY KEY ("select"))`
		if c.partitioned {
			ddl += ` PARTITION BY RANGE ("select"); CREATE TABLE ` + c.table + `_p PARTITION OF ` + c.table + ` FOR VALUES FROM (0) TO (1000)`
		}
		mustExec(t, pool, ddl)
		tab := prepare(t, pool, fencedwrite.Spec{
			Table:       c.table,
			Key:         []string{"select"},
			Set:         set,
			Read:        []string{"select", "pgfence_t", "pgfence_c", "token"},
			FenceColumn: "pgfence_t",
		})
		key := []any{int64(1)}
		row := func() string {
			return queryString(t, pool, `SELECT "pgfence_c" || ':' || "pgfence_u" || ':' || "token" || ':' || "pgfence_t" FROM `+c.table+` WHERE "select" = 1`)
		}

		res, err := tab.Upsert(ctx, pool, 3, key, values("a"))
		if err != nil || !res.Inserted || res.Fence != 3 {
			t.Fatalf("%s: Upsert of a new row: %+v, %v", c.table, res, err)
		}
		res, err = tab.Upsert(ctx, pool, 4, key, values("bb"))
		if err != nil || res.Inserted || res.Fence != 4 {
			t.Fatalf("%s: Upsert of an existing row: %+v, %v", c.table, res, err)
		}
		_, err = tab.Upsert(ctx, pool, 4, key, values("ccc"))
		wantIs(t, err, pgfence.ErrAlreadyApplied)
		_, err = tab.Upsert(ctx, pool, 3, key, values("ccc"))
		wantStale(t, err, 3, 4)
		_, err = tab.Update(ctx, pool, 3, key, values("ccc"))
		wantStale(t, err, 3, 4)
		_, err = tab.Update(ctx, pool, 4, key, values("ccc"))
		wantIs(t, err, pgfence.ErrAlreadyApplied)
		if got := row(); got != "bb:bb:2:4" {
			t.Fatalf("%s: row after the refused writes = %q, want bb:bb:2:4", c.table, got)
		}

		var k, f, tok int64
		var cur string
		_, err = tab.Read(ctx, pool, 3, key, &k, &f, &cur, &tok)
		wantStale(t, err, 3, 4)
		if _, err := tab.Read(ctx, pool, 5, key, &k, &f, &cur, &tok); err != nil || k != 1 || f != 5 || cur != "bb" || tok != 2 {
			t.Fatalf("%s: Read = %d %d %q %d, %v; want 1 5 bb 2", c.table, k, f, cur, tok, err)
		}
		if res, err := tab.Update(ctx, pool, 6, key, values("dddd")); err != nil || res.Fence != 6 {
			t.Fatalf("%s: Update: %+v, %v", c.table, res, err)
		}
		_, err = tab.Delete(ctx, pool, 5, key)
		wantStale(t, err, 5, 6)
		if got := row(); got != "dddd:dddd:4:6" {
			t.Fatalf("%s: row after the refused Delete = %q, want dddd:dddd:4:6", c.table, got)
		}
		if _, err := tab.Delete(ctx, pool, 6, key); err != nil {
			t.Fatalf("%s: Delete: %v", c.table, err)
		}
		_, err = tab.Delete(ctx, pool, 6, key)
		wantIs(t, err, pgfence.ErrNotFound)
		_, err = tab.Update(ctx, pool, 7, key, values("x"))
		wantIs(t, err, pgfence.ErrNotFound)
		if n := queryInt(t, pool, `SELECT count(*) FROM `+c.table); n != 0 {
			t.Fatalf("%s: %d rows after Delete", c.table, n)
		}
	}
}
