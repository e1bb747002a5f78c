package e2e

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx" for goose
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/internal/testing/repo"
)

// repoRoot is the pgfence module's directory.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot find the source file")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
}

// sqlcBinary finds sqlc: the one `make tools` installs into .bin, or one on
// PATH. The test fails (it is never skipped) when there is none.
func sqlcBinary(t testing.TB) string {
	t.Helper()
	if p := filepath.Join(repoRoot(t), ".bin", "sqlc"); fileExists(p) {
		return p
	}
	if p, err := exec.LookPath("sqlc"); err == nil {
		return p
	}
	t.Fatal("sqlc not found: run `make tools` (installs sqlc into .bin) or put sqlc v1.31.1 on PATH")
	return ""
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// pgfenceBinary builds the CLI (the module in cmd/pgfence).
func pgfenceBinary(t testing.TB) string {
	t.Helper()
	return repo.Pgfence(t)
}

// run runs a command in dir and fails the test with its output if it fails.
func run(t testing.TB, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// newModule writes a Go module that requires pgfence from this checkout.
func newModule(t testing.TB) string {
	t.Helper()
	root := repoRoot(t)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "go.mod"), "module example.com/app\n\ngo 1.26\n\n"+
		"require github.com/pgfence/pgfence v0.0.0\n\nreplace github.com/pgfence/pgfence => "+root+"\n")
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "go.sum"), string(sum))
	writeFile(t, filepath.Join(dir, "sqlc.yaml"), `version: "2"
sql:
  - engine: postgresql
    schema: db/migrations
    queries: db/queries
    gen:
      go:
        package: db
        out: db
        sql_package: pgx/v5
        emit_pointers_for_null_types: true
`)
	return dir
}

// gooseUp applies the module's own migrations (its goose_db_version table is
// public.goose_db_version; pgfence's is pgfence.goose_db_version).
func gooseUp(t testing.TB, dsn, dir string) {
	t.Helper()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS(dir))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("goose up: %v", err)
	}
}

const appSchema = `-- +goose Up
CREATE TABLE invoices (
    id      bigint PRIMARY KEY,
    pdf_url text,
    status  text   NOT NULL
);
CREATE TABLE catalogue (
    store_id   int    NOT NULL,
    sku        text   NOT NULL,
    price      bigint NOT NULL,
    store_lock text   GENERATED ALWAYS AS ('store:' || store_id) STORED,
    fence      bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (store_id, sku)
);

-- +goose Down
DROP TABLE catalogue;
DROP TABLE invoices;
`

