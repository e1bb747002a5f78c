package fencegen_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// generatedStatement returns the statement named name of the query file of
// opts, its sqlc parameters @p (with or without a ::bigint cast) replaced by
// $1, $2, ... in the order of params.
func generatedStatement(t *testing.T, opts fencegen.Options, name string, params ...string) string {
	t.Helper()
	files, err := fencegen.Generate(opts)
	if err != nil {
		t.Fatal(err)
	}
	for _, part := range strings.Split(string(files.Queries.Data), "-- name: ") {
		if first, body, _ := strings.Cut(part, "\n"); strings.HasPrefix(first, name+" ") {
			for i, p := range params {
				body = strings.ReplaceAll(body, "@"+p, "$"+string(rune('1'+i)))
			}
			if strings.Contains(body, "@") {
				t.Fatalf("%s: a parameter is left: %s", name, body)
			}
			return body
		}
	}
	t.Fatalf("no statement %s", name)
	return ""
}

// TestGeneratedKeyOperator: the generated statements compare a key of a
// built-in type with pg_catalog's "=", so an "=(varchar, varchar)" planted in
// public (which would win over pg_catalog's text "=", needing no cast) does
// not run; a key whose type brings its own "=" (citext) keeps it when
// OwnEqualKeys, read from the catalog, lists it.
func TestGeneratedKeyOperator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, s := range []string{
		`CREATE EXTENSION citext`,
		`CREATE TABLE vk (code varchar(20) PRIMARY KEY, n int NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0)`,
		`INSERT INTO vk (code) VALUES ('a'), ('b'), ('c')`,
		`CREATE TABLE ck (code citext PRIMARY KEY, n int NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0)`,
		`INSERT INTO ck (code) VALUES ('abc')`,
		`CREATE FUNCTION public.planted_eq(varchar, varchar) RETURNS boolean LANGUAGE sql AS 'SELECT true'`,
		`CREATE OPERATOR public.= (LEFTARG = varchar, RIGHTARG = varchar, FUNCTION = public.planted_eq)`,
	} {
		if _, err := pool.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	// The planted operator is what a bare "=" runs on this path.
	var all int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM vk WHERE code = 'a'::varchar`).Scan(&all); err != nil || all != 3 {
		t.Fatalf("bare = on the planted path matched %d rows (%v), want all 3: the test does not plant what it means to", all, err)
	}

	vk := fencegen.Options{Table: "vk", Key: []string{"code"}, Set: []string{"n"}, HasFenceColumn: true, Version: "00002"}
	if own, err := fencegen.OwnEqualKeys(ctx, pool, vk); err != nil || len(own) != 0 {
		t.Fatalf("OwnEqualKeys(varchar key) = %v, %v; want none", own, err)
	}
	for _, c := range []struct {
		name   string
		params []string
		args   []any
	}{
		{"FencedUpdateVk", []string{"token", "code", "n"}, []any{int64(5), "a", 7}},
		{"FencedUpdateVkReentrant", []string{"token", "code", "n"}, []any{int64(6), "a", 8}},
		{"FencedReadVk", []string{"token", "code"}, []any{int64(7), "a"}},
		{"FencedDeleteVk", []string{"token", "code"}, []any{int64(8), "a"}},
	} {
		stmt := generatedStatement(t, vk, c.name, c.params...)
		if _, err := pool.Exec(ctx, stmt, c.args...); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var changed int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM vk WHERE code OPERATOR(pg_catalog.<>) 'a' AND (fence OPERATOR(pg_catalog.<>) 0 OR n OPERATOR(pg_catalog.<>) 0)`).Scan(&changed); err != nil || changed != 0 {
			t.Fatalf("%s changed %d rows other than its key's (%v): the planted = ran", c.name, changed, err)
		}
	}
	// A key absent is refused as no such row, not matched by the planted =.
	stmt := generatedStatement(t, vk, "FencedUpdateVk", "token", "code", "n")
	var pe *pgconn.PgError
	if _, err := pool.Exec(ctx, stmt, int64(9), "zz", 1); !errors.As(err, &pe) || pe.Code != "PF005" {
		t.Fatalf("update of an absent key: %v, want PF005 (no such row)", err)
	}

	ck := fencegen.Options{Table: "ck", Key: []string{"code"}, Set: []string{"n"}, HasFenceColumn: true, Version: "00002"}
	own, err := fencegen.OwnEqualKeys(ctx, pool, ck)
	if err != nil || !slices.Equal(own, []string{"code"}) {
		t.Fatalf("OwnEqualKeys(citext key) = %v, %v; want [code]", own, err)
	}
	// Without it, pg_catalog's "=" compares citext as text: 'ABC' is not
	// 'abc'. With it, citext's own "=" matches the row.
	update := func(o fencegen.Options, token int64) error {
		_, err := pool.Exec(ctx, generatedStatement(t, o, "FencedUpdateCk", "token", "code", "n"), token, "ABC", 1)
		return err
	}
	if err := update(ck, 1); !errors.As(err, &pe) || pe.Code != "PF005" {
		t.Fatalf("citext key compared with pg_catalog's =: %v, want PF005", err)
	}
	ck.OwnEqualKeys = own
	if err := update(ck, 2); err != nil {
		t.Fatalf("citext key compared with its own =: %v", err)
	}
	assertFence(t, pool, "ck", 2)
}

func assertFence(t *testing.T, pool *pgxpool.Pool, table string, want int64) {
	t.Helper()
	var got int64
	if err := pool.QueryRow(context.Background(), "SELECT max(fence) FROM "+table).Scan(&got); err != nil || got != want {
		t.Fatalf("%s: fence %d (%v), want %d", table, got, err, want)
	}
}
