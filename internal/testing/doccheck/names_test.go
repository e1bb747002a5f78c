package doccheck_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/doccheck"
)

// errRef matches an error variable named in a document: pgfence.ErrLost,
// migrations.ErrUnknownMigration, or a bare ErrLost (the root package's).
var errRef = regexp.MustCompile(`\b(?:([a-z][a-z0-9]*)\.)?(Err[A-Z][A-Za-z0-9]*)\b`)

// packageDirs maps the package qualifiers documents use for this
// repository's packages to their directories; other qualifiers (pgx., ...)
// are other modules' and not checked.
var packageDirs = map[string]string{
	"":            ".",
	"pgfence":     ".",
	"migrations":  "migrations",
	"pglock":      "pglock",
	"advisory":    "pglock/advisory",
	"fencedwrite": "fencedwrite",
	"skiplocked":  "skiplocked",
	"outbox":      "outbox",
	"pgfencetest": "pgfencetest",
}

// exportedNames returns the exported top-level names declared in the
// non-test Go files of dir.
func exportedNames(t *testing.T, dir string) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.ValueSpec:
						for _, n := range s.Names {
							names[n.Name] = n.IsExported()
						}
					case *ast.TypeSpec:
						names[s.Name.Name] = s.Name.IsExported()
					}
				}
			case *ast.FuncDecl:
				if d.Recv == nil {
					names[d.Name.Name] = d.Name.IsExported()
				}
			}
		}
	}
	return names
}

// TestDocsNameExistingErrors: every error variable of this repository that
// README.md and docs/ name (pgfence.ErrLost, a bare ErrLost,
// migrations.ErrUnknownMigration) is declared. CHANGELOG.md names removed
// ones on purpose and is not checked.
func TestDocsNameExistingErrors(t *testing.T) {
	t.Parallel()
	root, _, err := doccheck.ModuleRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := doccheck.MarkdownFiles(root)
	if err != nil {
		t.Fatal(err)
	}
	declared := map[string]map[string]bool{}
	refs := 0
	for _, d := range docs {
		if d != "README.md" && !strings.HasPrefix(d, "docs/") {
			continue
		}
		src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(d)))
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(src), "\n") {
			for _, m := range errRef.FindAllStringSubmatch(line, -1) {
				dir, ours := packageDirs[m[1]]
				if !ours {
					continue
				}
				if declared[dir] == nil {
					declared[dir] = exportedNames(t, filepath.Join(root, filepath.FromSlash(dir)))
				}
				refs++
				if !declared[dir][m[2]] {
					t.Errorf("%s:%d names %s, which package %s does not declare", d, i+1, m[0], dir)
				}
			}
		}
	}
	if refs == 0 {
		t.Fatal("no error names found in the documents: the pattern is broken")
	}
	t.Logf("%d error names checked", refs)
}

// TestDocsNameNewestMigration: the samples that show the schema version
// (docs/cli.md's `pgfence version` and `migrate up` output, docs/testing.md's
// template database) name the newest migration's version.
func TestDocsNameNewestMigration(t *testing.T) {
	t.Parallel()
	root, _, err := doccheck.ModuleRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(root, "migrations", "*.sql"))
	if err != nil {
		t.Fatal(err)
	}
	newest := 0
	for _, f := range files {
		num, _, ok := strings.Cut(filepath.Base(f), "_")
		if !ok {
			continue
		}
		if v, err := strconv.Atoi(num); err == nil && v > newest {
			newest = v
		}
	}
	if newest == 0 {
		t.Fatal("no migrations found")
	}
	v := strconv.Itoa(newest)
	for _, c := range []struct{ doc, pattern string }{
		{"docs/cli.md", `(?m)^schema:\s+(\d+) `},
		{"docs/cli.md", `(?m)^applied \d+ migration\(s\); version (\d+)$`},
		{"docs/testing.md", `pgfencetest_tpl_v(\d+)`},
	} {
		src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(c.doc)))
		if err != nil {
			t.Fatal(err)
		}
		ms := regexp.MustCompile(c.pattern).FindAllStringSubmatch(string(src), -1)
		if len(ms) == 0 {
			t.Errorf("%s: nothing matches %s", c.doc, c.pattern)
		}
		for _, m := range ms {
			if m[1] != v {
				t.Errorf("%s: %q names version %s, the newest migration is %s", c.doc, m[0], m[1], v)
			}
		}
	}
}
