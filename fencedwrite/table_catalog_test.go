package fencedwrite_test

// Tests of what Prepare reads from the catalog and how the statements it
// builds depend on it: which rows a key reaches (inheritance children,
// partitions), which unique indexes identify one row (collation, operator
// class, DEFERRABLE, NULL), the operator a key is compared with (domains),
// and the names the statements use for their own columns.

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// wantKeyRefused checks that Prepare refused spec with ErrInvalid naming
// Spec.Key, its Reason containing why.
func wantKeyRefused(t *testing.T, db pgfence.DBTX, spec fencedwrite.Spec, why string) {
	t.Helper()
	_, err := fencedwrite.Prepare(context.Background(), db, spec)
	if err == nil {
		t.Fatalf("Prepare(%+v) accepted the key; want ErrInvalid naming Spec.Key (%s)", spec, why)
	}
	var pe *pgfence.Error
	if !matches(err, invalidArg("Spec.Key")) || !errors.As(err, &pe) || !strings.Contains(pe.Reason, why) {
		t.Fatalf("Prepare(%+v) = %v; want ErrInvalid naming Spec.Key, saying %q", spec, err, why)
	}
}

// TestTableInheritanceChildNotReached: a table with an inheritance child
// whose row has the same key. The parent's primary key does not cover the
// child, so the statements must name the parent ONLY: a stale write that the
// parent's row refuses is refused (it was applied to the child's row and
// reported as success), and a Delete deletes the parent's row alone (it
// deleted both).
func TestTableInheritanceChildNotReached(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `CREATE TABLE acct_archive () INHERITS (acct)`)
	mustExec(t, pool, `INSERT INTO acct VALUES (1, 100, 5)`)         // the newer holder (token 5) wrote it
	mustExec(t, pool, `INSERT INTO acct_archive VALUES (1, 100, 1)`) // an old copy, same key
	mustExec(t, pool, `INSERT INTO acct_archive VALUES (2, 100, 1)`) // a key only the child has
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "acct", Key: []string{"id"}, Set: []string{"balance"}})
	child := func() string {
		return queryString(t, pool, `SELECT string_agg(id || ':' || balance || ':' || fence, ' ' ORDER BY id) FROM ONLY acct_archive`)
	}

	_, err := tbl.Update(ctx, pool, 3, []any{int64(1)}, []any{int64(0)})
	wantStale(t, err, 3, 5)
	if n := queryInt(t, pool, `SELECT count(*) FROM acct WHERE balance = 0`); n != 0 {
		t.Fatalf("the refused Update changed %d rows", n)
	}
	if _, err := tbl.Update(ctx, pool, 6, []any{int64(1)}, []any{int64(50)}); err != nil {
		t.Fatal(err)
	}
	if res, err := tbl.Upsert(ctx, pool, 7, []any{int64(1)}, []any{int64(60)}); err != nil || res.Inserted {
		t.Fatalf("Upsert of the parent's row: %+v, %v", res, err)
	}
	var bal int64
	if _, err := tbl.Read(ctx, pool, 7, []any{int64(1)}, &bal); err != nil || bal != 60 {
		t.Fatalf("Read: balance %d, %v; want 60", bal, err)
	}
	// The child's rows are not the parent's: not found through it.
	_, err = tbl.Update(ctx, pool, 8, []any{int64(2)}, []any{int64(0)})
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = tbl.Delete(ctx, pool, 8, []any{int64(2)})
	wantIs(t, err, pgfence.ErrNotFound)
	if _, err := tbl.Delete(ctx, pool, 8, []any{int64(1)}); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM ONLY acct`); n != 0 {
		t.Errorf("Delete left %d rows in the parent", n)
	}
	if got := child(); got != "1:100:1 2:100:1" {
		t.Errorf("the child's rows changed: %s; want 1:100:1 2:100:1", got)
	}
}

// TestTablePartitionedUpsert: a partitioned table's INSERT cannot return
// xmax (0A000), and every Upsert failed. Upsert inserts and updates, says
// which, also inside the caller's transaction for a row it inserted, and
// refuses stale tokens; Update, Read and Delete reach the rows in the
// partitions (no ONLY).
func TestTablePartitionedUpsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE pt (id int, region text, v text, fence bigint NOT NULL DEFAULT 0,
		PRIMARY KEY (id, region)) PARTITION BY LIST (region)`)
	mustExec(t, pool, `CREATE TABLE pt_eu PARTITION OF pt FOR VALUES IN ('eu')`)
	mustExec(t, pool, `CREATE TABLE pt_us PARTITION OF pt FOR VALUES IN ('us')`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "pt", Key: []string{"id", "region"}, Set: []string{"v"}})
	row := func(id int, region string) string {
		return queryString(t, pool, `SELECT v || ':' || fence FROM pt WHERE id = $1 AND region = $2`, id, region)
	}

	if res, err := tbl.Upsert(ctx, pool, 2, []any{1, "eu"}, []any{"a"}); err != nil || !res.Inserted || res.Fence != 2 {
		t.Fatalf("Upsert of a new row: %+v, %v; want inserted, fence 2", res, err)
	}
	if res, err := tbl.Upsert(ctx, pool, 3, []any{1, "eu"}, []any{"b"}); err != nil || res.Inserted || res.Fence != 3 {
		t.Fatalf("Upsert of an existing row: %+v, %v; want updated, fence 3", res, err)
	}
	_, err := tbl.Upsert(ctx, pool, 3, []any{1, "eu"}, []any{"replay"})
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = tbl.Upsert(ctx, pool, 2, []any{1, "eu"}, []any{"stale"})
	wantStale(t, err, 2, 3)
	if got := row(1, "eu"); got != "b:3" {
		t.Fatalf("row after the refusals = %q, want b:3", got)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if res, err := tbl.Upsert(ctx, tx, 4, []any{2, "us"}, []any{"x"}); err != nil || !res.Inserted {
		t.Fatalf("Upsert of a new row in a transaction: %+v, %v", res, err)
	}
	if res, err := tbl.Upsert(ctx, tx, 5, []any{2, "us"}, []any{"y"}); err != nil || res.Inserted {
		t.Fatalf("Upsert in a transaction of the row it inserted: %+v, %v; want updated", res, err)
	}
	_, err = tbl.Upsert(ctx, tx, 4, []any{2, "us"}, []any{"stale"})
	wantStale(t, err, 4, 5)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := row(2, "us"); got != "y:5" {
		t.Fatalf("row inserted and updated in a transaction = %q, want y:5", got)
	}

	if _, err := tbl.Update(ctx, pool, 6, []any{1, "eu"}, []any{"c"}); err != nil {
		t.Fatal(err)
	}
	var v string
	if _, err := tbl.Read(ctx, pool, 7, []any{1, "eu"}, &v); err != nil || v != "c" {
		t.Fatalf("Read = %q, %v; want c", v, err)
	}
	if _, err := tbl.Delete(ctx, pool, 7, []any{1, "eu"}); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM pt`); n != 1 {
		t.Fatalf("%d rows after deleting one of two", n)
	}
}

// TestPrepareRefusesKeyUnderOtherCollation: a key column with a
// case-insensitive collation and a unique index under collation "C" lets
// 'abc' and 'ABC' both exist, and the statements' "=" (the column's
// collation) matches both: a stale write overwrote the other row and was
// reported applied. Such an index is not a key.
func TestPrepareRefusesKeyUnderOtherCollation(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	if queryInt(t, pool, `SELECT count(*) FROM pg_collation WHERE collprovider = 'i'`) == 0 {
		t.Skip("no ICU collations")
	}
	mustExec(t, pool, `CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
	mustExec(t, pool, `CREATE TABLE ck (code text COLLATE ci NOT NULL, v text, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `CREATE UNIQUE INDEX ck_code ON ck (code COLLATE "C")`)
	mustExec(t, pool, `INSERT INTO ck VALUES ('abc', 'x', 5), ('ABC', 'y', 1)`)
	wantKeyRefused(t, pool, fencedwrite.Spec{Table: "ck", Key: []string{"code"}, Set: []string{"v"}}, "collation")
	// The index under the column's own collation is a key.
	mustExec(t, pool, `CREATE TABLE ck2 (code text COLLATE ci NOT NULL UNIQUE, v text, fence bigint NOT NULL DEFAULT 0)`)
	prepare(t, pool, fencedwrite.Spec{Table: "ck2", Key: []string{"code"}, Set: []string{"v"}})
}

// TestPrepareRefusesKeyWithOtherOperatorClass: a citext key with a unique
// index of text's operator class lets 'abc' and 'ABC' both exist, and
// citext's "=" matches both: a stale Update overwrote the other row. Such an
// index is not a key; one with citext's own (default) class is.
func TestPrepareRefusesKeyWithOtherOperatorClass(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE EXTENSION citext`)
	mustExec(t, pool, `CREATE TABLE ok (code citext NOT NULL, v text, fence bigint NOT NULL DEFAULT 0)`)
	mustExec(t, pool, `CREATE UNIQUE INDEX ok_code ON ok (code text_ops)`)
	mustExec(t, pool, `INSERT INTO ok VALUES ('abc', 'x', 5), ('ABC', 'y', 1)`)
	wantKeyRefused(t, pool, fencedwrite.Spec{Table: "ok", Key: []string{"code"}, Set: []string{"v"}}, "operator class")
	mustExec(t, pool, `CREATE TABLE ok2 (code citext PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0)`)
	prepare(t, pool, fencedwrite.Spec{Table: "ok2", Key: []string{"code"}, Set: []string{"v"}})
}