// appMain exercises every generated method through its returned error only.
const appMain = `package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/app/db"
	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

var failed bool

// refused checks a refused write by its error alone.
func refused(what string, err error, want error) {
	var pe *pgfence.Error
	switch {
	case err == nil:
		fmt.Printf("FAIL %s: nil error for a refused write\n", what)
		failed = true
	case !errors.Is(fencedwrite.TranslateError(err), want) || !errors.As(fencedwrite.TranslateError(err), &pe) || pe.Kind != want:
		fmt.Printf("FAIL %s: %v, want %v\n", what, fencedwrite.TranslateError(err), want)
		failed = true
	default:
		fmt.Printf("ok %s: %v\n", what, fencedwrite.TranslateError(err))
	}
}

func applied(what string, err error) {
	if err != nil {
		fmt.Printf("FAIL %s: %v\n", what, err)
		failed = true
		return
	}
	fmt.Printf("ok %s\n", what)
}

// tokens returns an old and the current token of a lock: two grants, the
// first released.
func tokens(ctx context.Context, pool *pgxpool.Pool, name string) (old, cur int64) {
	for i, holder := range []string{"old-importer", "new-importer"} {
		l, err := pglock.New(pool, &pglock.Config{Holder: holder})
		if err != nil {
			panic(err)
		}
		lease, err := l.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			panic(err)
		}
		if i == 0 {
			old = lease.Token()
			if err := lease.Release(ctx); err != nil {
				panic(err)
			}
		} else {
			cur = lease.Token()
		}
		_ = l.Close()
	}
	return old, cur
}

func main() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	q := db.New(pool)
	url := "s3://invoices/1.pdf"

	// invoices: fenced, not guarded.
	if _, err := pool.Exec(ctx, "INSERT INTO invoices (id, status) VALUES (1, 'new'), (2, 'new')"); err != nil {
		panic(err)
	}
	t1, t2 := tokens(ctx, pool, "invoices")
	f, err := q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{ID: 1, PdfUrl: &url, Status: "paid", Token: t2})
	applied("update with the current token", err)
	if f != t2 {
		fmt.Printf("FAIL update returned fence %d, want %d\n", f, t2)
		failed = true
	}
	_, err = q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{ID: 1, Status: "void", Token: t1})
	refused("strict update, stale token", err, pgfence.ErrStaleToken)
	var st *pgfence.Error
	if !errors.As(fencedwrite.TranslateError(err), &st) || st.Token != t1 ||
		!strings.HasPrefix(st.Reason, fmt.Sprintf("row fence %d > token %d (key ", t2, t1)) || st.Name != "invoices" {
		fmt.Printf("FAIL stale token error carries token/fence: %#v\n", st)
		failed = true
	}
	_, err = q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{ID: 1, PdfUrl: &url, Status: "paid", Token: t2})
	refused("strict update, replay", err, pgfence.ErrAlreadyApplied)
	_, err = q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{ID: 99, Status: "paid", Token: t2})
	refused("strict update, no such row", err, pgfence.ErrNotFound)
	_, err = q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{ID: 2, Status: "paid", Token: 0})
	refused("strict update, token 0", err, pgfence.ErrInvalid)
	if !errors.As(fencedwrite.TranslateError(err), &st) || !strings.HasPrefix(st.Reason, "token: ") {
		fmt.Printf("FAIL token 0 error names the token: %v\n", err)
		failed = true
	}
	// A Params struct with Token left unset: every form refuses it, and
	// nothing is written (row 2's fence is still 0, and key 11 is absent).
	_, err = q.FencedUpdateInvoicesReentrant(ctx, db.FencedUpdateInvoicesReentrantParams{ID: 2, Status: "void"})
	refused("re-entrant update, token unset", err, pgfence.ErrInvalid)
	_, err = q.FencedUpsertInvoices(ctx, db.FencedUpsertInvoicesParams{ID: 11, Status: "new"})
	refused("upsert of a new key, token unset", err, pgfence.ErrInvalid)
	if !errors.As(fencedwrite.TranslateError(err), &st) || st.Reason != "token: must be > 0" {
		fmt.Printf("FAIL upsert, token unset: Reason %q, want %q\n", st.Reason, "token: must be > 0")
		failed = true
	}
	_, err = q.FencedReadInvoices(ctx, db.FencedReadInvoicesParams{ID: 2})
	refused("fenced read, token unset", err, pgfence.ErrInvalid)
	var unset int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM invoices WHERE id = 11 OR (id = 2 AND fence <> 0)").Scan(&unset); err != nil || unset != 0 {
		fmt.Printf("FAIL writes with the token unset changed %d rows (%v)\n", unset, err)
		failed = true
	}
	_, err = q.FencedUpdateInvoicesReentrant(ctx, db.FencedUpdateInvoicesReentrantParams{ID: 1, PdfUrl: &url, Status: "paid", Token: t2})
	applied("re-entrant update, same grant again", err)
	_, err = q.FencedUpdateInvoicesReentrant(ctx, db.FencedUpdateInvoicesReentrantParams{ID: 1, Status: "void", Token: t1})
	refused("re-entrant update, stale token", err, pgfence.ErrStaleToken)
	up, err := q.FencedUpsertInvoices(ctx, db.FencedUpsertInvoicesParams{ID: 10, Status: "new", Token: t2})
	applied("upsert inserts", err)
	if !up.Inserted {
		fmt.Println("FAIL upsert did not report an insert")
		failed = true
	}
	_, err = q.FencedUpsertInvoices(ctx, db.FencedUpsertInvoicesParams{ID: 10, Status: "void", Token: t1})
	refused("upsert, stale token", err, pgfence.ErrStaleToken)
	row, err := q.FencedReadInvoices(ctx, db.FencedReadInvoicesParams{ID: 2, Token: t2})
	applied("fenced read", err)
	if row.Status != "new" || row.Fence != t2 {
		fmt.Printf("FAIL fenced read returned %+v\n", row)
		failed = true
	}
	_, err = q.FencedReadInvoices(ctx, db.FencedReadInvoicesParams{ID: 2, Token: t1})
	refused("fenced read, stale token", err, pgfence.ErrStaleToken)
	_, err = q.FencedDeleteInvoices(ctx, db.FencedDeleteInvoicesParams{ID: 1, Token: t1})
	refused("delete, stale token", err, pgfence.ErrStaleToken)
	_, err = q.FencedDeleteInvoices(ctx, db.FencedDeleteInvoicesParams{ID: 1, Token: t2})
	applied("delete with the current token", err)
	_, err = q.FencedDeleteInvoices(ctx, db.FencedDeleteInvoicesParams{ID: 1, Token: t2})
	refused("delete, row already gone", err, pgfence.ErrNotFound)

	// catalogue: guarded, its lock named by a generated column.
	s1, s2 := tokens(ctx, pool, "store:1")
	_, err = q.FencedUpsertCatalogue(ctx, db.FencedUpsertCatalogueParams{StoreID: 1, Sku: "a", Price: 100, Token: s2})
	applied("guarded upsert (insert) with the current token", err)
	_, err = q.FencedUpsertCatalogue(ctx, db.FencedUpsertCatalogueParams{StoreID: 1, Sku: "b", Price: 100, Token: s2})
	applied("guarded upsert of a second row", err)
	_, err = q.FencedUpdateCatalogueReentrant(ctx, db.FencedUpdateCatalogueReentrantParams{StoreID: 1, Sku: "a", Price: 90, Token: s2})
	refused("strict guard refuses a second write by the same grant", err, pgfence.ErrGuard)
	_, err = q.FencedUpsertCatalogue(ctx, db.FencedUpsertCatalogueParams{StoreID: 1, Sku: "late", Price: 1, Token: s1})
	refused("guarded upsert by a superseded holder (new row)", err, pgfence.ErrStaleToken)
	_, err = q.FencedDeleteCatalogue(ctx, db.FencedDeleteCatalogueParams{StoreID: 1, Sku: "a", Token: s1})
	refused("guarded delete by a superseded holder", err, pgfence.ErrStaleToken)
	_, err = q.FencedUpsertCatalogue(ctx, db.FencedUpsertCatalogueParams{StoreID: 1, Sku: "forged", Price: 1, Token: s2 + 100})
	refused("guarded upsert with a forged token", err, pgfence.ErrInvalid)
	_, err = q.FencedUpsertCatalogue(ctx, db.FencedUpsertCatalogueParams{StoreID: 2, Sku: "x", Price: 1, Token: s2})
	refused("guarded upsert under a lock never granted", err, pgfence.ErrInvalid)
	_, err = pool.Exec(ctx, "INSERT INTO catalogue (store_id, sku, price) VALUES (1, 'plain', 1)")
	refused("plain INSERT", err, pgfence.ErrGuard)
	_, err = pool.Exec(ctx, "DELETE FROM catalogue WHERE store_id = 1")
	refused("plain DELETE", err, pgfence.ErrGuard)
	_, err = pool.Exec(ctx, "UPDATE catalogue SET price = 0")
	refused("plain UPDATE", err, pgfence.ErrGuard)
	_, err = q.FencedDeleteCatalogue(ctx, db.FencedDeleteCatalogueParams{StoreID: 1, Sku: "b", Token: s2})
	applied("guarded delete with the current token", err)
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM catalogue").Scan(&n); err != nil || n != 1 {
		fmt.Printf("FAIL catalogue has %d rows (%v), want 1\n", n, err)
		failed = true
	}
	if failed {
		os.Exit(1)
	}
	fmt.Println("all checks passed")
}
`

