package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// quickStartBlock returns the Go block of the README's quick start, as
// written.
func quickStartBlock(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n## Quick start\n")
	if !ok {
		t.Fatal("README.md has no \"## Quick start\" section")
	}
	_, rest, ok = strings.Cut(rest, "```go\n")
	if !ok {
		t.Fatal("README.md's quick start has no Go block")
	}
	block, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("README.md's quick start Go block is not closed")
	}
	return block
}

// quickStartMain runs the quick start's block in a function with its
// context (ctx, pool as the app role, render) and prints its error, or ok.
const quickStartMain = `package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock"
)

var (
	_ = errors.New
	_ = pgx.ErrNoRows
	_ = time.Second
)

func render(ctx context.Context) string { return "https://pdfs.example/42.pdf" }

func quickStart(ctx context.Context, pool *pgxpool.Pool) error {
%s
	return nil
}

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println("connect:", err)
		return
	}
	defer pool.Close()
	if err := quickStart(ctx, pool); err != nil {
		fmt.Println("error:", err)
		return
	}
	fmt.Println("ok")
}
`

// TestQuickStartAsAppRole runs the README's quick start as written, as the
// application role created from docs/migrations.md's block alone, on a
// database the owner migrated (with a table invoices the role may SELECT and
// UPDATE, as the README says): the fenced write lands with the lease's
// token; a row whose fence is ahead of the token is reported fenced out and
// keeps its value; a missing row is reported as missing, not as fenced out.
func TestQuickStartAsAppRole(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t) // migrated by the owner
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	role, appDSN := pgtest.DocRole(t, "migrations.md", dsn, "app")
	if _, err := admin.Exec(ctx, `CREATE TABLE invoices (id bigint PRIMARY KEY, pdf_url text, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "GRANT SELECT, UPDATE ON invoices TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	dir := newModule(t)
	writeFile(t, filepath.Join(dir, "main.go"), strings.Replace(quickStartMain, "%s", quickStartBlock(t), 1))
	run(t, dir, nil, "go", "mod", "tidy")
	bin := filepath.Join(t.TempDir(), "quickstart")
	run(t, dir, nil, "go", "build", "-o", bin, ".")
	quickStart := func() string {
		return strings.TrimSpace(run(t, dir, []string{"DATABASE_URL=" + appDSN}, bin))
	}
	row := func() (url *string, fence int64) {
		t.Helper()
		if err := admin.QueryRow(ctx, `SELECT pdf_url, fence FROM invoices WHERE id = 42`).Scan(&url, &fence); err != nil {
			t.Fatal(err)
		}
		return url, fence
	}
	token := func() int64 {
		t.Helper()
		var tok int64
		if err := admin.QueryRow(ctx, `SELECT token FROM pgfence.locks WHERE name = 'invoice:42'`).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		return tok
	}

	if _, err := admin.Exec(ctx, `INSERT INTO invoices (id) VALUES (42)`); err != nil {
		t.Fatal(err)
	}
	if out := quickStart(); out != "ok" {
		t.Fatalf("quick start on a fresh row: %q, want ok", out)
	}
	if url, fence := row(); url == nil || *url != "https://pdfs.example/42.pdf" || fence != token() {
		t.Fatalf("after the quick start the row is (%v, fence %d), want the pdf and fence = the lease's token %d", url, fence, token())
	}

	// A newer writer's fence: the next run's token is below it.
	if _, err := admin.Exec(ctx, `UPDATE invoices SET pdf_url = 'newer', fence = 1000000 WHERE id = 42`); err != nil {
		t.Fatal(err)
	}
	out := quickStart()
	if !strings.HasPrefix(out, "error: invoice 42: fenced out: row fence 1000000 >= token ") {
		t.Fatalf("quick start behind a newer fence: %q, want fenced out", out)
	}
	if url, fence := row(); url == nil || *url != "newer" || fence != 1000000 {
		t.Fatalf("the fenced-out run changed the row: (%v, fence %d)", url, fence)
	}

	if _, err := admin.Exec(ctx, `DELETE FROM invoices WHERE id = 42`); err != nil {
		t.Fatal(err)
	}
	if out := quickStart(); out != "error: invoice 42: no such row" {
		t.Fatalf("quick start without the row: %q, want no such row", out)
	}
	// Every run released its lease: the lock is free.
	var held bool
	if err := admin.QueryRow(ctx, `SELECT holder IS NOT NULL FROM pgfence.locks WHERE name = 'invoice:42'`).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if held {
		t.Error("the quick start left its lease held")
	}
}
