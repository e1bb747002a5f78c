package fencegen_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func invoiceOpts() fencegen.Options {
	return fencegen.Options{
		Table:   "invoices",
		Key:     []string{"id"},
		Set:     []string{"pdf_url", "status"},
		Version: "00002",
		Guard:   &fencedwrite.GuardOptions{LockName: "invoices"},
	}
}

func TestGenerateRejects(t *testing.T) {
	t.Parallel()
	with := func(f func(*fencegen.Options)) fencegen.Options { o := invoiceOpts(); f(&o); return o }
	cases := []struct {
		name string
		opts fencegen.Options
		want error
	}{
		{"sql table", with(func(o *fencegen.Options) { o.Table = "x; drop table y" }), argErr{pgfence.ErrInvalid, "table"}},
		{"sql column", with(func(o *fencegen.Options) { o.Set = []string{"status = 'x'"} }), argErr{pgfence.ErrInvalid, "set column"}},
		{"comment key", with(func(o *fencegen.Options) { o.Key = []string{"id--"} }), argErr{pgfence.ErrInvalid, "key column"}},
		{"empty table", with(func(o *fencegen.Options) { o.Table = "" }), argErr{pgfence.ErrInvalid, "table"}},
		{"huge column", with(func(o *fencegen.Options) { o.Set = []string{strings.Repeat("c", 64)} }), argErr{pgfence.ErrInvalid, "set column"}},
		{"quoted fence", with(func(o *fencegen.Options) { o.FenceColumn = `"fence"` }), argErr{pgfence.ErrInvalid, "fence column"}},
		{"lock column", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockNameColumn: "a;b"} }), argErr{pgfence.ErrInvalid, "lock name column"}},
		{"no key", with(func(o *fencegen.Options) { o.Key = nil }), fencegen.ErrInvalidOptions},
		{"no set", with(func(o *fencegen.Options) { o.Set = nil }), fencegen.ErrInvalidOptions},
		{"dup column", with(func(o *fencegen.Options) { o.Set = []string{"status", "status"} }), fencegen.ErrInvalidOptions},
		{"fence in set", with(func(o *fencegen.Options) { o.Set = []string{"fence"} }), fencegen.ErrInvalidOptions},
		{"bad version", with(func(o *fencegen.Options) { o.Version = "1; drop" }), fencegen.ErrInvalidOptions},
		{"bad go name", with(func(o *fencegen.Options) { o.Name = "invoice" }), fencegen.ErrInvalidOptions},
		{"quote in lock", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a'); drop table y; --"} }), fencegen.ErrInvalidOptions},
		{"C1 CSI in lock", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a\u009b2Jb"} }), fencegen.ErrInvalidOptions},
		{"bidi override in lock", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a\u202eb"} }), fencegen.ErrInvalidOptions},
		{"bidi isolate in lock", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a\u2066b"} }), fencegen.ErrInvalidOptions},
		{"line separator in lock", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a\u2028b"} }), fencegen.ErrInvalidOptions},
		{"two locks", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockName: "a", LockNameColumn: "b"} }), fencegen.ErrInvalidOptions},
		{"own = not a key", with(func(o *fencegen.Options) { o.OwnEqualKeys = []string{"status"} }), fencegen.ErrInvalidOptions},
	}
	for _, c := range cases {
		files, err := fencegen.Generate(c.opts)
		if !matchErr(err, c.want) || files != nil {
			t.Errorf("%s: Generate = %v, %v; want %v", c.name, files, err, c.want)
		}
	}
	_, err := fencegen.Generate(with(func(o *fencegen.Options) { o.Table = "x; drop table y" }))
	var pe *pgfence.Error
	if !errors.As(err, &pe) || !strings.Contains(pe.Reason, `"x; drop table y"`) {
		t.Errorf("error does not name the input: %v", err)
	}
}

