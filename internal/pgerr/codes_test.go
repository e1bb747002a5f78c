package pgerr_test

import (
	"context"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/internal/testing/repo"
)

// pfCode matches a SQLSTATE of class PF.
var pfCode = regexp.MustCompile(`\bPF[0-9A-Z]{3}\b`)

// kindNames names each kind as package pgfence exports it (and checks that
// it exports the same values the table names).
var kindNames = map[error]string{
	pgfence.ErrInvalid:        "pgfence.ErrInvalid",
	pgfence.ErrLocked:         "pgfence.ErrLocked",
	pgfence.ErrLost:           "pgfence.ErrLost",
	pgfence.ErrReleased:       "pgfence.ErrReleased",
	pgfence.ErrClosed:         "pgfence.ErrClosed",
	pgfence.ErrStaleToken:     "pgfence.ErrStaleToken",
	pgfence.ErrAlreadyApplied: "pgfence.ErrAlreadyApplied",
	pgfence.ErrNotFound:       "pgfence.ErrNotFound",
	pgfence.ErrTokenExhausted: "pgfence.ErrTokenExhausted",
	pgfence.ErrSlowGrant:      "pgfence.ErrSlowGrant",
	pgfence.ErrGuard:          "pgfence.ErrGuard",
	pgfence.ErrNoSchema:       "pgfence.ErrNoSchema",
}

func live(t *testing.T) []pgerr.PFCode {
	t.Helper()
	var out []pgerr.PFCode
	seen := map[string]bool{}
	for _, c := range pgerr.PFCodes {
		if seen[c.Code] {
			t.Errorf("PFCodes lists %s twice", c.Code)
		}
		seen[c.Code] = true
		if !pfCode.MatchString(c.Code) || c.Meaning == "" {
			t.Errorf("PFCodes row %+v: want a PF code and a meaning", c)
		}
		if c.Kind != nil {
			if _, ok := kindNames[c.Kind]; !ok {
				t.Errorf("%s: kind %v is not one of package pgfence's", c.Code, c.Kind)
			}
			if c.Retryable {
				t.Errorf("%s: a refusal with a kind is not retryable (pgfence.IsRetryable says no to every kind)", c.Code)
			}
		}
		if !c.Retired {
			out = append(out, c)
		}
	}
	if len(kindNames) != len(pgerr.Kinds) {
		t.Errorf("pgerr.Kinds has %d kinds, package pgfence exports %d", len(pgerr.Kinds), len(kindNames))
	}
	return out
}

