package pgident

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestLookupTable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE DOMAIN item_label AS text;
		CREATE TABLE items (
			id       bigint PRIMARY KEY,
			gone     int,
			tenant   text NOT NULL DEFAULT 'x',
			code     varchar(20) NOT NULL,
			qty      int,
			"Mixed"  int,
			doubled  int GENERATED ALWAYS AS (qty * 2) STORED,
			label    item_label
		);
		ALTER TABLE items DROP COLUMN gone;
		CREATE UNIQUE INDEX items_code_tenant ON items (code, tenant);
		CREATE UNIQUE INDEX items_qty_incl ON items (qty) INCLUDE ("Mixed");
		CREATE UNIQUE INDEX items_partial ON items ("Mixed") WHERE qty > 0;
		CREATE UNIQUE INDEX items_expr ON items (lower(code));
		CREATE INDEX items_plain ON items (tenant);
		CREATE FUNCTION noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END';
		CREATE TRIGGER z_trg BEFORE UPDATE ON items FOR EACH ROW EXECUTE FUNCTION noop();
		CREATE TRIGGER a_trg BEFORE INSERT ON items FOR EACH ROW EXECUTE FUNCTION noop();
		CREATE TABLE refs (item bigint REFERENCES items (id));`); err != nil {
		t.Fatal(err)
	}
	for _, name := range []TableName{{Name: "items"}, {Schema: "public", Name: "items"}} {
		got, err := Lookup(ctx, pool, name)
		if err != nil {
			t.Fatalf("Lookup(%s): %v", name, err)
		}
		if got.OID == 0 || got.Schema != "public" || got.Name != "items" || got.Qualified() != `"public"."items"` {
			t.Fatalf("Lookup(%s) = %+v", name, got)
		}
		wantCols := []Column{
			{Name: "id", Type: "bigint", NotNull: true, Builtin: true},
			{Name: "tenant", Type: "text", NotNull: true, HasDefault: true, Builtin: true},
			{Name: "code", Type: "character varying(20)", NotNull: true, Builtin: true},
			{Name: "qty", Type: "integer", Builtin: true},
			{Name: "Mixed", Type: "integer", Builtin: true},
			{Name: "doubled", Type: "integer", HasDefault: true, Generated: true, Builtin: true},
			{Name: "label", Type: "item_label", Builtin: true}, // a domain of schema public over text
		}
		if !reflect.DeepEqual(got.Columns, wantCols) {
			t.Errorf("columns\n got %+v\nwant %+v", got.Columns, wantCols)
		}
		// Primary key first, then unique indexes in creation order, key
		// columns in index order; INCLUDE columns, partial and expression
		// indexes left out; the index on nullable qty is unusable. The
		// foreign key's internal triggers live on items too and are not
		// listed.
		wantKeys := [][]string{{"id"}, {"code", "tenant"}}
		if !reflect.DeepEqual(got.UniqueKeys, wantKeys) {
			t.Errorf("unique keys = %v, want %v", got.UniqueKeys, wantKeys)
		}
		if len(got.UnusableKeys) != 1 || !reflect.DeepEqual(got.UnusableKeys[0].Columns, []string{"qty"}) ||
			got.UnusableKeyProblem([]string{"qty"}) == "" || got.UnusableKeyProblem([]string{"id"}) != "" {
			t.Errorf("unusable keys = %+v, want the index on qty", got.UnusableKeys)
		}
		if got.Partitioned {
			t.Errorf("items is reported partitioned")
		}
		if want := []string{"a_trg", "z_trg"}; !reflect.DeepEqual(got.Triggers, want) {
			t.Errorf("triggers = %v, want %v", got.Triggers, want)
		}
		if c, ok := got.Column("Mixed"); !ok || c.Name != "Mixed" {
			t.Errorf("Column(Mixed) = %v, %v", c, ok)
		}
		if _, ok := got.Column("mixed"); ok {
			t.Errorf("Column(mixed) found: names are case-sensitive")
		}
		if _, ok := got.Column("gone"); ok {
			t.Errorf("dropped column listed")
		}
	}
}

func TestLookupEmptyAndPartitionedTables(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE TABLE nothing ();
		CREATE TABLE parts (id bigint, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
		CREATE TABLE parts_2025 PARTITION OF parts FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');`); err != nil {
		t.Fatal(err)
	}
	got, err := Lookup(ctx, pool, TableName{Name: "nothing"})
	if err != nil || got.Columns == nil || len(got.Columns) != 0 || len(got.UniqueKeys) != 0 || len(got.Triggers) != 0 {
		t.Fatalf("Lookup(nothing) = %+v, %v", got, err)
	}
	for _, name := range []string{"parts", "parts_2025"} {
		got, err := Lookup(ctx, pool, TableName{Name: name})
		if err != nil || len(got.Columns) != 2 || !IsUniqueKey(got.UniqueKeys, []string{"at", "id"}) || got.Partitioned != (name == "parts") {
			t.Fatalf("Lookup(%s) = %+v, %v", name, got, err)
		}
	}
}