func TestGenerateOutput(t *testing.T) {
	t.Parallel()
	opts := invoiceOpts()
	opts.Table = "billing.Invoices"
	opts.Key = []string{"id", "token"}
	files, err := fencegen.Generate(opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(files.Migrations) != 2 ||
		files.Migrations[0].Kind != fencegen.ColumnMigration || files.Migrations[0].Name != "00002_pgfence_fence_billing_invoices.sql" ||
		files.Migrations[1].Kind != fencegen.GuardMigration || files.Migrations[1].Name != "00003_pgfence_guard_billing_invoices.sql" ||
		files.Queries.Kind != fencegen.QueryFile || files.Queries.Name != "fenced_billing_invoices.sql" {
		t.Fatalf("files %v %v %q", files.Migrations[0].Name, files.Migrations[len(files.Migrations)-1].Name, files.Queries.Name)
	}
	col, guard, qs := string(files.Migrations[0].Data), string(files.Migrations[1].Data), string(files.Queries.Data)
	for _, want := range []string{
		`ALTER TABLE "billing"."Invoices" ADD COLUMN "fence" bigint NOT NULL DEFAULT 0;`,
		"-- +goose Down\nALTER TABLE \"billing\".\"Invoices\" DROP COLUMN \"fence\";",
	} {
		if !strings.Contains(col, want) {
			t.Errorf("column migration lacks %q:\n%s", want, col)
		}
	}
	for _, want := range []string{
		`SELECT pgfence.guard('"billing"."Invoices"'::pg_catalog.regclass, lock_name => 'invoices', fence_column => 'fence', mode => 'strict');`,
		"-- +goose Down\nSELECT pgfence.unguard(",
	} {
		if !strings.Contains(guard, want) {
			t.Errorf("guard migration lacks %q:\n%s", want, guard)
		}
	}
	if strings.Contains(col, "pgfence.guard") || strings.Contains(guard, "ADD COLUMN") {
		t.Errorf("column and guard migrations are not separate:\n%s\n%s", col, guard)
	}
	if first, _, _ := strings.Cut(qs, "\n"); !strings.HasPrefix(first, "-- Generated by pgfence (fencegen)") &&
		!strings.HasPrefix(first, "-- Code generated by pgfence (fencegen)") {
		t.Errorf("query file's first line is not the generated header: %q", first)
	}
	for _, want := range []string{
		"-- name: FencedUpdateInvoices :one",
		"-- name: FencedUpdateInvoicesReentrant :one",
		"-- name: FencedReadInvoices :one",
		`t."fence" OPERATOR(pg_catalog.<) @token::bigint`,
		`t."fence" OPERATOR(pg_catalog.<=) @token::bigint`,
		`t."token" OPERATOR(pg_catalog.=) @token_value`, // a column named token does not clash with the fencing token
		`c."id" OPERATOR(pg_catalog.=) @id`,
	} {
		if !strings.Contains(qs, want) {
			t.Errorf("queries lack %q:\n%s", want, qs)
		}
	}
	// A key listed in OwnEqualKeys keeps its type's own "=", the others not.
	own := opts
	own.OwnEqualKeys = []string{"token"}
	if f, err := fencegen.Generate(own); err != nil {
		t.Fatal(err)
	} else if q := string(f.Queries.Data); !strings.Contains(q, `t."token" = @token_value`) || !strings.Contains(q, `c."token" = @token_value`) ||
		!strings.Contains(q, `t."id" OPERATOR(pg_catalog.=) @id`) || strings.Contains(q, `"id" = @id`) {
		t.Errorf("OwnEqualKeys [token]: queries:\n%s", q)
	}
	// Column already there: only the guard, with the version as given.
	opts.HasFenceColumn = true
	if f, err := fencegen.Generate(opts); err != nil || len(f.Migrations) != 1 || f.Migrations[0].Kind != fencegen.GuardMigration ||
		f.Migrations[0].Name != "00002_pgfence_guard_billing_invoices.sql" {
		t.Fatalf("HasFenceColumn with guard: %+v, %v", f, err)
	}
	// Column already there and no guard: only the queries.
	opts.Guard = nil
	if f, err := fencegen.Generate(opts); err != nil || len(f.Migrations) != 0 || len(f.Queries.Data) == 0 {
		t.Fatalf("HasFenceColumn without guard: %+v, %v", f, err)
	}
	dir := t.TempDir()
	if err := files.Write(dir, dir); err != nil {
		t.Fatal(err)
	}
	before := listDir(t, dir)
	if len(before) != 3 {
		t.Fatalf("first Write wrote %v", before)
	}
	// Writing again is a no-op.
	wp, err := files.Plan(fencegen.Dirs{Migrations: dir, Queries: dir})
	if err != nil {
		t.Fatalf("second Plan = %v", err)
	}
	if err := wp.Apply(); err != nil {
		t.Fatalf("second Apply = %v", err)
	}
	for _, s := range wp.Steps {
		if s.Action != fencegen.UpToDate || s.Data != nil {
			t.Errorf("second Write: %v %s", s.Action, s.Path)
		}
	}
	if after := listDir(t, dir); strings.Join(after, " ") != strings.Join(before, " ") || wp.Changes() {
		t.Fatalf("second Write changed the directory: %v -> %v", before, after)
	}
}

// listDir lists the names in dir, sorted, with "/" after directories.
func listDir(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() {
			n += "/"
		}
		names = append(names, n)
	}
	return names
}

