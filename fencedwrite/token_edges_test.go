package fencedwrite_test

// Tests of fenced writes at the ends of the token range: the largest
// bigint is a token like any other (no arithmetic on it overflows), and
// the smallest is refused with the other tokens not above 0.

import (
	"context"
	"encoding/json"
	"math"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestValuesAtTokenEdges: a fenced value written with math.MaxInt64 takes
// that fence; the same token is then refused under Strict and accepted
// under Reentrant, the token just below it is refused as stale by writes
// and by the fenced read, and 0, -1 and math.MinInt64 are refused before
// any SQL, changing nothing.
func TestValuesAtTokenEdges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	const top = int64(math.MaxInt64)
	if _, err := fencedwrite.UpsertValue(ctx, pool, 5, fencedwrite.Strict, "k", json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	if res, err := fencedwrite.UpdateValue(ctx, pool, top, fencedwrite.Strict, "k", json.RawMessage(`2`)); err != nil || res.Fence != top {
		t.Fatalf("UpdateValue with MaxInt64: %+v, %v; want fence %d", res, err, top)
	}
	_, err := fencedwrite.UpdateValue(ctx, pool, top, fencedwrite.Strict, "k", json.RawMessage(`3`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = fencedwrite.UpsertValue(ctx, pool, top, fencedwrite.Strict, "k", json.RawMessage(`3`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = fencedwrite.UpdateValue(ctx, pool, top-1, fencedwrite.Reentrant, "k", json.RawMessage(`3`))
	wantStale(t, err, top-1, top)
	_, err = fencedwrite.ReadValue(ctx, pool, top-1, "k")
	wantStale(t, err, top-1, top)
	_, err = fencedwrite.DeleteValue(ctx, pool, top-1, "k")
	wantStale(t, err, top-1, top)
	if res, err := fencedwrite.UpsertValue(ctx, pool, top, fencedwrite.Reentrant, "k", json.RawMessage(`4`)); err != nil || res.Inserted || res.Fence != top {
		t.Fatalf("re-entrant UpsertValue with MaxInt64: %+v, %v", res, err)
	}
	if v, err := fencedwrite.ReadValue(ctx, pool, top, "k"); err != nil || string(v.Value) != "4" || v.Fence != top {
		t.Fatalf("ReadValue with MaxInt64: %+v %s, %v; want 4 with fence %d", v, v.Value, err, top)
	}

	for _, tok := range []int64{0, -1, math.MinInt64} {
		_, err = fencedwrite.UpsertValue(ctx, pool, tok, fencedwrite.Reentrant, "k", json.RawMessage(`5`))
		wantIs(t, err, invalidArg("token"))
		_, err = fencedwrite.UpdateValue(ctx, pool, tok, fencedwrite.Strict, "k", json.RawMessage(`5`))
		wantIs(t, err, invalidArg("token"))
		_, err = fencedwrite.ReadValue(ctx, pool, tok, "k")
		wantIs(t, err, invalidArg("token"))
		_, err = fencedwrite.DeleteValue(ctx, pool, tok, "k")
		wantIs(t, err, invalidArg("token"))
	}
	v, err := fencedwrite.GetValue(ctx, pool, "k")
	if err != nil || string(v.Value) != "4" || v.Fence != top {
		t.Fatalf("value after the refused calls: %+v %s, %v; want 4 with fence %d", v, v.Value, err, top)
	}
	if _, err := fencedwrite.DeleteValue(ctx, pool, top, "k"); err != nil {
		t.Fatalf("DeleteValue with MaxInt64: %v", err)
	}
	_, err = fencedwrite.GetValue(ctx, pool, "k")
	wantIs(t, err, pgfence.ErrNotFound)
}

// TestTableAtTokenEdges: the same for a prepared table: Update, Upsert,
// Read and Delete with math.MaxInt64 work and leave that fence, the token
// below it is refused as stale, and math.MinInt64 is refused before any SQL.
func TestTableAtTokenEdges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	const top = int64(math.MaxInt64)
	strict := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	reent := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}, Mode: fencedwrite.Reentrant})
	row := func() string {
		return queryString(t, pool, `SELECT status || ':' || fence FROM invoices WHERE id = 1`)
	}
	if res, err := strict.Update(ctx, pool, top, []any{1}, []any{"a"}); err != nil || res.Fence != top {
		t.Fatalf("Update with MaxInt64: %+v, %v", res, err)
	}
	_, err := strict.Upsert(ctx, pool, top, []any{1}, []any{"b"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	if res, err := reent.Upsert(ctx, pool, top, []any{1}, []any{"b"}); err != nil || res.Inserted || res.Fence != top {
		t.Fatalf("re-entrant Upsert with MaxInt64: %+v, %v", res, err)
	}
	_, err = reent.Update(ctx, pool, top-1, []any{1}, []any{"stale"})
	wantStale(t, err, top-1, top)
	var status string
	_, err = strict.Read(ctx, pool, top-1, []any{1}, &status)
	wantStale(t, err, top-1, top)
	if _, err := strict.Read(ctx, pool, top, []any{1}, &status); err != nil || status != "b" {
		t.Fatalf("Read with MaxInt64: %q, %v; want b", status, err)
	}
	_, err = strict.Update(ctx, pool, math.MinInt64, []any{1}, []any{"min"})
	wantIs(t, err, invalidArg("token"))
	_, err = strict.Delete(ctx, pool, math.MinInt64, []any{1})
	wantIs(t, err, invalidArg("token"))
	want := "b:" + "9223372036854775807"
	if got := row(); got != want {
		t.Fatalf("row after the refused calls = %q, want %q", got, want)
	}
	// A new row upserted with MaxInt64, then deleted with it.
	if res, err := strict.Upsert(ctx, pool, top, []any{10}, []any{"new"}); err != nil || !res.Inserted || res.Fence != top {
		t.Fatalf("Upsert of a new row with MaxInt64: %+v, %v", res, err)
	}
	if _, err := strict.Delete(ctx, pool, top, []any{10}); err != nil {
		t.Fatalf("Delete with MaxInt64: %v", err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM invoices WHERE id = 10`); n != 0 {
		t.Fatalf("%d rows left after Delete", n)
	}
}
