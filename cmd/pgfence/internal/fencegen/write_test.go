package fencegen_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/fencedwrite"
)

func mustGenerate(t *testing.T, opts fencegen.Options) *fencegen.Files {
	t.Helper()
	f, err := fencegen.Generate(opts)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// actions renders a plan as "action name" lines (base names only).
func actions(wp *fencegen.WritePlan) string {
	var out []string
	for _, s := range wp.Steps {
		out = append(out, s.Action.String()+" "+filepath.Base(s.Path))
	}
	return strings.Join(out, "\n")
}

func mustWrite(t *testing.T, opts fencegen.Options, d fencegen.Dirs, want string) *fencegen.WritePlan {
	t.Helper()
	wp, err := mustGenerate(t, opts).Plan(d)
	if err != nil {
		t.Fatal(err)
	}
	if err := wp.Apply(); err != nil {
		t.Fatal(err)
	}
	if got := actions(wp); got != want {
		t.Fatalf("Write:\n%s\nwant:\n%s", got, want)
	}
	return wp
}

func tempDirs(t *testing.T) (fencegen.Dirs, string) {
	t.Helper()
	root := t.TempDir()
	return fencegen.Dirs{Migrations: filepath.Join(root, "db", "migrations"), Queries: filepath.Join(root, "db", "queries")}, root
}

func basicOpts() fencegen.Options {
	return fencegen.Options{Table: "invoices", Key: []string{"id"}, Set: []string{"pdf_url", "status"}, Version: "00002"}
}

func TestWriteCreatesMissingDirectoriesAndRerunIsNoop(t *testing.T) {
	t.Parallel()
	d, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")
	before := append(listDir(t, d.Migrations), listDir(t, d.Queries)...)
	// The same options again, even with another version (the default is the clock): nothing to do.
	opts := basicOpts()
	opts.Version = "20261129090000"
	wp := mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\nup to date fenced_invoices.sql")
	if wp.Changes() {
		t.Error("Changes() = true for an up-to-date plan")
	}
	if after := append(listDir(t, d.Migrations), listDir(t, d.Queries)...); strings.Join(after, " ") != strings.Join(before, " ") {
		t.Errorf("re-run changed the directories: %v -> %v", before, after)
	}
	if err := wp.Apply(); err == nil {
		t.Error("Apply twice: no error")
	}
}

func TestWriteGuardLater(t *testing.T) {
	t.Parallel()
	d, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")

	// The guard added later, without HasFenceColumn: only the guard migration.
	opts := basicOpts()
	opts.Version = "00005"
	opts.Guard = &fencedwrite.GuardOptions{LockName: "invoices"}
	wp := mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\ncreate 00005_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")
	g := string(wp.Steps[1].Data)
	if !strings.Contains(g, "lock_name => 'invoices', fence_column => 'fence', mode => 'strict');\n\n-- +goose Down\nSELECT pgfence.unguard(") ||
		strings.Contains(g, "ADD COLUMN") {
		t.Errorf("guard migration:\n%s", g)
	}
	// With HasFenceColumn: the same.
	opts.HasFenceColumn = true
	mustWrite(t, opts, d, "up to date 00005_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")
	opts.HasFenceColumn = false
	mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\nup to date 00005_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")

	// Another mode: a new guard migration whose Down restores the strict guard.
	opts.Version = "00007"
	opts.Guard.Mode = fencedwrite.Reentrant
	wp = mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\ncreate 00007_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")
	g = string(wp.Steps[1].Data)
	if !strings.Contains(g, "mode => 'reentrant');\n") ||
		!strings.Contains(g, "-- +goose Down\n-- Restores the guard this migration replaced.\nSELECT pgfence.guard('\"invoices\"'::pg_catalog.regclass, lock_name => 'invoices', fence_column => 'fence', mode => 'strict');\n") {
		t.Errorf("replacing guard migration:\n%s", g)
	}
	// Back to strict: the newest guard is reentrant, so a new migration again.
	opts.Version = "00009"
	opts.Guard.Mode = fencedwrite.Strict
	mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\ncreate 00009_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")
	// Another lock source: a new guard migration.
	opts.Version = "00011"
	opts.Guard = &fencedwrite.GuardOptions{LockNameColumn: "status"}
	mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\ncreate 00011_pgfence_guard_invoices.sql\nup to date fenced_invoices.sql")
	// Existing migrations were never touched.
	if got := strings.Join(listDir(t, d.Migrations), " "); got != "00002_pgfence_fence_invoices.sql 00005_pgfence_guard_invoices.sql "+
		"00007_pgfence_guard_invoices.sql 00009_pgfence_guard_invoices.sql 00011_pgfence_guard_invoices.sql" {
		t.Errorf("migrations: %s", got)
	}
	// A version not newer than the newest migration is refused.
	opts.Version = "00003"
	opts.Guard = &fencedwrite.GuardOptions{LockName: "other"}
	if err := mustGenerate(t, opts).Write(d.Migrations, d.Queries); !errors.Is(err, fencegen.ErrConflict) || !strings.Contains(err.Error(), "version 12 or later") {
		t.Errorf("old version: %v", err)
	}
}

// An old-style migration (column and guard in one file, as earlier versions
// of the generator wrote) is recognised: column and guard are up to date.
func TestPlanRecognisesCombinedMigration(t *testing.T) {
	t.Parallel()
	d, _ := tempDirs(t)
	old := `-- Generated by pgfence (fencegen): fencing for "invoices".
-- Rollout: apply this, ship writers that send tokens, then attach the guard last.

-- +goose Up
ALTER TABLE "invoices" ADD COLUMN "fence" bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN "invoices"."fence" IS 'Highest fencing token; writes with a lower token are refused.';
SELECT pgfence.guard('"invoices"'::regclass, lock_name => 'invoices', fence_column => 'fence', mode => 'strict');

-- +goose Down
SELECT pgfence.unguard('"invoices"'::regclass);
ALTER TABLE "invoices" DROP COLUMN "fence";
`
	writeFile(t, filepath.Join(d.Migrations, "20250101000000_pgfence_fence_invoices.sql"), old)
	opts := basicOpts()
	opts.Version = ""
	opts.Guard = &fencedwrite.GuardOptions{LockName: "invoices"}
	wp, err := mustGenerate(t, opts).Plan(d)
	if err != nil {
		t.Fatal(err)
	}
	if got := actions(wp); got != "up to date 20250101000000_pgfence_fence_invoices.sql\nup to date 20250101000000_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql" {
		t.Errorf("plan:\n%s", got)
	}
}

func TestPlanConflicts(t *testing.T) {
	t.Parallel()
	d, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")

	// Another fence column for the same table.
	opts := basicOpts()
	opts.Version, opts.FenceColumn = "00003", "fence2"
	if _, err := mustGenerate(t, opts).Plan(d); !errors.Is(err, fencegen.ErrConflict) || !strings.Contains(err.Error(), "00002_pgfence_fence_invoices.sql") {
		t.Errorf("other fence column: %v", err)
	}
	// A file named like a generated migration, without the header.
	d2, _ := tempDirs(t)
	writeFile(t, filepath.Join(d2.Migrations, "00001_pgfence_fence_invoices.sql"), "-- +goose Up\nSELECT 1;\n")
	if _, err := mustGenerate(t, basicOpts()).Plan(d2); !errors.Is(err, fencegen.ErrConflict) {
		t.Errorf("header-less migration: %v", err)
	}
	// Another table with the same file name part ("a_b"."c" and "a"."b_c"): its query file
	// is not taken over.
	d3, _ := tempDirs(t)
	mustWrite(t, fencegen.Options{Table: "a_b.c", Key: []string{"id"}, Set: []string{"v"}, Version: "00001"}, d3,
		"create 00001_pgfence_fence_a_b_c.sql\ncreate fenced_a_b_c.sql")
	_, err := mustGenerate(t, fencegen.Options{Table: "a.b_c", Key: []string{"id"}, Set: []string{"v"}, Version: "00002"}).Plan(d3)
	if !errors.Is(err, fencegen.ErrConflict) || !strings.Contains(err.Error(), "another table") {
		t.Errorf("query file of another table: %v", err)
	}
	// The user's own query file of that name is never overwritten.
	d4, _ := tempDirs(t)
	writeFile(t, filepath.Join(d4.Queries, "fenced_invoices.sql"), "-- name: Mine :one\nSELECT 1;\n")
	if err := mustGenerate(t, basicOpts()).Write(d4.Migrations, d4.Queries); !errors.Is(err, fencegen.ErrFileExists) {
		t.Errorf("user's query file: %v", err)
	}
	if _, err := os.Stat(d4.Migrations); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("refused write created the migrations directory: %v", err)
	}
}

