package cli

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestGenFenced(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE invoices (id int PRIMARY KEY, pdf_url text, status text); INSERT INTO invoices VALUES (1, NULL, 'new')"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	mig, qry := filepath.Join(dir, "migrations"), filepath.Join(dir, "queries")
	for _, d := range []string{mig, qry} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	args := []string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "pdf_url,status",
		"--migrations-dir", mig, "--queries-dir", qry, "--version", "00001", "--check"}
	r := run(t, dsn, args...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join(qry, "fenced_invoices.sql")) {
		t.Fatalf("gen: %+v", r)
	}
	q, err := os.ReadFile(filepath.Join(qry, "fenced_invoices.sql"))
	if err != nil || !strings.Contains(string(q), "FencedUpdateInvoicesReentrant") || !strings.Contains(string(q), `"fence" OPERATOR(pg_catalog.<) @token`) {
		t.Fatalf("query file: %v\n%s", err, q)
	}
	// The migration is a working goose migration.
	db := stdlib.OpenDBFromPool(pool)
	defer func(db *sql.DB) { _ = db.Close() }(db)
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS(mig))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	var fence int64
	if err := pool.QueryRow(ctx, "SELECT fence FROM invoices WHERE id = 1").Scan(&fence); err != nil || fence != 0 {
		t.Fatalf("fence column after migration: %d %v", fence, err)
	}
	// Running it again (with --check: the column is now there) is a no-op.
	before := append(dirNames(t, mig), dirNames(t, qry)...)
	if r := run(t, dsn, args...); r.code != 0 || !strings.Contains(r.stdout, "up to date "+filepath.Join(mig, "00001_pgfence_fence_invoices.sql")) ||
		!strings.Contains(r.stdout, "the files are up to date") || strings.Contains(r.stdout, "wrote") {
		t.Fatalf("second gen: %+v", r)
	}
	if after := append(dirNames(t, mig), dirNames(t, qry)...); strings.Join(before, " ") != strings.Join(after, " ") {
		t.Fatalf("second gen changed files: %v -> %v", before, after)
	}
	// The guard added later (after the column migration was applied): only the
	// guard migration is written, and it applies.
	guardArgs := append(append([]string{}, args[:len(args)-3]...), "--version", "00002", "--guard-lock", "invoices", "--check")
	r = run(t, dsn, guardArgs...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join(mig, "00002_pgfence_guard_invoices.sql")+"\n") ||
		strings.Count(r.stdout, "wrote") != 1 || strings.Count(r.stdout, "up to date") != 2 {
		t.Fatalf("guard later: %+v", r)
	}
	p, err = goose.NewProvider(goose.DialectPostgres, db, os.DirFS(mig))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := p.Up(ctx); err != nil || len(res) != 1 {
		t.Fatalf("goose up of the guard migration: %v %v", res, err)
	}
	var guarded int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.guarded_tables WHERE relid = 'invoices'::regclass AND lock_name = 'invoices'").Scan(&guarded); err != nil || guarded != 1 {
		t.Fatalf("guard after migration: %d %v", guarded, err)
	}
	if _, err := pool.Exec(ctx, "UPDATE invoices SET status = 'unfenced' WHERE id = 1"); err == nil {
		t.Fatal("guarded table took an unfenced update")
	}
	if r := run(t, dsn, guardArgs...); r.code != 0 || strings.Contains(r.stdout, "wrote") {
		t.Fatalf("guard re-run: %+v", r)
	}

	empty := t.TempDir()
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"gen", "fenced", "--table", "x; drop table y", "--key", "id", "--set", "a"}, ExitUsage},
		{[]string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "status; --"}, ExitUsage},
		{[]string{"gen", "fenced", "--table", "nope", "--key", "id", "--set", "a", "--check"}, ExitNotFound},
		{[]string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "missing", "--check"}, ExitNotFound},
		{[]string{"gen", "fenced", "--table", "invoices", "--key", "id"}, ExitUsage},
	} {
		r := run(t, dsn, append(tc.args, "--migrations-dir", empty, "--queries-dir", empty)...)
		if r.code != tc.code {
			t.Errorf("%v: code %d, want %d (%s)", tc.args, r.code, tc.code, r.stderr)
		}
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Errorf("rejected input wrote %d file(s)", len(entries))
	}
	var tables int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'invoices'").Scan(&tables); err != nil || tables != 1 {
		t.Fatalf("invoices table gone: %d %v", tables, err)
	}
}