// TestSchemaRaisesOnlyTabledCodes reads every function of the migrated
// schema: each PF code it names is a live row of PFCodes, and each live row
// is raised by some function (the table has no stale rows). The migration
// file names no code outside the table either (retired ones in comments).
func TestSchemaRaisesOnlyTabledCodes(t *testing.T) {
	codes := live(t)
	pool := pgtest.Pool(t)
	rows, err := pool.Query(context.Background(), `
		SELECT p.proname, p.prosrc FROM pg_proc p
		JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'pgfence'`)
	if err != nil {
		t.Fatal(err)
	}
	raisedBy := map[string][]string{}
	for rows.Next() {
		var name, src string
		if err := rows.Scan(&name, &src); err != nil {
			t.Fatal(err)
		}
		for _, code := range pfCode.FindAllString(src, -1) {
			raisedBy[code] = append(raisedBy[code], name)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(raisedBy) == 0 {
		t.Fatal("no function of schema pgfence names a PF code: the query read nothing")
	}
	for code, fns := range raisedBy {
		c, ok := pgerr.LookupPF(code)
		switch {
		case !ok:
			t.Errorf("%s (named by %v) is not in pgerr.PFCodes: add it there and to docs/sql.md", code, fns)
		case c.Retired:
			t.Errorf("%s (named by %v) is retired in pgerr.PFCodes", code, fns)
		}
	}
	for _, c := range codes {
		if len(raisedBy[c.Code]) == 0 {
			t.Errorf("%s is in pgerr.PFCodes but no function of the schema raises it: retire it", c.Code)
		}
	}

	src, err := os.ReadFile(filepath.Join(repo.Root(), "migrations", "00001_pgfence.sql"))
	if err != nil {
		t.Fatal(err)
	}
	for _, code := range pfCode.FindAllString(string(src), -1) {
		if _, ok := pgerr.LookupPF(code); !ok {
			t.Errorf("the migration names %s, which is not in pgerr.PFCodes", code)
		}
	}
}

// TestDocTableMatches checks docs/sql.md's table of SQLSTATEs: one row per
// live code, with the Go error the table gives it.
func TestDocTableMatches(t *testing.T) {
	codes := live(t)
	doc, err := os.ReadFile(filepath.Join(repo.Root(), "docs", "sql.md"))
	if err != nil {
		t.Fatal(err)
	}
	rowRE := regexp.MustCompile("(?m)^\\| `(PF[0-9A-Z]{3})` \\|.*\\| ([^|]+) \\|$")
	rows := map[string]string{}
	for _, m := range rowRE.FindAllStringSubmatch(string(doc), -1) {
		if _, dup := rows[m[1]]; dup {
			t.Errorf("docs/sql.md lists %s twice", m[1])
		}
		rows[m[1]] = strings.TrimSpace(m[2])
	}
	for _, c := range codes {
		got, ok := rows[c.Code]
		if !ok {
			t.Errorf("docs/sql.md's table has no row for %s", c.Code)
			continue
		}
		want := "no kind"
		if c.Kind != nil {
			want = "`" + kindNames[c.Kind] + "`"
		}
		if c.Retryable {
			want += "; retry"
		}
		if got != want {
			t.Errorf("docs/sql.md, %s: Go column %q, want %q", c.Code, got, want)
		}
		delete(rows, c.Code)
	}
	for code := range rows {
		t.Errorf("docs/sql.md lists %s, which pgerr.PFCodes does not (or retired)", code)
	}
}

// TestClassifyKinds checks what a PF code becomes: its table kind, and
// pgfence.IsRetryable only where the table says so.
func TestClassifyKinds(t *testing.T) {
	for _, c := range live(t) {
		err := &pgconn.PgError{Code: c.Code}
		got, ok := pgerr.Classify(err)
		if !ok || got.Code != c.Code || got.Kind != c.Kind {
			t.Errorf("Classify(%s) = %+v, %v", c.Code, got, ok)
		}
		if r := pgerr.IsRetryable(err); r != c.Retryable {
			t.Errorf("IsRetryable(%s) = %v, want %v", c.Code, r, c.Retryable)
		}
		pe := &pgfence.Error{Kind: c.Kind, Err: err}
		if r := pgfence.IsRetryable(pe); r != c.Retryable {
			t.Errorf("pgfence.IsRetryable(*Error{%s}) = %v, want %v", c.Code, r, c.Retryable)
		}
	}
	if _, ok := pgerr.Classify(&pgconn.PgError{Code: "PF999"}); ok {
		t.Error("Classify(PF999): a code outside the table was classified")
	}
	if _, ok := pgerr.Classify(errors.New("PF003")); ok {
		t.Error("Classify of a non-server error was classified")
	}
}

// TestNoCodeLiterals checks that the library's packages name PF codes only
// through internal/pgerr's constants: no string literal "PF..." in their
// non-test Go files, so the table is the one place a code is mapped.
func TestNoCodeLiterals(t *testing.T) {
	root := repo.Root()
	var checked int
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch {
			case rel == "internal/pgerr", strings.HasPrefix(rel, "internal/testing"), rel == "cmd", rel == "bench",
				rel == "observe", rel != "." && strings.HasPrefix(rel, "."), rel == "scripts", rel == "docs":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		checked++
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			s, err := strconv.Unquote(lit.Value)
			if err == nil && len(s) == 5 && pfCode.MatchString(s) {
				t.Errorf("%s: string literal %q: use internal/pgerr's constant", rel, s)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 20 {
		t.Fatalf("checked %d Go files: the walk missed the library", checked)
	}
}
