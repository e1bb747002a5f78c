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

	"github.com/pgfence/pgfence/internal/pgtest"
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
	if r.code != 0 || !strings.Contains(r.stdout, "fenced_invoices.sql") {
		t.Fatalf("gen: %+v", r)
	}
	q, err := os.ReadFile(filepath.Join(qry, "fenced_invoices.sql"))
	if err != nil || !strings.Contains(string(q), "FencedUpdateInvoicesReentrant") || !strings.Contains(string(q), "fence <") {
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
	// Running it again refuses to overwrite.
	if r := run(t, dsn, args[:len(args)-1]...); r.code == 0 {
		t.Fatalf("second gen overwrote files: %+v", r)
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