const sampleSchema = `-- +goose Up
CREATE TABLE invoices (
    id       bigint PRIMARY KEY,
    customer text   NOT NULL,
    pdf_url  text,
    status   text   NOT NULL DEFAULT 'new'
);
INSERT INTO invoices (id, customer) VALUES (1, 'acme'), (2, 'globex');

-- +goose Down
DROP TABLE invoices;
`

func TestValidateAgainstLiveSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, strings.Split(strings.Split(sampleSchema, "-- +goose Down")[0], "-- +goose Up")[1]); err != nil {
		t.Fatal(err)
	}
	with := func(f func(*fencegen.Options)) fencegen.Options { o := invoiceOpts(); f(&o); return o }
	if err := fencegen.Validate(ctx, pool, invoiceOpts()); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		opts fencegen.Options
		want error
	}{
		{"unknown table", with(func(o *fencegen.Options) { o.Table = "invoice" }), argErr{pgfence.ErrNotFound, "table"}},
		{"unknown column", with(func(o *fencegen.Options) { o.Set = []string{"pdf"} }), argErr{pgfence.ErrNotFound, "column"}},
		{"unknown lock column", with(func(o *fencegen.Options) { o.Guard = &fencedwrite.GuardOptions{LockNameColumn: "store"} }), argErr{pgfence.ErrNotFound, "column"}},
		{"key not unique", with(func(o *fencegen.Options) { o.Key = []string{"customer"} }), argErr{pgfence.ErrInvalid, "key"}},
		{"no fence yet", with(func(o *fencegen.Options) { o.HasFenceColumn = true }), argErr{pgfence.ErrNotFound, "fence column"}},
		{"sql table", with(func(o *fencegen.Options) { o.Table = "x; drop table y" }), argErr{pgfence.ErrInvalid, "table"}},
	}
	for _, c := range cases {
		if err := fencegen.Validate(ctx, pool, c.opts); !matchErr(err, c.want) {
			t.Errorf("%s: Validate = %v, want %v", c.name, err, c.want)
		}
	}
	if _, err := pool.Exec(ctx, "ALTER TABLE invoices ADD COLUMN fence bigint NOT NULL DEFAULT 0"); err != nil {
		t.Fatal(err)
	}
	if err := fencegen.Validate(ctx, pool, invoiceOpts()); !errors.Is(err, fencegen.ErrInvalidOptions) {
		t.Errorf("existing fence column without HasFenceColumn: %v", err)
	}
	if err := fencegen.Validate(ctx, pool, with(func(o *fencegen.Options) { o.HasFenceColumn = true })); err != nil {
		t.Errorf("HasFenceColumn: %v", err)
	}
}