func TestWriteUpdatesQueryFile(t *testing.T) {
	t.Parallel()
	d, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")
	opts := basicOpts()
	opts.Set = []string{"status"}
	wp := mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\nupdate fenced_invoices.sql")
	b, err := os.ReadFile(filepath.Join(d.Queries, "fenced_invoices.sql"))
	if err != nil || string(b) != string(wp.Steps[1].Data) || strings.Contains(string(b), "pdf_url") {
		t.Errorf("query file not rewritten: %v\n%s", err, b)
	}
}

func TestQueryFileNamesPerQuerySet(t *testing.T) {
	t.Parallel()
	cases := []struct {
		table, name, want string
	}{
		{"invoices", "", "fenced_invoices.sql"},
		{"invoices", "Invoices", "fenced_invoices.sql"},
		{"invoices", "InvoicePdf", "fenced_invoices.invoice_pdf.sql"},
		{"invoices", "HTTPInvoices", "fenced_invoices.http_invoices.sql"},
		{"invoices_pdf", "", "fenced_invoices_pdf.sql"},
		{"invoices", "Pdf", "fenced_invoices.pdf.sql"},
		{"billing.Invoices", "V2", "fenced_billing_invoices.v2.sql"},
	}
	for _, c := range cases {
		f := mustGenerate(t, fencegen.Options{Table: c.table, Key: []string{"id"}, Set: []string{"v"}, Name: c.name})
		if f.Queries.Name != c.want {
			t.Errorf("%s %q: %s, want %s", c.table, c.name, f.Queries.Name, c.want)
		}
	}
	// Two query sets for one table share the migration and do not collide.
	d, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")
	opts := basicOpts()
	opts.Name, opts.Set, opts.Version = "InvoicePdf", []string{"pdf_url"}, "00003"
	mustWrite(t, opts, d, "up to date 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.invoice_pdf.sql")
	mustWrite(t, basicOpts(), d, "up to date 00002_pgfence_fence_invoices.sql\nup to date fenced_invoices.sql")
}

