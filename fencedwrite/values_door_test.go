package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// valueRows is every row of pgfence.fenced_values as JSON, ordered by key.
func valueRows(t *testing.T, db *pgxpool.Pool) string {
	t.Helper()
	return queryString(t, db, `SELECT coalesce(jsonb_agg(to_jsonb(v) ORDER BY v.key), '[]')::text FROM pgfence.fenced_values v`)
}

func sqlStateOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// TestValuesAppRole runs as the application role of docs/migrations.md
// (pgtest.DocRole): a direct INSERT, UPDATE or DELETE on
// pgfence.fenced_values fails with permission denied and changes nothing;
// the helpers, which call the four fenced value functions, work; each bad
// argument of a function fails with SQLSTATE PF011 naming the argument and
// changes nothing.
func TestValuesAppRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	role, appDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")
	app := pgtest.PoolFor(t, appDSN)
	mustExec(t, admin, `INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('a', '"a"', 5), ('b', '"b"', 7)`)

	// Direct writes: permission denied (42501), nothing changes.
	before := valueRows(t, admin)
	for _, stmt := range []string{
		`INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('forged', '1', 1)`,
		`INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('a', '"forged"', 1) ON CONFLICT (key) DO UPDATE SET fence = 0`,
		`UPDATE pgfence.fenced_values SET fence = 0 WHERE key = 'a'`,
		`UPDATE pgfence.fenced_values SET value = '"forged"'`,
		`DELETE FROM pgfence.fenced_values WHERE key = 'b'`,
		`DELETE FROM pgfence.fenced_values`,
	} {
		if _, err := app.Exec(ctx, stmt); sqlStateOf(err) != "42501" {
			t.Errorf("%s as %s: %v, want SQLSTATE 42501", stmt, role, err)
		}
	}
	if after := valueRows(t, admin); after != before {
		t.Fatalf("direct writes changed pgfence.fenced_values:\nbefore %s\nafter  %s", before, after)
	}

	// Through the functions (the helpers), as the same role.
	res, err := fencedwrite.UpsertValue(ctx, app, 8, fencedwrite.Strict, "c", json.RawMessage(`1`))
	if err != nil || !res.Inserted || res.Fence != 8 {
		t.Fatalf("UpsertValue of a new key: %+v, %v", res, err)
	}
	if res, err := fencedwrite.UpsertValue(ctx, app, 9, fencedwrite.Strict, "c", json.RawMessage(`2`)); err != nil || res.Inserted || res.Fence != 9 {
		t.Fatalf("UpsertValue of an existing key: %+v, %v", res, err)
	}
	_, err = fencedwrite.UpsertValue(ctx, app, 9, fencedwrite.Strict, "c", json.RawMessage(`3`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	if _, err := fencedwrite.UpsertValue(ctx, app, 9, fencedwrite.Reentrant, "c", json.RawMessage(`3`)); err != nil {
		t.Fatalf("re-entrant UpsertValue: %v", err)
	}
	if _, err := fencedwrite.UpdateValue(ctx, app, 10, fencedwrite.Strict, "c", json.RawMessage(`4`)); err != nil {
		t.Fatalf("UpdateValue: %v", err)
	}
	_, err = fencedwrite.UpdateValue(ctx, app, 10, fencedwrite.Strict, "c", json.RawMessage(`5`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	if _, err := fencedwrite.UpdateValue(ctx, app, 10, fencedwrite.Reentrant, "c", json.RawMessage(`5`)); err != nil {
		t.Fatalf("re-entrant UpdateValue: %v", err)
	}
	_, err = fencedwrite.UpdateValue(ctx, app, 4, fencedwrite.Reentrant, "a", json.RawMessage(`"old"`))
	wantStale(t, err, 4, 5)
	v, err := fencedwrite.ReadValue(ctx, app, 6, "a")
	if err != nil || string(v.Value) != `"a"` || v.Fence != 6 {
		t.Fatalf("ReadValue: %+v, %v", v, err)
	}
	_, err = fencedwrite.ReadValue(ctx, app, 5, "a")
	wantStale(t, err, 5, 6)
	if _, err := fencedwrite.ModifyValue(ctx, app, 6, "a", func(cur json.RawMessage) (json.RawMessage, error) {
		return json.RawMessage(`"a2"`), nil
	}); err != nil {
		t.Fatalf("ModifyValue: %v", err)
	}
	_, err = fencedwrite.DeleteValue(ctx, app, 6, "b")
	wantStale(t, err, 6, 7)
	if _, err := fencedwrite.DeleteValue(ctx, app, 7, "b"); err != nil {
		t.Fatalf("DeleteValue: %v", err)
	}
	_, err = fencedwrite.UpdateValue(ctx, app, 7, fencedwrite.Strict, "b", json.RawMessage(`1`))
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = fencedwrite.DeleteValue(ctx, app, 7, "b")
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = fencedwrite.ReadValue(ctx, app, 7, "b")
	wantIs(t, err, pgfence.ErrNotFound)
	if v, err := fencedwrite.GetValue(ctx, app, "c"); err != nil || string(v.Value) != "5" || v.Fence != 10 {
		t.Fatalf("GetValue: %+v %s, %v", v, v.Value, err)
	}
	if got, want := valueRows(t, admin), `[{"key": "a", "fence": 6, "value": "a2", `; !strings.HasPrefix(got, want) {
		t.Fatalf("rows after the helpers: %s, want a prefix %s", got, want)
	}

	// The functions' own shape: one row, row_found false for no such key.
	var applied, found bool
	var fence *int64
	if err := app.QueryRow(ctx, `SELECT applied, fence, row_found FROM pgfence.fenced_value_update('nope', '1', 1, false)`).
		Scan(&applied, &fence, &found); err != nil || applied || fence != nil || found {
		t.Fatalf("fenced_value_update of a missing key: applied %v fence %v row_found %v, %v", applied, fence, found, err)
	}

	// Bad arguments: PF011 naming the argument, nothing changes.
	before = valueRows(t, admin)
	long, wide := strings.Repeat("k", 513), strings.Repeat("€", 171) // 513 bytes, 171 characters
	const (
		update = `SELECT * FROM pgfence.fenced_value_update($1, $2, $3, $4)`
		upsert = `SELECT * FROM pgfence.fenced_value_upsert($1, $2, $3, $4)`
		del    = `SELECT * FROM pgfence.fenced_value_delete($1, $2)`
		read   = `SELECT * FROM pgfence.fenced_value_read($1, $2)`
	)
	val := json.RawMessage(`"forged"`)
	for _, c := range []struct {
		sql  string
		args []any
		says string
	}{
		{update, []any{nil, val, 100, false}, "pgfence.fenced_value_update: key must be 1 to 512 bytes, got NULL"},
		{update, []any{"", val, 100, false}, "pgfence.fenced_value_update: key must be 1 to 512 bytes, got 0 bytes"},
		{update, []any{long, val, 100, false}, "key must be 1 to 512 bytes, got 513 bytes"},
		{update, []any{wide, val, 100, false}, "key must be 1 to 512 bytes, got 513 bytes"},
		{update, []any{"a", val, 0, false}, "pgfence.fenced_value_update: token must be > 0, got 0"},
		{update, []any{"a", val, -1, true}, "token must be > 0, got -1"},
		{update, []any{"a", val, nil, true}, "token must be > 0, got NULL"},
		{update, []any{"a", nil, 100, false}, "pgfence.fenced_value_update: value must be a jsonb value"},
		{update, []any{"a", val, 100, nil}, "pgfence.fenced_value_update: reentrant must be true or false, got NULL"},
		{upsert, []any{nil, val, 100, false}, "pgfence.fenced_value_upsert: key must be 1 to 512 bytes, got NULL"},
		{upsert, []any{"", val, 100, false}, "got 0 bytes"},
		{upsert, []any{long, val, 100, true}, "got 513 bytes"},
		{upsert, []any{"new", val, 0, false}, "pgfence.fenced_value_upsert: token must be > 0, got 0"},
		{upsert, []any{"new", val, -1, false}, "token must be > 0, got -1"},
		{upsert, []any{"new", nil, 100, false}, "pgfence.fenced_value_upsert: value must be a jsonb value"},
		{upsert, []any{"new", val, 100, nil}, "pgfence.fenced_value_upsert: reentrant must be true or false"},
		{del, []any{nil, 100}, "pgfence.fenced_value_delete: key must be 1 to 512 bytes, got NULL"},
		{del, []any{"", 100}, "got 0 bytes"},
		{del, []any{long, 100}, "got 513 bytes"},
		{del, []any{"a", 0}, "pgfence.fenced_value_delete: token must be > 0, got 0"},
		{del, []any{"a", -1}, "token must be > 0, got -1"},
		{read, []any{nil, 100}, "pgfence.fenced_value_read: key must be 1 to 512 bytes, got NULL"},
		{read, []any{"", 100}, "got 0 bytes"},
		{read, []any{long, 100}, "got 513 bytes"},
		{read, []any{"a", 0}, "pgfence.fenced_value_read: token must be > 0, got 0"},
		{read, []any{"a", -1}, "token must be > 0, got -1"},
	} {
		_, err := app.Exec(ctx, c.sql, c.args...)
		if sqlStateOf(err) != "PF011" || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s %v: %v, want SQLSTATE PF011 saying %q", c.sql, c.args, err, c.says)
		}
	}
	if after := valueRows(t, admin); after != before {
		t.Fatalf("refused arguments changed pgfence.fenced_values:\nbefore %s\nafter  %s", before, after)
	}
}

// TestValueErrorBadArgument: a PF011 of a fenced value function, which the
// helpers' own checks keep from happening, becomes pgfence.ErrInvalid naming
// the token or "key or value" and keeps the PostgreSQL error.
func TestValueErrorBadArgument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, c := range []struct {
		sql  string
		want error
	}{
		{`SELECT * FROM pgfence.fenced_value_update('k', '1', 0, false)`, invalidArg("token")},
		{`SELECT * FROM pgfence.fenced_value_read('k', -1)`, invalidArg("token")},
		{`SELECT * FROM pgfence.fenced_value_upsert('', '1', 1, false)`, invalidArg("key or value")},
		{`SELECT * FROM pgfence.fenced_value_update('k', NULL, 1, false)`, invalidArg("key or value")},
	} {
		_, err := pool.Exec(ctx, c.sql)
		if sqlStateOf(err) != "PF011" {
			t.Fatalf("%s: %v, want SQLSTATE PF011", c.sql, err)
		}
		got := fencedwrite.ValueError(err)
		var pgErr *pgconn.PgError
		if !matches(got, c.want) || !errors.As(got, &pgErr) {
			t.Errorf("%s: %v, want %v wrapping the PostgreSQL error", c.sql, got, c.want)
		}
	}
	// Anything else is TranslateError's.
	var pe *pgfence.Error
	if got := fencedwrite.ValueError(pgx.ErrTxClosed); !errors.As(got, &pe) || pe.Kind != nil || !errors.Is(got, pgx.ErrTxClosed) {
		t.Errorf("ValueError(ErrTxClosed) = %#v, want a database failure", got)
	}
}