// TestGenFencedExistingColumn: a table that already has its fence column is
// a usage error that names the flag to pass, not the Go field behind it.
func TestGenFencedExistingColumn(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	if _, err := pgtest.PoolFor(t, dsn).Exec(context.Background(),
		"CREATE TABLE invoices (id int PRIMARY KEY, status text, fence bigint NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	args := []string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "status",
		"--migrations-dir", dir, "--queries-dir", dir, "--check"}
	r := run(t, dsn, args...)
	if r.code != ExitUsage || !strings.Contains(r.stderr, "--has-fence-column") {
		t.Fatalf("gen on a table with a fence column: code %d, want %d and a message naming --has-fence-column:\n%s", r.code, ExitUsage, r.stderr)
	}
	if r := run(t, dsn, append(args, "--has-fence-column")...); r.code != 0 {
		t.Fatalf("gen --has-fence-column: %+v", r)
	}
}

// dirNames lists the names in dir (none when it does not exist).
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// tree lists every file and directory under root, relative to it.
func tree(t *testing.T, root string) string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if rel, _ := filepath.Rel(root, path); rel != "." {
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(out, " ")
}

func writeTestFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

var genBase = []string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "pdf_url,status"}

func gen(args ...string) []string { return append(append([]string{}, genBase...), args...) }

// TestGenFencedRerunAndGuardLater: no database needed.
func TestGenFencedRerunAndGuardLater(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	mig, qry := filepath.Join(root, "db", "migrations"), filepath.Join(root, "db", "queries") // missing: created
	dirs := []string{"--migrations-dir", mig, "--queries-dir", qry}
	r := run(t, "", gen(append(dirs, "--version", "00001")...)...)
	want := "wrote " + filepath.Join(mig, "00001_pgfence_fence_invoices.sql") + "\nwrote " + filepath.Join(qry, "fenced_invoices.sql") +
		"\nnext: apply the migrations with goose, then run sqlc generate\n"
	if r.code != 0 || r.stdout != want {
		t.Fatalf("first run: %+v\nwant stdout:\n%s", r, want)
	}
	before := tree(t, root)
	// The identical command, and the same without --version (a fresh default version): nothing written.
	for _, args := range [][]string{gen(append(dirs, "--version", "00001")...), gen(dirs...)} {
		r := run(t, "", args...)
		want := "up to date " + filepath.Join(mig, "00001_pgfence_fence_invoices.sql") + "\nup to date " + filepath.Join(qry, "fenced_invoices.sql") +
			"\nthe files are up to date: nothing written\n"
		if r.code != 0 || r.stdout != want {
			t.Fatalf("re-run %v: %+v\nwant stdout:\n%s", args, r, want)
		}
		if after := tree(t, root); after != before {
			t.Fatalf("re-run changed files: %s -> %s", before, after)
		}
	}
	// The guard later, as a user would add it: only the guard migration.
	r = run(t, "", gen(append(dirs, "--has-fence-column", "--guard-lock-column", "status", "--version", "00003")...)...)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "wrote "+filepath.Join(mig, "00003_pgfence_guard_invoices.sql")+"\nup to date "+filepath.Join(qry, "fenced_invoices.sql")+"\n") ||
		!strings.Contains(r.stdout, "apply the guard migration once every writer") {
		t.Fatalf("guard later: %+v", r)
	}
	// The same guard again without --has-fence-column: up to date.
	r = run(t, "", gen(append(dirs, "--guard-lock-column", "status")...)...)
	if r.code != 0 || strings.Count(r.stdout, "up to date ") != 3 || strings.Contains(r.stdout, "wrote") {
		t.Fatalf("guard re-run: %+v", r)
	}
	// Another guard mode: a new guard migration.
	r = run(t, "", gen(append(dirs, "--guard-lock-column", "status", "--guard-reentrant")...)...)
	if r.code != 0 || strings.Count(r.stdout, "wrote ") != 1 || !strings.Contains(r.stdout, "_pgfence_guard_invoices.sql") {
		t.Fatalf("guard mode change: %+v", r)
	}
	if n := len(dirNames(t, mig)); n != 3 {
		t.Fatalf("%d migrations, want 3: %v", n, dirNames(t, mig))
	}
	// Other set columns: the query file is rewritten.
	r = run(t, "", "gen", "fenced", "--table", "invoices", "--key", "id", "--set", "status", "--migrations-dir", mig, "--queries-dir", qry,
		"--guard-lock-column", "status", "--guard-reentrant")
	if r.code != 0 || !strings.Contains(r.stdout, "updated "+filepath.Join(qry, "fenced_invoices.sql")) ||
		!strings.HasSuffix(r.stdout, "next: run sqlc generate\n") {
		t.Fatalf("query file update: %+v", r)
	}
}

