package faultsuite

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

// TestValuesDoorProbes: as a role with exactly docs/migrations.md's grants,
// every direct change of pgfence.fenced_values (INSERT, UPDATE, DELETE,
// TRUNCATE, COPY, a row lock, DDL, a trigger, a replaced or overloaded
// function) fails, and the fenced value functions refuse every write an
// older holder of the lease could attempt: its lower token through update,
// upsert, delete and read in either mode, the current grant's token again in
// strict mode, and NULL arguments that would make the fence check neither
// true nor false (PF011). A role with SELECT on the table but no EXECUTE
// cannot call the functions. Nothing changes, and the current holder writes
// afterwards.
func TestValuesDoorProbes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, admin, app, role := integritySetup(t, ctx)

	// The first grant of lease "cursor" wrote the key, the second (the
	// victim) wrote it again; the first grant's token is old.
	l := newIntegLocker(t, app, pglock.Config{Holder: "worker"})
	first, err := l.TryAcquire(ctx, "cursor", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fencedwrite.UpsertValue(ctx, app, first.Token(), fencedwrite.Strict, "cursor", json.RawMessage(`{"offset": 1}`)); err != nil {
		t.Fatalf("the first grant's write: %v", err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	victim, err := l.TryAcquire(ctx, "cursor", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Release(context.Background())
	old, tok := first.Token(), victim.Token()
	if _, err := fencedwrite.UpdateValue(ctx, app, tok, fencedwrite.Strict, "cursor", json.RawMessage(`{"offset": 2}`)); err != nil {
		t.Fatalf("the victim's write: %v", err)
	}

	rows := func() string {
		t.Helper()
		var s string
		if err := admin.QueryRow(ctx, `SELECT coalesce(jsonb_agg(to_jsonb(v) ORDER BY v.key), '[]')::text
			FROM pgfence.fenced_values v`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := rows()

	// Direct changes: permission denied, whatever they would write.
	for _, stmt := range []string{
		`INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('forged', '1', 9223372036854775807)`,
		`INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('cursor', '{}', 1) ON CONFLICT (key) DO UPDATE SET fence = 0`,
		`UPDATE pgfence.fenced_values SET fence = 0 WHERE key = 'cursor'`,
		`UPDATE pgfence.fenced_values SET value = '{"offset": 0}'`,
		`DELETE FROM pgfence.fenced_values WHERE key = 'cursor'`,
		`TRUNCATE pgfence.fenced_values`,
		`SELECT 1 FROM pgfence.fenced_values WHERE key = 'cursor' FOR UPDATE`,
	} {
		if _, err := app.Exec(ctx, stmt); sqlState(err) != sqlStateDenied {
			t.Errorf("%s as %s: %v, want SQLSTATE %s", stmt, role, err, sqlStateDenied)
		}
	}
	_, err = app.CopyFrom(ctx, pgx.Identifier{"pgfence", "fenced_values"}, []string{"key", "value", "fence"},
		pgx.CopyFromRows([][]any{{"copied", json.RawMessage(`1`), int64(1) << 62}}))
	if sqlState(err) != sqlStateDenied {
		t.Errorf("COPY into pgfence.fenced_values: %v, want SQLSTATE %s", err, sqlStateDenied)
	}
	for _, stmt := range []string{
		`ALTER TABLE pgfence.fenced_values ADD COLUMN x int`,
		`CREATE TRIGGER a_first BEFORE UPDATE ON pgfence.fenced_values FOR EACH ROW EXECUTE FUNCTION pgfence.ha_gate()`,
		`CREATE OR REPLACE FUNCTION pgfence.fenced_value_update(key text, value jsonb, token bigint, reentrant boolean,
			OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT row_found boolean)
			LANGUAGE sql AS $$ SELECT true, 0::bigint, now(), true $$`,
		`CREATE FUNCTION pgfence.fenced_value_update(key text, value text, token bigint, reentrant boolean)
			RETURNS boolean LANGUAGE sql AS $$ SELECT true $$`,
		`ALTER FUNCTION pgfence.fenced_value_delete(text, bigint) SECURITY INVOKER`,
		`DROP FUNCTION pgfence.fenced_value_read(text, bigint)`,
	} {
		if _, err := app.Exec(ctx, stmt); err == nil {
			t.Errorf("%s succeeded as %s", stmt, role)
		}
	}
	if after := rows(); after != before {
		t.Fatalf("direct changes changed pgfence.fenced_values:\nbefore %s\nafter  %s", before, after)
	}

	// Through the functions with the older grant's token, or the victim's
	// again in strict mode: refused (applied false, the row's fence).
	for _, c := range []struct {
		sql   string
		token int64
	}{
		{`SELECT applied, fence FROM pgfence.fenced_value_update('cursor', '{"offset": 0}', $1, false)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_update('cursor', '{"offset": 0}', $1, true)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_upsert('cursor', '{"offset": 0}', $1, false)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_upsert('cursor', '{"offset": 0}', $1, true)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_delete('cursor', $1)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_read('cursor', $1)`, old},
		{`SELECT applied, fence FROM pgfence.fenced_value_update('cursor', '{"offset": 0}', $1, false)`, tok},
		{`SELECT applied, fence FROM pgfence.fenced_value_upsert('cursor', '{"offset": 0}', $1, false)`, tok},
	} {
		var applied bool
		var fence int64
		if err := app.QueryRow(ctx, c.sql, c.token).Scan(&applied, &fence); err != nil || applied || fence != tok {
			t.Errorf("%s with token %d: applied %v fence %d, %v; want refused at fence %d", c.sql, c.token, applied, fence, err, tok)
		}
	}
	// NULLs that would make the fence check NULL, and other bad arguments:
	// PF011 before the table is touched.
	for _, c := range []struct {
		sql  string
		args []any
		says string
	}{
		{`SELECT pgfence.fenced_value_update('cursor', '{}', NULL, true)`, nil, "token must be > 0, got NULL"},
		{`SELECT pgfence.fenced_value_update('cursor', '{}', $1, NULL)`, []any{tok + 1}, "reentrant must be true or false, got NULL"},
		{`SELECT pgfence.fenced_value_upsert('cursor', NULL, $1, true)`, []any{tok + 1}, "value must be a jsonb value"},
		{`SELECT pgfence.fenced_value_upsert(NULL, '{}', $1, true)`, []any{tok + 1}, "key must be 1 to 512 bytes, got NULL"},
		{`SELECT pgfence.fenced_value_delete('cursor', NULL)`, nil, "token must be > 0, got NULL"},
		{`SELECT pgfence.fenced_value_read('cursor', NULL)`, nil, "token must be > 0, got NULL"},
		{`SELECT pgfence.fenced_value_read($1, $2)`, []any{strings.Repeat("c", 513), tok + 1}, "got 513 bytes"},
	} {
		_, err := app.Exec(ctx, c.sql, c.args...)
		if sqlState(err) != sqlStateBadArgment || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want SQLSTATE %s saying %q", c.sql, err, sqlStateBadArgment, c.says)
		}
	}
	if after := rows(); after != before {
		t.Fatalf("refused calls changed pgfence.fenced_values:\nbefore %s\nafter  %s", before, after)
	}

	// Without EXECUTE, SELECT on the table is all a role has.
	bare := poolAs(t, dsn, integRole(t, ctx, admin, "pgfence_values_bare",
		"GRANT USAGE ON SCHEMA pgfence TO %s; GRANT SELECT ON pgfence.fenced_values TO %s;"))
	for _, stmt := range []string{
		`SELECT pgfence.fenced_value_update('cursor', '{}', 1000, true)`,
		`SELECT pgfence.fenced_value_upsert('bare', '{}', 1000, true)`,
		`SELECT pgfence.fenced_value_delete('cursor', 1000)`,
		`SELECT pgfence.fenced_value_read('cursor', 1000)`,
	} {
		if _, err := bare.Exec(ctx, stmt); sqlState(err) != sqlStateDenied {
			t.Errorf("%s without EXECUTE: %v, want SQLSTATE %s", stmt, err, sqlStateDenied)
		}
	}
	if _, err := fencedwrite.GetValue(ctx, bare, "cursor"); err != nil {
		t.Errorf("GetValue with SELECT only: %v", err)
	}
	if after := rows(); after != before {
		t.Fatalf("calls without EXECUTE changed pgfence.fenced_values:\nbefore %s\nafter  %s", before, after)
	}

	// The victim reads and writes on.
	if _, err := fencedwrite.ModifyValue(ctx, app, tok, "cursor", func(json.RawMessage) (json.RawMessage, error) {
		return json.RawMessage(`{"offset": 3}`), nil
	}); err != nil {
		t.Fatalf("the victim's read-modify-write after the probes: %v", err)
	}
	var value string
	var fence int64
	if err := admin.QueryRow(ctx, `SELECT value::text, fence FROM pgfence.fenced_values WHERE key = 'cursor'`).Scan(&value, &fence); err != nil ||
		value != `{"offset": 3}` || fence != tok {
		t.Fatalf("cursor after the victim's write: %s fence %d (%v), want {\"offset\": 3} fence %d", value, fence, err, tok)
	}
}