// TestPrepareRefusesDeferrableKey: a DEFERRABLE unique constraint lets
// duplicates exist inside a transaction, and ON CONFLICT cannot use it
// (every Upsert failed, 55000). Prepare refuses it.
func TestPrepareRefusesDeferrableKey(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE dk (id int NOT NULL, v text, fence bigint NOT NULL DEFAULT 0,
		CONSTRAINT dk_id UNIQUE (id) DEFERRABLE INITIALLY IMMEDIATE)`)
	wantKeyRefused(t, pool, fencedwrite.Spec{Table: "dk", Key: []string{"id"}, Set: []string{"v"}}, "DEFERRABLE")
}

// TestPrepareRefusesNullableKey: a unique index over a nullable column
// never conflicts on NULL, so Upsert with a NULL key inserted a new row on
// every call and never refused a stale token. Prepare refuses it unless the
// index is NULLS NOT DISTINCT (PostgreSQL 15+).
func TestPrepareRefusesNullableKey(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE ext (id bigserial PRIMARY KEY, tenant text NOT NULL, ext_id text,
		v text, fence bigint NOT NULL DEFAULT 0, UNIQUE (tenant, ext_id))`)
	wantKeyRefused(t, pool, fencedwrite.Spec{Table: "ext", Key: []string{"tenant", "ext_id"}, Set: []string{"v"}}, `"ext_id" is nullable`)
	if queryInt(t, pool, `SELECT current_setting('server_version_num')::int`) < 150000 {
		return
	}
	mustExec(t, pool, `CREATE TABLE ext2 (tenant text NOT NULL, ext_id text, v text, fence bigint NOT NULL DEFAULT 0,
		UNIQUE NULLS NOT DISTINCT (tenant, ext_id))`)
	prepare(t, pool, fencedwrite.Spec{Table: "ext2", Key: []string{"tenant", "ext_id"}, Set: []string{"v"}})
}

