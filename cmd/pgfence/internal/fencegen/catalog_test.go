package fencegen_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestGeneratedInheritanceChildNotReached: the generated statements name
// an ordinary table ONLY. Without it they also reached the rows of its
// inheritance children, which its primary key does not cover: a stale
// update that the parent's row refuses was applied to the child's row of
// the same key and reported as success, and a delete deleted both rows.
func TestGeneratedInheritanceChildNotReached(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, s := range []string{
		`CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		`CREATE TABLE acct_archive () INHERITS (acct)`,
		`INSERT INTO acct VALUES (1, 100, 5)`,
		`INSERT INTO acct_archive VALUES (1, 100, 1), (2, 100, 1)`,
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	opts := fencegen.Options{Table: "acct", Key: []string{"id"}, Set: []string{"balance"}, HasFenceColumn: true, Version: "00002"}
	if err := fencegen.Validate(ctx, pool, opts); err != nil {
		t.Fatal(err)
	}
	child := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT string_agg(id || ':' || balance || ':' || fence, ' ' ORDER BY id) FROM ONLY acct_archive`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	update := generatedStatement(t, opts, "FencedUpdateAcct", "token", "id", "balance")
	var pe *pgconn.PgError
	if _, err := pool.Exec(ctx, update, int64(3), int64(1), int64(0)); !errors.As(err, &pe) || pe.Code != "PF003" {
		t.Fatalf("stale update (token 3, parent's fence 5): %v, want PF003", err)
	}
	if _, err := pool.Exec(ctx, update, int64(6), int64(2), int64(0)); !errors.As(err, &pe) || pe.Code != "PF005" {
		t.Fatalf("update of a key only the child has: %v, want PF005", err)
	}
	for _, c := range []struct {
		name   string
		params []string
		args   []any
	}{
		{"FencedUpdateAcct", []string{"token", "id", "balance"}, []any{int64(6), int64(1), int64(50)}},
		{"FencedReadAcct", []string{"token", "id"}, []any{int64(7), int64(1)}},
		{"FencedDeleteAcct", []string{"token", "id"}, []any{int64(7), int64(1)}},
	} {
		if _, err := pool.Exec(ctx, generatedStatement(t, opts, c.name, c.params...), c.args...); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ONLY acct`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("parent rows after the delete: %d, %v; want 0", n, err)
	}
	if got := child(); got != "1:100:1 2:100:1" {
		t.Fatalf("the child's rows changed: %s; want 1:100:1 2:100:1", got)
	}
}

// TestGeneratedPartitioned: a partitioned table's rows are in its
// partitions, so the statements name it without ONLY, which Validate
// requires Options.Partitioned to say (and refuses for an ordinary table);
// Partitioned reads it from the catalog.
func TestGeneratedPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, s := range []string{
		`CREATE TABLE pt (id int, region text, v text, fence bigint NOT NULL DEFAULT 0, PRIMARY KEY (id, region)) PARTITION BY LIST (region)`,
		`CREATE TABLE pt_eu PARTITION OF pt FOR VALUES IN ('eu')`,
		`INSERT INTO pt VALUES (1, 'eu', 'a', 0)`,
		`CREATE TABLE plain (id int PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0)`,
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	opts := fencegen.Options{Table: "pt", Key: []string{"id", "region"}, Set: []string{"v"}, HasFenceColumn: true, Version: "00002"}
	if err := fencegen.Validate(ctx, pool, opts); !matchErr(err, argErr{pgfence.ErrInvalid, "table"}) || !strings.Contains(err.Error(), "partitioned") {
		t.Fatalf("Validate(partitioned table, Partitioned false) = %v; want ErrInvalid naming the table", err)
	}
	if p, err := fencegen.Partitioned(ctx, pool, opts); err != nil || !p {
		t.Fatalf("Partitioned(pt) = %v, %v", p, err)
	}
	opts.Partitioned = true
	if err := fencegen.Validate(ctx, pool, opts); err != nil {
		t.Fatal(err)
	}
	update := generatedStatement(t, opts, "FencedUpdatePt", "token", "id", "region", "v")
	if _, err := pool.Exec(ctx, update, int64(2), 1, "eu", "b"); err != nil {
		t.Fatalf("update of a row in a partition: %v", err)
	}
	var v string
	if err := pool.QueryRow(ctx, `SELECT v || ':' || fence FROM pt WHERE id = 1`).Scan(&v); err != nil || v != "b:2" {
		t.Fatalf("row = %q, %v; want b:2", v, err)
	}
	// The upsert cannot read xmax there (0A000): it inserts, updates and
	// refuses like the ordinary table's.
	upsert := generatedStatement(t, opts, "FencedUpsertPt", "token", "id", "region", "v")
	for _, c := range []struct {
		token    int64
		id       int
		v        string
		fence    int64
		inserted bool
		code     string
	}{
		{3, 2, "new", 3, true, ""},     // no row: inserted into the partition
		{5, 1, "c", 5, false, ""},      // an older fence: updated
		{4, 1, "d", 0, false, "PF003"}, // a newer fence: refused
		{5, 1, "e", 0, false, "PF004"}, // the same token again (strict): refused
	} {
		var (
			fence    int64
			inserted bool
		)
		err := pool.QueryRow(ctx, upsert, c.token, c.id, "eu", c.v).Scan(&fence, &inserted)
		var pgErr *pgconn.PgError
		switch {
		case c.code != "" && (!errors.As(err, &pgErr) || pgErr.Code != c.code):
			t.Errorf("upsert(token %d, id %d) = %v; want SQLSTATE %s", c.token, c.id, err, c.code)
		case c.code == "" && (err != nil || fence != c.fence || inserted != c.inserted):
			t.Errorf("upsert(token %d, id %d) = fence %d, inserted %v, %v; want %d, %v", c.token, c.id, fence, inserted, err, c.fence, c.inserted)
		}
	}
	var rows string
	if err := pool.QueryRow(ctx, `SELECT string_agg(id || ':' || v || ':' || fence, ' ' ORDER BY id) FROM pt`).Scan(&rows); err != nil || rows != "1:c:5 2:new:3" {
		t.Fatalf("rows after the upserts: %q, %v; want 1:c:5 2:new:3", rows, err)
	}
	plain := fencegen.Options{Table: "plain", Key: []string{"id"}, Set: []string{"v"}, HasFenceColumn: true, Version: "00002", Partitioned: true}
	if err := fencegen.Validate(ctx, pool, plain); !matchErr(err, argErr{pgfence.ErrInvalid, "table"}) {
		t.Fatalf("Validate(ordinary table, Partitioned true) = %v; want ErrInvalid naming the table", err)
	}
	if p, err := fencegen.Partitioned(ctx, pool, plain); err != nil || p {
		t.Fatalf("Partitioned(plain) = %v, %v", p, err)
	}
}

// TestGeneratedDomainKeyOperator: a key of a domain over bigint was listed
// by OwnEqualKeys (the domain is not in pg_catalog), so --check generated a
// bare "=" for it, and an "=" planted for the domain on the search_path
// made one update rewrite every row. A domain over a built-in type is
// compared with pg_catalog's "=" of its base type.
func TestGeneratedDomainKeyOperator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, s := range []string{
		`CREATE DOMAIN account_id AS bigint`,
		`CREATE TABLE dacct (id account_id PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`,
		`INSERT INTO dacct SELECT g, 100, 0 FROM generate_series(1, 5) g`,
		`CREATE FUNCTION public.evil_eq(account_id, account_id) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true'`,
		`CREATE OPERATOR public.= (LEFTARG = account_id, RIGHTARG = account_id, FUNCTION = public.evil_eq)`,
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	opts := fencegen.Options{Table: "dacct", Key: []string{"id"}, Set: []string{"balance"}, HasFenceColumn: true, Version: "00002"}
	own, err := fencegen.OwnEqualKeys(ctx, pool, opts)
	if err != nil || len(own) != 0 {
		t.Fatalf("OwnEqualKeys(domain over bigint) = %v, %v; want none", own, err)
	}
	opts.OwnEqualKeys = own
	if _, err := pool.Exec(ctx, generatedStatement(t, opts, "FencedUpdateDacct", "token", "id", "balance"), int64(7), int64(1), int64(0)); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM dacct WHERE balance = 0 OR fence <> 0`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("one fenced update of key 1 changed %d rows (%v): the planted = ran", n, err)
	}
	// An enum keeps its own "=" (pg_catalog has none for it but anyenum's).
	if _, err := pool.Exec(ctx, `CREATE TYPE color AS ENUM ('red', 'green');
		CREATE TABLE paint (c color PRIMARY KEY, n int, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	if own, err := fencegen.OwnEqualKeys(ctx, pool, fencegen.Options{Table: "paint", Key: []string{"c"}}); err != nil || !slices.Equal(own, []string{"c"}) {
		t.Fatalf("OwnEqualKeys(enum) = %v, %v; want [c]", own, err)
	}
}

// TestValidateUnusableKey: Validate refuses the unique indexes that
// fencedwrite.Prepare refuses (here one over a nullable column, which never
// conflicts on NULL), saying why.
func TestValidateUnusableKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE ext (id bigserial PRIMARY KEY, tenant text NOT NULL, ext_id text,
		v text, fence bigint NOT NULL DEFAULT 0, UNIQUE (tenant, ext_id))`); err != nil {
		t.Fatal(err)
	}
	opts := fencegen.Options{Table: "ext", Key: []string{"tenant", "ext_id"}, Set: []string{"v"}, HasFenceColumn: true, Version: "00002"}
	if err := fencegen.Validate(ctx, pool, opts); !matchErr(err, argErr{pgfence.ErrInvalid, "key"}) || !strings.Contains(err.Error(), `"ext_id" is nullable`) {
		t.Fatalf("Validate(nullable unique key) = %v; want ErrInvalid naming the key, saying ext_id is nullable", err)
	}
}
