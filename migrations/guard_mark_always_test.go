package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// guardMarkAlwaysVersion is the version of migration
// 00013_pgfence_guard_mark_always.sql, which takes the WHEN clause of 00011
// away from the reentrant guard's mark trigger again.
const guardMarkAlwaysVersion = 13

// TestGuardMarkAlways: guards attached at version 12 have the mark trigger's
// WHEN clause; migration 00013 takes it away, so that every UPDATE assigning
// the fence calls the mark function (track_functions counts the calls); the
// guards refuse and accept exactly the same changes before the migration,
// after it and after its Down; pgfence.guard() attaches no clause from then
// on, pgfence.set_mark_trigger gives it back to one table, and the Down gives
// it back to all.
func TestGuardMarkAlways(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pool, db, tables, reentrant, statements := markWhenSetup(t, ctx, "guard_mark_always", guardMarkAlwaysVersion)
	before := fmt.Sprintf("version %d", guardMarkAlwaysVersion-1)
	after := fmt.Sprintf("version %d", guardMarkAlwaysVersion)
	isReentrant := func(table string) bool { return reentrant[table] }
	none := func(string) bool { return false }
	checkMarkWhen(t, ctx, pool, before, tables, isReentrant)
	beforeOutcomes := guardOutcomes(t, ctx, pool, statements)
	calls := []struct{ sql, before, after string }{
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id = 2", "check=1 mark=0", "check=1 mark=1"}, // 7 -> 10: raised
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id = 1", "check=1 mark=1", "check=1 mark=1"}, // 10 -> 10: kept
		{"UPDATE gc_column_reentrant_null SET v = v + 1, fence = 10 WHERE id IN (1, 2)", "check=2 mark=1", "check=2 mark=2"},
		{"UPDATE gc_column_strict SET v = v + 1, fence = 10 WHERE id = 2", "check=1 mark=0", "check=1 mark=0"},
	}
	checkCalls := func(phase string, after bool) {
		t.Helper()
		for _, c := range calls {
			want := c.before
			if after {
				want = c.after
			}
			if got := guardCalls(t, ctx, pool, c.sql); got != want {
				t.Errorf("%s: %s: trigger function calls %q, want %q", phase, c.sql, got, want)
			}
		}
	}
	checkCalls(before, false)

	// To this migration's version, not the newest: a later migration must
	// not change what this test sees.
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, guardMarkAlwaysVersion); err != nil {
		t.Fatal(err)
	}
	checkMarkWhen(t, ctx, pool, after, tables, none)
	compareOutcomes(t, before, beforeOutcomes, after, guardOutcomes(t, ctx, pool, statements), statements)
	checkCalls(after, true)

	// A guard attached from now on has no clause; the owner may give it back.
	const table = "gc_column_reentrant_null"
	mustExecPool(t, ctx, pool, "SELECT pgfence.guard('"+table+"', lock_name_column => 'lock', mode => 'reentrant')")
	checkMarkWhen(t, ctx, pool, after+", attached again", tables, none)
	if got := queryString(t, ctx, pool, "SELECT pgfence.set_mark_trigger('"+table+"', true)::text"); got != "true" {
		t.Errorf("set_mark_trigger(%s, true): %s", table, got)
	}
	checkMarkWhen(t, ctx, pool, after+", clause given back", tables, func(tb string) bool { return tb == table })
	compareOutcomes(t, before, beforeOutcomes, after+", clause given back", guardOutcomes(t, ctx, pool, statements), statements)
	mustExecPool(t, ctx, pool, "SELECT pgfence.set_mark_trigger('"+table+"', false)")

	if err := migrations.DownTo(ctx, db, guardMarkAlwaysVersion-1); err != nil {
		t.Fatal(err)
	}
	checkMarkWhen(t, ctx, pool, before+" again", tables, isReentrant)
	compareOutcomes(t, before, beforeOutcomes, before+" again", guardOutcomes(t, ctx, pool, statements), statements)
	checkCalls(before+" again", false)
	mustExecPool(t, ctx, pool, "SELECT pgfence.guard('"+table+"', lock_name_column => 'lock', mode => 'reentrant')")
	checkMarkWhen(t, ctx, pool, before+", attached again", tables, isReentrant)
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