func TestGenFencedTwoQuerySets(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	dirs := []string{"--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q")}
	if r := run(t, "", gen(append(dirs, "--version", "00001")...)...); r.code != 0 {
		t.Fatal(r)
	}
	r := run(t, "", append([]string{"gen", "fenced", "--table", "invoices", "--key", "id", "--set", "pdf_url", "--name", "InvoicePdf"}, dirs...)...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join(root, "q", "fenced_invoices.invoice_pdf.sql")) ||
		!strings.Contains(r.stdout, "up to date "+filepath.Join(root, "m", "00001_pgfence_fence_invoices.sql")) {
		t.Fatalf("second query set: %+v", r)
	}
	if got := tree(t, root); got != "m m/00001_pgfence_fence_invoices.sql q q/fenced_invoices.invoice_pdf.sql q/fenced_invoices.sql" {
		t.Errorf("files: %s", got)
	}
}

// TestGenFencedAllOrNothing: when the query file cannot be written, the
// migration is not written either.
func TestGenFencedAllOrNothing(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	writeTestFile(t, filepath.Join(root, "queries"), "a file, not a directory")
	for _, q := range []string{filepath.Join(root, "queries"), filepath.Join(root, "queries", "sub")} {
		r := run(t, "", gen("--migrations-dir", filepath.Join(root, "migrations"), "--queries-dir", q)...)
		if r.code == 0 || !strings.Contains(r.stderr, "not a directory") || strings.Contains(r.stdout, "wrote") {
			t.Errorf("%s: %+v", q, r)
		}
		if got := tree(t, root); got != "queries" {
			t.Errorf("%s: files left: %s", q, got)
		}
	}
	// The user's own query file of that name.
	own := t.TempDir()
	writeTestFile(t, filepath.Join(own, "q", "fenced_invoices.sql"), "-- name: Mine :one\nSELECT 1;\n")
	r := run(t, "", gen("--migrations-dir", filepath.Join(own, "m"), "--queries-dir", filepath.Join(own, "q"))...)
	if r.code == 0 || !strings.Contains(r.stderr, "was not generated by pgfence") {
		t.Errorf("user's query file: %+v", r)
	}
	if got := tree(t, own); got != "q q/fenced_invoices.sql" {
		t.Errorf("user's query file: files: %s", got)
	}
}

func TestGenFencedDryRun(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	r := run(t, "", gen("--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q"),
		"--version", "00001", "--guard-lock", "invoices", "--dry-run")...)
	if r.code != 0 || !strings.Contains(r.stdout, "would write "+filepath.Join(root, "m", "00001_pgfence_fence_invoices.sql")) ||
		!strings.Contains(r.stdout, "would write "+filepath.Join(root, "m", "00002_pgfence_guard_invoices.sql")) ||
		!strings.Contains(r.stdout, "would write "+filepath.Join(root, "q", "fenced_invoices.sql")) ||
		!strings.Contains(r.stdout, `ALTER TABLE "invoices" ADD COLUMN "fence" bigint NOT NULL DEFAULT 0;`) ||
		!strings.Contains(r.stdout, "SELECT pgfence.guard(") || !strings.Contains(r.stdout, "-- name: FencedUpdateInvoices :one") ||
		!strings.HasSuffix(r.stdout, "dry run: nothing written\n") {
		t.Fatalf("dry run: %+v", r)
	}
	if got := tree(t, root); got != "" {
		t.Errorf("dry run wrote: %s", got)
	}
}

