package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGuardedFencesRefusesNonTables: the owner of a guarded table can turn
// it into a view (drop the guard's trigger, empty it, CREATE RULE
// "_RETURN"); the relation keeps its oid, so the guard's registration still
// names it. pgfence.guarded_fences read it as the reader (an on-call role, a
// superuser) and so ran the owner's function with the reader's rights. Since
// 00024 a relation that is not a table is listed unchecked and not read.
func TestGuardedFencesRefusesNonTables(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, p := beforeMigration(t, ctx, 24)
	dsn := admin.Config().ConnString()
	owner, ownerID := loginRole(t, ctx, dsn, admin, "tblowner")
	mustExecPool(t, ctx, admin, "CREATE SCHEMA own AUTHORIZATION "+ownerID)
	mustExecPool(t, ctx, admin, "CREATE TABLE public.ran (who text)")
	mustExecPool(t, ctx, admin, "GRANT INSERT ON public.ran TO PUBLIC")
	ow := pgtest.PoolFor(t, withUser(t, dsn, owner))
	mustExecPool(t, ctx, ow, `CREATE TABLE own.t (id int PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExecPool(t, ctx, ow, `INSERT INTO own.t VALUES (1, 'l', 0)`)
	mustExecPool(t, ctx, admin, `SELECT pgfence.guard('own.t', lock_name_column => 'lock')`)
	mustExecPool(t, ctx, ow, `CREATE FUNCTION own.planted() RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO public.ran VALUES (current_user); RETURN true; END $$`)
	for _, s := range []string{
		`DROP TRIGGER pgfence_guard_b_check ON own.t`,
		`DELETE FROM own.t`,
		`ALTER TABLE own.t DROP CONSTRAINT t_pkey`,
		`VACUUM own.t`, // clears relhastriggers and relhasindex
		`CREATE RULE "_RETURN" AS ON SELECT TO own.t DO INSTEAD SELECT 1 AS id, 'l'::text AS lock, 0::bigint AS fence WHERE own.planted()`,
	} {
		mustExecPool(t, ctx, ow, s)
	}
	read := func() (ran, unchecked string) {
		t.Helper()
		mustExecPool(t, ctx, admin, `TRUNCATE public.ran`)
		unchecked = queryString(t, ctx, admin, `SELECT string_agg(coalesce(unchecked, 'read'), ';') FROM pgfence.guarded_fences WHERE table_name LIKE '%own.t'`)
		return queryString(t, ctx, admin, `SELECT string_agg(who, ',') FROM public.ran`), unchecked
	}
	if ran, _ := read(); ran == "" {
		t.Error("at 23 the view's planted function did not run: the test no longer shows the defect")
	}
	if _, err := p.UpTo(ctx, 24); err != nil {
		t.Fatal(err)
	}
	if ran, unchecked := read(); ran != "" || !strings.Contains(unchecked, "not a table") {
		t.Errorf("at 24: the owner's function ran as %q; unchecked %q, want it to say the relation is not a table", ran, unchecked)
	}

	// A table with a foreign-table partition is not read either, and an
	// ordinary guarded table still is.
	mustExecPool(t, ctx, admin, `CREATE TABLE pt (id int, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0) PARTITION BY LIST (id)`)
	mustExecPool(t, ctx, admin, `CREATE TABLE pt1 PARTITION OF pt FOR VALUES IN (1)`)
	mustExecPool(t, ctx, admin, `CREATE TABLE plain (id int PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExecPool(t, ctx, admin, `INSERT INTO plain VALUES (1, 'l', 0), (2, 'l', 0)`)
	for _, tbl := range []string{"pt", "plain"} {
		mustExecPool(t, ctx, admin, `SELECT pgfence.guard('`+tbl+`', lock_name_column => 'lock')`)
	}
	mustExecPool(t, ctx, admin, `CREATE EXTENSION IF NOT EXISTS postgres_fdw`)
	mustExecPool(t, ctx, admin, `CREATE SERVER loop FOREIGN DATA WRAPPER postgres_fdw`)
	mustExecPool(t, ctx, admin, `CREATE FOREIGN TABLE pt2 PARTITION OF pt FOR VALUES IN (2) SERVER loop`)
	if got := queryString(t, ctx, admin, `SELECT unchecked FROM pgfence.guarded_fences WHERE table_name = 'pt'`); !strings.Contains(got, "pt2") {
		t.Errorf("partitioned table with a foreign partition: unchecked %q, want it to name pt2", got)
	}
	if got := queryString(t, ctx, admin, `SELECT rows || ':' || coalesce(unchecked, 'read') FROM pgfence.guarded_fences WHERE table_name = 'plain'`); got != "2:read" {
		t.Errorf("ordinary guarded table: %q, want 2 rows read", got)
	}

	// Each table of a tree is read ONLY, and together they are all of it:
	// an inheritance parent and its child, a lock name expression.
	for _, s := range []string{
		`CREATE TABLE inh (id int, region text NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		`CREATE TABLE inh_c (extra int) INHERITS (inh)`,
		`INSERT INTO inh VALUES (1, 'eu', 0)`,
		`INSERT INTO inh_c VALUES (2, 'eu', 0, 7), (3, 'us', 0, 7)`,
		`SELECT pgfence.guard('inh', lock_name_expression => $e$'region:' || region$e$)`,
	} {
		mustExecPool(t, ctx, admin, s)
	}
	if got := queryString(t, ctx, admin, `SELECT string_agg(lock_name || '=' || rows || ':' || coalesce(unchecked, 'read'), ' ' ORDER BY lock_name)
		FROM pgfence.guarded_fences WHERE table_name = 'inh'`); got != "region:eu=2:read region:us=1:read" {
		t.Errorf("inheritance parent with a child, lock name expression: %q, want region:eu=2:read region:us=1:read", got)
	}
}

// TestGuardedFencesColumnGrantReader: a reader with the on-call grants and
// SELECT on a guarded table's fence and lock columns only reads its figures
// at 24 as at 23 (LOCK TABLE needs SELECT on the whole table: such a reader
// is not made to take the lock).
func TestGuardedFencesColumnGrantReader(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, p := beforeMigration(t, ctx, 24)
	dsn := admin.Config().ConnString()
	mustExecPool(t, ctx, admin, `CREATE TABLE public.g (id int PRIMARY KEY, lock text NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExecPool(t, ctx, admin, `INSERT INTO public.g VALUES (1, 'l', 0), (2, 'l', 0)`)
	mustExecPool(t, ctx, admin, `SELECT pgfence.guard('public.g', lock_name_column => 'lock')`)
	name, roleDSN := pgtest.DocRole(t, "observability.md", dsn, "pgfence_oncall")
	mustExecPool(t, ctx, admin, `GRANT SELECT (lock, fence) ON public.g TO `+pgx.Identifier{name}.Sanitize())
	reader := pgtest.PoolFor(t, roleDSN)
	for _, v := range []int64{23, 24} {
		if v == 24 {
			if _, err := p.UpTo(ctx, 24); err != nil {
				t.Fatal(err)
			}
		}
		var rows *int64
		if err := reader.QueryRow(ctx, `SELECT rows FROM pgfence.guarded_fences`).Scan(&rows); err != nil || rows == nil || *rows != 2 {
			t.Errorf("at %d, on-call role with column grants: rows %v, %v; want 2", v, rows, err)
		}
	}
}

// TestOutboxStatusCountsPrunedDelivered: pgfence.outbox_status joined each
// intent to its job, so deleting finished jobs (as docs/outbox.md
// recommends) took delivered intents out of the counts, and a topic whose
// jobs were all deleted out of the view. Since 00024 an intent whose job is
// gone counts as delivered.
func TestOutboxStatusCountsPrunedDelivered(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, 24)
	const key = `\x000102030405060708090a0b0c0d0e0f`
	var token int64
	if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant('ol', 'h', 60000000, '`+key+`')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b"} {
		mustExecPool(t, ctx, pool, fmt.Sprintf(`SELECT pgfence.outbox_enqueue('ol', %d, '%s', 'topic1', '%s', '{}'::jsonb, 5, NULL)`, token, key, k))
	}
	mustExecPool(t, ctx, pool, `UPDATE pgfence.jobs SET state = 'completed', finished_at = now() WHERE id IN (SELECT id FROM pgfence.outbox)`)
	mustExecPool(t, ctx, pool, `DELETE FROM pgfence.jobs WHERE state = 'completed'`)
	status := func() string {
		return queryString(t, ctx, pool, `SELECT string_agg(topic || ':' || delivered, ',') FROM pgfence.outbox_status`)
	}
	if got := status(); got != "" {
		t.Errorf("at 23: outbox_status %q; the test expected the pruned topic missing (the defect)", got)
	}
	if _, err := p.UpTo(ctx, 24); err != nil {
		t.Fatal(err)
	}
	if got := status(); got != "topic1:2" {
		t.Errorf("at 24: outbox_status %q, want topic1:2 (two delivered intents whose jobs were deleted)", got)
	}
}

// TestGuardedFencesDisabledTrigger: a guard whose check trigger its table's
// owner disabled (ALTER TABLE ... DISABLE TRIGGER) checks nothing, and
// pgfence.guarded_fences listed the table as any other; since 00024 a row
// of its own says so, beside the figures, until the trigger is enabled.
func TestGuardedFencesDisabledTrigger(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, _ := beforeMigration(t, ctx, 25)
	mustExecPool(t, ctx, admin, `CREATE TABLE d (id int PRIMARY KEY, fence bigint NOT NULL DEFAULT 0)`)
	mustExecPool(t, ctx, admin, `INSERT INTO d VALUES (1, 0)`)
	mustExecPool(t, ctx, admin, `SELECT pgfence.guard('d', lock_name => 'l')`)
	state := func() string {
		return queryString(t, ctx, admin, `SELECT string_agg(coalesce(rows::text, '-') || ':' || coalesce(unchecked, 'read'), ' | ' ORDER BY unchecked NULLS FIRST)
			FROM pgfence.guarded_fences WHERE table_name = 'd'`)
	}
	if got := state(); got != "1:read" {
		t.Fatalf("enabled guard: %q, want 1:read", got)
	}
	mustExecPool(t, ctx, admin, `ALTER TABLE d DISABLE TRIGGER pgfence_guard_b_check`)
	if got := state(); !strings.HasPrefix(got, "1:read | -:the guard's trigger pgfence_guard_b_check is disabled or missing on public.d:") {
		t.Errorf("disabled guard: %q, want the figures and a row saying the trigger is disabled", got)
	}
	mustExecPool(t, ctx, admin, `ALTER TABLE d ENABLE TRIGGER pgfence_guard_b_check`)
	if got := state(); got != "1:read" {
		t.Errorf("enabled again: %q, want 1:read", got)
	}
	// One partition's trigger disabled: the parent's is enabled, the
	// partition's writes are not checked.
	mustExecPool(t, ctx, admin, `CREATE TABLE pd (id int, fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (id)) PARTITION BY RANGE (id)`)
	mustExecPool(t, ctx, admin, `CREATE TABLE pd1 PARTITION OF pd FOR VALUES FROM (0) TO (100)`)
	mustExecPool(t, ctx, admin, `SELECT pgfence.guard('pd', lock_name => 'l')`)
	mustExecPool(t, ctx, admin, `ALTER TABLE pd1 DISABLE TRIGGER pgfence_guard_b_check`)
	if got := queryString(t, ctx, admin, `SELECT string_agg(unchecked, ' | ') FROM pgfence.guarded_fences WHERE table_name = 'pd'`); !strings.Contains(got, "missing on public.pd1:") {
		t.Errorf("a partition's trigger disabled: %q, want a row naming pd1", got)
	}
}