// moduleRoot finds the pgfence module root from the test's directory.
func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), "module github.com/pgfence/pgfence\n") {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("pgfence module root not found")
		}
		dir = parent
	}
}

// sqlcBinary returns the repository's sqlc, installing it into .bin like
// `make tools` does when it is missing. Never skips.
func sqlcBinary(t *testing.T, root string) string {
	t.Helper()
	bin := filepath.Join(root, ".bin", "sqlc")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	run(t, root, []string{"GOBIN=" + filepath.Join(root, ".bin"), "CGO_ENABLED=1"},
		"go", "install", "github.com/sqlc-dev/sqlc/cmd/sqlc@v1.31.1")
	return bin
}

func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

const demoMain = `package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/fencedemo/db"
	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

func grant(ctx context.Context, pool *pgxpool.Pool) int64 {
	var tok int64
	err := pool.QueryRow(ctx, "INSERT INTO pgfence.locks(name, token) VALUES ('invoices', 1) "+
		"ON CONFLICT (name) DO UPDATE SET token = locks.token + 1 RETURNING token").Scan(&tok)
	if err != nil {
		panic(err)
	}
	return tok
}

func outcome(err error) string {
	switch {
	case err == nil:
		return "applied"
	case errors.Is(err, pgfence.ErrStaleToken):
		return "stale"
	case errors.Is(err, pgfence.ErrAlreadyApplied):
		return "already-applied"
	case errors.Is(err, pgfence.ErrNotFound):
		return "not-found"
	case errors.Is(err, pgfence.ErrGuard):
		return "guard-rejected"
	case errors.Is(err, pgfence.ErrInvalid):
		return "invalid"
	}
	return "error: " + err.Error()
}

func main() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("FENCEDEMO_DSN"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	q := db.New(pool)
	// Only the returned error tells a refused write: the generated methods fail closed.
	update := func(mode fencedwrite.Mode, id, tok int64, status string) error {
		pdf := fmt.Sprintf("s3://invoices/%d-%d.pdf", id, tok)
		var err error
		if mode == fencedwrite.Reentrant {
			_, err = q.FencedUpdateInvoicesReentrant(ctx, db.FencedUpdateInvoicesReentrantParams{
				PdfUrl: &pdf, Status: status, Token: tok, ID: id})
		} else {
			_, err = q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{
				PdfUrl: &pdf, Status: status, Token: tok, ID: id})
		}
		return fencedwrite.TranslateError(err)
	}
	t1 := grant(ctx, pool)
	fmt.Println("first", outcome(update(fencedwrite.Strict, 1, t1, "rendered")))
	fmt.Println("replay", outcome(update(fencedwrite.Strict, 1, t1, "rendered")))
	fmt.Println("reentrant", outcome(update(fencedwrite.Reentrant, 1, t1, "rendered")))
	fmt.Println("missing", outcome(update(fencedwrite.Strict, 99, t1, "rendered")))
	t2 := grant(ctx, pool)
	fmt.Println("newer", outcome(update(fencedwrite.Strict, 1, t2, "sent")))
	fmt.Println("older", outcome(update(fencedwrite.Strict, 1, t1, "void")))
	t3 := grant(ctx, pool)
	read, err := q.FencedReadInvoices(ctx, db.FencedReadInvoicesParams{Token: t3, ID: 2})
	fmt.Println("read", outcome(fencedwrite.TranslateError(err)), read.Status)
	fmt.Println("write-after-read", outcome(update(fencedwrite.Reentrant, 2, t3, read.Status+"+paid")))
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'hand-edited' WHERE id = 1")
	fmt.Println("unfenced", outcome(fencedwrite.TranslateError(err)))
	_, err = pool.Exec(ctx, "UPDATE invoices SET status = 'forged', fence = 1000 WHERE id = 1")
	fmt.Println("forged", outcome(fencedwrite.TranslateError(err)))
	var final string
	if err := pool.QueryRow(ctx, "SELECT string_agg(status || ':' || fence, ',' ORDER BY id) FROM invoices").Scan(&final); err != nil {
		panic(err)
	}
	fmt.Println("rows", final)
}
`