// TestGenFencedDryRunFailsWhenStdoutFails: the files a dry run prints are
// its only result; when stdout cannot be written (a full disk, a closed
// pipe) it exits 1 and says so. It exited 0.
func TestGenFencedDryRunFailsWhenStdoutFails(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	r := runTo(t, "", failWriter{}, gen("--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q"),
		"--guard-lock", "invoices", "--dry-run")...)
	if r.code != ExitError || !strings.Contains(r.stderr, "cannot write the dry run to stdout: no space left on device") {
		t.Errorf("dry run to a failing stdout: code %d, stderr %q; want %d", r.code, r.stderr, ExitError)
	}
	if got := tree(t, root); got != "" {
		t.Errorf("dry run wrote: %s", got)
	}
}

// TestGenFencedFailsWhenStdoutFails: a run that writes the files but cannot
// print which (a full disk, a closed pipe) exits 1 and says that the files
// were written. It exited 0.
func TestGenFencedFailsWhenStdoutFails(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	r := runTo(t, "", failWriter{}, gen("--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q"),
		"--guard-lock", "invoices")...)
	if r.code != ExitError || !strings.Contains(r.stderr, "the files are in place (written or already up to date), but cannot write the result to stdout: no space left on device") {
		t.Errorf("gen to a failing stdout: code %d, stderr %q; want %d", r.code, r.stderr, ExitError)
	}
	if got := tree(t, root); got == "" {
		t.Error("gen wrote no file")
	}
}

// TestGenFencedRefusesTerminalControlsInGuardLock: a --guard-lock name with
// a C1 control (U+009B, a CSI), a bidirectional or other format character
// (U+202E, U+2066, U+200F) or a line separator exits 2, with the
// character escaped in the message, and nothing is printed or written. Only
// C0 controls and DEL were refused, and --dry-run printed the others raw.
func TestGenFencedRefusesTerminalControlsInGuardLock(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"inv\u009b2Joice", "inv\u0085oice", "inv\u202eoice", "inv\u2066oice", "inv\u200foice", "inv\u2028oice", "inv\u00adoice"} {
		root := t.TempDir()
		for _, dry := range []bool{true, false} {
			args := gen("--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q"), "--guard-lock", name)
			if dry {
				args = append(args, "--dry-run")
			}
			r := run(t, "", args...)
			if r.code != ExitUsage || r.stdout != "" || !strings.Contains(r.stderr, "a control or format character") {
				t.Errorf("--guard-lock %q (dry run %v): code %d, stdout %q, stderr %q; want %d", name, dry, r.code, r.stdout, r.stderr, ExitUsage)
			}
			if bad, ok := termClean(r.stderr); !ok {
				t.Errorf("--guard-lock %q: the error prints %s raw: %q", name, bad, r.stderr)
			}
		}
		if got := tree(t, root); got != "" {
			t.Errorf("--guard-lock %q wrote: %s", name, got)
		}
	}
	// Other non-ASCII letters are names like any other.
	root := t.TempDir()
	r := run(t, "", gen("--migrations-dir", filepath.Join(root, "m"), "--queries-dir", filepath.Join(root, "q"), "--guard-lock", "Rechnungen:Köln", "--dry-run")...)
	if r.code != ExitOK || !strings.Contains(r.stdout, "lock_name => 'Rechnungen:Köln'") {
		t.Errorf("--guard-lock with a non-ASCII letter: %+v", r)
	}
}

// The tests below change the working directory, so they do not run in
// parallel (t.Chdir); parallel tests wait until they are done.