func TestLookupSearchPathAndCase(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE SCHEMA other;
		CREATE TABLE other.only_there (id int);
		CREATE TABLE other.both (id int, o int);
		CREATE TABLE public.both (id int);
		CREATE TABLE "CamelCase" (id int);`); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := Lookup(ctx, conn, TableName{Name: "only_there"}); !errors.Is(err, ErrUnknownTable) {
		t.Fatalf("only_there outside search_path: %v", err)
	}
	if got, err := Lookup(ctx, conn, TableName{Schema: "other", Name: "only_there"}); err != nil || got.Schema != "other" {
		t.Fatalf("other.only_there: %+v, %v", got, err)
	}
	if got, err := Lookup(ctx, conn, TableName{Name: "both"}); err != nil || got.Schema != "public" || len(got.Columns) != 1 {
		t.Fatalf("both with the default search_path: %+v, %v", got, err)
	}
	if _, err := conn.Exec(ctx, "SET search_path = other, public"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(context.Background(), "RESET search_path") //nolint:errcheck
	if got, err := Lookup(ctx, conn, TableName{Name: "both"}); err != nil || got.Schema != "other" || len(got.Columns) != 2 {
		t.Fatalf("both with search_path other: %+v, %v", got, err)
	}
	if got, err := Lookup(ctx, conn, TableName{Name: "only_there"}); err != nil || got.Schema != "other" {
		t.Fatalf("only_there with search_path other: %+v, %v", got, err)
	}
	// Names are used as stored: no case folding either way.
	if got, err := Lookup(ctx, conn, TableName{Name: "CamelCase"}); err != nil || got.Name != "CamelCase" {
		t.Fatalf("CamelCase: %+v, %v", got, err)
	}
	if _, err := Lookup(ctx, conn, TableName{Name: "camelcase"}); !errors.Is(err, ErrUnknownTable) {
		t.Fatalf("camelcase: %v", err)
	}
}

func TestLookupRefusesWhatIsNotATable(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE TABLE base (id int);
		CREATE VIEW a_view AS SELECT * FROM base;
		CREATE MATERIALIZED VIEW a_matview AS SELECT * FROM base;
		CREATE SEQUENCE a_seq;
		CREATE INDEX an_index ON base (id);
		CREATE TYPE a_type AS (x int);`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name TableName
		kind string
	}{
		{TableName{Name: "no_such_table"}, ""},
		{TableName{Schema: "no_such_schema", Name: "base"}, ""},
		{TableName{Name: "a_view"}, "v"},
		{TableName{Name: "a_matview"}, "m"},
		{TableName{Name: "a_seq"}, "S"},
		{TableName{Name: "an_index"}, "i"},
		{TableName{Name: "a_type"}, "c"},
		{TableName{Schema: "pg_catalog", Name: "pg_class"}, ""}, // a system catalog is a table
	} {
		got, err := Lookup(ctx, pool, tc.name)
		if tc.name.Schema == "pg_catalog" {
			if err != nil || got.Name != "pg_class" {
				t.Errorf("Lookup(%s) = %v", tc.name, err)
			}
			continue
		}
		var te *TableError
		if !errors.As(err, &te) || !errors.Is(err, ErrUnknownTable) || te.Kind != tc.kind || te.Table != tc.name.String() {
			t.Errorf("Lookup(%s) = %+v, %v; want a *TableError of kind %q", tc.name, got, err, tc.kind)
		}
	}
}