// A failure in the middle of Apply leaves nothing behind: a file appearing
// at the guard migration's name after Plan makes Apply fail after it moved
// the query file and the column migration into place.
func TestWriteAllOrNothing(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	d := fencegen.Dirs{Migrations: filepath.Join(root, "migrations"), Queries: filepath.Join(root, "new", "queries")}
	if err := os.Mkdir(d.Migrations, 0o755); err != nil {
		t.Fatal(err)
	}
	opts := basicOpts()
	opts.Guard = &fencedwrite.GuardOptions{LockName: "invoices"}
	wp, err := mustGenerate(t, opts).Plan(d)
	if err != nil {
		t.Fatal(err)
	}
	intruder := filepath.Join(d.Migrations, "00003_pgfence_guard_invoices.sql")
	writeFile(t, intruder, "mine")
	err = wp.Apply()
	if !errors.Is(err, fencegen.ErrFileExists) || !strings.Contains(err.Error(), "nothing written") {
		t.Fatalf("Apply = %v, want ErrFileExists", err)
	}
	if got := strings.Join(listDir(t, d.Migrations), " "); got != "00003_pgfence_guard_invoices.sql" {
		t.Errorf("migrations left: %s", got)
	}
	if b, _ := os.ReadFile(intruder); string(b) != "mine" {
		t.Errorf("the other file was changed: %q", b)
	}
	if _, err := os.Stat(filepath.Join(root, "new")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("created directories left behind: %v", err)
	}

	// The same with an update of the query file: the old content comes back.
	d2, _ := tempDirs(t)
	mustWrite(t, basicOpts(), d2, "create 00002_pgfence_fence_invoices.sql\ncreate fenced_invoices.sql")
	qpath := filepath.Join(d2.Queries, "fenced_invoices.sql")
	oldQ, err := os.ReadFile(qpath)
	if err != nil {
		t.Fatal(err)
	}
	opts = basicOpts()
	opts.Set, opts.Version = []string{"status"}, "00004"
	opts.Guard = &fencedwrite.GuardOptions{LockName: "invoices"}
	wp, err = mustGenerate(t, opts).Plan(d2)
	if err != nil {
		t.Fatal(err)
	}
	if got := actions(wp); got != "up to date 00002_pgfence_fence_invoices.sql\ncreate 00004_pgfence_guard_invoices.sql\nupdate fenced_invoices.sql" {
		t.Fatalf("plan:\n%s", got)
	}
	writeFile(t, filepath.Join(d2.Migrations, "00004_pgfence_guard_invoices.sql"), "mine")
	if err := wp.Apply(); !errors.Is(err, fencegen.ErrFileExists) {
		t.Fatalf("Apply = %v", err)
	}
	if b, _ := os.ReadFile(qpath); string(b) != string(oldQ) {
		t.Errorf("query file not restored:\n%s", b)
	}
	if got := strings.Join(listDir(t, d2.Queries), " "); got != "fenced_invoices.sql" {
		t.Errorf("queries dir: %s", got)
	}
	if got := strings.Join(listDir(t, d2.Migrations), " "); got != "00002_pgfence_fence_invoices.sql 00004_pgfence_guard_invoices.sql" {
		t.Errorf("migrations dir: %s", got)
	}
}