// TestGenFencedSQLCConfig: the directories come from sqlc.yaml in the
// current directory or from --sqlc-config; flags override.
func TestGenFencedSQLCConfig(t *testing.T) {
	app := t.TempDir()
	writeTestFile(t, filepath.Join(app, "go.mod"), "module example.com/app\n\ngo 1.26\n")
	writeTestFile(t, filepath.Join(app, "sqlc.yaml"), `version: "2"
sql:
  - engine: postgresql
    schema: db/migrations
    queries: db/queries
    gen:
      go: {package: appdb, out: appdb}
`)
	t.Chdir(app)
	r := run(t, "", gen("--version", "00001")...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join("db", "migrations", "00001_pgfence_fence_invoices.sql")+"\n") ||
		!strings.Contains(r.stdout, "wrote "+filepath.Join("db", "queries", "fenced_invoices.sql")+"\n") {
		t.Fatalf("from ./sqlc.yaml: %+v", r)
	}
	// --queries-dir overrides one of them.
	r = run(t, "", gen("--name", "Second", "--queries-dir", "other")...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join("other", "fenced_invoices.second.sql")) ||
		!strings.Contains(r.stdout, "up to date "+filepath.Join("db", "migrations", "00001_pgfence_fence_invoices.sql")) {
		t.Fatalf("--queries-dir override: %+v", r)
	}
	// --sqlc-config from elsewhere; two blocks need --sqlc-block.
	cfg := filepath.Join(app, "conf", "sqlc.yaml")
	writeTestFile(t, cfg, `version: "2"
sql:
  - engine: postgresql
    schema: ../a/migrations
    queries: ../a/queries
    gen: {go: {package: adb}}
  - engine: postgresql
    schema: ../b/schema.sql
    queries: ../b/queries
    gen: {go: {package: bdb}}
`)
	t.Chdir(t.TempDir())
	r = run(t, "", gen("--sqlc-config", cfg)...)
	if r.code != ExitUsage || !strings.Contains(r.stderr, "2 postgresql blocks (adb, bdb)") || !strings.Contains(r.stderr, "--sqlc-block") {
		t.Fatalf("two blocks: %+v", r)
	}
	r = run(t, "", gen("--sqlc-config", cfg, "--sqlc-block", "bdb", "--version", "00001")...)
	if r.code != 0 || !strings.Contains(r.stdout, "wrote "+filepath.Join(app, "b", "00001_pgfence_fence_invoices.sql")) ||
		!strings.Contains(r.stderr, "note: sqlc's schema is ../b/schema.sql, not a directory") {
		t.Fatalf("--sqlc-block: %+v", r)
	}
	if got := tree(t, filepath.Join(app, "b")); got != "00001_pgfence_fence_invoices.sql queries queries/fenced_invoices.sql" {
		t.Errorf("block b: %s", got)
	}
}

// TestGenFencedNoDirectories: no sqlc.yaml and no directories is a usage
// error that names the flags; nothing is written into the current directory.
func TestGenFencedNoDirectories(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	r := run(t, "", genBase...)
	if r.code != ExitUsage || !strings.Contains(r.stderr, "give --migrations-dir and --queries-dir") || !strings.Contains(r.stderr, "sqlc.yaml") {
		t.Fatalf("no directories: %+v", r)
	}
	r = run(t, "", gen("--migrations-dir", "m")...)
	if r.code != ExitUsage || !strings.Contains(r.stderr, "give --queries-dir") {
		t.Fatalf("no queries dir: %+v", r)
	}
	if got := tree(t, dir); got != "" {
		t.Errorf("wrote: %s", got)
	}
}