func TestLookupReturnsDatabaseErrors(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err := Lookup(cancelled, pool, TableName{Name: "x"})
	if err == nil || errors.Is(err, ErrUnknownTable) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Lookup with a cancelled context = %v", err)
	}
}

// TestLookupUnusableKeys: a unique index is a key only if "=" on its
// columns finds at most one row: not DEFERRABLE, each column under its own
// collation and its type's default btree operator class, every column NOT
// NULL unless NULLS NOT DISTINCT. The others are listed with the reason. A
// domain's columns, through domains over domains, are Builtin when the base
// type is; an enum's are not.
func TestLookupUnusableKeys(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `
		CREATE DOMAIN acct AS bigint;
		CREATE DOMAIN vip_acct AS acct;
		CREATE TYPE color AS ENUM ('red', 'green');
		CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
		CREATE EXTENSION citext;
		CREATE TABLE k (
			id     vip_acct PRIMARY KEY,
			c      text COLLATE ci NOT NULL,
			p      citext NOT NULL,
			sc     text NOT NULL,
			sp     text NOT NULL,
			d      int NOT NULL,
			n      text,
			v      varchar(10) NOT NULL,
			col    color NOT NULL,
			arr    int[] NOT NULL,
			vd     acct NOT NULL
		);
		CREATE UNIQUE INDEX k_c ON k (c COLLATE "C");
		CREATE UNIQUE INDEX k_p ON k (p text_ops);
		CREATE UNIQUE INDEX k_sc ON k (sc COLLATE "C");
		CREATE UNIQUE INDEX k_sp ON k (sp text_pattern_ops);
		ALTER TABLE k ADD CONSTRAINT k_d UNIQUE (d) DEFERRABLE INITIALLY IMMEDIATE;
		CREATE UNIQUE INDEX k_n ON k (n);
		CREATE UNIQUE INDEX k_v ON k (v);
		CREATE UNIQUE INDEX k_col ON k (col);
		CREATE UNIQUE INDEX k_arr ON k (arr);
		CREATE UNIQUE INDEX k_vd ON k (vd);
		CREATE UNIQUE INDEX k_c_ok ON k (c, p);`); err != nil {
		t.Fatal(err)
	}
	got, err := Lookup(ctx, pool, TableName{Name: "k"})
	if err != nil {
		t.Fatal(err)
	}
	// sc and sp: another deterministic collation, another class with the
	// same "=": they identify one row as the default index would.
	wantKeys := [][]string{{"id"}, {"sc"}, {"sp"}, {"v"}, {"col"}, {"arr"}, {"vd"}, {"c", "p"}}
	if !reflect.DeepEqual(got.UniqueKeys, wantKeys) {
		t.Errorf("unique keys = %v, want %v", got.UniqueKeys, wantKeys)
	}
	for col, want := range map[string]string{
		"c": "collation",
		"p": "operator class",
		"d": "DEFERRABLE",
		"n": `"n" is nullable`,
	} {
		if p := got.UnusableKeyProblem([]string{col}); !strings.Contains(p, want) {
			t.Errorf("problem of the index on %s = %q, want it to say %q", col, p, want)
		}
	}
	if len(got.UnusableKeys) != 4 {
		t.Errorf("unusable keys = %+v, want 4", got.UnusableKeys)
	}
	for name, builtin := range map[string]bool{"id": true, "vd": true, "col": false, "arr": true, "v": true} {
		if c, _ := got.Column(name); c.Builtin != builtin {
			t.Errorf("column %s (%s): Builtin = %v, want %v", name, c.Type, c.Builtin, builtin)
		}
	}

	var version int
	if err := pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version < 150000 {
		return
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE nnd (a text NOT NULL, b text, UNIQUE NULLS NOT DISTINCT (a, b))`); err != nil {
		t.Fatal(err)
	}
	got, err = Lookup(ctx, pool, TableName{Name: "nnd"})
	if err != nil || !IsUniqueKey(got.UniqueKeys, []string{"b", "a"}) {
		t.Fatalf("Lookup(nnd) = %+v, %v; want (a, b) a key: NULLS NOT DISTINCT", got, err)
	}
}