// snippetMark precedes a Go block in the docs that calls code sqlc generates
// for the user's own tables; the test below compiles those blocks against the
// code it generated (table invoices (id, pdf_url, status), package db).
const snippetMark = "<!-- snippet: generated -->"

// generatedSnippets extracts the marked Go blocks of README.md and docs/ and
// wraps each in a function whose parameters are the variables the docs use.
func generatedSnippets(t testing.TB) string {
	t.Helper()
	root := repoRoot(t)
	docs := []string{filepath.Join(root, "README.md")}
	_ = filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			docs = append(docs, p)
		}
		return nil
	})
	var b strings.Builder
	b.WriteString(`package main

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"example.com/app/db"
	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

var (
	_ = errors.Is
	_ = fmt.Errorf
	_ = log.Printf
	_ = fencedwrite.TranslateError
	_ = db.New
)
`)
	n := 0
	for _, doc := range docs {
		text, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(text), "\n")
		for i := 0; i < len(lines); i++ {
			if strings.TrimSpace(lines[i]) != snippetMark {
				continue
			}
			if i+1 >= len(lines) || strings.TrimSpace(lines[i+1]) != "```go" {
				t.Fatalf("%s:%d: %s is not followed by a Go block", doc, i+1, snippetMark)
			}
			var body []string
			j := i + 2
			for ; j < len(lines) && strings.TrimSpace(lines[j]) != "```"; j++ {
				body = append(body, lines[j])
			}
			n++
			rel, _ := filepath.Rel(root, doc)
			fmt.Fprintf(&b, "\n// %s line %d\nfunc snippet%d(ctx context.Context, pool *pgxpool.Pool, url string, token int64) error {\n%s\n\treturn nil\n}\n",
				rel, i+3, n, strings.Join(body, "\n"))
			i = j
		}
	}
	if n == 0 {
		t.Fatalf("no %s block in the docs: the generated-method example is not compiled", snippetMark)
	}
	return b.String()
}

