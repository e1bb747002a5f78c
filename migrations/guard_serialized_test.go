package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// guardSerializedVersion is migration 00027_pgfence_guard_serialized.sql.
const guardSerializedVersion = 27

// TestGuardAttachSerialized: a first pgfence.guard() of a table while
// another transaction's first guard() of it is uncommitted waits for it and
// then attaches again. At version 26 it failed with a raw unique violation
// of pg_proc (23505) once the other committed; the Down gives that back.
func TestGuardAttachSerialized(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, guardSerializedVersion)

	// run attaches the guard of a new table twice at once and returns the
	// second attach's SQLSTATE ("" for none) and how many guard triggers
	// the table has then.
	run := func(version int) (code string, triggers int) {
		t.Helper()
		tbl := fmt.Sprintf("guard_serialized_%d", version)
		if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0)`, tbl)); err != nil {
			t.Fatal(err)
		}
		first, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = first.Rollback(ctx) }()
		if _, err := first.Exec(ctx, `SELECT pgfence.guard($1::regclass, lock_name => 'x')`, tbl); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := pool.Exec(ctx, `SELECT pgfence.guard($1::regclass, lock_name => 'x') /* second */`, tbl)
			done <- err
		}()
		if !awaitLockWait(t, ctx, pool, "/* second */", done) {
			t.Fatalf("version %d: the second guard() did not wait for the first: %v", version, <-done)
		}
		if err := first.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		code = sqlState(<-done)
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass
			AND tgname IN ('pgfence_guard_a_mark', 'pgfence_guard_b_check')`, tbl).Scan(&triggers); err != nil {
			t.Fatal(err)
		}
		return code, triggers
	}

	if code, n := run(guardSerializedVersion - 1); code != "23505" {
		t.Errorf("version %d: the second guard(): %q (%d triggers); want 23505 (the old failure)", guardSerializedVersion-1, code, n)
	}
	if _, err := p.UpTo(ctx, guardSerializedVersion); err != nil {
		t.Fatal(err)
	}
	if code, n := run(guardSerializedVersion); code != "" || n != 1 {
		t.Errorf("version %d: the second guard(): %q, %d guard triggers; want no error and 1 (strict: the check)", guardSerializedVersion, code, n)
	}
	// unguard() waits for an uncommitted guard() of the table as well, and
	// then detaches it.
	tbl := "guard_serialized_unguard"
	if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0)`, tbl)); err != nil {
		t.Fatal(err)
	}
	first, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = first.Rollback(ctx) }()
	if _, err := first.Exec(ctx, `SELECT pgfence.guard($1::regclass, lock_name => 'x')`, tbl); err != nil {
		t.Fatal(err)
	}
	type result struct {
		removed bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		r.err = pool.QueryRow(ctx, `SELECT pgfence.unguard($1::regclass) /* detach */`, tbl).Scan(&r.removed)
		done <- r
	}()
	if !awaitLockWait(t, ctx, pool, "/* detach */", done) {
		t.Fatalf("unguard() did not wait for the uncommitted guard(): %+v", <-done)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || !r.removed {
		t.Errorf("unguard() after the guard() committed: removed %v, %v; want true", r.removed, r.err)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname LIKE 'pgfence_guard%'`, tbl).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d guard triggers left after unguard()", left)
	}
}