// TestTableRefusesNilKeyValue: a nil key value is ErrInvalid naming the key,
// before any SQL runs: NULL equals nothing, so it named no row (and an
// Upsert through a NULLS NOT DISTINCT key could insert one no other call
// finds).
func TestTableRefusesNilKeyValue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	var nilID *int64
	for _, key := range [][]any{{nil}, {nilID}} {
		_, err := tbl.Upsert(ctx, pool, 5, key, []any{"x"})
		wantIs(t, err, invalidArg("key"))
		_, err = tbl.Update(ctx, pool, 5, key, []any{"x"})
		wantIs(t, err, invalidArg("key"))
		_, err = tbl.Delete(ctx, pool, 5, key)
		wantIs(t, err, invalidArg("key"))
		var s string
		_, err = tbl.Read(ctx, pool, 5, key, &s)
		wantIs(t, err, invalidArg("key"))
		_, err = tbl.Modify(ctx, pool, 5, key, func(cur []any) ([]any, error) { return cur, nil })
		wantIs(t, err, invalidArg("key"))
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM invoices WHERE fence <> 0 OR status <> 'new'`); n != 0 {
		t.Fatalf("%d rows changed", n)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM invoices`); n != 3 {
		t.Fatalf("%d rows, want 3", n)
	}
}