// TestGenFencedRefusesPgfenceModule: run in the pgfence repository itself,
// whose sqlc.yaml points at the library's own migrations/ and queries/, the
// generator refuses rather than add a user migration to the library.
func TestGenFencedRefusesPgfenceModule(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", "..", "..", "..")) // the repository
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "go.mod")); err != nil || !strings.HasPrefix(string(b), "module github.com/pgfence/pgfence\n") {
		t.Fatalf("not the pgfence module root: %s (%v)", root, err)
	}
	mig, qry := filepath.Join(root, "migrations"), filepath.Join(root, "queries")
	before := append(dirNames(t, mig), dirNames(t, qry)...)
	t.Cleanup(func() {
		// Should the refusal ever break, do not leave files in the repository.
		keep := map[string]bool{}
		for _, n := range before {
			keep[n] = true
		}
		for _, d := range []string{mig, qry} {
			for _, n := range dirNames(t, d) {
				if !keep[n] && strings.Contains(n, "invoices") {
					t.Errorf("generator wrote %s into the pgfence module", filepath.Join(d, n))
					_ = os.Remove(filepath.Join(d, n))
				}
			}
		}
	})
	t.Chdir(root)
	tmp := t.TempDir()
	for _, args := range [][]string{
		gen(),
		gen("--migrations-dir", mig, "--queries-dir", tmp),
		gen("--migrations-dir", tmp, "--queries-dir", "queries"),
	} {
		r := run(t, "", args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, "pgfence module itself") || !strings.Contains(r.stderr, "--migrations-dir") {
			t.Errorf("%v: %+v", args[len(genBase):], r)
		}
	}
	if after := append(dirNames(t, mig), dirNames(t, qry)...); strings.Join(after, " ") != strings.Join(before, " ") {
		t.Errorf("pgfence's own directories changed: %v -> %v", before, after)
	}
	if got := tree(t, tmp); got != "" {
		t.Errorf("wrote %s", got)
	}
}

// TestGenFencedIgnoredFlags: flags that would be ignored are refused (exit
// 2) and nothing is written: --guard-reentrant without a guard lock, an
// empty --fence-column (it meant the default), --sqlc-block when both
// directories are given and no --sqlc-config is read.
func TestGenFencedIgnoredFlags(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	dirs := []string{"--migrations-dir", "m", "--queries-dir", "q"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{append(gen(dirs...), "--guard-reentrant"), "--guard-reentrant needs --guard-lock"},
		{append(gen(dirs...), "--fence-column", ""), "--fence-column is empty"},
		{append(gen(dirs...), "--sqlc-block", "app"), "--sqlc-block selects a block"},
	} {
		r := run(t, "", c.args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, c.want) {
			t.Errorf("pgfence %q: %+v, want exit %d naming %q", c.args, r, ExitUsage, c.want)
		}
	}
	if got := tree(t, dir); got != "" {
		t.Errorf("wrote: %s", got)
	}
}

// TestGenFencedKeyOperator: the query file compares a built-in key with
// pg_catalog's "="; with --check, a key whose type brings its own "="
// (citext) keeps it, and without --check (no types known) it does not.
func TestGenFencedKeyOperator(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	if _, err := pgtest.PoolFor(t, dsn).Exec(context.Background(),
		"CREATE EXTENSION citext; CREATE TABLE tags (tenant int, name citext, label text, PRIMARY KEY (tenant, name))"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		check bool
		want  []string
	}{
		{true, []string{`t."tenant" OPERATOR(pg_catalog.=) @tenant`, `t."name" = @name`, `c."name" = @name`}},
		{false, []string{`t."tenant" OPERATOR(pg_catalog.=) @tenant`, `t."name" OPERATOR(pg_catalog.=) @name`, `c."name" OPERATOR(pg_catalog.=) @name`}},
	} {
		dir := t.TempDir()
		args := []string{"gen", "fenced", "--table", "tags", "--key", "tenant,name", "--set", "label",
			"--migrations-dir", dir, "--queries-dir", dir, "--version", "00001"}
		if c.check {
			args = append(args, "--check")
		}
		if r := run(t, dsn, args...); r.code != 0 {
			t.Fatalf("gen (check %v): %+v", c.check, r)
		}
		q, err := os.ReadFile(filepath.Join(dir, "fenced_tags.sql"))
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range c.want {
			if !strings.Contains(string(q), w) {
				t.Errorf("check %v: query file lacks %q:\n%s", c.check, w, q)
			}
		}
	}
}