// A target that is not a directory fails before anything is written.
func TestPlanQueriesDirIsAFile(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	writeFile(t, filepath.Join(root, "queries"), "not a directory")
	for _, q := range []string{filepath.Join(root, "queries"), filepath.Join(root, "queries", "sub")} {
		d := fencegen.Dirs{Migrations: filepath.Join(root, "migrations"), Queries: q}
		if err := mustGenerate(t, basicOpts()).Write(d.Migrations, d.Queries); err == nil || !strings.Contains(err.Error(), "not a directory") {
			t.Errorf("%s: Write = %v", q, err)
		}
		if got := strings.Join(listDir(t, root), " "); got != "queries" {
			t.Errorf("%s: left %s", q, got)
		}
	}
}

func TestPlanRefusesPgfenceModule(t *testing.T) {
	t.Parallel()
	root := moduleRoot(t)
	tmp := t.TempDir()
	for _, d := range []fencegen.Dirs{
		{Migrations: filepath.Join(root, "migrations"), Queries: tmp},
		{Migrations: tmp, Queries: filepath.Join(root, "queries")},
		{Migrations: filepath.Join(root, "internal", "nothing-here", "migrations"), Queries: tmp},
	} {
		if _, err := mustGenerate(t, basicOpts()).Plan(d); !errors.Is(err, fencegen.ErrPgfenceModule) {
			t.Errorf("%+v: Plan = %v, want ErrPgfenceModule", d, err)
		}
	}
	// The user's own module is fine.
	app := filepath.Join(tmp, "app")
	writeFile(t, filepath.Join(app, "go.mod"), "module example.com/app\n\ngo 1.26\n")
	if _, err := mustGenerate(t, basicOpts()).Plan(fencegen.Dirs{Migrations: filepath.Join(app, "db"), Queries: filepath.Join(app, "q")}); err != nil {
		t.Errorf("user's module: %v", err)
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
