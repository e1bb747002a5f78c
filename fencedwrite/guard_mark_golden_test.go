package fencedwrite_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGuardMarkSourceGolden holds the source of the reentrant mode's mark
// function (trigger pgfence_guard_a_mark calls <trigger function>_mark)
// against testdata/guard/*-mark.plpgsql, as TestGuardSourceGolden does for the
// check function; a strict guard has none. Rewrite with the same flag:
//
//	go test -run TestGuardMarkSourceGolden ./fencedwrite -update-guard-golden
func TestGuardMarkSourceGolden(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE golden_mark (id bigint PRIMARY KEY, lock_col text NOT NULL, "FenceCol" bigint NOT NULL DEFAULT 0)`)
	markSource := func() (src string, found bool) {
		t.Helper()
		err := pool.QueryRow(ctx, `
			SELECT coalesce(max(p.prosrc), ''), count(p.oid) > 0 FROM pgfence.guarded_tables g
			JOIN pg_proc p ON p.proname = g.trigger_function || '_mark'
			JOIN pg_namespace n ON n.oid = p.pronamespace AND n.nspname = 'pgfence'
			WHERE g.relid = 'golden_mark'::regclass`).Scan(&src, &found)
		if err != nil {
			t.Fatalf("read the mark function: %v", err)
		}
		return src, found
	}

	if err := fencedwrite.Guard(ctx, pool, "golden_mark", fencedwrite.GuardOptions{
		LockNameColumn: "lock_col", FenceColumn: "FenceCol"}); err != nil {
		t.Fatal(err)
	}
	if _, found := markSource(); found {
		t.Fatal("a strict guard has a mark function")
	}
	if err := fencedwrite.Guard(ctx, pool, "golden_mark", fencedwrite.GuardOptions{
		LockNameColumn: "lock_col", FenceColumn: "FenceCol", Mode: fencedwrite.Reentrant}); err != nil {
		t.Fatal(err)
	}
	src, found := markSource()
	if !found {
		t.Fatal("a reentrant guard has no mark function")
	}
	path := filepath.Join("testdata", "guard", "column-reentrant-mark.plpgsql")
	if *updateGolden {
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	} else if want, err := os.ReadFile(path); err != nil {
		t.Fatalf("%v (create it with -update-guard-golden)", err)
	} else if src != string(want) {
		t.Errorf("pgfence.guard() generates another mark function than %s:\n%s\n(if the generator changed on purpose, "+
			"run with -update-guard-golden and review the diff)", path, src)
	}

	// Detached, the guard leaves neither function behind.
	if had, err := fencedwrite.Unguard(ctx, pool, "golden_mark"); err != nil || !had {
		t.Fatalf("Unguard: %v, %v", had, err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgfence'::regnamespace
		AND proname LIKE 'guard\_%'`); n != 0 {
		t.Fatalf("%d generated functions left after Unguard", n)
	}
}