// TestGeneratedMethodsFailClosed is the user's path end to end: the CLI
// generates the migration and the query file, goose applies them, the real
// sqlc generates Go, and a program that checks only the returned errors of
// the generated methods finds every refused write (strict, re-entrant,
// upsert, delete, fenced read; on a plain and on a guarded table whose lock
// name is a generated column).
func TestGeneratedMethodsFailClosed(t *testing.T) {
	t.Parallel()
	sqlc := sqlcBinary(t)
	cli := pgfenceBinary(t)
	dsn := pgtest.DSN(t)
	dir := newModule(t)
	mig := filepath.Join(dir, "db", "migrations")
	qry := filepath.Join(dir, "db", "queries")
	writeFile(t, filepath.Join(mig, "00001_app.sql"), appSchema)

	run(t, dir, nil, cli, "gen", "fenced", "--table", "invoices", "--key", "id", "--set", "pdf_url,status",
		"--version", "00002", "--migrations-dir", mig, "--queries-dir", qry)
	run(t, dir, nil, cli, "gen", "fenced", "--table", "catalogue", "--key", "store_id,sku", "--set", "price",
		"--has-fence-column", "--guard-lock-column", "store_lock",
		"--version", "00003", "--migrations-dir", mig, "--queries-dir", qry)
	gooseUp(t, dsn, mig)
	run(t, dir, nil, sqlc, "generate")
	if b, err := os.ReadFile(filepath.Join(dir, "db", "fenced_invoices.sql.go")); err != nil {
		t.Fatal(err)
	} else if strings.Contains(string(b), "Code generated by pgfence") {
		t.Errorf("the query file's header became part of the generated Go code:\n%s", b)
	}
	writeFile(t, filepath.Join(dir, "main.go"), appMain)
	writeFile(t, filepath.Join(dir, "readme_snippets.go"), generatedSnippets(t))
	run(t, dir, nil, "go", "mod", "tidy")
	run(t, dir, nil, "go", "vet", "./...")
	out := run(t, dir, []string{"DATABASE_URL=" + dsn}, "go", "run", ".")
	t.Log(out)
	if !strings.Contains(out, "all checks passed") || strings.Contains(out, "FAIL") {
		t.Fatalf("generated methods:\n%s", out)
	}
}