// TestTableDomainKeyComparedAsBaseType: a key of the application's own
// domain over bigint (and a domain over that domain) was compared with a
// bare "=", so an operator planted on the search_path decided which rows a
// write changed: one Update rewrote every row. The key is compared with
// pg_catalog's "=" of the base type.
func TestTableDomainKeyComparedAsBaseType(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE DOMAIN account_id AS bigint`)
	mustExec(t, pool, `CREATE DOMAIN vip_account_id AS account_id CHECK (VALUE > 0)`)
	for _, typ := range []string{"account_id", "vip_account_id"} {
		tbl := "d_" + typ
		mustExec(t, pool, `CREATE TABLE `+tbl+` (id `+typ+` PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
		mustExec(t, pool, `INSERT INTO `+tbl+` SELECT g, 100, 0 FROM generate_series(1, 5) g`)
		// Planted by a role with CREATE on public (the default before PG 15).
		mustExec(t, pool, `CREATE FUNCTION public.evil_eq_`+typ+`(`+typ+`, `+typ+`) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true'`)
		mustExec(t, pool, `CREATE OPERATOR public.= (LEFTARG = `+typ+`, RIGHTARG = `+typ+`, FUNCTION = public.evil_eq_`+typ+`)`)
		if n := queryInt(t, pool, `SELECT count(*) FROM `+tbl+` WHERE id = 1::`+typ); n != 5 {
			t.Fatalf("%s: the planted = matched %d rows, want 5: the test does not plant what it means to", typ, n)
		}
		ft := prepare(t, pool, fencedwrite.Spec{Table: tbl, Key: []string{"id"}, Set: []string{"balance"}})
		if _, err := ft.Update(ctx, pool, 7, []any{int64(1)}, []any{int64(0)}); err != nil {
			t.Fatalf("%s: Update: %v", typ, err)
		}
		if n := queryInt(t, pool, `SELECT count(*) FROM `+tbl+` WHERE balance = 0 OR fence <> 0`); n != 1 {
			t.Errorf("%s: one fenced Update of key 1 changed %d rows (the planted = ran)", typ, n)
		}
		if _, err := ft.Upsert(ctx, pool, 8, []any{int64(2)}, []any{int64(1)}); err != nil {
			t.Fatalf("%s: Upsert: %v", typ, err)
		}
		if _, err := ft.Delete(ctx, pool, 8, []any{int64(3)}); err != nil {
			t.Fatalf("%s: Delete: %v", typ, err)
		}
		_, err := ft.Update(ctx, pool, 9, []any{int64(42)}, []any{int64(0)})
		wantIs(t, err, pgfence.ErrNotFound)
		if got := queryString(t, pool, `SELECT string_agg(id || ':' || balance || ':' || fence, ' ' ORDER BY id::bigint) FROM `+tbl); got != "1:0:7 2:1:8 4:100:0 5:100:0" {
			t.Errorf("%s: rows = %s; want 1:0:7 2:1:8 4:100:0 5:100:0", typ, got)
		}
	}
}

// TestUpsertFenceNamedPgfenceInserted: the upsert named its inserted flag
// pgfence_inserted, so a fence column of that name made every Upsert fail
// (42702, ambiguous column). The statements' own result columns are named by
// the CTEs, so no column name clashes: not the fence, a set column named
// "inserted" nor a key column named "fence".
func TestUpsertFenceNamedPgfenceInserted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE odd2 (fence int PRIMARY KEY, inserted text, pgfence_inserted bigint NOT NULL DEFAULT 0)`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "odd2", Key: []string{"fence"}, Set: []string{"inserted"}, FenceColumn: "pgfence_inserted"})
	if res, err := tbl.Upsert(ctx, pool, 1, []any{1}, []any{"a"}); err != nil || !res.Inserted || res.Fence != 1 {
		t.Fatalf("Upsert of a new row: %+v, %v; want inserted, fence 1", res, err)
	}
	if res, err := tbl.Upsert(ctx, pool, 2, []any{1}, []any{"b"}); err != nil || res.Inserted || res.Fence != 2 {
		t.Fatalf("Upsert of an existing row: %+v, %v; want updated, fence 2", res, err)
	}
	_, err := tbl.Upsert(ctx, pool, 1, []any{1}, []any{"stale"})
	wantStale(t, err, 1, 2)
	if _, err := tbl.Delete(ctx, pool, 2, []any{1}); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM odd2`); n != 0 {
		t.Fatalf("%d rows after Delete", n)
	}
}