const demoWant = `first applied
replay already-applied
reentrant applied
missing not-found
newer applied
older stale
read applied new
write-after-read applied
unfenced guard-rejected
forged invalid
rows sent:2,new+paid:3
`

// TestEndToEnd runs the generator on a sample schema, applies the migration
// with goose, runs sqlc on the output, compiles the generated Go in a
// temporary module and runs fenced writes with it against PostgreSQL.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	root := moduleRoot(t)
	sqlc := sqlcBinary(t, root)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	work := t.TempDir()
	schemaDir := filepath.Join(work, "schema")
	queriesDir := filepath.Join(work, "queries")
	for _, d := range []string{schemaDir, queriesDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(schemaDir, "00001_invoices.sql"), []byte(sampleSchema), 0o644); err != nil {
		t.Fatal(err)
	}
	app, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS(schemaDir))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Up(ctx); err != nil {
		t.Fatal(err)
	}

	// Generate, validated against the live schema.
	// Reentrant guard: the demo writes again after a fenced read with the same token.
	opts := invoiceOpts()
	opts.Guard.Mode = fencedwrite.Reentrant
	if err := fencegen.Validate(ctx, pool, opts); err != nil {
		t.Fatal(err)
	}
	files, err := fencegen.Generate(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := files.Write(schemaDir, queriesDir); err != nil {
		t.Fatal(err)
	}
	// The generated migrations (fence column, then guard) apply (and are valid goose files).
	app, err = goose.NewProvider(goose.DialectPostgres, db, os.DirFS(schemaDir))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := app.Up(ctx); err != nil || len(res) != 2 {
		t.Fatalf("goose up of the generated migrations: %v, %v", res, err)
	}

	// sqlc on the output.
	if err := os.WriteFile(filepath.Join(work, "sqlc.yaml"), []byte(`version: "2"
sql:
  - engine: postgresql
    schema: schema
    queries: queries
    gen:
      go:
        package: db
        out: db
        sql_package: pgx/v5
        emit_pointers_for_null_types: true
`), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, work, nil, sqlc, "generate")

	// Compile the generated Go in a temporary module and run it.
	gomod := "module example.com/fencedemo\n\ngo 1.26.0\n\nrequire (\n\tgithub.com/jackc/pgx/v5 v5.12.0\n" +
		"\tgithub.com/pgfence/pgfence v0.0.0\n)\n\nreplace github.com/pgfence/pgfence => " + root + "\n"
	if err := os.WriteFile(filepath.Join(work, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "go.sum"), sum, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "main.go"), []byte(demoMain), 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"GOFLAGS=-mod=mod", "GOWORK=off"}
	run(t, work, env, "go", "build", "-o", "fencedemo", ".")
	got := run(t, work, []string{"FENCEDEMO_DSN=" + dsn}, filepath.Join(work, "fencedemo"))
	if got != demoWant {
		t.Fatalf("demo output:\n%s\nwant:\n%s", got, demoWant)
	}

	// Down removes the guard and the column again.
	if _, err := app.DownTo(ctx, 1); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_attribute WHERE attrelid = 'invoices'::pg_catalog.regclass AND attname = 'fence'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("fence column after down: %d, %v", n, err)
	}
}

// argErr stands for a *pgfence.Error of kind whose Reason names arg.
type argErr struct {
	kind error
	arg  string
}

func (a argErr) Error() string { return a.kind.Error() + " (" + a.arg + ")" }

// matchErr reports whether err is want: for an argErr, a *pgfence.Error of
// its kind whose Reason starts with the argument.
func matchErr(err, want error) bool {
	a, ok := want.(argErr)
	if !ok {
		return errors.Is(err, want)
	}
	var pe *pgfence.Error
	return errors.As(err, &pe) && pe.Kind == a.kind && errors.Is(err, a.kind) && strings.HasPrefix(pe.Reason, a.arg+":")
}