// TestTablePartitionedUpsertConcurrentInsert: on a partitioned table a row
// that another transaction inserts while Upsert waits for it is neither
// inserted again nor updated: the write is refused, as stale when the
// row's fence is newer, and otherwise with a retryable error without Kind;
// nothing is written either way.
func TestTablePartitionedUpsertConcurrentInsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `CREATE TABLE pc (id int, region text, v text, fence bigint NOT NULL DEFAULT 0,
		PRIMARY KEY (id, region)) PARTITION BY LIST (region)`)
	mustExec(t, pool, `CREATE TABLE pc_eu PARTITION OF pc FOR VALUES IN ('eu')`)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "pc", Key: []string{"id", "region"}, Set: []string{"v"}})
	for _, c := range []struct {
		id         int
		otherFence int64 // the fence of the row the other transaction inserts
	}{{1, 9}, {2, 1}} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mustExec(t, tx, `INSERT INTO pc VALUES ($1, 'eu', 'other', $2)`, c.id, c.otherFence)
		done := make(chan error, 1)
		go func() {
			_, err := tbl.Upsert(ctx, pool, 5, []any{c.id, "eu"}, []any{"mine"})
			done <- err
		}()
		waitBlocked(t, pool)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		err = <-done
		if c.otherFence > 5 {
			wantStale(t, err, 5, c.otherFence)
		} else {
			var pe *pgfence.Error
			if !errors.As(err, &pe) || pe.Kind != nil || !pgfence.IsRetryable(err) {
				t.Fatalf("Upsert racing an insert with fence %d: %v; want a retryable refusal without Kind", c.otherFence, err)
			}
		}
		if got := queryString(t, pool, `SELECT v || ':' || fence FROM pc WHERE id = $1`, c.id); got != "other:"+strconv.FormatInt(c.otherFence, 10) {
			t.Fatalf("row %d = %q; want the other transaction's", c.id, got)
		}
	}
}

// TestPrepareAcceptsKeyOfSameEquality: unique indexes whose equality is the
// column's own "=" (another deterministic collation, or an operator class
// whose equality is the default class's, such as text_pattern_ops, on a
// column compared deterministically) identify one row exactly as the
// default index would, and are keys. Each case shows that the index refuses
// a duplicate under the column's "=" and that ON CONFLICT infers it; the
// first version of the stricter key rule refused all three.
func TestPrepareAcceptsKeyOfSameEquality(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, c := range []struct{ name, ddl string }{
		{"text_pattern_ops", `CREATE TABLE sameeq1 (code text NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
			CREATE UNIQUE INDEX sameeq1_code ON sameeq1 (code text_pattern_ops)`},
		{"varchar_pattern_ops", `CREATE TABLE sameeq2 (code varchar(20) NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
			CREATE UNIQUE INDEX sameeq2_code ON sameeq2 (code varchar_pattern_ops)`},
		{"COLLATE C (deterministic)", `CREATE TABLE sameeq3 (code text NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
			CREATE UNIQUE INDEX sameeq3_code ON sameeq3 (code COLLATE "C")`},
	} {
		t.Run(c.name, func(t *testing.T) {
			mustExec(t, pool, c.ddl)
		})
	}
	for i, tbl := range []string{"sameeq1", "sameeq2", "sameeq3"} {
		mustExec(t, pool, `INSERT INTO `+tbl+` VALUES ('abc', 'x', 5)`)
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl+` VALUES ('abc', 'y', 1)`); err == nil {
			t.Fatalf("%s: the unique index let a duplicate in", tbl)
		}
		// ON CONFLICT (code) infers the index (what Upsert needs).
		mustExec(t, pool, `INSERT INTO `+tbl+` VALUES ('abc', 'y', 6) ON CONFLICT (code) DO UPDATE SET v = excluded.v`)
		_, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: tbl, Key: []string{"code"}, Set: []string{"v"}})
		if err != nil {
			t.Errorf("case %d (%s): Prepare refused a key that identifies one row: %v", i, tbl, err)
		}
	}
}
